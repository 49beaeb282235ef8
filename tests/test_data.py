"""Tests for data/benchmarks.py: gold answers as the grader reads them (reward.gold_answer), row
fields and errors, the embedded tiny world, and the shared benchmark / training files (every gold
answer grades correct against itself). Tests that need ../shared/data skip when it is absent."""

import json
import os

import pytest

import data.benchmarks as B
import reward
from data.benchmarks import load_benchmark, load_problems
from data.prompts import PAPER_INSTRUCTION, build_prompt
from reward import gold_answer

# the shared benchmark files beside the checkout (../shared), as on CI; tests skip without them
SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "benchmarks")
TRAIN = os.path.join(os.path.dirname(SHARED), "train")


def test_gold_answer():
    assert gold_answer(27.0) == "27"
    assert gold_answer("27.0") == "27"
    assert gold_answer("025") == "25"
    assert gold_answer("0") == "0"
    assert gold_answer(2.5) == "2.5"
    assert gold_answer(["$\\frac{1}{2}$"]) == "\\frac{1}{2}"
    assert gold_answer(["3", "5"]) == "3, 5"
    assert gold_answer("4.5e33") == "4.5 \\times 10^{33}"
    assert gold_answer("\\left( 3, \\frac{\\pi}{2} \\right)") == \
        "\\left( 3, \\frac{\\pi}{2} \\right)"
    # and the edges of a raw value
    assert gold_answer(None) == "" and gold_answer(7) == "7"
    assert gold_answer(("1", None, "")) == "1"
    assert gold_answer(4.5e33) == "4.5 \\times 10^{33}"     # not the float's noisy int digits
    assert gold_answer(" $x$ ") == "x"
    assert gold_answer("66.450") == "66.450"                # stated precision kept; grade() copes
    assert reward.grade("66.45", gold_answer("66.450"))


@pytest.mark.parametrize("value,what", [
    ({"value": 3}, "a dict"), (True, "a bool"), ([["1", "2"]], "a list holding a list"),
    (["1", {"a": 1}], "a list holding a dict"), (float("nan"), "a non-finite float"),
    (float("inf"), "a non-finite float"), ([False], "a bool"), ({1, 2}, "a set")])
def test_gold_answer_refuses_values_the_grader_cannot_read(value, what):
    # as text ("{'value': 3}", "True", "nan") they match no boxed answer: every reward would be 0
    with pytest.raises(ValueError, match=f"the answer is {what} .*which the grader cannot read"):
        gold_answer(value)


def test_benchmarks_has_no_normaliser_or_boxed_extractor_of_its_own(tmp_path):
    assert not hasattr(B, "normalize_answer") and not hasattr(B, "last_boxed")
    assert B.gold_answer is reward.gold_answer and B.extract_boxed is reward.extract_boxed
    raw = [{"problem": "Q1", "answer": " 27.0 "}, {"problem": "Q2", "answer": ["$4.5e33$"]},
           {"problem": "Q3", "answer": "[1, 2)"}, {"problem": "Q4", "answer": 0.5},
           # the answer from the solution is found the way grading finds a model's answer:
           # the LAST box, \fbox too, escaped braces kept
           {"problem": "Q5", "solution": "\\boxed{1}, no: \\fbox{\\{1, 2\\}}."}]
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in raw) + "\n")
    rows = load_benchmark(str(path))
    expected = [gold_answer(r["answer"]) for r in raw[:4]]
    expected.append(gold_answer(reward.extract_boxed(raw[4]["solution"])))
    assert [r["answer"] for r in rows] == expected
    assert expected[-1] == "\\{1, 2\\}"


