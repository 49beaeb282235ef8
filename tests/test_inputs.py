"""Inputs that would waste a whole run are refused with one line before anything is written (issue
#20): non-finite flag and config values, answers the grader cannot read, chat-message problems that
are not a single user message, blank problems and answers. train.py runs in-process, as a user's
command would, and --out must stay empty."""

import json
import os
import re

import pytest
from transformers import AutoTokenizer

import train
from data.benchmarks import load_benchmark, load_problems
from data.prompts import load_prompt_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
TRAIN = os.path.join(ROOT, "data", "tinymath", "train.jsonl")


@pytest.fixture(scope="module")
def rows():
    """64 rows of the tiny world's training set: enough for train.py's default batch sizes."""
    with open(TRAIN) as f:
        return [json.loads(next(f)) for _ in range(64)]


@pytest.fixture
def good_train(tmp_path, rows):
    """A small good training file, for the commands whose bad input is a benchmark."""
    return write_jsonl(tmp_path / "good.jsonl", rows)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def with_row(rows, i, **fields):
    """A copy of `rows` whose row i (line i + 1 of the file) has `fields` replaced."""
    return rows[:i] + [{**rows[i], **fields}] + rows[i + 1:]


def refused(tmp_path, capsys, *argv, code=None):
    """train.main on bad input -> the one message line; asserts no traceback and an empty --out."""
    out = tmp_path / "run"
    base = ["--model", WARM, "--out", str(out), "--eval-data", "tiny-test", "--eval-limit", "2"]
    with pytest.raises(SystemExit) as e:
        train.main([*base, *argv])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "Traceback" not in err
    if code is not None:
        assert e.value.code == code
    assert not out.exists() or not any(out.iterdir()), sorted(os.listdir(out))
    return e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- flag and config values

# should a bad value get through, these make the command fail at once (no model) or stop after
# the step-0 evaluation, instead of training a run with it
NO_MODEL = ("--model", "/nonexistent/model")
NO_STEPS = ("--steps", "0")


@pytest.mark.parametrize("argv,needle", [
    (["--lr", "inf"], "argument --lr: expected a finite number, got 'inf'"),          # a table row (">0")
    (["--nccl-timeout", "inf"], "argument --nccl-timeout: expected a finite number"),
    (["--alpha", "nan"], "argument --alpha: expected a finite number, got 'nan'"),    # an Algo knob
    (["--kl-clamp=-inf"], "argument --kl-clamp: expected a finite number, got '-inf'"),
    (["--weight-clip", "0", "nan"], "argument --weight-clip: expected a finite number"),  # a pair
    (["--eval-temperatures", "0.4", "inf"], "argument --eval-temperatures: expected a finite number"),  # a list
    (["--eval-temperatures", "1", "-0.5"], "argument --eval-temperatures: must be >=0, got -0.5"),
])
def test_non_finite_flag_values_are_argparse_errors(tmp_path, capsys, argv, needle):
    msg = refused(tmp_path, capsys, *argv, *NO_MODEL, code=2)
    assert needle in msg


@pytest.mark.parametrize("config,needle", [
    ('{"alpha": NaN}', "alpha: expected a finite number, got 'nan'"),       # json reads NaN and Infinity
    ('{"lr": Infinity}', "lr: expected a finite number, got 'inf'"),
    ('{"weight_clip": [0, Infinity]}', "weight_clip: expected a finite number, got 'inf'"),
    ('{"steps": null}', "steps: null is not a value (leave the key out for the default, 50)"),
    ('{"eval_data": "tiny-test"}', "eval_data: expected a JSON list, got 'tiny-test'"),
    ('{"eval_temperatures": 1.0}', "eval_temperatures: expected a JSON list, got 1.0"),
    ('{"eval_temperatures": []}', "eval_temperatures: expected at least one value, got []"),
    ('{"eval_temperatures": [1, NaN]}', "eval_temperatures: expected a finite number, got 'nan'"),
    ('{"eval_temperature": 1.0}', "unknown keys ['eval_temperature']"),        # now a list: a clear error
])
def test_config_values_get_the_flags_checks(tmp_path, capsys, config, needle):
    cfg = tmp_path / "c.json"
    cfg.write_text(config)
    msg = refused(tmp_path, capsys, "--config", str(cfg), *NO_MODEL, code=2)
    assert f"{cfg}: {needle}" in msg


# ----------------------------------------------------------------------------- answers

UNREADABLE = ("which the grader cannot read "
              "(give it as text or a number; several answers as a flat list of those)")


def test_answers_the_grader_cannot_read_are_errors_naming_file_and_line(tmp_path, capsys, rows, good_train):
    f = write_jsonl(tmp_path / "train.jsonl", with_row(rows, 2, answer={"value": 3}))
    msg = refused(tmp_path, capsys, "--train-data", str(f), *NO_STEPS)   # an error, not a skipped row
    assert msg == f'error: {f}:3: the answer is a dict ({{"value": 3}}), {UNREADABLE}'
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "1+1", "answer": "2"},
                                                   {"problem": "Is 7 prime?", "answer": True}])
    msg = refused(tmp_path, capsys, "--eval-data", str(bench), "--train-data", str(good_train), *NO_STEPS)
    assert msg == f"error: {bench}:2: the answer is a bool (true), {UNREADABLE}"


