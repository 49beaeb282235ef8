"""Bad input ends in one clear line; no fault loses a run; non-finite steps are skipped; a run ends
with a summary; metrics can be mirrored to TensorBoard.

The fault tests run train.py in a subprocess that a failpoint (faults.py) SIGKILLs at a named
place, then `--resume` it, and require the metrics of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest
import torch

import evaluate
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
TRAIN = os.path.join(ROOT, "data", "tinymath", "train.jsonl")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    with open(TRAIN) as f:
        lines = [next(f) for _ in range(64)]
    (d / "train.jsonl").write_text("".join(lines))
    return d, lines


def small(out, train_data, *extra):
    return ["--model", WARM, "--train-data", str(train_data), "--out", str(out), "--steps", "4",
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "24", "--eval-data", "tiny-test", "--eval-limit", "4", "--eval-every", "2",
            "--save-every", "2", *extra]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same_metrics(a, b):
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if not (k == "step_time" or k.startswith("time_") or k.endswith("_per_s")):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (x["step"], k)


# ----------------------------------------------------------------------------- bad input


def bad_run(tmp_path, capsys, *argv):
    """train.main on bad input -> (exit code, the one message line); nothing left in --out."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--model", WARM, "--out", str(out), "--eval-data", "tiny-test", "--eval-limit", "2", *argv])
    err = capsys.readouterr().err
    msg = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert e.value.code != 0 and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists() and not (out / "config.json").exists()
    return msg


def test_bad_training_files_name_file_and_line(tmp_path, capsys, data):
    d, lines = data
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines[:5]) + '{"problem": "1+1", "answer": \n' + "".join(lines[5:10]))
    msg = bad_run(tmp_path, capsys, "--train-data", str(broken))
    assert msg.startswith(f"error: {broken}:6: not valid JSON") and "(each line must be one JSON object)" in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"error: {empty}: no rows" in bad_run(tmp_path, capsys, "--train-data", str(empty))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes("".join(lines[:2]).encode() + b'{"problem": "\xff\xfe", "answer": "1"}\n')
    assert f"error: {binary}:3: not UTF-8 text" in bad_run(tmp_path, capsys, "--train-data", str(binary))
    missing = tmp_path / "nope.jsonl"
    assert f"error: {missing}: file not found" in bad_run(tmp_path, capsys, "--train-data", str(missing))
    listy = tmp_path / "list.jsonl"
    listy.write_text(lines[0] + "[1, 2]\n")
    assert f"error: {listy}:2: expected a JSON object" in bad_run(tmp_path, capsys, "--train-data", str(listy))


def test_rows_without_answer_are_skipped_and_named_unless_strict(tmp_path, capsys, data):
    d, lines = data
    f = tmp_path / "noanswer.jsonl"
    f.write_text("".join(lines[:3]) + '{"problem": "What is 2+2?"}\n' + "".join(lines[3:64]))
    from data.benchmarks import load_problems
    rows = load_problems(str(f))
    assert len(rows) == 64 and f"{f}:4" in capsys.readouterr().out
    msg = bad_run(tmp_path, capsys, "--train-data", str(f), "--strict-data")
    assert msg.startswith(f"error: {f}:4: no answer")


@pytest.mark.parametrize("argv,needle", [
    (["--alpha", "-1"], "alpha must be >= 0"), (["--group-size", "1"], "--group-size: must be >=2"),
    (["--top-p", "1.5"], "--top-p: must be (0,1]"), (["--lr", "0"], "--lr: must be >0"),
    (["--algo", "erpo", "--kl", "k2"], "--kl cannot act on --algo erpo"),
    (["--algo", "sft", "--alpha", "0.5"], "--alpha cannot act on --algo sft"),
    (["--algo", "rloo", "--kl-clamp", "5"], "--kl-clamp cannot act on --algo rloo"),
    (["--algo", "grpo", "--max-resample-rounds", "2"], "--max-resample-rounds cannot act")])
