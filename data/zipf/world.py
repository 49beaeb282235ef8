"""The Zipf world: word problems whose topics follow a long-tailed (Zipf) law, so that some
questions are rare under the warm start, and whose worked solutions restate the question and use
the topic's own facts, so that a rare question induces a rare response.

Each problem is a short story in one topic (a market, a school, a pirate ship, an alchemist's
workshop, ...): an owner starts with some things, then events change the count, then a question.
A topic has its own owners, things, verbs and its own container, whose size is a FACT of the topic
that the question never states ("a crate holds 10 apples", "a retort holds 7 phials"). The worked
solution restates each event with its verb and its things, writes the arithmetic one step per line
inside <think> </think>, then the answer in \\boxed{} (the paper's format, method.md §5), e.g.

    Paracelsus keeps 23 phials. Paracelsus spills 5 phials. Paracelsus fills 2 retorts of phials.
    How many phials does Paracelsus keep now?
    <think>
    spills 5 phials: 23 - 5 = 18
    2 retorts of phials: 2 * 7 = 14
    18 + 14 = 32
    </think>
    The answer is \\boxed{32}.

Topic k (k = 1 the most common) is drawn with probability proportional to 1 / k^ZIPF_S, in the
warm-start corpus and in the RL and held-out sets alike: the warm start learns the common topics'
words, verbs and container sizes well and the rare topics' poorly, so a rare topic's question has
a high NLL, and so has its solution (its verbs' signs and its container size are what the warm
start is unsure of). Level = number of arithmetic steps, as in the tiny world (data/tinymath).

DESIGN 2 (design 1, the topics alone, gave r(query NLL, response NLL) ~ 0: a solution copies its
rare words from the question, and copying is easy). Each problem is also written in one of
N_DIALECTS dialects, drawn by a steeper Zipf law (DIALECT_S): dialect 1 is English, every other one
a made-up language with its own syllables, in which every word but the owner's name is a pseudo-word
of that dialect, in the question and in the solution alike. The solution's arithmetic is written in
words ("23 minus 5 equals 18", "the answer is"), words the question does not contain: a model that
barely knows a rare dialect is unsure of its question AND of its solution, which is the coupling
ERPO's query weights and Query-KL rest on (method.md §4).

DESIGN 3 (design 2 gave r = 0.58 / 0.56 / 0.44 and no degradation under GRPO). Two changes:
- each solution line names its operation in a word the question never contains ("spills 5 phials
  subtract: 23 minus 5 equals 18", "add", "multiply"), so a solution holds more dialect words that
  the model must produce, not copy, than design 2's;
- the RL training and held-out sets draw dialects by a flatter law (RL_DIALECT_S) than the
  warm-start corpus: RL meets questions the warm start saw rarely far more often than it saw them
  (as the paper's RL set, MATH levels 3-5, is harder than what its base model was tuned on).

Everything here is pure: a problem is a function of a `random.Random` state.
"""

import random
import re
from dataclasses import dataclass

ZIPF_S = 1.2     # the topic law's exponent: p(k) ~ 1 / k^s
N_DIALECTS = 12  # dialect 1 = English
DIALECT_S = 1.5  # the dialect law's exponent in the warm-start corpus ...
RL_DIALECT_S = 0.5  # ... and in the RL training and held-out sets (design 3)


@dataclass(frozen=True)
class Topic:
    name: str
    owners: tuple          # who has the things
    things: tuple          # plural nouns
    container: str         # plural noun of the topic's container ...
    size: int              # ... and how many things one holds (never said in a question)
    have: str              # the topic's verb for owning ("has", "keeps", ...), 3rd person
    gain: tuple            # verbs that add things
    lose: tuple            # verbs that take things away
    fill: str              # the verb of getting whole containers


