"""Issue #50's data-loss and validation findings, each refused in one line before anything is
written: --export pointing at a run folder (plumbing/run_dir.export_overlap), a reference model
inside the run --overwrite removes (run_dir.read_refusal), a start of the adaptive
entropy coefficient above its bound (rl/controllers.py), --jobs 0 in the study commands."""

import json
import os
import subprocess
import sys

import pytest

import losses
from plumbing import run_dir
from rl import controllers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def a_run(folder, step=3):
    """A run folder as train.py leaves one: its config.json and metrics."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"algo": "erpo", "out": folder}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": step}) + "\n")
    return folder


def test_export_into_a_run_folder_is_refused(tmp_path):
    """The run's own --out, another run's folder, a run's own files (hf/, ckpt/...): refused, naming the
    folder; a folder of its own inside --out, a model folder written before, a new folder: fine."""
    run, new = a_run(str(tmp_path / "runs" / "erpo")), str(tmp_path / "runs" / "new")
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    for out, export, says in ((run, run, "is --out"), (new, new, "is --out"),
                              (new, run, "is the run folder"), (new, run + "/hf", "is hf/ of the run folder"),
                              (new, run + "/ckpt/x", "is inside ckpt/ of the run folder")):
        why = run_dir.export_overlap(export, out)
        assert why and says in why and "choose a folder outside it" in why, (export, why)
    for out, export in ((run, run + "/final"), (new, str(model)), (new, str(tmp_path / "models" / "n"))):
        assert run_dir.export_overlap(export, out) is None, export
    why = run_dir.refusal(run, resume=True, overwrite=False, export=run)
    assert why.startswith(f"--export {run} is --out")
    assert sorted(os.listdir(run)) == ["config.json", "metrics.jsonl"]                 # asked, nothing written


def test_a_reference_inside_the_run_that_overwrite_removes_is_refused(tmp_path):
    """--overwrite --qkl-ref-model <out>/ckpt removed the old run, that checkpoint included, and only
    then read the reference: refusal(reads=...) says so first; without --overwrite, or a model
    elsewhere (or a folder of the user's own in --out), it is fine."""
    run = a_run(str(tmp_path / "run"))
    os.makedirs(os.path.join(run, "ckpt"))
    os.makedirs(os.path.join(run, "mine"))
    reads = {"--qkl-ref-model": os.path.join(run, "ckpt")}
    why = run_dir.refusal(run, resume=False, overwrite=True, reads=reads)
    assert why.startswith(f"--qkl-ref-model {run}/ckpt is in the run that --overwrite would remove")
    assert run_dir.refusal(run, resume=True, overwrite=False, reads=reads) is None
    for other in (str(tmp_path), os.path.join(run, "mine"), None):
        assert run_dir.refusal(run, resume=False, overwrite=True, reads={"--qkl-ref-model": other}) is None


def test_an_entropy_coefficient_above_its_bound_is_refused_not_clipped():
    """--entropy-coef 0.1 --entropy-target 0.5 ran at 0.05 (the default --entropy-coef-max) while the
    printed settings said 0.1: now one line naming both flags, at parse time (refusal) and when made."""
    class Args:
        entropy_target, entropy_coef_delta, entropy_coef_max = 0.5, 0.005, 0.05
    algo = losses.make_algo("grpo", entropy_coef=0.1)
    why = controllers.refusal(Args, algo)
    assert "--entropy-coef 0.1 is above --entropy-coef-max 0.05" in why and "\n" not in why
    with pytest.raises(SystemExit, match="--entropy-coef-max 0.1 or more"):
        controllers.AdaptiveEntropy({"entropy_target": 0.5, "entropy_coef_delta": 0.005,
                                     "entropy_coef_max": 0.05}, algo)
    assert controllers.refusal(Args, losses.make_algo("grpo", entropy_coef=0.05)) is None   # at the bound
    Args.entropy_target = 0.0                                                # off: nothing to check
    assert controllers.refusal(Args, algo) is None


@pytest.mark.parametrize("study", ["headline", "long_run"])
def test_study_jobs_0_is_one_line_and_leaves_no_folder(tmp_path, study):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", f"study.{study}", "--jobs", "0", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"{study}.py: error: argument --jobs: must be >= 1 (runs at a time), got 0"]
    assert os.listdir(tmp_path) == []