def test_load_benchmark_fields_and_errors(tmp_path):
    path = tmp_path / "b.jsonl"
    rows = [{"question": "Q1", "final_answer": ["$27.0$"], "solution": ["s"], "idx": 7},
            {"problem": "Q2", "answer": 27.0, "level": 3},
            {"Problem": "Q3", "solution": "so \\boxed{\\frac{1}{2}}."},
            {"problem": "Q4", "answer": "025", "id": "a"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_benchmark(str(path))
    assert [r["problem"] for r in got] == ["Q1", "Q2", "Q3", "Q4"]
    assert [r["answer"] for r in got] == ["27", "27", "\\frac{1}{2}", "25"]
    assert [r["id"] for r in got] == ["7", "1", "2", "a"]
    assert got[1]["level"] == 3 and got[0]["solution"] == "s"
    assert len(load_benchmark(str(path), limit=2)) == 2
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("no-such-benchmark")
    with pytest.raises(ValueError, match="not found"):
        load_benchmark(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="no problem field"):
        load_benchmark(str(tmp_path / "bad.jsonl"))


def test_paper_template_keeps_its_literal_boxed():
    # str.format read the instruction's "\\boxed{}" as a field: every --template paper prompt raised
    text = build_prompt(None, " What is 1+1? ", "paper")
    assert text == "What is 1+1? " + PAPER_INSTRUCTION + "\n" and text.count("\\boxed{}") == 1
    with pytest.raises(ValueError, match="a problem must be non-empty text"):
        build_prompt(None, [{"role": "user", "content": "What is 1+1?"}], "plain")


def test_tiny_benchmarks_load():
    rows = load_benchmark("tiny-test", limit=5)
    if not rows:
        pytest.skip("data/tinymath/test.jsonl not generated yet")
    assert all(r["answer"] and r["problem"] and r["id"] for r in rows)
    group = load_benchmark("tiny")
    assert len({r["id"] for r in group}) == len(group)  # ids unique across the three sets


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="shared benchmark files not present")
def test_shared_benchmarks_load_and_grade():
    files = sorted(f for f in os.listdir(SHARED) if f.endswith(".jsonl"))
    assert files
    for f in files:
        path = os.path.join(SHARED, f)
        rows = load_benchmark(path)
        assert rows and all(r["problem"] and r["answer"] for r in rows)
        assert len({r["id"] for r in rows}) == len(rows)
        with open(path) as fh:   # each row's answer is the grader's reading of the raw value
            raw = [json.loads(line) for line in fh if line.strip()]
        assert [r["answer"] for r in rows] == [gold_answer(r["answer"]) for r in raw], f
        scores, _ = reward.score_batch(["\\boxed{" + r["answer"] + "}" for r in rows],
                                       [r["answer"] for r in rows])
        assert all(s == 1.0 for s in scores), f
        for r in rows:
            if "answer_original" in r:  # AMC stores 27.0: the float must grade as 27
                assert reward.score("\\boxed{" + gold_answer(r["answer_original"]) + "}",
                                    r["answer"]) == 1.0
    aime = load_benchmark(os.path.join(SHARED, "aime2024.jsonl"))
    padded = [r for r in aime if r.get("answer_raw", "").startswith("0")]
    assert padded  # "025" and friends
    for r in padded:
        assert reward.score("\\boxed{" + r["answer_raw"] + "}", r["answer"]) == 1.0
        assert reward.score("\\boxed{" + str(int(r["answer_raw"])) + "}", r["answer"]) == 1.0


def test_math_l3to5_training_set_loads_and_its_answers_grade():
    """The paper's training set by name from a local copy: the 2 rows with an empty answer are
    skipped (and counted), every other gold answer grades correct against itself."""
    if not os.path.isfile(os.path.join(TRAIN, "math_l3to5.jsonl")):
        pytest.skip("shared MATH L3-5 training file not available")
    rows = load_problems("math-l3to5", data_dir=TRAIN)
    assert len(rows) == 8521 and all(r["answer"] for r in rows)
    sample = rows[::17]
    scores, counts = reward.score_batch(["\\boxed{" + r["answer"] + "}" for r in sample],
                                        [r["answer"] for r in sample], timeout=10.0)
    assert sum(scores) >= 0.99 * len(sample), counts
    with pytest.raises(ValueError, match="no answer"):
        load_benchmark(os.path.join(TRAIN, "math_l3to5.jsonl"))
