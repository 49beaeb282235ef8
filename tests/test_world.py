"""The embedded tiny world: deterministic generation, disjoint splits, gradeable solutions, and a
tokenizer/model that the real loading path reads back unchanged."""

import hashlib
import json
import os
import random

import pytest

from data.tinymath import prepare, world

TINY = os.path.dirname(prepare.__file__)
SHIPPED = ["test", "hard", "ood", "train"]


def _rows(name):
    with open(os.path.join(TINY, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def regenerated():
    return prepare.generate_splits(1234)


def test_generation_is_deterministic_and_matches_the_shipped_files(regenerated, tmp_path):
    again = prepare.generate_splits(1234)
    assert again == regenerated
    assert prepare.generate_splits(1235)["test"] != regenerated["test"]
    for name in SHIPPED:  # the committed JSONL is exactly what `prepare` writes
        prepare.write_jsonl(tmp_path / f"{name}.jsonl", regenerated[name])
        fresh = hashlib.sha256((tmp_path / f"{name}.jsonl").read_bytes()).hexdigest()
        with open(os.path.join(TINY, f"{name}.jsonl"), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == fresh, f"{name}.jsonl is stale: rerun prepare"


def test_splits_are_disjoint_and_sized(regenerated):
    texts = {name: {r["problem"] for r in rows} for name, rows in regenerated.items()}
    for name, parts in prepare.SPLITS.items():
        size = sum(n for n, _, _ in parts)
        assert len(texts[name]) == size == len(regenerated[name])  # no duplicate inside a split
        assert {r["level"] for r in regenerated[name]} == {lv for _, lvs, _ in parts for lv in lvs}
    names = list(texts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not texts[a] & texts[b], f"{a} and {b} share problems"


def test_ood_split_is_out_of_the_rl_training_distribution(regenerated):
    rl_words = {w for r in regenerated["train"] for w in r["problem"].split()}
    for r in regenerated["ood"]:
        assert any(o in r["problem"] for o in world.OOD_OBJECTS)
        assert any(n in r["problem"] for n in world.OOD_NAMES)
        assert set(r["problem"].split()) - rl_words, "an OOD problem is made only of RL-training words"
    for r in regenerated["train"] + regenerated["test"] + regenerated["hard"]:
        assert not set(r["problem"].replace(".", " ").replace("?", " ").split()) & set(world.OOD_OBJECTS + world.OOD_NAMES)
    ood_share = sum(any(n in r["problem"] for n in world.OOD_NAMES) for r in regenerated["sft"]) / len(regenerated["sft"])
    assert 0.05 < ood_share < 0.15  # the warm start sees the held-out phrasing rarely (docstring of prepare)


def _eval_solution(solution):
    """Check a worked solution by hand: every line 'a op b = c' is right, the chain ends in the box."""
    body = solution.split("<think>\n")[1].split("\n</think>")[0].splitlines()
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a // b if a % b == 0 else None}
    for line in body:
        a, op, b, eq, c = line.split()
        assert eq == "=" and ops[op](int(a), int(b)) == int(c), line
    return int(body[-1].split()[-1])


def test_every_answer_is_right_and_graded_correct(regenerated):
    import reward

    for name, rows in regenerated.items():
        sample = rows if name != "sft" else rows[:2000]
        for r in sample:
            assert str(_eval_solution(r["solution"])) == r["answer"]
            assert len(r["solution"].split("<think>\n")[1].split("\n</think>")[0].splitlines()) == r["steps"]
        scores, counts = reward.score_batch([r["solution"] for r in sample], [r["answer"] for r in sample])
        assert sum(scores) == len(sample), (name, counts)
        wrong = [str(int(r["answer"]) + 1) for r in sample[:200]]
        assert sum(reward.score_batch([r["solution"] for r in sample[:200]], wrong)[0]) == 0


def test_levels_get_harder():
    rng = random.Random(0)
    steps = {lv: world.make_problem(rng, lv)["steps"] for lv in world.LEVELS}
    assert [steps[lv] for lv in sorted(steps)] == sorted(steps.values())
    with pytest.raises(ValueError):
        world.make_problem(rng, 9)


def test_shipped_checkpoint_loads_through_the_real_path():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modeling import models
    import rollout
    from data.prompts import build_prompt

    path = os.path.join(TINY, "warmstart")
    model = AutoModelForCausalLM.from_pretrained(path)
    auto_tok = AutoTokenizer.from_pretrained(path)
    model2, tok = models.load_policy(path)
    assert model.config.model_type == "qwen2" and model.num_parameters() < 2_000_000
    text = _rows("ood")[0]["problem"] + "\n" + _rows("ood")[0]["solution"] + "  \n\n 1,000"
    # AutoTokenizer (Qwen2Tokenizer) and our loader tokenize alike, and decoding is lossless
    assert auto_tok(text).input_ids == tok(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert [tok.decode([t]) for t in tok("123").input_ids] == ["1", "2", "3"]
    # the chat template wraps the problem as a user turn and opens the assistant turn
    prompt = build_prompt(tok, _rows("test")[0]["problem"], "plain")
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    # the warm start writes the paper's format
    ids = tok(prompt, add_special_tokens=False).input_ids
    ro = rollout.sample(model2, [ids] * 4, max_new_tokens=64, eos_ids=rollout.eos_token_ids(model2, tok),
                        pad_id=tok.pad_token_id, temperature=1.0, seeds=[0, 1, 2, 3])
    outs = tok.batch_decode(ro.response_ids, skip_special_tokens=True)
    assert sum("<think>" in o and "</think>" in o and "\\boxed{" in o for o in outs) >= 3, outs
