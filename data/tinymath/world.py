"""The tiny math world: word problems about someone's collection of things.

Each problem is a short story: a start count, then events that each change the count, then a
question. Every event is one or two arithmetic steps, and the worked solution writes one step per
line inside <think> </think>, then the answer in \\boxed{} (the paper's format, method.md §5), e.g.

    Mia has 23 apples. Mia gives 5 apples to Tom. Mia buys 4 bags with 6 apples in each bag.
    How many apples does Mia have now?
    <think>
    23 - 5 = 18
    4 * 6 = 24
    18 + 24 = 42
    </think>
    The answer is \\boxed{42}.

Level = number of arithmetic steps (like MATH's levels 1-5, harder means longer chains and larger
numbers); levels 6-7 exist only for the "harder than training" evaluation set. The
out-of-distribution set uses names, objects and phrasings that no other split ever uses
("style ood"): the arithmetic is the same, part of the surface text is new.

Everything here is pure: a problem is a function of a `random.Random` state, so a split is a
function of the seed (see prepare.py).
"""

import random

NAMES = ["Mia", "Tom", "Ana", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben", "Lily", "Jack",
         "Nora", "Owen", "Ruby", "Liam", "Emma", "Noah", "Ella", "Finn", "Rosa", "Omar", "Kate",
         "Hugo"]
OBJECTS = ["apples", "marbles", "stickers", "coins", "books", "pencils", "cookies", "stamps",
           "shells", "cards", "buttons", "candies", "rocks", "beads", "toys", "flowers"]
OOD_NAMES = ["Iris", "Theo", "Maya", "Axel", "Nina", "Cole"]
OOD_OBJECTS = ["crayons", "feathers", "keys", "balloons", "postcards", "ribbons"]

# Phrasings per event kind. {n}: the owner, {o}: the objects, {f}: a friend, {k}/{a}/{b}: numbers.
# The "ood" lists are used only by the out-of-distribution split: new names and objects, a new
# way to open and to ask, and one new phrasing per event next to the familiar ones. (A first
# version changed every sentence; the warm start then produced no answer at all, which measures
# nothing.)
PHRASES = {
    "start": {
        "train": ["{n} has {x} {o}.", "{n} owns {x} {o}.", "{n} starts with {x} {o}."],
        "ood": ["{n} collects {x} {o}."],
    },
    "gain": {
        "train": ["{n} finds {k} more {o}.", "{f} gives {n} {k} {o}.", "{n} buys {k} more {o}."],
        "ood": ["{n} finds {k} more {o}.", "{n} receives {k} extra {o}."],
    },
    "lose": {
        "train": ["{n} gives {k} {o} to {f}.", "{n} loses {k} {o}.", "{n} sells {k} {o}."],
        "ood": ["{n} loses {k} {o}.", "{n} throws away {k} {o}."],
    },
    "boxes": {
        "train": ["{n} buys {a} bags with {b} {o} in each bag.",
                  "{f} gives {n} {a} boxes of {b} {o} each."],
        "ood": ["{n} buys {a} bags with {b} {o} in each bag.", "{n} picks up {a} packs of {b} {o} each."],
    },
    "times": {
        "train": ["The number of {o} that {n} has becomes {k} times as large."],
        "ood": ["The number of {o} that {n} has becomes {k} times as large."],
    },
    "share": {
        "train": ["{n} splits the {o} equally into {k} piles and keeps one pile."],
        "ood": ["{n} splits the {o} equally into {k} piles and keeps one pile."],
    },
    "question": {
        "train": ["How many {o} does {n} have now?", "How many {o} does {n} have in the end?"],
        "ood": ["In the end, how many {o} are left with {n}?"],
    },
}

# level -> (number of arithmetic steps, largest start count, largest count allowed at any step)
LEVELS = {1: (1, 20, 99), 2: (2, 30, 99), 3: (2, 60, 199), 4: (3, 60, 199), 5: (4, 99, 299),
          6: (5, 99, 299), 7: (6, 99, 299)}
LEVEL_RANGE = (1, 7)


def _event(rng: random.Random, x: int, steps_left: int, cap: int):
    """Pick one event that keeps every count in [0, cap]. -> (kind, numbers, [(a, op, b, result)])."""
    kinds = ["gain", "lose", "times", "share"] + (["boxes"] if steps_left >= 2 else [])
    for _ in range(100):
        kind = rng.choice(kinds)
        if kind == "gain" and x + 1 <= cap:
            k = rng.randint(1, min(cap - x, 40))
            return kind, {"k": k}, [(x, "+", k, x + k)]
        if kind == "lose" and x >= 2:
            k = rng.randint(1, min(x - 1, 40))
            return kind, {"k": k}, [(x, "-", k, x - k)]
        if kind == "times" and 2 * x <= cap:
            k = rng.choice([m for m in (2, 3, 4) if m * x <= cap])
            return kind, {"k": k}, [(x, "*", k, x * k)]
        if kind == "share":
            ks = [m for m in (2, 3, 4, 5) if x % m == 0 and x // m >= 1]
            if ks:
                k = rng.choice(ks)
                return kind, {"k": k, "j": k - 1}, [(x, "/", k, x // k)]
        if kind == "boxes":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            if x + a * b <= cap:
                return kind, {"a": a, "b": b}, [(a, "*", b, a * b), (x, "+", a * b, x + a * b)]
    raise RuntimeError("no valid event")  # unreachable for the caps above; kept loud on purpose


def make_problem(rng: random.Random, level: int, style: str = "train") -> dict:
    """One problem of `level` in phrasing `style` ("train" or "ood"): a dict with problem, answer,
    solution (the worked solution in the paper's format), level and the number of steps."""
    if level not in LEVELS:
        raise ValueError(f"level must be in {sorted(LEVELS)}, got {level}")
    n_steps, max_start, cap = LEVELS[level]
    name, friend = rng.sample(OOD_NAMES if style == "ood" else NAMES, 2)
    obj = rng.choice(OOD_OBJECTS if style == "ood" else OBJECTS)
    x = rng.randint(2, max_start)

    def say(kind, **kw):
        return rng.choice(PHRASES[kind][style]).format(n=name, f=friend, o=obj, **kw)

    sentences, lines = [say("start", x=x)], []
    while len(lines) < n_steps:
        kind, nums, steps = _event(rng, x, n_steps - len(lines), cap)
        sentences.append(say(kind, **nums))
        lines += [f"{a} {op} {b} = {r}" for a, op, b, r in steps]
        x = steps[-1][3]
    sentences.append(say("question"))
    solution = "<think>\n" + "\n".join(lines) + "\n</think>\nThe answer is \\boxed{" + f"{x}" + "}."
    return {"problem": " ".join(sentences), "answer": str(x), "solution": solution,
            "level": level, "steps": n_steps}
