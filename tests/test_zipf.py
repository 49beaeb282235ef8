"""The Zipf world (data/zipf/, tasks/zipf.py, study/zipf.py): its files are its generator's output,
its solutions are right, its topics follow the law, its warm start is what the SFT recipe makes
(a shortened run against a committed fingerprint), `--task zipf` trains, and the committed premise
numbers are what the shipped warm start gives."""

import hashlib
import json
import os
import random
from collections import Counter

import pytest
import torch

from data.zipf import prepare, world

ZIPF = os.path.dirname(prepare.__file__)
ROOT = os.path.dirname(os.path.dirname(ZIPF))
SHIPPED = ["test", "rare", "train"]


@pytest.fixture(scope="module")
def regenerated():
    return prepare.generate_splits(1234)


def test_generation_is_deterministic_and_matches_the_shipped_files(regenerated, tmp_path):
    assert prepare.generate_splits(1234) == regenerated
    for name in SHIPPED:  # the committed JSONL is exactly what `prepare` writes
        prepare.write_jsonl(tmp_path / f"{name}.jsonl", regenerated[name])
        fresh = hashlib.sha256((tmp_path / f"{name}.jsonl").read_bytes()).hexdigest()
        with open(os.path.join(ZIPF, f"{name}.jsonl"), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == fresh, f"{name}.jsonl is stale: rerun prepare"


def test_splits_are_disjoint_sized_and_the_rare_set_is_rare(regenerated):
    texts = {name: {r["problem"] for r in rows} for name, rows in regenerated.items()}
    for name, parts in prepare.SPLITS.items():
        assert len(texts[name]) == sum(n for n, _, _ in parts) == len(regenerated[name])
    names = list(texts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not texts[a] & texts[b], f"{a} and {b} share problems"
    rare = {world.TOPICS[k].name for k in prepare.RARE}
    assert {r["topic"] for r in regenerated["rare"]} == rare
    share = sum(r["topic"] in rare for r in regenerated["train"]) / len(regenerated["train"])
    expected = sum(world.topic_weights()[k] for k in prepare.RARE)
    assert abs(share - expected) < 0.03 and 0.1 < expected < 0.3   # rare questions are in training too


def test_topics_follow_the_zipf_law(regenerated):
    counts = Counter(r["rank"] for r in regenerated["sft"])
    n = len(regenerated["sft"])
    for k, p in enumerate(world.topic_weights(), start=1):
        assert abs(counts[k] / n - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3, (k, counts[k] / n, p)
    assert counts[1] > 10 * counts[len(world.TOPICS)]


def _eval_solution(solution):
    """Check a worked solution by hand: each line's 'a op b = c' is right; the chain ends in the box."""
    body = solution.split("<think>\n")[1].split("\n</think>")[0].splitlines()
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for line in body:
        a, op, b, eq, c = line.split(": ")[-1].split()
        assert eq == "=" and ops[op](int(a), int(b)) == int(c), line
    return int(body[-1].split()[-1]), len(body)


def test_every_answer_is_right_uses_the_topic_facts_and_is_graded_correct(regenerated):
    import reward

    by_name = {t.name: t for t in world.TOPICS}
    for name, rows in regenerated.items():
        sample = rows if name != "sft" else rows[:2000]
        for r in sample:
            assert _eval_solution(r["solution"]) == (int(r["answer"]), r["steps"])
            topic = by_name[r["topic"]]
            assert topic.owners[0] in r["problem"] or any(o in r["problem"] for o in topic.owners)
            if topic.container in r["problem"]:          # the container's size is in the answer, never the question
                assert f"* {topic.size} =" in r["solution"]
        scores, counts = reward.score_batch([r["solution"] for r in sample], [r["answer"] for r in sample])
        assert sum(scores) == len(sample), (name, counts)


def test_levels_and_topics_are_checked():
    rng = random.Random(0)
    steps = {lv: world.make_problem(rng, lv)["steps"] for lv in world.LEVELS}
    assert [steps[lv] for lv in sorted(steps)] == sorted(steps.values())
    with pytest.raises(ValueError):
        world.make_problem(rng, 9)
    assert world.make_problem(rng, 3, topic=7)["topic"] == world.TOPICS[7].name
