"""Checkpoints as evaluate.py reads them: every checkpoint of an FSDP2 run (torch.distributed.checkpoint
shards, no HF weights) loads on one process with the weights of the same step's HF export, an
intermediate one too (a run killed mid-way); the dtype of exported HF folders."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import evaluate as E
from evaluation import heldout
from modeling import models
from plumbing import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def train(out, data, *extra, fault=None):
    """A 2-step GRPO run under FSDP2 on 2 CPU processes (gloo), a checkpoint after every step."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ERPO_FAULT", None)
    if fault:
        env["ERPO_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port",
           str(29800 + os.getpid() % 100 + (50 if fault else 0)), os.path.join(ROOT, "train.py"), "--model", WARM,
           "--train-data", data, "--out", str(out), "--steps", "2", "--algo", "grpo", "--rollout-batch", "8",
           "--update-batch", "4", "--group-size", "4", "--micro-batch", "8", "--max-new-tokens", "48",
           "--eval-every", "0", "--save-every", "1", "--fsdp", "true", "--lr", "1e-3", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """{"cut": a copy of the run killed at step 2 (its checkpoint: step 1, no HF export),
        "run": the same run resumed to its end (ckpt/ and hf/ of step 2)}."""
    d = tmp_path_factory.mktemp("fsdp")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        (d / "train.jsonl").write_text("".join(next(f) for _ in range(64)))
    run = d / "run"
    r = train(run, str(d / "train.jsonl"), fault="metrics-write:2")     # rank 0 killed writing step 2's line
    assert r.returncode != 0 and (run / "ckpt" / "dcp").is_dir() and not (run / "hf").exists(), r.stderr[-3000:]
    shutil.copytree(run, d / "cut")
    r = train(run, str(d / "train.jsonl"), "--resume")
    assert r.returncode == 0 and "at step 1" in r.stdout, r.stderr[-3000:]
    return {"cut": d / "cut", "run": run}


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_sharded_checkpoint_loads_as_the_same_steps_hf_export(fsdp_run):
    run = fsdp_run["run"]
    assert not list((run / "ckpt").glob("*.safetensors")) and not (run / "ckpt" / "config.json").exists()
    src = checkpoints.find_model(str(run / "ckpt"))
    assert src.model == WARM and src.dcp == str(run / "ckpt" / "dcp")                  # the run's --model
    hf, tok_hf = models.load_policy(str(run / "hf"))
    want = weights(hf)
    ids = torch.tensor([tok_hf("Mia has 23 apples. Mia gives 5 apples to Tom.", add_special_tokens=False).input_ids])
    for path in (run / "ckpt", run):                                     # the checkpoint, or its run folder
        model, tok = heldout.load_model(str(path), "cpu", "auto")
        got = weights(model)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # still tied
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, hf(input_ids=ids).logits)
        assert tok(["a b"], padding=True).input_ids == tok_hf(["a b"], padding=True).input_ids
        assert tok.padding_side == "left" and model.generation_config.eos_token_id == hf.generation_config.eos_token_id
    # In the dtype evaluate asks for: the export loaded in bfloat16, bit for bit.
    model, _ = heldout.load_model(str(run / "ckpt"), "cpu", "bfloat16")
    hf16, _ = models.load_policy(str(run / "hf"), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), hf16.state_dict().values()))


def test_a_finished_fsdp2_runs_damaged_export_is_rebuilt_by_resume(fsdp_run, tmp_path):
    """Issue #40: hf/ cut short by a full disk; --resume of the finished run rebuilds it from the
    checkpoint of its last step (every rank joins the export), the same weights as before."""
    run = tmp_path / "run"
    shutil.copytree(fsdp_run["run"], run)
    assert checkpoints.export_damage(str(run / "hf")) is None
    path = run / "hf" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        before = {k: f.get_tensor(k).clone() for k in f.keys()}         # (not mapped: cut below)
    path.write_bytes(path.read_bytes()[:4096])
    r = train(run, str(fsdp_run["run"].parent / "train.jsonl"), "--resume")
    assert r.returncode == 0 and f"--resume: {run}/hf is not complete (model.safetensors: 4096 bytes" in r.stdout, \
        r.stderr[-3000:]
    assert checkpoints.export_damage(str(run / "hf")) is None
    with safe_open(str(path), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in before.items())


