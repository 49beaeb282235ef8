"""The Countdown task: its expression parser and evaluator, the "each number exactly once" rule,
row checks (the answer makes the target; a bad row named by its file line; rows with Countdown's
fields never graded as math), and a generator whose every row the scorer grades correct."""

import json
import os
import re
from collections import Counter
from fractions import Fraction

import pytest

import tasks
from data.countdown import prepare
from plumbing import extension
from plumbing.errors import DataError
from tasks import countdown

ROW = {"numbers": [3, 5, 2], "target": 16}


@pytest.fixture(scope="module")
def regenerated():
    return prepare.generate_splits(1234)


def _value(text):
    return countdown.evaluate(text)[0]


def _boxed(expr):
    return f"<think>\n</think>\nThe answer is \\boxed{{{expr}}}."


# ----------------------------------------------------------------------------- the expression

@pytest.mark.parametrize("text, value", [
    ("3 + 5 * 2", 13), ("(3 + 5) * 2", 16), ("10 - 4 - 3", 3), ("10 - (4 - 3)", 9),   # precedence,
    ("12 / 2 / 3", 2), ("12 / (2 / 3)", 18), ("2 * 3 + 4 * 5", 26), ("((7))", 7),       # left to right
    ("8-2*3", 2), (" 4 +\t5 ", 9),                                                      # spacing is free
    ("7 / 2", Fraction(7, 2)), ("6 / (1 - 3 / 4)", 24), ("(1 - 5) * 3", -12),           # exact rationals
    ("2 \\times 3", 6), ("2\\cdot 3", 6), ("2 × 3", 6), ("8 \\div 4", 2), ("8 ÷ 4", 2),   # synonyms
    ("9 − 4", 5), ("\\left(1 + 2\\right) * 3", 9),
])
def test_evaluates_with_precedence_and_exact_fractions(text, value):
    assert _value(text) == value and isinstance(_value(text), Fraction)


@pytest.mark.parametrize("text", [
    "-3 + 5", "3 * -5", "+3", "3 - - 5",            # no unary minus or plus (module docstring)
    "1 / 0", "3 / (2 - 2)", "5 / (1 - 1) * 0",      # division by zero anywhere
    "", "3 +", "(3 + 5", "3 + 5)", "()", "3 5", "3 (5)", "2.5", "03 + 5", "x + 3",   # junk
    "2 ^ 3", "3 + 5 = 8", "eval('1')", "\\divides 4", "2 \\timesx", "\\left[3\\right]", "²", "٣",
])
def test_rejects_what_is_not_a_plain_expression(text):
    with pytest.raises(countdown.Rejected):
        countdown.evaluate(text)


def test_caps_length_and_nesting():
    deep = "(" * countdown.MAX_DEPTH + "1" + ")" * countdown.MAX_DEPTH
    assert _value(deep) == 1
    with pytest.raises(countdown.Rejected, match="nested"):
        countdown.evaluate("(" + deep + ")")
    long = " + ".join(["1"] * 25)                    # 97 characters
    assert len(long) <= countdown.MAX_CHARS and _value(long) == 25
    with pytest.raises(countdown.Rejected, match="longer"):
        countdown.evaluate(long + " + 1")
    with pytest.raises(countdown.Rejected):          # deep nesting past the length cap: no recursion
        countdown.evaluate("(" * 10_000 + "1" + ")" * 10_000)


def test_records_the_integers_used_in_order():
    assert countdown.evaluate("(12 + 3) * 12")[1] == [12, 3, 12]


# ----------------------------------------------------------------------------- scoring

@pytest.mark.parametrize("expr, outcome", [
    ("(3 + 5) * 2", "correct"), ("2 * (5 + 3)", "correct"), ("(5 + 3) \\times 2", "correct"),
    ("16", "wrong"),                                  # the bare target uses none of the numbers
    ("3 + 5 * 2", "wrong"),                           # the right numbers, the wrong value
    ("(3 + 5) * 2 * 1", "wrong"),                     # an extra number (the value is still 16)
    ("(3 + 5 + 0) * 2", "wrong"),
    ("8 * 2", "wrong"), ("(3 + 5) * 2 + 5 - 5", "wrong"),   # missing; repeated
    ("(3 + 5) * 2 / 0", "rejected"), ("(3 + 5) * -2", "rejected"),
])
def test_each_number_exactly_once_and_the_target(expr, outcome):
    got = countdown.score(_boxed(expr), ROW)
    assert got == tasks.Scored(float(outcome == "correct"), outcome)


def test_repeated_numbers_count_as_a_multiset():
    row = {"numbers": [2, 2, 3], "target": 12}
    assert countdown.score(_boxed("2 * 2 * 3"), row).outcome == "correct"
    assert countdown.score(_boxed("(2 + 2) * 3"), row).outcome == "correct"
    assert countdown.score(_boxed("2 * 6"), row).outcome == "wrong"
    assert countdown.score(_boxed("2 * 3 * 2 * 1"), row).outcome == "wrong"