# Most common first. Sizes differ between neighbouring topics so that a guess from a common topic
# is wrong in a rare one.
TOPICS = [
    Topic("market", ("Mia", "Tom", "Ana", "Leo"), ("apples", "pears", "plums", "eggs"), "crates", 10,
          "has", ("buys", "picks"), ("sells", "eats"), "buys"),
    Topic("school", ("Sam", "Ivy", "Max", "Eva"), ("pencils", "books", "stickers", "crayons"), "boxes", 6,
          "owns", ("finds", "gets"), ("lends", "loses"), "gets"),
    Topic("farm", ("Joe", "Rosa", "Hank", "Lena"), ("sheep", "goats", "hens", "cows"), "pens", 5,
          "keeps", ("breeds", "rescues"), ("sells", "trades"), "fills"),
    Topic("bakery", ("Ben", "Lily", "Nora", "Finn"), ("muffins", "buns", "rolls", "pies"), "trays", 9,
          "has", ("bakes", "makes"), ("sells", "drops"), "bakes"),
    Topic("pirates", ("Flint", "Morgan", "Anne", "Kidd"), ("doubloons", "rubies", "pearls", "emeralds"),
          "chests", 11, "hoards", ("plunders", "finds"), ("buries", "squanders"), "hauls"),
    Topic("wizard", ("Merlin", "Morgana", "Alaric", "Elspeth"), ("potions", "scrolls", "runes", "wands"),
          "cauldrons", 4, "guards", ("conjures", "brews"), ("vanishes", "banishes"), "summons"),
    Topic("space", ("Zara", "Orion", "Nova", "Kepler"), ("probes", "satellites", "rovers", "beacons"),
          "payloads", 3, "operates", ("launches", "assembles"), ("decommissions", "strands"), "receives"),
    Topic("alchemy", ("Paracelsus", "Flamel", "Hermes", "Agrippa"), ("phials", "salts", "elixirs", "crucibles"),
          "retorts", 7, "keeps", ("distils", "transmutes"), ("spills", "calcines"), "fills"),
    Topic("knights", ("Gawain", "Percival", "Tristan", "Bedivere"), ("pennants", "gauntlets", "shields", "lances"),
          "armouries", 12, "musters", ("forges", "wins"), ("surrenders", "shatters"), "requisitions"),
    Topic("bees", ("Hilde", "Bruno", "Greta", "Anselm"), ("honeycombs", "frames", "queens", "drones"),
          "supers", 8, "tends", ("harvests", "raises"), ("swarms", "culls"), "stacks"),
    Topic("coins", ("Mortimer", "Cornelius", "Ptolemy", "Octavia"), ("denarii", "sestertii", "drachmas", "obols"),
          "rouleaux", 13, "curates", ("acquires", "mints"), ("auctions", "debases"), "catalogues"),
    Topic("maps", ("Mercator", "Ortelius", "Blaeu", "Hondius"), ("portolans", "globes", "atlases", "charts"),
          "portfolios", 14, "archives", ("engraves", "surveys"), ("misplaces", "bequeaths"), "binds"),
    Topic("falconry", ("Ragnhild", "Eadric", "Wulfstan", "Aethelflaed"), ("gyrfalcons", "merlins", "kestrels",
          "goshawks"), "mews", 2, "mans", ("hatches", "traps"), ("releases", "forfeits"), "provisions"),
    Topic("vineyard", ("Bacchus", "Dionysia", "Silenus", "Ariadne"), ("amphorae", "hogsheads", "firkins",
          "tuns"), "cellars", 15, "stores", ("decants", "ferments"), ("quaffs", "libates"), "cellars"),
    Topic("glass", ("Murano", "Barovier", "Seguso", "Venini"), ("goblets", "chalices", "carafes", "ewers"),
          "kilns", 16, "displays", ("blows", "anneals"), ("cracks", "pawns"), "fires"),
    Topic("herbarium", ("Linnaeus", "Tournefort", "Bauhin", "Cesalpino"), ("specimens", "rhizomes", "sporangia",
          "fronds"), "vascula", 17, "catalogues", ("presses", "collects"), ("desiccates", "misfiles"), "gathers"),
]

# level -> (number of arithmetic steps, largest start count, largest count allowed at any step)
LEVELS = {1: (1, 20, 99), 2: (2, 30, 99), 3: (3, 40, 150), 4: (4, 50, 199), 5: (5, 60, 199)}
LEVEL_RANGE = (1, 5)


def topic_weights(s=ZIPF_S) -> list[float]:
    """p(k) ~ 1 / k^s over topics 1..len(TOPICS), normalised."""
    w = [1.0 / k ** s for k in range(1, len(TOPICS) + 1)]
    return [x / sum(w) for x in w]


def draw_topic(rng: random.Random, ranks=None) -> int:
    """A topic index by the Zipf law (restricted to `ranks`, 0-based, when given)."""
    ranks = list(range(len(TOPICS))) if ranks is None else list(ranks)
    weights = topic_weights()
    return rng.choices(ranks, weights=[weights[k] for k in ranks])[0]


def _event(rng, topic: Topic, thing: str, x: int, steps_left: int, cap: int):
    """One event that keeps the count in [1, cap] -> (sentence template, solution lines, new count).
    The sentence template still holds {n} (the owner)."""
    kinds = ["gain", "lose"] + (["fill"] if steps_left >= 2 else [])
    for _ in range(100):
        kind = rng.choice(kinds)
        if kind == "gain" and x + 1 <= cap:
            k, verb = rng.randint(1, min(cap - x, 30)), rng.choice(topic.gain)
            return (f"{{n}} {verb} {k} {thing}.", [f"{verb} {k} {thing} add: {x} plus {k} equals {x + k}"],
                    x + k)
        if kind == "lose" and x >= 2:
            k, verb = rng.randint(1, min(x - 1, 30)), rng.choice(topic.lose)
            return (f"{{n}} {verb} {k} {thing}.",
                    [f"{verb} {k} {thing} subtract: {x} minus {k} equals {x - k}"], x - k)
        if kind == "fill":
            a = rng.randint(2, 5)
            m = a * topic.size
            if x + m <= cap:
                return (f"{{n}} {topic.fill} {a} {topic.container} of {thing}.",
                        [f"{a} {topic.container} of {thing} multiply: {a} times {topic.size} equals {m}",
                         f"add: {x} plus {m} equals {x + m}"],
                        x + m)
    raise RuntimeError("no valid event")  # unreachable for the caps above; kept loud on purpose


