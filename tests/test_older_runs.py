"""Runs made by older code (issue #40): --resume of a run whose config.json lacks the options added
since keeps training as it did (train.BEFORE_OPTION) and says which options it filled in, in one line."""

import json
import os

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
# The options a config.json written at d5ba7a3 (2026-12-01) lacks: the 18 keys
NEWER = ["entropy_coef", "eval_temperatures", "lora_alpha", "lora_dropout", "lora_rank", "lora_targets",
         "lr_decay_steps", "lr_floor", "lr_schedule", "mask_truncated", "no_signal", "plan_gpu", "qkl_ref_decay",
         "qkl_ref_every", "sapo_tau_neg", "sapo_tau_pos", "tis_cap", "top_entropy_quantile"]


def no_reward(monkeypatch):
    """Every completion scores 0: no update batch has a signal."""
    real = train.experience.tasks.score_rows

    def fake(completions, rows, **kw):
        _, _, counts = real(completions, rows, **kw)
        return [0.0] * len(rows), [False] * len(rows), counts
    monkeypatch.setattr(train.experience.tasks, "score_rows", fake)


def metrics(out):
    with open(out / "metrics.jsonl") as f:
        return {m["step"]: m for m in map(json.loads, f)}


def test_resume_of_an_older_config_keeps_how_it_trained_and_says_so(tmp_path, small_data, monkeypatch, capsys):
    out = tmp_path / "run"
    no_reward(monkeypatch)
    train.main(["--model", WARM, "--train-data", small_data, "--out", str(out), "--steps", "2", "--rollout-batch",
                "8", "--update-batch", "4", "--group-size", "4", "--max-new-tokens", "16", "--eval-every", "2",
                "--eval-limit", "2", "--eval-data", "tiny-test", "--query-cache-dir", "", "--no-signal", "step"])
    cfg = json.loads((out / "config.json").read_text())
    old = {k: v for k, v in cfg.items() if k not in NEWER} | {"eval_temperature": 0.5}   # as d5ba7a3 wrote it
    (out / "config.json").write_text(json.dumps(old, indent=2))
    capsys.readouterr()
    train.main(["--out", str(out), "--resume", "--steps", "3"])
    said = [ln for ln in capsys.readouterr().out.splitlines() if "lacks" in ln]   # (plan_gpu: not the run's)
    assert len(said) == 1 and said[0].startswith(f"--resume: {out}/config.json (an older version's) lacks 17 "
                                                 "options newer than the run")
    assert "no_signal 'step' (as before the option)" in said[0] and "eval_temperatures [0.5] (as" in said[0]
    ms = metrics(out)
    assert ms[3]["no_signal_steps"] == 0 and ms[3]["grad_norm"] is not None   # it steps, as before
    new = json.loads((out / "config.json").read_text())
    assert new["no_signal"] == "step" and new["eval_temperatures"] == [0.5]
    assert new["resumed"][-1]["added"]["no_signal"] == "step" and sorted(new["resumed"][-1]["added"]) == [k for k in NEWER if k != "plan_gpu"]
    capsys.readouterr()
    train.main(["--out", str(out), "--resume", "--steps", "4"])            # now complete: nothing to say
    assert "lacks" not in capsys.readouterr().out and metrics(out)[4]["no_signal_steps"] == 0