def test_option_values_out_of_range_are_argparse_errors(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_malformed_config_and_benchmark_files(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"steps": 3,\n "lr": }')
    with pytest.raises(SystemExit) as e:
        train.main(["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and f"{cfg}:2: not valid JSON" in capsys.readouterr().err
    for bad, needle in (({"group_size": 1}, "group_size: must be >=2"), ({"top_p": 2.0}, "top_p: must be (0,1]"),
                        ({"sampler": "beam"}, "sampler: invalid value 'beam'"), ({"steps": "x"}, "steps: expected int")):
        cfg.write_text(json.dumps(bad))     # a config file gets the same checks as the flags
        with pytest.raises(SystemExit) as e:
            train.main(["--config", str(cfg), "--out", str(tmp_path / "o")])
        assert e.value.code == 2 and needle in capsys.readouterr().err, bad
    assert not (tmp_path / "o").exists()
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", WARM, "--benchmarks", str(bench), "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{bench}:2: no answer" in err and "Traceback" not in err  # never skipped
    bench.write_text('{"problem": "1+1", "answer": "2"}\nnot json\n')
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", WARM, "--benchmarks", str(bench), "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{bench}:2: not valid JSON" in err and "Traceback" not in err


def test_too_little_data_and_a_bad_model_folder(tmp_path, capsys, data):
    d, lines = data
    few = tmp_path / "few.jsonl"
    few.write_text("".join(lines[:5]))
    assert f"error: {few}: 5 usable examples, fewer than one batch (--rollout-batch 32" in \
        bad_run(tmp_path, capsys, "--train-data", str(few))
    empty_model = tmp_path / "model"
    empty_model.mkdir()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(empty_model), "--out", str(out)])
    assert str(e.value.code).startswith(f"error: cannot load model '{empty_model}'") and not out.exists()


def test_bad_input_from_the_command_line_prints_no_traceback(tmp_path, data):
    """The same as a user sees it: a real process, exit status, one line on stderr."""
    d, lines = data
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines[:5]) + "{oops\n")
    r = subprocess.run([sys.executable, "train.py", "--train-data", str(broken), "--out", str(tmp_path / "o"),
                        "--eval-data", "tiny-test", "--eval-limit", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {broken}:6: not valid JSON")


# ----------------------------------------------------------------------------- faults


def run_proc(argv, fault=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ERPO_FAULT", None)
    if fault:
        env["ERPO_FAULT"] = fault
    code = "import sys, torch; torch.set_num_threads(1); import train; train.main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("full") / "run"
    r = run_proc(small(out, data[0] / "train.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    return metrics(out)


@pytest.mark.parametrize("fault,leftover", [
    ("query-cache", None),          # inside the Query-KL cache build of a fresh run: no checkpoint yet
    ("mid-step:10", "ckpt"),        # step 3, after a backward, before its optimizer step
    ("ckpt-rename:1", "ckpt.old"),  # the save at step 4, between moving ckpt aside and ckpt.tmp in
    ("metrics-write:4", "ckpt"),    # half of step 3's metrics line on disk
])
def test_a_kill_anywhere_then_resume_gives_the_uninterrupted_metrics(tmp_path, data, uninterrupted, fault, leftover):
    out = tmp_path / "run"
    argv = small(out, data[0] / "train.jsonl") + (["--query-cache-dir", ""] if fault == "query-cache" else [])
    r = run_proc(argv, fault)                         # (no shared cache: the build must run to be killed)
    assert r.returncode == -9, (fault, r.returncode, r.stderr[-2000:])
    if leftover:
        assert (out / leftover / "state.pt").exists()
    if fault == "ckpt-rename:1":
        assert not (out / "ckpt").exists()            # the window the recovery closes
    r = run_proc(argv + ["--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    if fault == "query-cache":
        assert "starting from scratch" in r.stdout
    else:  # it continued (a fresh start would also reproduce the metrics: check it did not)
        assert f"resumed from {out}/ckpt at step 2" in r.stdout, r.stdout[-2000:]
    if fault == "ckpt-rename:1":
        assert "restored it" in r.stdout
    same_metrics(uninterrupted, metrics(out))


# ----------------------------------------------------------------------------- numerical faults


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with a non-finite gradient."""
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def poisoned_rl_loss(monkeypatch, bad_calls, kind):
    """losses.rl_loss whose calls in `bad_calls` (1-based) have a NaN loss or a NaN gradient."""
    real, calls = train.losses.rl_loss, [0]

    def fake(algo, **kw):
        calls[0] += 1
        if calls[0] in bad_calls and kind == "grad":
            kw["logp"] = _NaNGrad.apply(kw["logp"])
        loss, st = real(algo, **kw)
        if calls[0] in bad_calls and kind == "loss":
            loss = loss * float("nan")
            st["loss"] = loss.detach()
        return loss, st
    monkeypatch.setattr(train.losses, "rl_loss", fake)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_a_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch, data, kind):
    # 2 optimizer steps per RL step, 1 micro-batch each (micro-batch 16): call 3 = step 2's first
    poisoned_rl_loss(monkeypatch, {3}, kind)
    train.main(small(tmp_path / "run", data[0] / "train.jsonl", "--micro-batch", "16", "--eval-every", "0"))
    ms = {m["step"]: m for m in metrics(tmp_path / "run")}
    assert [ms[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 0, 0]
    assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in ms.values())
    opt = torch.load(tmp_path / "run" / "ckpt" / "state.pt", weights_only=False)["opt"]
    assert {int(s["step"]) for s in opt["state"].values()} == {7}     # 8 optimizer steps, 1 never applied


def test_max_bad_steps_in_a_row_end_the_run_with_the_checkpoint_intact(tmp_path, monkeypatch, data, capsys):
    poisoned_rl_loss(monkeypatch, set(range(3, 100)), "loss")   # from step 2 on, every step is bad
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(small(out, data[0] / "train.jsonl", "--micro-batch", "16", "--eval-every", "0",
                         "--save-every", "1"))
    assert "3 optimizer steps in a row had a non-finite loss or gradient" in str(e.value.code)
    state = torch.load(out / "ckpt" / "state.pt", weights_only=False)
    assert state["step"] == 2                 # step 2 (two skips) was saved; step 3's third skip ended it
    assert [m["skipped_steps"] for m in metrics(out) if m["step"] > 0] == [0, 2]


# ----------------------------------------------------------------------------- the end of a run


def test_summary_and_tensorboard_mirror(tmp_path, data, capsys):
    out = tmp_path / "run"
    train.main(small(out, data[0] / "train.jsonl", "--steps", "2", "--log", "tensorboard"))
    text = capsys.readouterr().out
    assert "done: 2 steps" in text and "held-out tiny-test" in text and "(step 0) ->" in text
    assert "final (step 2): query_kl" in text and f"checkpoint {out}/ckpt/" in text
    assert f"python analysis.py runs {out}" in text and f"python evaluate.py --model {out}/ckpt" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    ms = metrics(out)
    got = {(e.step, round(e.value, 5)) for e in acc.Scalars("reward")}
    assert got == {(m["step"], round(m["reward"], 5)) for m in ms if "reward" in m}
    assert [e.step for e in acc.Scalars("eval_acc")] == [m["step"] for m in ms if "eval_acc" in m]


@pytest.mark.parametrize("content,needle", [
    (b"", ": no rows"), (b'{"problem": "1+1", "answer": "2"}\n\xff\n', ":2: not UTF-8 text"),
    (b'{"problem": "1+1", "answer": "2"}\n[1]\n', ":2: expected a JSON object"), (None, ": file not found")])
def test_bad_benchmark_files_for_evaluate(tmp_path, capsys, content, needle):
    bench = tmp_path / "bench.jsonl"
    if content is not None:
        bench.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", WARM, "--benchmarks", str(bench), "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"evaluate.py: error: {bench}{needle}" in err, err
    assert "Traceback" not in err and not (tmp_path / "e").exists()
