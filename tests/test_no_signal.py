"""No signal, no step (method.md §8.6, issue #31): an update batch whose groups all have equal
rewards takes no optimizer step by default -- no AdamW update, no weight decay, the LR schedule
waits -- and is counted as `no_signal_steps`; `--no-signal step` takes it anyway. Without the rule,
Adam turns the KL terms' near-zero gradient into a full lr-sized step (the Countdown run below)."""

import json
import os

import pytest
import torch

import train
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
SIZES = ["--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--eval-every", "0",
         "--save-every", "0"]                                   # 2 optimizer steps per RL step
SAID = "no signal: an update batch whose every advantage is ~0 (its groups' rewards all equal) took no"


def run(out, *extra, steps=2):
    train.main(["--model", WARM, "--out", str(out), "--steps", str(steps), *SIZES, *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def optimizer_steps(monkeypatch):
    """Counts the optimizer steps train.py applies (AdamW's step, which the plain step calls itself
    and the step at scale through plumbing.optimizer.step)."""
    calls, real = [], torch.optim.AdamW.step

    def counted(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    return calls


def scores_only(monkeypatch, signal_row=None):
    """Every completion scores 0, so every group's rewards are equal, except row `signal_row` of each
    sampling round, which scores 1: a task the policy cannot solve yet (or one group that it can)."""
    real = train.experience.tasks.score_rows

    def fake(completions, rows, **kw):
        _, _, counts = real(completions, rows, **kw)
        scores = [float(i == signal_row) for i in range(len(rows))]
        return scores, [s == 1.0 for s in scores], counts
    monkeypatch.setattr(train.experience.tasks, "score_rows", fake)


def test_countdown_from_the_math_warm_start_takes_no_step_and_does_not_drift(tmp_path, capsys,
                                                                                optimizer_steps):
    """The issue's command: the math warm start scores 0% on Countdown, so no batch has a signal.
    With the default every optimizer step is skipped and Query-KL stays at the reference's."""
    argv = ["--algo", "erpo", "--task", "countdown", "--query-cache-dir", ""]
    ms = run(tmp_path / "skip", *argv, steps=3)
    assert [m["step"] for m in ms] == [1, 2, 3] and all(m["reward"] == 0 for m in ms)
    assert sum(m["no_signal_steps"] for m in ms) == 6 and not optimizer_steps
    assert all(m["grad_norm"] is None for m in ms)
    for m in ms:                                              # pi_0 itself: 0 up to rounding
        assert_rounding("no_signal.countdown_query_kl", m["query_kl"], 0.0)
    assert capsys.readouterr().out.count(SAID) == 1           # said once, the first time
    ms = run(tmp_path / "step", *argv, "--no-signal", "step", steps=2)
    assert len(optimizer_steps) == 4 and all(m["no_signal_steps"] == 0 for m in ms)
    assert ms[1]["query_kl"] > 0.1                              # Adam's full step on the KL term alone


@pytest.mark.parametrize("algo", ["erpo", "grpo", "rloo", "dapo"])
def test_no_signal_is_judged_on_the_rewards_for_every_algorithm(algo, tmp_path, small_data, monkeypatch,
                                                                 optimizer_steps):
    """RLOO's KL penalty in the reward is a regularizer, not a signal; DAPO's update batches of
    filler groups only are counted too. The policy never moves: Query-KL stays 0, the lr unchanged."""
    scores_only(monkeypatch)
    extra = ["--max-resample-rounds", "1"] if algo == "dapo" else []
    ms = run(tmp_path, "--algo", algo, "--train-data", small_data, "--max-new-tokens", "24", *extra)
    assert not optimizer_steps and [m["no_signal_steps"] for m in ms] == [2, 2]
    assert all(m["lr"] == 2e-4 for m in ms)
    for m in ms:
        assert_rounding("no_signal.query_kl", m["query_kl"], 0.0)


def test_an_update_batch_with_one_signal_group_steps(tmp_path, small_data, monkeypatch, optimizer_steps):
    """No signal is judged per optimizer step: row 16 is in the second update batch of each RL step
    (rows 0-15 are the first's), so the first is skipped and the second steps, on one group's signal."""
    scores_only(monkeypatch, signal_row=16)
    ms = run(tmp_path, "--algo", "erpo", "--train-data", small_data, "--max-new-tokens", "24")
    assert [m["no_signal_steps"] for m in ms] == [1, 1] and len(optimizer_steps) == 2
    assert all(m["grad_norm"] > 0 and m["zero_var_frac"] == 7 / 8 for m in ms)
    assert ms[1]["query_kl"] > 0                                # the policy moved


def test_the_opt_in_flag_steps_without_signal(tmp_path, small_data, monkeypatch, optimizer_steps):
    scores_only(monkeypatch)
    ms = run(tmp_path, "--algo", "erpo", "--train-data", small_data, "--max-new-tokens", "24",
             "--no-signal", "step")
    assert len(optimizer_steps) == 4 and [m["no_signal_steps"] for m in ms] == [0, 0]


def signal_in_the_first_round_only(monkeypatch):
    """Row 0 of the first sampling round scores 1, every other completion 0: one optimizer step is
    taken (the first update batch of step 1), then no batch has a signal again."""
    real, calls = train.experience.tasks.score_rows, []

    def fake(completions, rows, **kw):
        _, _, counts = real(completions, rows, **kw)
        scores = [float(not calls and i == 0) for i in range(len(rows))]
        calls.append(1)
        return scores, [s == 1.0 for s in scores], counts
    monkeypatch.setattr(train.experience.tasks, "score_rows", fake)


def test_a_divergence_shows_when_no_signal_skips_every_later_step(tmp_path, small_data, monkeypatch, capsys):
    """Issue #40: --lr 1e6's one step destroys the weights (norm x1e7); every later batch has no signal,
    so no loss is computed to say so. The weights' norm does: the run stops at step 2 with the
    divergence error, step 1's checkpoint (saved after the divergence) set aside."""
    signal_in_the_first_round_only(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run(out, "--train-data", small_data, "--max-new-tokens", "24", "--lr", "1e6", "--save-every", "1",
            steps=4)
    msg = str(e.value.code)
    assert msg.startswith("error: the policy diverged by step 2: the weights' norm is ") and "times the" in msg
    assert "--resume starts from the initial model" in msg and f"{out}/ckpt.diverged/" in msg
    assert msg.endswith("resume with a lower --lr")
    assert not (out / "ckpt").exists() and (out / "ckpt.diverged" / "state.pt").exists()
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1]


def test_weights_diverged_names_non_finite_and_blown_up_weights():
    import torch

    from plumbing.step_guard import weight_norm, weights_diverged
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert weight_norm(model) == pytest.approx(4.0) and weights_diverged(model, 4.0) is None
    assert weights_diverged(model, 1.0) is None                 # 4x: a run's weights may move
    assert "400 times the 0.01" in weights_diverged(model, 0.01)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert weights_diverged(model, 4.0) == "a weight is not finite"


def test_a_run_that_takes_no_step_for_idle_steps_in_a_row_says_so_once(tmp_path, small_data, monkeypatch, capsys):
    scores_only(monkeypatch)
    monkeypatch.setattr(train, "IDLE_STEPS", 2)
    run(tmp_path, "--train-data", small_data, "--max-new-tokens", "24", steps=4)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "RL steps in a row" in ln]
    assert len(said) == 1 and said[0].startswith("no optimizer step in 2 RL steps in a row (steps 1-2; "
                                                 "train_acc 0.000)") and "--no-signal step" in said[0]


def test_no_signal_is_judged_on_the_advantages_the_estimator_produced(tmp_path, small_data, monkeypatch,
                                                                       optimizer_steps):
    """The rule reads the advantages, not the rewards: an estimator registered from outside whose
    advantages are not 0 on a constant-reward group (a fixed baseline of 0.5: A = R - 0.5) steps on
    the batches where grpo, on the same rewards (every one 0), takes no step."""
    import losses
    from plumbing import extension
    scores_only(monkeypatch)
    args = ["--train-data", small_data, "--max-new-tokens", "24", "--algo", "grpo"]
    ms = run(tmp_path / "grpo", *args)
    assert not optimizer_steps and [m["no_signal_steps"] for m in ms] == [2, 2]
    row = losses.AdvantageRow(lambda x: x.rewards - 0.5, "R - 0.5", constant_is_zero=False)
    extension.register(losses.ADVANTAGES, "fixed-baseline", row)
    try:
        ms = run(tmp_path / "fixed", *args, "--adv", "fixed-baseline")
    finally:
        extension.unregister(losses.ADVANTAGES, "fixed-baseline")
    assert len(optimizer_steps) == 4 and [m["no_signal_steps"] for m in ms] == [0, 0]
    assert all(m["grad_norm"] is not None and m["grad_norm"] > 0 for m in ms)
    ms = run(tmp_path / "passk", *args, "--adv", "passk", "--passk-k", "2")  # pass@k: 0 on constant groups
    # (k = G is refused before the run: pass@G is 0 on every group, whatever its rewards)
    assert len(optimizer_steps) == 4 and [m["no_signal_steps"] for m in ms] == [2, 2]
