"""Bad input ends in one clear line; no fault loses a run; non-finite steps are skipped; a run ends
with a summary; metrics can be mirrored to TensorBoard.

The fault tests run train.py in a subprocess that a failpoint (plumbing/faults.py) SIGKILLs at a named
place, then `--resume` it, and require the metrics of an uninterrupted run."""

import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import evaluate
from rl import query_reference
import train
from plumbing import run_dir
from tests.rounding import assert_rounding, is_exact, is_timing

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
    """4 tiny RL steps; --no-signal step: every optimizer step is taken whatever the 4 groups' rewards,
    so the faults below always meet a step to break (the default skips a batch with no signal)."""
    return ["--no-signal", "step", "--model", WARM, "--train-data", str(train_data), "--out", str(out),
            "--steps", "4", "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "24", "--eval-data", "tiny-test", "--eval-limit", "4", "--eval-every", "2",
            "--save-every", "2", *extra]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same_metrics(a, b):
    """The resumed run's metrics are the uninterrupted run's: exact keys (tokens, rewards, counts) equal,
    the float ones within their measured tolerance (tests/rounding.py)."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if is_timing(k):
                continue
            if is_exact(k) or not isinstance(v, float):
                assert y[k] == v, (x["step"], k)
            else:
                assert_rounding(f"reliability.resume.{k}", y[k], v)


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
    no_tokenizer = tmp_path / "weights-only"                     # weights and config, no tokenizer files
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(WARM, name), no_tokenizer / name)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(no_tokenizer), "--out", str(out)])
    assert f"{no_tokenizer} holds no tokenizer" in str(e.value.code) and not out.exists()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(tmp_path / "gone"), "--out", str(out)])
    assert str(e.value.code) == f"error: model folder {tmp_path / 'gone'} not found" and not out.exists()


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
def uninterrupted_run(tmp_path_factory, data):
    """The 4-step run the fault tests must reproduce: checkpoints of steps 4 (ckpt/) and 2 (ckpt.prev/)."""
    out = tmp_path_factory.mktemp("full") / "run"
    r = run_proc(small(out, data[0] / "train.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return metrics(uninterrupted_run)


@pytest.mark.parametrize("fault,leftover", [
    ("query-cache", None),          # inside the Query-KL cache build of a fresh run: no checkpoint yet
    ("mid-step:10", "ckpt"),        # step 3, after a backward, before its optimizer step
    ("ckpt-rename:1", "ckpt.prev"), # the save at step 4, between moving ckpt aside and ckpt.tmp in
    ("ckpt-write:2", "ckpt"),       # the save at step 4, its weights half-written to ckpt.tmp
    ("metrics-write:4", "ckpt"),    # half of step 3's metrics line on disk
])
def test_a_kill_anywhere_then_resume_gives_the_uninterrupted_metrics(tmp_path, data, uninterrupted, fault, leftover):
    out = tmp_path / "run"
    argv = small(out, data[0] / "train.jsonl") + (["--query-cache-dir", ""] if fault == "query-cache" else [])
    r = run_proc(argv, fault)                         # (no shared cache: the build must run to be killed)
    assert r.returncode == -9, (fault, r.returncode, r.stderr[-2000:])
    if leftover:
        assert (out / leftover / "state.pt").exists()
    copies = [d for d in ("ckpt", "ckpt.prev", "ckpt.tmp", "ckpt.drop") if (out / d).exists()]
    assert len(copies) <= 2, copies                  # never three checkpoints on disk (make_room)
    if fault == "ckpt-rename:1":
        assert not (out / "ckpt").exists()            # the window the recovery closes
    r = run_proc(argv + ["--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    if fault == "query-cache":
        assert "starting from scratch" in r.stdout
    else:  # it continued (a fresh start would also reproduce the metrics: check it did not)
        assert f"resumed from {out}/ckpt at step 2" in r.stdout, r.stdout[-2000:]
    if fault == "ckpt-rename:1":
        assert f"{out}/ckpt was missing and {out}/ckpt.prev complete" in r.stdout
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


def saved_step(ckpt):
    return torch.load(ckpt / "state.pt", weights_only=False)["step"]


def test_max_bad_steps_in_a_row_end_the_run_and_set_aside_the_unchecked_checkpoint(tmp_path, monkeypatch, data):
    # 2 optimizer steps per RL step, a checkpoint after each; from step 3 on every step is bad. The
    # weights saved at step 2 never gave a finite loss (step 3's steps were bad), so when step 3's
    # save replaces that checkpoint, ckpt.prev/ stays step 1's (checked by step 2's first loss); at the
    # end, ckpt/ (step 3's save, those weights again) goes to ckpt.diverged/ and step 1's is ckpt/.
    poisoned_rl_loss(monkeypatch, set(range(5, 100)), "loss")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(small(out, data[0] / "train.jsonl", "--micro-batch", "16", "--eval-every", "0",
                         "--save-every", "1"))
    assert "3 optimizer steps in a row had a non-finite loss or gradient" in str(e.value.code)
    assert f"--resume continues from step 1 ({out}/ckpt/)" in str(e.value.code)
    assert f"{out}/ckpt.diverged/" in str(e.value.code)
    assert saved_step(out / "ckpt") == 1 and saved_step(out / "ckpt.diverged") == 3
    assert not (out / "ckpt.prev").exists()
    assert [m["skipped_steps"] for m in metrics(out) if m["step"] > 0] == [0, 0, 2]


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


# ----------------------------------------------------------------------------- run folders


def fingerprint(folder):
    """{relative path: (size, mtime_ns)} of every file under `folder`: did anything change?"""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def exit_line(capsys, fn, *argv):
    """fn(argv) must exit non-zero with one line and no traceback -> that line."""
    with pytest.raises(SystemExit) as e:
        fn(list(argv))
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and "Traceback" not in err, err[-2000:]
    return e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]


def test_a_fresh_run_never_replaces_a_run(tmp_path, capsys, data, uninterrupted_run):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run, out)
    before = fingerprint(out)
    msg = exit_line(capsys, train.main, *small(out, data[0] / "train.jsonl"))
    assert msg == (f"error: {out} holds a run (a checkpoint at step 4 (ckpt/), metrics up to step 4); continue it "
                   "with --resume, choose another --out, or replace it with --overwrite")
    assert fingerprint(out) == before
    (out / "notes.txt").write_text("the user's own file")
    train.main(small(out, data[0] / "train.jsonl", "--steps", "1", "--eval-every", "0", "--overwrite"))
    assert "--overwrite: removed the run that was in" in capsys.readouterr().out
    assert [m["step"] for m in metrics(out)] == [1] and saved_step(out / "ckpt") == 1
    assert not (out / "ckpt.prev").exists() and (out / "notes.txt").exists()
    for argv, needle in ((["--resume", "--overwrite"], "--resume continues the run in --out, --overwrite replaces it"),
                         (["--algo", "sft", "--resume"], "the SFT warm start does not resume")):
        assert needle in exit_line(capsys, train.main, "--out", str(out), *argv)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert exit_line(capsys, train.main, "--out", str(afile)) == f"error: --out {afile} is a file, not a folder"
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if not os.access(readonly, os.W_OK):      # (root can write anywhere)
            assert exit_line(capsys, train.main, "--out", str(readonly / "run")) == \
                f"error: --out {readonly / 'run'}: {readonly} is not writable"
    finally:
        readonly.chmod(0o700)


def test_one_process_per_run_folder_and_a_kill_releases_it(tmp_path, capsys, data):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from plumbing import run_dir; lock = run_dir.RunLock(sys.argv[1]); "
                               "assert lock.acquire() is None; print('held', flush=True); time.sleep(600)", str(out)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        msg = exit_line(capsys, train.main, *small(out, data[0] / "train.jsonl"))
        assert msg.startswith(f"error: {out} is in use by another run (pid {holder.pid} on ") and \
            msg.endswith("wait for it, or use another --out")
        assert not (out / "config.json").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    lock = run_dir.RunLock(str(out))          # SIGKILL released it: the next run takes it
    assert lock.acquire() is None
    lock.release()


# ----------------------------------------------------------------------------- --resume and its options


def test_resume_refuses_what_fixes_the_run_applies_the_rest_and_recovers_from_a_divergence(tmp_path, capsys, data):
    out = tmp_path / "run"
    base = small(out, data[0] / "train.jsonl", "--steps", "2", "--eval-every", "0")
    train.main(base)
    config = (out / "config.json").read_text()
    for argv, needle in ((["--algo", "grpo"], "--algo 'erpo' -> 'grpo'"), (["--alpha", "0.05"], "--alpha 0.01 -> 0.05"),
                         (["--seed", "1", "--group-size", "2"], "--group-size 4 -> 2; --seed 0 -> 1"),
                         (["--train-data", TRAIN], "--train-data")):
        msg = exit_line(capsys, train.main, "--out", str(out), "--resume", *argv)
        assert msg.startswith(f"error: --resume: {needle}") and "fix what a run is" in msg, msg
    assert (out / "config.json").read_text() == config      # refused: nothing rewritten
    # --lr 1e6: step 3's first loss is finite (step 2's weights: checked), its update destroys the
    # weights: the run stops and sets step 3's checkpoint aside. Which of the two divergence checks
    # fires depends on float rounding (measured: the CPU's own kernels vs ATen/MKL's AVX2 ones): the
    # next losses are not finite, or they are finite but every response scores 0, the no-signal rule
    # skips the steps, and the weights' norm says it (step_guard.weights_diverged)
    msg = exit_line(capsys, train.main, "--out", str(out), "--resume", "--steps", "6", "--lr", "1e6",
                    "--save-every", "1")
    assert msg.startswith(("error: 3 optimizer steps in a row had a non-finite loss or gradient",
                           "error: the policy diverged by step ")) and \
        f"--resume continues from step 2 ({out}/ckpt/)" in msg and msg.endswith("resume with a lower --lr")
    assert saved_step(out / "ckpt") == 2 and saved_step(out / "ckpt.diverged") == 3
    # the advice, followed: the options not given are the run's (config.json), the new lr is applied
    train.main(["--out", str(out), "--resume", "--steps", "4", "--lr", "1e-4"])
    printed = capsys.readouterr().out
    assert "--resume: from step 2: lr 1000000.0 -> 0.0001, steps 6 -> 4" in printed
    ms = {m["step"]: m for m in metrics(out)}
    assert sorted(ms) == [1, 2, 3, 4] and [ms[s]["lr"] for s in (3, 4)] == [1e-4, 1e-4]
    assert all(ms[s]["skipped_steps"] == 0 and math.isfinite(ms[s]["grad_norm"]) for s in (3, 4))
    assert ms[4]["entropy"] < 3 * ms[2]["entropy"]           # not the uniform distribution (entropy ~6.5)
    state = torch.load(out / "ckpt" / "state.pt", weights_only=False)
    assert state["step"] == 4 and {g["lr"] for g in state["opt"]["param_groups"]} == {1e-4}
    assert [r["at_step"] for r in json.loads((out / "config.json").read_text())["resumed"]] == [2, 2]


# ----------------------------------------------------------------------------- signals, corrupt checkpoints


def test_sigint_stops_at_the_step_boundary_with_a_checkpoint_and_resume_reproduces(tmp_path, monkeypatch, capsys,
                                                                                   data, uninterrupted):
    real, calls = train.rl_step, []
    before = signal.getsignal(signal.SIGINT)       # SIG_IGN when the suite runs as a background job

    def ctrl_c_in_step_3(run, step, *rest):
        calls.append(step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)    # arrives mid-step: the step still finishes
        return real(run, step, *rest)
    monkeypatch.setattr(train, "rl_step", ctrl_c_in_step_3)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(small(out, data[0] / "train.jsonl"))
    err = capsys.readouterr().err
    assert e.value.code == 130 and calls == [0, 1, 2] and "Traceback" not in err
    assert f"interrupted (SIGINT): saved the checkpoint of step 3 ({out}/ckpt/); continue with --resume" in err
    assert saved_step(out / "ckpt") == 3 and [m["step"] for m in metrics(out)] == [0, 1, 2, 3]   # (3: not a
    assert signal.getsignal(signal.SIGINT) is before                        # save step) handlers restored
    monkeypatch.setattr(train, "rl_step", real)
    train.main(small(out, data[0] / "train.jsonl", "--resume"))
    same_metrics(uninterrupted, metrics(out))


def worker_pids(parent):
    """{RANK: pid} of the torchrun workers under `parent` (read from /proc)."""
    found = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            pid, ppid = int(stat.split("/")[2]), int(open(stat).read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if ppid == parent else []
        except (OSError, ValueError, IndexError):
            continue
        rank = [e[5:].decode() for e in env if e.startswith(b"RANK=")]
        if rank:
            found[int(rank[0])] = pid
    return found


def test_sigterm_to_one_rank_stops_both_and_the_run_resumes(tmp_path, data):
    """Two DDP processes (gloo); SIGTERM reaches rank 1 only, mid-run: both ranks stop after the same
    step (one all-reduce of the flag), rank 0 saves, and --resume finishes the run on one process.
    (That a resumed run reproduces the uninterrupted one is the SIGINT test's and the kill tests': a
    2-rank step rounds differently from a 1-rank one, and a flipped sampled token then moves metrics.)"""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ERPO_FAULT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port",
           str(29700 + os.getpid() % 200), os.path.join(ROOT, "train.py"),
           *small(out, data[0] / "train.jsonl", "--save-every", "0")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not any(m["step"] >= 1 and "reward" in m for m in run_dir.read_jsonl(str(out / "metrics.jsonl"))):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    stopped = saved_step(out / "ckpt")
    assert 2 <= stopped < 4 and [m["step"] for m in metrics(out) if "reward" in m] == list(range(1, stopped + 1))
    assert f"interrupted (SIGTERM): saved the checkpoint of step {stopped}" in err, err[-3000:]
    r = run_proc(small(out, data[0] / "train.jsonl", "--resume"))
    assert r.returncode == 0 and f"resumed from {out}/ckpt at step {stopped}" in r.stdout, r.stderr[-2000:]
    assert [m["step"] for m in metrics(out) if "reward" in m] == [1, 2, 3, 4]


def test_a_corrupt_checkpoint_falls_back_to_the_one_before(tmp_path, capsys, data, uninterrupted_run, uninterrupted):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run, out)
    for victim in ("model.safetensors", "state.pt"):
        assert saved_step(out / "ckpt") == 4 and saved_step(out / "ckpt.prev") == 2
        path = out / "ckpt" / victim
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])     # a disk that filled up, say
        train.main(small(out, data[0] / "train.jsonl", "--resume"))
        printed = capsys.readouterr().out
        assert f"--resume: {out}/ckpt is corrupt ({victim}: " in printed, printed[-2000:]
        assert "continuing from the checkpoint before it, step 2" in printed
        same_metrics(uninterrupted, metrics(out))
    for ckpt in ("ckpt", "ckpt.prev"):
        (out / ckpt / "state.pt").write_bytes(b"")
    msg = exit_line(capsys, train.main, *small(out, data[0] / "train.jsonl", "--resume"))
    assert msg.startswith(f"error: --resume: {out}/ckpt is corrupt (state.pt: ") and "no intact checkpoint" in msg


def test_a_full_query_cache_disk_does_not_stop_a_run(tmp_path, monkeypatch, capsys, data):
    real_save, shared = query_reference.torch.save, tmp_path / "shared"

    def full_disk(obj, path, *a, **k):
        if str(path).startswith(str(shared)):     # what torch raises when the disk fills mid-write
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 512 vs 448")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(query_reference.torch, "save", full_disk)
    out = tmp_path / "run"
    train.main(small(out, data[0] / "train.jsonl", "--steps", "1", "--eval-every", "0", "--save-every", "0",
                     "--query-cache-dir", str(shared)))
    assert "query-KL reference cache: not shared ([enforce fail" in capsys.readouterr().out
    assert [m["step"] for m in metrics(out)] == [1] and not list(shared.rglob("*.tmp*"))



# ----------------------------------------------------------------------------- the fuzz sweep's (issue #31)


def test_every_refusal_comes_before_overwrite_removes_the_old_run(tmp_path, capsys, monkeypatch, data,
                                                                  uninterrupted_run):
    """--overwrite removes the old run only once nothing can refuse any more: --log's package (looked
    up, not imported) and the SFT batch that does not divide by the world size are asked first."""
    import importlib.util

    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run, out)
    before = fingerprint(out)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real_find_spec(name, *a))                        # (wandb may be installed here)
    msg = exit_line(capsys, train.main, *small(out, data[0] / "train.jsonl", "--overwrite", "--log", "wandb"))
    assert msg == "error: --log wandb needs the wandb package (pip install wandb)"
    monkeypatch.setattr(train.distributed, "setup", lambda **kw: train.distributed.Dist(0, 3, torch.device("cpu")))
    msg = exit_line(capsys, train.main, "--algo", "sft", "--model", WARM, "--out", str(out), "--overwrite",
                    "--sft-batch", "8")
    assert msg == "error: --sft-batch 8 does not divide by world size 3"
    assert fingerprint(out) == before


def test_a_resume_says_which_metrics_lines_before_the_checkpoint_are_lost(tmp_path, capsys, data,
                                                                           uninterrupted_run):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted_run, out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]))              # step 4's line lost
    train.main(small(out, data[0] / "train.jsonl", "--resume", "--steps", "5", "--eval-every", "0"))
    printed = capsys.readouterr().out
    assert (f"warning: --resume: {out}/metrics.jsonl has no line for step 4 (of the checkpoint's 1..4): "
            "their metrics are lost (not recomputed); the run continues from step 4") in printed
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3, 5]


def test_no_checkpoint_says_why(tmp_path, capsys, data):
    out = tmp_path / "run"
    train.main(small(out, data[0] / "train.jsonl", "--steps", "0", "--save-every", "1"))
    assert f"run folder {out}/ (metrics.jsonl, config.json), no checkpoint (no step was trained)" in \
        capsys.readouterr().out
    train.main(small(tmp_path / "r2", data[0] / "train.jsonl", "--steps", "1", "--save-every", "0",
                     "--eval-every", "0"))
    assert "no checkpoint (--save-every 0)" in capsys.readouterr().out


def test_path_options_name_the_same_files_wherever_a_resume_runs(tmp_path, capsys, monkeypatch, data):
    """config.json records the files a run used as absolute paths: a resume from another folder, where
    the relative --train-data names another file, reads the run's own. An older run's relative path
    (as config.json wrote it then) names that other file from there: refused in one short line."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(data[0] / "train.jsonl", a / "train.jsonl")
    with open(TRAIN) as f:
        (b / "train.jsonl").write_text("".join(f.readlines()[100:164]))   # other problems
    monkeypatch.chdir(a)
    out = a / "run"
    train.main(small(out, "train.jsonl", "--steps", "2", "--eval-every", "0"))
    config = json.loads((out / "config.json").read_text())
    assert config["train_data"] == str(a / "train.jsonl") and config["model"] == WARM
    monkeypatch.chdir(b)
    train.main(["--out", str(out), "--resume", "--steps", "3"])
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 "train_data": "train.jsonl"}))
    before = fingerprint(out)
    msg = exit_line(capsys, train.main, "--out", str(out), "--resume", "--steps", "4")
    assert msg == (f"error: --resume: {out}/query_cache.pt was built from other prompts or settings (data "
                   f"{run_dir.short(str(a / 'train.jsonl'), 40)} -> 'train.jsonl'; the prompts differ); resume from "
                   "the folder the run was started in, with its options (config.json), or start a new run "
                   "(another --out)")
    assert fingerprint(out) == before


def test_a_truncated_model_file_is_one_line(tmp_path, capsys, data):
    model = tmp_path / "model"
    shutil.copytree(WARM, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    msg = exit_line(capsys, train.main, *small(tmp_path / "run", data[0] / "train.jsonl", "--model", str(model)))
    assert msg.startswith(f"error: cannot load model '{model}': ") and not (tmp_path / "run").exists()


# Sends the process SIGINT while train.py imports torch (how a Ctrl-C in the first seconds lands).
INTERRUPT_IMPORT = """
import builtins, os, runpy, signal, sys
real = builtins.__import__
def interrupting(name, *a, **k):
    if name == "torch":
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *a, **k)
builtins.__import__ = interrupting
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_during_the_imports_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", INTERRUPT_IMPORT, "train.py", "--out", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "interrupted (SIGINT): stopped while starting, nothing written"
    assert not (tmp_path / "run").exists()
