"""Options that say one thing and do another (issue #40's fuzz findings): an LR schedule's horizon on
--resume (tests/test_menu.py runs it), options that cannot act, --lora-targets with spaces, a task's
response length, a model whose tokenizer does not fit the task, and the --dry-run plan of a LoRA run.
Each is checked at parse time or on the pieces, in seconds; bench/reliability_sweep.py runs each as
a user's command."""

import json
import os

import pytest
from transformers import AutoTokenizer

import tasks
import train
from plumbing import memory_plan, time_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
ZIPF_WARM = os.path.join(ROOT, "data", "zipf", "warmstart")


def refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0]
    return err[0]


@pytest.mark.parametrize("argv, needle", [
    (["--lr-floor", "0.1"], "--lr-floor 0.1 cannot act under --lr-schedule constant"),
    (["--lr-decay-steps", "20"], "--lr-decay-steps 20 cannot act under --lr-schedule constant"),
    (["--lora-alpha", "32"], "--lora-alpha 32.0 cannot act without --lora-rank"),
    (["--lora-dropout", "0.1"], "--lora-dropout 0.1 cannot act without --lora-rank"),
    (["--lora-targets", "q_proj"], "--lora-targets q_proj cannot act without --lora-rank"),
    (["--lr-schedule", "cosine", "--lr-decay-steps", "4", "--steps", "8"],
     "--lr-decay-steps 4 < --steps 8 with --lr-floor 0: the cosine LR schedule reaches 0 at step 4"),
])
def test_options_that_cannot_act_are_refused(capsys, tmp_path, argv, needle):
    assert needle in refused(capsys, [*argv, "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [
    ["--lr-schedule", "cosine", "--lr-floor", "0.1", "--lr-decay-steps", "4", "--steps", "8"],
    ["--lr-schedule", "linear", "--lr-decay-steps", "8", "--steps", "8"],
    ["--lora-rank", "4", "--lora-alpha", "32", "--lora-targets", "q_proj, v_proj"],
    ["--lr-floor", "0", "--lora-alpha", "16"],                            # the defaults change nothing
])
def test_the_same_options_where_they_act(argv):
    train.parse_args(argv)


def test_the_decay_horizon_is_steps_unless_given():
    args, _ = train.parse_args(["--lr-schedule", "cosine", "--steps", "8"])
    assert args.lr_decay_steps == 0                                      # config.json: it follows --steps


def test_a_task_s_response_length_is_the_default_and_less_is_warned(capsys):
    assert train.parse_args(["--task", "zipf"])[0].max_new_tokens == 160
    assert train.parse_args([])[0].max_new_tokens == 96                  # math: the table's
    assert "warning" not in capsys.readouterr().out
    assert train.parse_args(["--task", "zipf", "--max-new-tokens", "96"])[0].max_new_tokens == 96
    out = capsys.readouterr().out
    assert "warning: --max-new-tokens 96 is below the 160 tokens --task zipf's solutions need" in out


def rows_of(path, task, n=64):
    with open(path) as f:
        return [{**json.loads(next(f)), "task": task} for _ in range(n)]


def test_a_tokenizer_that_does_not_fit_the_task_is_named():
    math_tok, zipf_tok = AutoTokenizer.from_pretrained(WARM), AutoTokenizer.from_pretrained(ZIPF_WARM)
    zipf_rows = rows_of(os.path.join(ROOT, "data", "zipf", "train.jsonl"), "zipf")
    why = tasks.tokenizer_misfit("zipf", math_tok, WARM, zipf_rows)
    assert why and why.endswith("give --model data/zipf/warmstart") and "tokens per word" in why
    assert tasks.tokenizer_misfit("zipf", zipf_tok, ZIPF_WARM, zipf_rows) is None      # its own
    math_rows = rows_of(os.path.join(ROOT, "data", "tinymath", "train.jsonl"), "math")
    assert tasks.tokenizer_misfit("math", math_tok, WARM, math_rows) is None
    cd_rows = rows_of(os.path.join(ROOT, "data", "countdown", "train.jsonl"), "countdown")
    assert tasks.tokenizer_misfit("countdown", math_tok, WARM, cd_rows) is None        # no warm start named


def test_the_dry_run_plan_of_a_lora_run_counts_the_adapters():
    argv = ["--config", os.path.join(ROOT, "configs", "paper_qwen7b.json"), "--fsdp", "false",
            "--kv-budget", "524288"]        # (0, the config's: the cache takes what the rest leaves)
    full, _ = train.parse_args(argv)
    lora, _ = train.parse_args([*argv, "--lora-rank", "16"])
    arch = memory_plan.arch_for(full.model)
    peak = {n: max(memory_plan.phases(arch, a, 8, True).values()) for n, a in (("full", full), ("lora", lora))}
    assert peak["lora"] < 0.6 * peak["full"]                               # no Adam state, grads, reference
    update = {n: memory_plan.phases(arch, a, 8, True)["optimizer"] for n, a in (("full", full), ("lora", lora))}
    assert update["lora"] < 0.3 * update["full"]
    report = memory_plan.report(lora, 8, True)
    assert "LoRA rank 16 (40.4M adapter parameters train)" in report and "lora.merged" in report
    t_full, t_lora = (time_model.report(a, 8, True, "h100") for a in (full, lora))
    assert "6N + 6 x 40.4M FLOPs per token (LoRA rank 16" in t_lora and "8N FLOPs per token" in t_full


def test_an_older_run_s_fixed_horizon_resumed_past_it_is_refused(capsys, tmp_path):
    """A run made before the horizon followed --steps recorded it resolved (lr_decay_steps 4 of
    --steps 4): resumed to 8 at floor 0, steps 5-8 would not train; --lr-decay-steps may change."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"lr_schedule": "cosine", "lr_decay_steps": 4,
                                                              "steps": 4}))
    argv = ["--out", str(tmp_path / "run"), "--resume", "--steps", "8"]
    line = refused(capsys, argv)
    assert "--lr-decay-steps 4 (the run's, config.json) < --steps 8" in line and "steps 5-8 would not train" in line
    assert train.parse_args([*argv, "--lr-decay-steps", "8"])[0].lr_decay_steps == 8