def test_an_intermediate_checkpoint_loads_and_evaluates(fsdp_run, tmp_path):
    """The checkpoint of step 1 of a run killed in step 2: no HF folder anywhere, yet evaluate.py
    takes the run folder (or its ckpt/) and its weights are step 1's: neither the warm start's nor step 2's."""
    cut, final = fsdp_run["cut"], fsdp_run["run"]
    assert checkpoints.load_state(str(cut)).step == 1 and not (cut / "hf").exists()
    step1 = weights(heldout.load_model(str(cut / "ckpt"), "cpu", "auto")[0])
    assert all(torch.equal(step1[k], v) for k, v in weights(heldout.load_model(str(cut), "cpu", "auto")[0]).items())
    for other in (WARM, str(final / "hf")):
        theirs = weights(models.load_policy(other)[0])
        assert any(not torch.equal(step1[k], theirs[k]) for k in theirs), other
    out = tmp_path / "eval"
    summary = E.main(["--model", str(cut), "--labels", "step1", "--benchmarks", "tiny-test", "--limit", "2",
                      "--temperatures", "1.0", "--n", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress"])
    assert summary["results"]["step1"]["tiny-test"]["by_temperature"]["1"]["num_problems"] == 2
    assert len(E.run_dir.read_jsonl(str(out / "samples.jsonl"))) == 2


def test_a_folder_that_is_neither_a_model_nor_a_checkpoint_is_one_line(fsdp_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        checkpoints.find_model(str(tmp_path))
    msg = str(e.value.code)
    assert msg.startswith(f"error: {tmp_path} is neither a model folder") and "\n" not in msg
    with pytest.raises(SystemExit) as e:                                 # evaluate.py says so before anything else
        E.main(["--model", str(tmp_path), "--benchmarks", "tiny-test", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "neither a model folder" in err and not (tmp_path / "o").exists()
    orphan = tmp_path / "orphan"                                         # a checkpoint without its run's config.json
    shutil.copytree(fsdp_run["cut"] / "ckpt", orphan / "ckpt")
    with pytest.raises(SystemExit) as e:
        checkpoints.find_model(str(orphan / "ckpt"))
    assert "the architecture is the initial model named by" in str(e.value.code)
    cfg = json.loads((fsdp_run["cut"] / "config.json").read_text())
    (orphan / "config.json").write_text(json.dumps({**cfg, "model": str(tmp_path / "gone")}))
    with pytest.raises(SystemExit) as e:
        checkpoints.find_model(str(orphan))
    assert "is not a model folder from here" in str(e.value.code)


# ----------------------------------------------------------------------------- export dtype


def file_dtypes(folder):
    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            out |= {s.get_slice(k).get_dtype() for k in s.keys()}
    return out


def test_export_dtype(tmp_path):
    """auto: bfloat16 when the run computed in bf16, else the weights' own (float32: the tiny warm
    start stays float32); or as asked. config.json names the files' dtype; the model is unchanged."""
    model, tok = models.load_policy(WARM)
    before = weights(model)
    cases = {"fp32": (None, False, "F32", "float32"), "auto_bf16": ("auto", True, "BF16", "bfloat16"),
             "fp16": ("float16", True, "F16", "float16"), "bf16": (torch.bfloat16, False, "BF16", "bfloat16")}
    for name, (dtype, bf16, stored, config) in cases.items():
        checkpoints.export(model, tok, str(tmp_path / name), dtype, bf16=bf16)
        assert file_dtypes(tmp_path / name) == {stored}, name
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == config, name
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())
    # a float32 run's export: the warm start's bytes; its config.json the same but for the stamp of the
    # transformers version that wrote it (requirements.txt does not pin transformers)
    fp32 = tmp_path / "fp32"
    assert (fp32 / "model.safetensors").read_bytes() == open(os.path.join(WARM, "model.safetensors"), "rb").read()
    unstamped = [{k: v for k, v in json.load(open(path)).items() if k != "transformers_version"}
                 for path in (fp32 / "config.json", os.path.join(WARM, "config.json"))]
    assert unstamped[0] == unstamped[1]
    with safe_open(str(tmp_path / "auto_bf16" / "model.safetensors"), framework="pt") as s:
        assert "lm_head.weight" not in s.keys()                           # tied weights stay tied
    half = (tmp_path / "auto_bf16" / "model.safetensors").stat().st_size
    assert half < 0.55 * (tmp_path / "fp32" / "model.safetensors").stat().st_size
    loaded, _ = models.load_policy(str(tmp_path / "auto_bf16"), dtype="bfloat16")
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)) for k, v in before.items())
    with pytest.raises(ValueError):
        checkpoints.export_dtype("int8", False, torch.float32)


FSDP_SAVE = r'''
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from modeling import models
from plumbing import checkpoints, distributed, optimizer, run_dir
torch.set_num_threads(1)
d = distributed.setup(fsdp=True)                      # world size 1: a process group of one
out = sys.argv[3]
model, tok = models.load_policy(sys.argv[2], shard=distributed.sharder(True, d.device, bf16=False))
opt = optimizer.adamw(model, 1e-3, 0.0)
sched = optimizer.warmup_then_constant(opt, 0)
run_dir.write_config(out, {"model": sys.argv[2]})
checkpoints.save_checkpoint(out, model, tok, opt, sched, 1, final=True, export_dtype="auto", bf16=True)
distributed.teardown()
'''


def test_the_final_export_of_an_fsdp2_run_takes_the_export_dtype(tmp_path):
    """save_checkpoint(final=True, export_dtype="auto", bf16=True) of a sharded policy: <out>/hf in
    bfloat16, the checkpoint's shards stay float32 (the master weights resume from), and both load
    to the same bfloat16 model."""
    (tmp_path / "w.py").write_text(FSDP_SAVE)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(tmp_path / "w.py"), ROOT, WARM, str(out)], cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert file_dtypes(out / "hf") == {"BF16"} and checkpoints.is_sharded(str(out))
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(str(out / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    assert {m.properties.dtype for k, m in md.items() if k.startswith("model.")} == {torch.float32}
    a = heldout.load_model(str(out / "ckpt"), "cpu", "bfloat16")[0].state_dict()
    b = models.load_policy(str(out / "hf"), dtype="bfloat16")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- writes that fail, files lost


TRAIN = os.path.join(ROOT, "data", "tinymath", "train.jsonl")


def tiny(out, train_data, *extra):
    """train.py's argv of a 4-step single-process run, a checkpoint every 2 steps (--no-signal step:
    every optimizer step is taken, so each checkpoint is checked by the step after it)."""
    return ["--model", WARM, "--train-data", str(train_data), "--out", str(out), "--steps", "4",
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "24", "--eval-data", "tiny-test", "--eval-limit", "4", "--eval-every", "2",
            "--save-every", "2", "--no-signal", "step", *extra]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(the finished run's folder, its training file): checkpoints of steps 4 (ckpt/) and 2 (ckpt.prev/)."""
    d = tmp_path_factory.mktemp("tiny")
    with open(TRAIN) as f:
        (d / "train.jsonl").write_text("".join(next(f) for _ in range(64)))
    import train as T
    T.main(tiny(d / "run", d / "train.jsonl"))
    return d / "run", d / "train.jsonl"


def copy_of(tiny_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tiny_run[0], out)
    return out


def files(folder):
    """{relative path: bytes} of the files under `folder` (a checkpoint's loss_checked marker aside: a
    resumed run's first finite step writes it)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in (checkpoints.CHECKED, ".lock")}


def exits(capsys, argv) -> str:
    """train.main(argv) exits with one line and no traceback -> the line."""
    import train as T
    with pytest.raises(SystemExit) as e:
        T.main(argv)
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and "Traceback" not in err, err[-2000:]
    return e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]


def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_checkpoint(tiny_run, tmp_path, capsys, monkeypatch):
    out = copy_of(tiny_run, tmp_path)
    ckpt, real_save = files(out / "ckpt"), torch.save

    def full_disk(obj, path, *a, **k):       # what torch.save raises when the disk fills mid-write
        if "ckpt.tmp" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 512 vs 448")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(checkpoints.torch, "save", full_disk)
    msg = exits(capsys, tiny(out, tiny_run[1], "--resume", "--steps", "6"))
    assert msg == (f"error: cannot save the checkpoint of step 6 in {out} ([enforce fail at inline_container.cc:"
                   "626] . unexpected pos 512 vs 448: a full disk, or a file size limit (ulimit -f)?); the "
                   f"checkpoint of step 4 ({out}/ckpt/) is intact: --resume continues from it once the disk "
                   "takes one")
    assert files(out / "ckpt") == ckpt and not (out / "ckpt.tmp").exists()
    assert not (out / "ckpt.prev").exists()         # make_room: two copies at most, the checked one kept
    monkeypatch.setattr(checkpoints.torch, "save", real_save)
    import train as T
    T.main(tiny(out, tiny_run[1], "--resume", "--steps", "6"))                  # the advice, followed
    assert checkpoints.saved_step(str(out / "ckpt")) == 6


def test_a_file_size_limit_at_a_save_is_one_line(tiny_run, tmp_path):
    """`ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ), the checkpoint of step 4 stays."""
    import resource

    out = copy_of(tiny_run, tmp_path)
    ckpt = files(out / "ckpt")
    limit = 2 * 2 ** 20                      # below the 3.5 MB model.safetensors
    r = subprocess.run([sys.executable, "train.py", *tiny(out, tiny_run[1], "--resume", "--steps", "6")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert line.startswith(f"error: cannot save the checkpoint of step 6 in {out} (") and "File too large" in line
    assert line.endswith(f"the checkpoint of step 4 ({out}/ckpt/) is intact: --resume continues from it once the "
                         "disk takes one")
    assert files(out / "ckpt") == ckpt


def test_a_metrics_line_on_a_full_disk_is_one_line(tiny_run, tmp_path, capsys, monkeypatch):
    import builtins
    import errno

    from plumbing import run_dir

    class Full:                              # metrics.jsonl opened for appending on a disk that is full
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            self.f.flush()

        def close(self):
            self.f.close()

    def open_full(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        return Full(f) if str(path).endswith("metrics.jsonl") and mode == "a" else f
    out = copy_of(tiny_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text()
    monkeypatch.setattr(run_dir, "open", open_full, raising=False)
    msg = exits(capsys, tiny(out, tiny_run[1], "--resume", "--steps", "6"))
    assert msg == (f"error: cannot append step 5 to {out}/metrics.jsonl (No space left on device); the checkpoint "
                   f"of step 4 ({out}/ckpt/) is intact: --resume continues from it once the disk takes one")
    assert (out / "metrics.jsonl").read_text() == lines


def test_an_unreadable_query_cache_is_rebuilt_exactly_or_refused(tiny_run, tmp_path, capsys):
    """On --resume the cache is the reference: rebuilt from the initial model where the checkpoint's
    record of it (its meta) says that gives it back bit for bit, else one line and nothing changed."""
    import train as T

    out = copy_of(tiny_run, tmp_path)
    cache = out / "query_cache.pt"
    saved = torch.load(cache)
    cache.write_bytes(cache.read_bytes()[:100])                         # cut short
    T.main(tiny(out, tiny_run[1], "--resume", "--query-cache-dir", ""))  # (no shared copy: built again)
    assert f"--resume: {cache} was unreadable (RuntimeError: " in capsys.readouterr().out
    rebuilt = torch.load(cache)
    assert rebuilt["meta"] == saved["meta"] and all(torch.equal(x, y) for x, y in zip(rebuilt["logp"], saved["logp"]))
    cache.write_bytes(b"")
    other = tmp_path / "other"                                           # the initial model, retrained
    shutil.copytree(WARM, other)
    from safetensors.torch import load_file, save_file
    w = load_file(str(other / "model.safetensors"))
    save_file({k: v + 1e-3 if k.endswith("norm.weight") else v for k, v in w.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for model, why in ((str(other), f"the initial model {other} does not have the weights it was built from"),
                       (str(tmp_path / "gone"), "its initial model does not load (model folder ")):
        (out / "config.json").write_text(json.dumps({**config, "model": model}))
        before = files(out)
        msg = exits(capsys, tiny(out, tiny_run[1], "--resume", "--measure-policy-kl", "false")[2:])  # (config.json's
        # --model; no reference model, whose load would be the first to fail)
        assert msg.startswith(f"error: --resume: {cache} is unreadable (EOFError (an empty file?)) and cannot be "
                              f"rebuilt exactly: {why}") and msg.endswith("put the file back, or start a new run "
                                                                          "(another --out)"), msg
        assert files(out) == before
    (out / "config.json").write_text(json.dumps(config))
    state = torch.load(out / "ckpt" / "state.pt", weights_only=False)
    del state["extra"]["query_cache"]                                    # a checkpoint of an older version
    torch.save(state, out / "ckpt" / "state.pt")
    msg = exits(capsys, tiny(out, tiny_run[1], "--resume"))
    assert "cannot be rebuilt exactly: the checkpoint does not record what it was built from" in msg


def test_an_export_that_cannot_be_written_is_one_line(tmp_path):
    model, tok = models.load_policy(WARM)
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        checkpoints.export(model, tok, str(tmp_path / "afile" / "hf"))
    assert str(e.value.code).startswith(f"error: cannot write the export {tmp_path / 'afile' / 'hf'} (")


def test_make_room_keeps_two_copies_and_a_trusted_one(tmp_path):
    """Before ckpt.tmp is written: a checked ckpt/ stays (it becomes the fallback) and ckpt.prev/ goes;
    an unchecked ckpt/ goes and the checked ckpt.prev/ stays. Either way one trusted checkpoint is
    left if the write then fails, and two are on disk while it runs."""
    def make(checked):
        out = tmp_path / f"run{checked}"
        for d in ("ckpt", "ckpt.prev"):
            (out / d).mkdir(parents=True)
            torch.save({"step": 4 if d == "ckpt" else 2}, out / d / "state.pt")
        (out / "ckpt.prev" / checkpoints.CHECKED).touch()
        if checked:
            (out / "ckpt" / checkpoints.CHECKED).touch()
        checkpoints.make_room(str(out))
        return sorted(p.name for p in out.iterdir())
    assert make(True) == ["ckpt"]
    assert make(False) == ["ckpt.prev"]
    assert "step 2" in checkpoints.kept_note(str(tmp_path / "runFalse"))   # what --resume falls back to