def base_form(verb: str) -> str:
    """The verb after "does": has -> have, keeps -> keep."""
    return "have" if verb == "has" else verb.removesuffix("s")


def dialect_weights(n=N_DIALECTS, s=DIALECT_S) -> list[float]:
    w = [1.0 / k ** s for k in range(1, n + 1)]
    return [x / sum(w) for x in w]


def draw_dialect(rng: random.Random, ranks=None, s=DIALECT_S) -> int:
    """A dialect index (0 = English) by the dialect law of exponent s, restricted to `ranks` when given."""
    ranks = list(range(N_DIALECTS)) if ranks is None else list(ranks)
    weights = dialect_weights(s=s)
    return rng.choices(ranks, weights=[weights[k] for k in ranks])[0]


CONSONANTS, VOWELS = "bcdfghjklmnprstvwxz", "aeiouy"


def _syllables(d: int) -> list[str]:
    """Dialect d's syllable inventory: its own consonants and vowels (a fixed function of d)."""
    r = random.Random(f"zipf-dialect-{d}")
    cs, vs = r.sample(CONSONANTS, 6), r.sample(VOWELS, 3)
    return [c + v for c in cs for v in vs] + [c + v + r.choice(cs) for c in cs[:3] for v in vs]


TEMPLATE_WORDS = ("of how many does now plus minus times equals the answer is have add subtract "
                  "multiply").split()


def vocabulary() -> list[str]:
    """Every word a problem or solution can contain, but the owners' names (lower case, sorted)."""
    words = set(TEMPLATE_WORDS)
    for t in TOPICS:
        words |= {*t.things, t.container, t.have, base_form(t.have), *t.gain, *t.lose, t.fill}
    return sorted(w.lower() for w in words)


_LEXICONS: dict = {}


def lexicon(d: int) -> dict:
    """Dialect d's word for every word of vocabulary(): 1-3 of its syllables, no two words alike,
    a fixed function of d."""
    if d not in _LEXICONS:
        syl, used, out = _syllables(d), set(), {}
        for w in vocabulary():
            r = random.Random(f"zipf-dialect-{d}-{w}")
            while (p := "".join(r.choice(syl) for _ in range(r.randint(1, 3)))) in used:
                pass
            used.add(p)
            out[w] = p
        _LEXICONS[d] = out
    return _LEXICONS[d]


def dialect_word(word: str, d: int) -> str:
    """`word` in dialect d (d = 0: itself), capitalised as the word is."""
    if d == 0:
        return word
    out = lexicon(d)[word.lower()]
    return out.capitalize() if word[0].isupper() else out


def translate(text: str, d: int, keep=()) -> str:
    """Every word of `text` in dialect d, except the words in `keep` (names) and \\boxed / think."""
    keep = set(keep) | {"boxed", "think"}

    def word(m):
        return m.group(0) if m.group(0) in keep else dialect_word(m.group(0), d)

    return re.sub(r"[A-Za-z]+", word, text)


def make_problem(rng: random.Random, level: int, topic: int | None = None,
                 dialect: int | None = None) -> dict:
    """One problem of `level` in topic index `topic` and dialect index `dialect` (each drawn by its
    law when None): a dict with problem, answer, solution (the worked solution in the paper's
    format), level, steps, the topic's name and rank and the dialect's rank (1 = the most common)."""
    if level not in LEVELS:
        raise ValueError(f"level must be in {sorted(LEVELS)}, got {level}")
    k = draw_topic(rng) if topic is None else topic
    d = draw_dialect(rng) if dialect is None else dialect
    t = TOPICS[k]
    n_steps, max_start, cap = LEVELS[level]
    owner, thing = rng.choice(t.owners), rng.choice(t.things)
    x = rng.randint(2, max_start)
    sentences, lines = [f"{owner} {t.have} {x} {thing}."], []
    while len(lines) < n_steps:
        sentence, new_lines, x = _event(rng, t, thing, x, n_steps - len(lines), cap)
        sentences.append(sentence.format(n=owner))
        lines += new_lines
    sentences.append(f"How many {thing} does {owner} {base_form(t.have)} now?")
    solution = "<think>\n" + "\n".join(lines) + "\n</think>\nThe answer is \\boxed{" + f"{x}" + "}."
    return {"problem": translate(" ".join(sentences), d, t.owners), "answer": str(x),
            "solution": translate(solution, d, t.owners), "level": level, "steps": n_steps, "topic": t.name,
            "rank": k + 1, "dialect": d + 1}