def test_the_last_box_counts_and_no_box_is_no_answer():
    assert countdown.score("I get 16.", ROW).outcome == "no_answer"
    assert countdown.score("\\boxed{(3 + 5) * 2", ROW).outcome == "no_answer"        # never closed
    assert countdown.score("\\boxed{16} then \\boxed{(3 + 5) * 2}", ROW).outcome == "correct"
    assert countdown.score("\\boxed{(3 + 5) * 2} then \\boxed{16}", ROW).outcome == "wrong"


def test_scores_through_the_task_registry():
    rows = [{**ROW, "task": "countdown"}] * 3
    rewards, correct, counts = tasks.score_rows(
        [_boxed("(3 + 5) * 2"), _boxed("16"), "no box"], rows)
    assert rewards == [1.0, 0.0, 0.0] and correct == [True, False, False]
    assert counts["correct"] == counts["wrong"] == counts["no_answer"] == 1 and counts["rejected"] == 0


@pytest.mark.parametrize("row, says", [
    ({"target": 4}, "numbers"), ({"numbers": [3], "target": 3}, "2 to 6"),
    ({"numbers": list(range(1, 8)), "target": 3}, "2 to 6"), ({"numbers": "3 5", "target": 8}, "numbers"),
    ({"numbers": [3, 0], "target": 3}, "positive"), ({"numbers": [3, -1], "target": 2}, "positive"),
    ({"numbers": [3, 2.0], "target": 5}, "positive"), ({"numbers": [3, True], "target": 4}, "positive"),
    ({"numbers": [3, 5]}, "target"), ({"numbers": [3, 5], "target": "8"}, "target"),
    ({"numbers": [3, 5], "target": 8.0}, "target"),
])
def test_read_row_names_what_is_wrong(row, says):
    with pytest.raises(DataError, match=says) as e:
        countdown.read_row(row, "cd.jsonl:7")
    assert str(e.value).startswith("cd.jsonl:7: ")


def test_read_row_keeps_a_good_row():
    row = {"id": "x", "problem": "p", "answer": "3 + 5", "numbers": [3, 5], "target": 8}
    assert countdown.read_row(row, "here") == row


@pytest.mark.parametrize("answer, says", [
    ("(3 + 5) * 3", "uses [3, 3, 5], not the numbers [2, 3, 5]"),     # another number
    ("3 + 5 * 2", "makes 13, not the target 16"),                      # its target does not match
    ("(3 + 5) * 2 = 16", "is no Countdown expression"),                # an equation
    ("16", "uses [16], not the numbers [2, 3, 5]"),                    # the target alone
])
def test_read_row_checks_that_the_answer_makes_the_target(answer, says):
    row = {"id": "x", "problem": "p", "answer": answer, **ROW}
    with pytest.raises(DataError, match=re.escape(says)) as e:
        countdown.read_row(row, "cd.jsonl:7")
    assert str(e.value).startswith("cd.jsonl:7: the answer ")


def _cd_line(answer="(3 + 5) * 2", **fields):
    row = {"problem": "Use the numbers 3, 5 and 2 to make 16.", "answer": answer, **ROW, **fields}
    return json.dumps(row) + "\n"


def test_a_bad_row_is_named_by_its_line_in_the_file_not_its_index_among_kept_rows(tmp_path):
    """Blank lines and a training row skipped for its blank problem come before the bad row: the
    message names the file's line (1-based), in a held-out set and in a training set alike."""
    from evaluation import heldout
    from data.benchmarks import load_problems

    path = tmp_path / "cd.jsonl"
    path.write_text(_cd_line() + "\n" + _cd_line(problem=" ") + _cd_line() + "\n" + _cd_line("3 + 5 + 2"))
    says = f"{path}:6: the answer '3 + 5 + 2' makes 10, not the target 16"
    with pytest.raises(DataError, match=re.escape(says)):                 # a training set: line 3 is skipped
        load_problems(str(path), read_row=tasks.read_by(str(path), "countdown"))
    path.write_text(_cd_line() + "\n" + _cd_line() + _cd_line(numbers=[3, 5, -2]))
    with pytest.raises(DataError, match=re.escape(f"{path}:4: \"numbers\" must be positive integers")):
        heldout.load_sets([str(path)], task="countdown")


def test_rows_with_countdown_fields_and_no_task_are_refused_not_graded_as_math(tmp_path):
    """Graded as math, a Countdown row's bare \\boxed{target} would be correct: without a "task"
    field and without --task countdown, such rows are refused in one line that says both fixes."""
    from evaluation import heldout

    path = tmp_path / "mine.jsonl"
    path.write_text(_cd_line() * 2)
    with pytest.raises(DataError) as e:
        heldout.load_sets([str(path)], task="math")
    assert str(e.value) == (f"{path}:1: the row has countdown's fields (numbers, target) but no \"task\" "
                            "field, so it would be graded as math; pass --task countdown, or give the rows a "
                            "\"task\" field")
    path.write_text(_cd_line() * 2)
    rows = heldout.load_sets([str(path)], task="countdown")["mine"]
    assert {r["task"] for r in rows} == {"countdown"}
    assert tasks.score_rows([_boxed("16")], rows[:1])[1] == [False]
    path.write_text(_cd_line(task="countdown") + _cd_line(answer="16", task="math"))     # each row says
    assert [r["task"] for r in heldout.load_sets([str(path)], task="math")["mine"]] == ["countdown", "math"]


