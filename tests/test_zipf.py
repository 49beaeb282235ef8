"""The Zipf world (data/zipf/, tasks/zipf.py, study/zipf.py): its files are its generator's output,
its solutions are right, its topics follow the law, its warm start is what the SFT recipe makes
(a shortened run against a committed fingerprint), `--task zipf` trains, and the premise holds on
problems the world was not built from (r's interval, study.zipf.premise_interval)."""

import hashlib
import json
import os
import random
import subprocess
from collections import Counter

import pytest
import torch

from data.tinymath.prepare import write_jsonl
from data.zipf import prepare, world

ZIPF = os.path.dirname(prepare.__file__)
ROOT = os.path.dirname(os.path.dirname(ZIPF))
SHIPPED = ["test", "rare", "train"]
CLAIM_PROBLEMS, CLAIM_SEEDS, CLAIM_FLOOR = 150, (4, 5), 0.3   # test_the_premise_holds_on_fresh_problems


@pytest.fixture(scope="module")
def regenerated():
    return prepare.generate_splits(1234)


def test_generation_is_deterministic_and_matches_the_shipped_files(regenerated, tmp_path):
    assert prepare.generate_splits(1234) == regenerated
    for name in SHIPPED:  # the committed JSONL is exactly what `prepare` writes
        write_jsonl(tmp_path / f"{name}.jsonl", regenerated[name])
        fresh = hashlib.sha256((tmp_path / f"{name}.jsonl").read_bytes()).hexdigest()
        with open(os.path.join(ZIPF, f"{name}.jsonl"), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == fresh, f"{name}.jsonl is stale: rerun prepare"


def test_splits_are_disjoint_sized_and_the_rare_set_is_rare(regenerated):
    texts = {name: {r["problem"] for r in rows} for name, rows in regenerated.items()}
    for name, parts in prepare.SPLITS.items():
        assert len(texts[name]) == sum(part[0] for part in parts) == len(regenerated[name])
    names = list(texts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not texts[a] & texts[b], f"{a} and {b} share problems"
    rare = {k + 1 for k in prepare.RARE}
    assert {r["dialect"] for r in regenerated["rare"]} == rare
    for name, law in (("train", world.RL_DIALECT_S), ("sft", world.DIALECT_S)):
        share = sum(r["dialect"] in rare for r in regenerated[name]) / len(regenerated[name])
        expected = sum(world.dialect_weights(s=law)[k] for k in prepare.RARE)
        assert abs(share - expected) < 0.03, (name, share, expected)
    rl, warm = (sum(world.dialect_weights(s=law)[k] for k in prepare.RARE) for law in (world.RL_DIALECT_S,
                                                                                     world.DIALECT_S))
    assert rl > 3 * warm and warm < 0.15    # RL meets the rare dialects far more often than the warm start did


def test_topics_follow_the_zipf_law(regenerated):
    counts = Counter(r["rank"] for r in regenerated["sft"])
    n = len(regenerated["sft"])
    for k, p in enumerate(world.topic_weights(), start=1):
        assert abs(counts[k] / n - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3, (k, counts[k] / n, p)
    assert counts[1] > 10 * counts[len(world.TOPICS)]


def _eval_solution(solution, dialect):
    """Check a worked solution by hand: each line's 'a op b equals c' (in the row's dialect) is
    right; the chain ends in the box."""
    words = {v: k for k, v in world.lexicon(dialect - 1).items()} if dialect > 1 else {}
    body = solution.split("<think>\n")[1].split("\n</think>")[0].splitlines()
    names = {"plus": "add", "minus": "subtract", "times": "multiply"}
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    for line in body:
        head, arithmetic = line.split(": ")
        a, op, b, eq, c = arithmetic.split()
        op, eq, named = words.get(op, op), words.get(eq, eq), words.get(head.split()[-1], head.split()[-1])
        assert eq == "equals" and ops[op](int(a), int(b)) == int(c), line
        assert named == names[op], line          # the line names its operation (design 3)
    return int(body[-1].split()[-1]), len(body)


def test_every_answer_is_right_uses_the_topic_facts_and_is_graded_correct(regenerated):
    import reward

    by_name = {t.name: t for t in world.TOPICS}
    for name, rows in regenerated.items():
        sample = rows if name != "sft" else rows[:2000]
        for r in sample:
            assert _eval_solution(r["solution"], r["dialect"]) == (int(r["answer"]), r["steps"])
            topic = by_name[r["topic"]]
            assert topic.owners[0] in r["problem"] or any(o in r["problem"] for o in topic.owners)
            container = world.dialect_word(topic.container, r["dialect"] - 1)
            if container in r["problem"].split():       # the container's size is in the answer, never the question
                assert f" {world.dialect_word('times', r['dialect'] - 1)} {topic.size} " in r["solution"]
        scores, counts = reward.score_batch([r["solution"] for r in sample], [r["answer"] for r in sample])
        assert sum(scores) == len(sample), (name, counts)


def test_levels_and_topics_are_checked():
    rng = random.Random(0)
    steps = {lv: world.make_problem(rng, lv)["steps"] for lv in world.LEVELS}
    assert [steps[lv] for lv in sorted(steps)] == sorted(steps.values())
    with pytest.raises(ValueError):
        world.make_problem(rng, 9)
    assert world.make_problem(rng, 3, topic=7)["topic"] == world.TOPICS[7].name
    assert world.make_problem(rng, 3, dialect=4)["dialect"] == 5


def test_dialects_are_one_to_one_and_english_is_dialect_1():
    for d in range(world.N_DIALECTS):
        lex = {w: world.dialect_word(w, d) for w in world.vocabulary()}
        assert len(set(lex.values())) == len(lex)                 # a word of a dialect means one thing
        assert (d == 0) == all(k == v for k, v in lex.items())


def test_the_warm_start_is_what_the_sft_recipe_makes(regenerated, tmp_path):
    """The shipped warm start's tokenizer is the generator's, and a shortened run of the SFT recipe
    from the generator's base model gives the committed fingerprint (prepare.SHORT_SFT steps on one
    thread: per-step losses to 1e-4 and every parameter's sum and norm to 1e-4 of its norm; thread
    counts 1 and 2 gave identical numbers). The full recipe (750 steps) was checked by hand: its
    step-750 export is data/zipf/warmstart (prepare.py's docstring)."""
    from transformers import AutoTokenizer

    from study import zipf as study

    tokenizer, _ = prepare.make_base(regenerated, tmp_path / "base", 1234)
    shipped = AutoTokenizer.from_pretrained(os.path.join(ZIPF, "warmstart"))
    assert tokenizer.get_vocab() == shipped.get_vocab()
    write_jsonl(tmp_path / "sft.jsonl", regenerated["sft"])
    got = study.short_sft(str(tmp_path / "base"), str(tmp_path / "sft.jsonl"), str(tmp_path))
    with open(prepare.SHORT_SFT_FILE) as f:
        committed = json.load(f)
    assert got["argv"] == committed["argv"]
    assert got["losses"] == pytest.approx(committed["losses"], rel=1e-4)
    assert committed["losses"][-1] < committed["losses"][0] - 1.0         # it learns
    assert set(got["params"]) == set(committed["params"])
    for name, (total, norm) in committed["params"].items():
        assert got["params"][name] == pytest.approx([total, norm], abs=1e-4 * norm + 1e-6), name


def test_train_runs_two_steps_on_the_world(tmp_path):
    """`train.py --task zipf` from the shipped warm start: two GRPO steps, its own held-out sets."""
    import train

    out = tmp_path / "run"
    train.main(["--task", "zipf", "--model", os.path.join(ZIPF, "warmstart"), "--algo", "erpo", "--steps", "2",
                "--rollout-batch", "8", "--update-batch", "8", "--group-size", "4", "--max-new-tokens", "160",
                "--eval-every", "2", "--eval-limit", "8", "--save-every", "0", "--query-cache-dir", "",
                "--out", str(out)])
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [m["step"] for m in rows if "reward" in m] == [1, 2]
    assert {"eval_acc/zipf-test", "eval_acc/zipf-rare"} <= set(rows[-1])


PREMISE = os.path.join(ROOT, "study", "results", "zipf", "premise.json")


def test_the_premise_interval_on_hand_data():
    """study.zipf.premise_interval: exact on perfectly (anti-)correlated data, the response noise in
    the interval (two responses that disagree widen it to [-1, 1]), the Fisher-z interval's width on
    a bivariate normal sample, and a function of the data and its seed."""
    from study.zipf import premise_interval

    x = [0.5, 1.0, 2.5, 3.0, 4.5, 7.0]
    up = premise_interval(x, [[2 * a + 1, 2 * a + 1] for a in x])   # two responses on one line
    assert (up["r"], up["lo"], up["hi"]) == pytest.approx((1, 1, 1), abs=1e-12)
    assert up["r_seeds"] == pytest.approx([1, 1]) and up["responses"] == 2 and up["n"] == 6
    down = premise_interval(x, [-a for a in x])                     # one response per problem: (n,)
    assert (down["r"], down["lo"], down["hi"]) == pytest.approx((-1, -1, -1), abs=1e-12)
    # responses 0 and 1 say opposite things: each seed's r is +-1, the point estimate their mean (0),
    # and a resample drawing response 0 (or 1) for all 4 problems has chance 1/16 > 2.5%
    both = premise_interval([1, 2, 3, 4], [[1, -1], [2, -2], [3, -3], [4, -4]])
    assert both["r_seeds"] == pytest.approx([1, -1]) and both["r"] == pytest.approx(0, abs=1e-12)
    assert (both["lo"], both["hi"]) == pytest.approx((-1, 1), abs=1e-12)
    only_first = premise_interval([1, 2, 3, 4], [[1], [2], [3], [4]])
    assert (only_first["lo"], only_first["hi"]) == pytest.approx((1, 1), abs=1e-12)
    g = torch.Generator().manual_seed(7)
    a = torch.randn(400, generator=g, dtype=torch.float64)
    b = 0.6 * a + 0.8 * torch.randn(400, generator=g, dtype=torch.float64)
    got = premise_interval(a, b)
    half = 1.959964 / (400 - 3) ** 0.5
    fisher = [float(torch.tanh(torch.atanh(torch.tensor(got["r"])) + s * half)) for s in (-1, 1)]
    assert got["lo"] < got["r"] < got["hi"]
    assert [got["lo"], got["hi"]] == pytest.approx(fisher, abs=0.03), (got, fisher)
    assert premise_interval(a, b) == got and premise_interval(a, b, seed=1)["lo"] != got["lo"]
    with pytest.raises(ValueError):
        premise_interval([1, 2, 3], [[1, 2], [3, 4]])


@pytest.mark.skipif(not os.path.exists(PREMISE), reason="no premise measured for this world's design yet")
def test_the_premise_holds_on_fresh_problems():
    """The premise as a claim, not a replay: on problems the world was not built from (the first
    CLAIM_PROBLEMS of each of study.zipf's fresh sets: new generator seed, none of the world's texts,
    the laws of zipf-train, zipf-test and zipf-rare) with two sampling seeds the committed numbers
    never used (CLAIM_SEEDS), the warm start's r [95% interval] (premise_interval) has its lower
    bound above CLAIM_FLOOR on every set, and the committed point estimate of the matching committed
    set lies inside the fresh interval.

    Why this can fail and will not flake: the tiny world, which lacks the premise, has r about 0.1
    (committed intervals: upper bounds below CLAIM_FLOOR, checked below), so a world without the
    coupling fails the floor (the floor is the coupling's presence, not issue #35's goal r >= 0.6,
    which no committed lower bound reaches). The fresh Zipf lower bounds sit well above the floor:
    0.46 / 0.46 / 0.40 (train / test / rare laws) when this was written, 0.43 / 0.51 / 0.48 with
    sampling seeds 6 and 7 instead, a margin of twice the moves of r between sampling seeds (about
    +-0.05) that other numerics (another machine's kernels) could cause; the committed point
    estimates sat 0.08-0.15 inside both pairs' intervals. The interval holds the response noise, so
    the committed point estimate lying inside it is what a true claim predicts. ~40 s on one thread
    (600 responses per sampling seed)."""
    from study import zipf as study

    with open(PREMISE) as f:
        committed = json.load(f)
    for c in committed["tiny"]["coupling"].values():       # the floor separates a world without the premise
        assert c["hi"] < CLAIM_FLOOR, c
    torch.set_num_threads(1)
    from evaluation import heldout

    path = study.WORLDS["zipf"][0]
    fresh = study.fresh_problems(limit=CLAIM_PROBLEMS)
    world_texts = {r["problem"] for rows in prepare.generate_splits(prepare.SEED).values() for r in rows}
    for name, rows in fresh.items():
        assert len(rows) == CLAIM_PROBLEMS and not world_texts & {r["problem"] for r in rows}, name
    assert {r["dialect"] for r in fresh["fresh-rare"]} <= {k + 1 for k in prepare.RARE}
    model, tokenizer = heldout.load_model(path)
    model.eval()
    got = study.coupling(model, tokenizer, path, fresh, CLAIM_SEEDS)
    for (name, c), want in zip(got.items(), committed["zipf"]["coupling"].values()):
        assert c["lo"] > CLAIM_FLOOR, (name, c["r"], c["lo"], c["hi"])
        assert c["lo"] <= want["r"] <= c["hi"], (name, want["r"], c["lo"], c["hi"])


@pytest.mark.skipif(not os.path.exists(PREMISE), reason="no premise measured for this world's design yet")
def test_the_docs_quote_the_committed_premise():
    """docs/studies.md's premise table quotes every set's r [95% interval] as premise.json has it
    (study.zipf.r_cell), committed and fresh sets of both worlds, and the README's Results quote
    zipf-train's, fresh-train's and tiny-train's to two decimals."""
    from study import zipf as study

    with open(PREMISE) as f:
        committed = json.load(f)
    with open(os.path.join(ROOT, "docs", "studies.md"), encoding="utf-8") as f:
        docs = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for key, got in committed.items():
        for name, c in {**got["coupling"], **got.get("fresh", {}).get("coupling", {})}.items():
            assert study.r_cell(c) in docs, (key, name, study.r_cell(c))
    for key, name in (("zipf", "zipf-train"), ("tiny", "tiny-train")):
        c = committed[key]["coupling"][name]
        assert f"r = {c['r']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}]" in readme, name
    c = committed["zipf"]["fresh"]["coupling"]["fresh-train"]
    assert f"{c['r']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}] on freshly" in readme


def test_design4_is_the_papers_regime_and_its_criterion_rates_are_as_stated():
    """Issue #44's design 4, fixed before its runs: 240 steps are 15 epochs of the RL set, 4
    optimizer steps per RL step; the long-run rule on 800 pooled problems x 13 points rarely fires on
    a flat curve and fires more often the deeper the fall (the rates the docstring states)."""
    from study import zipf

    d = zipf.DESIGN4
    assert zipf.design4_epochs() == 15.0 and d["rollout_batch"] // d["update_batch"] == 4
    rates = zipf.criterion_rates(trials=4000)
    assert max(rates["false_alarm"].values()) <= 0.01
    fall = rates["detection_p0.3"]
    assert 0.45 <= fall[0.05] <= 0.65 and 0.7 <= fall[0.06] <= 0.87 and fall[0.08] >= 0.97


def test_the_hot_temperature_keeps_the_papers_share_of_the_t1_accuracy():
    from study import zipf

    curve = {1.0: 0.40, 1.2: 0.30, 1.4: 0.12, 1.6: 0.07, 1.8: 0.02}
    assert zipf.hot_temperature(curve) == 1.6          # 0.07 is nearest 0.19 x 0.40 = 0.076
    assert zipf.hot_temperature(curve, keep=0.75) == 1.2


def test_the_continued_sft_stops_inside_the_target_and_halves_an_overshoot():
    from study import zipf

    assert zipf.sft_decision(0.30, 50) == "continue"
    assert zipf.sft_decision(0.40, 50) == "stop" and zipf.sft_decision(0.37, 50) == "stop"
    assert zipf.sft_decision(0.47, 50) == "halve"
    assert zipf.sft_decision(0.47, 8) == "stop"          # a 4-step chunk is too short: keep the nearest


def test_design4s_recorded_warm_start_followed_its_rule_and_met_its_targets():
    """study/results/zipf/design4/: every chunk's decision is sft_decision's on its pass@1, the last
    one stopped inside the target, the hot temperature is hot_temperature's pick from the recorded
    curve, and the committed warm start is there."""
    import json
    import os

    from study import zipf

    with open(os.path.join(zipf.RESULTS, "design4", "warmstart.json")) as f:
        chunks = json.load(f)["chunks"]
    assert all(c["decision"] == zipf.sft_decision(c["pass1_rl"], c["steps"]) for c in chunks)
    lo, hi = zipf.DESIGN4["solve_target"]
    assert chunks[-1]["decision"] == "stop" and lo <= chunks[-1]["pass1_rl"] <= hi
    with open(os.path.join(zipf.RESULTS, "design4", "hot.json")) as f:
        hot = json.load(f)
    curve = {float(t): p for t, p in hot["pass1"].items()}
    assert zipf.hot_temperature(curve) == hot["hot"] and abs(curve[hot["hot"]] / curve[1.0] - 0.19) < 0.05
    assert os.path.isfile(os.path.join(zipf.WARMSTART4, "model.safetensors"))


def test_design4s_pilots_ran_the_design_and_their_verdicts_are_the_rules():
    """study/results/zipf/design4/pilots/: each seed ran design 4's arguments (its RL set, batch,
    240 steps, the recorded hot temperature) from the committed warm start, after the design's
    commit; its curve has the 13 evaluations, and its verdict is the long-run rule's on that curve."""
    import json
    import os

    from study import long_run, zipf

    with open(os.path.join(zipf.RESULTS, "design4", "hot.json")) as f:
        hot = json.load(f)["hot"]
    pilots = []
    for seed in zipf.PILOT_SEEDS:
        with open(os.path.join(zipf.RESULTS, "design4", "pilots", f"grpo-s{seed}.json")) as f:
            pilots.append(s := json.load(f))
        argv = s["argv"]
        expected = zipf.design4_pilot_args(argv[argv.index("--train-data") + 1], hot)
        assert argv[:len(expected)] == expected and argv[argv.index("--seed") + 1] == str(seed)
        assert os.path.basename(argv[argv.index("--model") + 1]) == "warmstart4"
        steps = sorted(int(k) for k in s["curve"])
        assert steps == list(range(0, zipf.DESIGN4["steps"] + 1, zipf.DESIGN4["eval_every"]))
        numbers = long_run.curve_numbers(steps, [s["curve"][str(k)] for k in steps])
        assert numbers == pytest.approx({k: s[k] for k in numbers})
        assert s["degrades"] == (numbers["onset"] != long_run.NEVER)
        # the design (57fd469) and its measurements (193d1d4) were committed before the pilot ran
        for before in ("57fd469", "193d1d4"):
            r = subprocess.run(["git", "merge-base", "--is-ancestor", before, s["commit"].split("+")[0]],
                               cwd=ROOT, capture_output=True)
            assert r.returncode != 1, (before, s["commit"])      # (128: a checkout without that history)
    with open(os.path.join(ROOT, "README.md")) as f:                # the README's sentence, from them
        readme = " ".join(f.read().split())
    def span(k):
        return "–".join(f"{100 * v:.1f}" for v in (min(p[k] for p in pilots), max(p[k] for p in pilots)))
    assert f"rises from {span('start')}% to {span('final')}% (smoothed) in all 3 seeds" in readme
    assert not any(p["degrades"] for p in pilots) and "do not degrade either" in readme