def test_other_unreadable_answers_and_blank_answers(tmp_path):
    bench = tmp_path / "b.jsonl"
    for answer, what in (([["1", "2"]], 'a list holding a list ([["1", "2"]])'),
                         (float("nan"), "a non-finite float (NaN)")):
        write_jsonl(bench, [{"problem": "Q", "answer": answer}])
        with pytest.raises(ValueError, match=re.escape(f"{bench}:1: the answer is {what}, {UNREADABLE}")):
            load_benchmark(str(bench))
    # a blank answer is no answer (it matches no response); the solution's box stands in, if any
    write_jsonl(bench, [{"problem": "Q", "answer": "  ", "solution": "so \\boxed{4}"},
                        {"problem": "Q", "answer": "  "}])
    with pytest.raises(ValueError, match=re.escape(f"{bench}:2: no answer: 'answer' is \"  \"")):
        load_benchmark(str(bench))
    assert [r["answer"] for r in load_problems(str(bench))] == ["4"]


# ----------------------------------------------------------------------------- problems


def test_a_single_user_message_is_the_problem_text(tmp_path, rows):
    """verl-style prompts ([{"role": "user", "content": ...}]) give the very prompts of plain text."""
    chats = [{**r, "problem": [{"role": "user", "content": r["problem"]}]} for r in rows[:8]]
    chat = write_jsonl(tmp_path / "chat.jsonl", chats)
    plain = write_jsonl(tmp_path / "plain.jsonl", rows[:8])
    tok = AutoTokenizer.from_pretrained(WARM)
    got, want = (load_prompt_set(str(p), tok, "paper", training=True) for p in (chat, plain))
    assert got.ids == want.ids and [r["problem"] for r in got.rows] == [r["problem"] for r in rows[:8]]
    assert "'role'" not in tok.decode(got.ids[0])


def test_other_chats_are_refused(tmp_path, capsys, rows):
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": rows[1]["problem"]}]
    f = write_jsonl(tmp_path / "train.jsonl", with_row(rows, 1, problem=system))
    msg = refused(tmp_path, capsys, "--train-data", str(f), *NO_STEPS)
    assert msg.startswith(f"error: {f}:2: the problem is a chat of 2 messages (roles system, user), "
                          "but only one user message can be a problem")
    multimodal = [{"role": "user", "content": [{"type": "text", "text": "1+1?"}]}]
    write_jsonl(f, [{"problem": multimodal, "answer": "2"}])
    with pytest.raises(ValueError, match=re.escape(f"{f}:1: the problem's user message has content [{{")):
        load_benchmark(str(f))


def test_blank_problems_are_skipped_in_training_and_errors_elsewhere(tmp_path, capsys, rows, good_train):
    f = write_jsonl(tmp_path / "train.jsonl", with_row(rows, 3, problem=" \n\t"))
    assert len(load_problems(str(f))) == 63          # skipped and named, like a row without the field
    assert f"{f}:4" in capsys.readouterr().out
    msg = refused(tmp_path, capsys, "--train-data", str(f), "--strict-data", *NO_STEPS)
    assert msg == f"error: {f}:4: no problem: 'problem' is empty or whitespace (fill it in, or drop the row)"
    # a benchmark never skips a row (--eval-limit 0: all of them)
    msg = refused(tmp_path, capsys, "--eval-data", str(f), "--eval-limit", "0",
                  "--train-data", str(good_train), *NO_STEPS)
    assert msg.startswith(f"error: {f}:4: no problem")


# ----------------------------------------------------------------------------- held-out sets

def test_a_heldout_set_that_is_the_training_set_is_refused(tmp_path, capsys, rows, good_train):
    """eval_acc, the held-out accuracy a run reports, is the first --eval-data set's: the training
    file, or a file of training problems (a copy of its first lines), is refused there; after a
    held-out set it is measured as the training set it is (the train vs held-out gap)."""
    msg = refused(tmp_path, capsys, "--train-data", str(good_train), "--eval-data", str(good_train),
                  *NO_STEPS)
    assert msg == (f"error: --eval-data {good_train} is the training file (--train-data {good_train}): "
                   "eval_acc, the held-out accuracy, would be training accuracy; give a held-out set first "
                   "(training problems may follow it, to measure the gap)")
    copy = write_jsonl(tmp_path / "held.jsonl", rows[10:20])
    msg = refused(tmp_path, capsys, "--train-data", str(good_train), "--eval-data", str(copy), "tiny-test",
                  *NO_STEPS)
    assert msg.startswith(f"error: --eval-data {copy} holds only training problems "
                          f"(--train-data {good_train})")
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"problem": "What is 1+1?", "answer": "2"}] + rows[:3])
    for i, eval_data in enumerate(([str(mixed)], ["tiny-test", str(good_train)])):   # a few shared; the gap
        out = tmp_path / f"ok{i}"
        train.main(["--model", WARM, "--out", str(out), "--train-data", str(good_train), "--eval-data",
                    *eval_data, "--eval-limit", "2", "--steps", "0", "--query-cache-dir", ""])
        assert (out / "metrics.jsonl").exists()


def test_inf_gets_no_advice_to_give_a_large_number(tmp_path, capsys):
    """No option means infinity, and for none of them is "a large one such as 1e9" what to give."""
    for flag in ("--alpha", "--lr", "--eval-temperatures"):
        msg = refused(tmp_path, capsys, flag, "inf", *NO_MODEL, code=2)
        assert msg.endswith(f"argument {flag}: expected a finite number, got 'inf'"), msg