def test_the_rule_is_any_tasks_own_fields():
    """Not Countdown's alone: a task registered with fields of its own claims rows that carry them."""
    extension.register(tasks.TASKS, "color", tasks.Task("color", "name a color", lambda c, r: None,
                                                        fields=("color",)))
    try:
        rows = [{"id": "0", "problem": "Name a color.", "answer": "red", "color": "red"}]
        with pytest.raises(DataError, match=re.escape("row 1: the row has color's fields (color) but no")):
            tasks.load_rows(rows, "colors.jsonl", "colors.jsonl", "math")
        assert tasks.load_rows(rows, "colors.jsonl", "colors.jsonl", "color")[0]["task"] == "color"
    finally:
        extension.unregister(tasks.TASKS, "color")


# ----------------------------------------------------------------------------- the generated sets

def _replay(row):
    """The worked solution's moves are right and combine the row's numbers down to the target."""
    pool = Counter(row["numbers"])
    body = row["solution"].split("<think>\n")[1].split("\n</think>")[0].splitlines()
    assert len(body) == len(row["numbers"]) - 1 == row["level"]
    for line in body:
        a, op, b, eq, r = line.split()
        a, b, r = int(a), int(b), int(r)
        assert eq == "=" and _value(f"{a} {op} {b}") == r and 0 < r <= prepare.CAP, line
        assert pool[a] >= 1 and pool[b] >= 1 + (a == b), line   # both are on the table
        pool -= Counter([a, b])
        pool[r] += 1
    assert pool == Counter([row["target"]])


def test_every_row_is_solved_by_its_answer_and_its_solution(regenerated):
    import reward

    for row in (r for rows in regenerated.values() for r in rows):
        assert reward.gold_answer(row["answer"]) == row["answer"]      # data.benchmarks keeps it readable
        assert countdown.score(_boxed(row["answer"]), row).outcome == "correct", row
        assert countdown.score(row["solution"], row).outcome == "correct", row
        assert row["solution"].endswith(f"\\boxed{{{row['answer']}}}.")
        lo, hi = prepare.NUMBER_RANGE
        assert all(lo <= n <= hi for n in row["numbers"]) and 0 < row["target"] <= prepare.CAP
        _replay(row)


def test_generation_is_deterministic_and_matches_the_shipped_files(regenerated):
    assert prepare.generate_splits(1234) == regenerated
    assert prepare.generate_splits(1235)["test"] != regenerated["test"]
    for name, rows in regenerated.items():
        with open(os.path.join(countdown.DATA, f"{name}.jsonl")) as f:
            assert f.read() == prepare.to_jsonl(rows), f"{name}.jsonl is stale: rerun prepare"


def test_splits_are_disjoint_and_sized(regenerated):
    keys = {name: [prepare.problem_key(r) for r in rows] for name, rows in regenerated.items()}
    for name, parts in prepare.SPLITS.items():
        assert len(set(keys[name])) == len(keys[name]) == sum(n for n, _ in parts)
        assert Counter(len(r["numbers"]) for r in regenerated[name]) == {k: n for n, k in parts}
    assert not set(keys["test"]) & (set(keys["train"]) | set(keys["sft"]))   # the same numbers in any order
    assert not set(keys["train"]) & set(keys["sft"])
    texts = {name: {r["problem"] for r in rows} for name, rows in regenerated.items()}
    assert not texts["test"] & (texts["train"] | texts["sft"])


def test_shipped_rows_load_as_countdown_rows():
    from data.benchmarks import load_benchmark

    for name, path in countdown.TASK.datasets.items():
        rows = tasks.load_rows(load_benchmark(path), path, name, "math")
        assert {r["task"] for r in rows} == {"countdown"}
        with open(path) as f:
            raw = json.loads(f.readline())
        assert {k: rows[0][k] for k in raw} == raw            # numbers, target, answer kept as written
    assert sum(os.path.getsize(p) for p in countdown.TASK.datasets.values()) < 1_000_000


def test_the_tiny_tokenizer_reads_the_texts_back(regenerated):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.join(os.path.dirname(countdown.DATA), "tinymath", "warmstart"))
    for row in regenerated["test"][:50] + regenerated["sft"][-50:]:
        for text in (row["problem"], row["solution"]):
            ids = tok(text, add_special_tokens=False).input_ids
            assert tok.decode(ids) == text
            assert tok.unk_token_id is None or tok.unk_token_id not in ids
