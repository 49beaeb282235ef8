"""What researchers expect from TRL and verl (issue #33), each against hand values or its formula,
and each run for 2 RL steps on the tiny world through one parametrised in-process fixture:
CISPO and SAPO surrogates, batch-std and REINFORCE++-baseline advantages, masking truncated
completions, truncated importance sampling."""

import json
import math
import os

import pytest
import torch

import losses
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def algo_with(**kw):
    return losses.make_algo("grpo", **kw)


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_detached_weight():
    """loss_t = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi: gradient -clip(r) A on every token,
    where PPO-clip zeroes the clipped ones."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64))
    r = torch.tensor([[0.5, 1.1, 2.0]], dtype=torch.float64)               # below, inside, above the range
    logp = (old + r.log()).requires_grad_()
    A, algo = torch.tensor([2.0], dtype=torch.float64), algo_with(surrogate="cispo", eps_low=0.2, eps_high=0.28)
    sur = losses.SURROGATES["cispo"].fn(logp, old, A, torch.ones_like(r), algo)
    sur.loss.sum().backward()
    weight = torch.tensor([[0.8, 1.1, 1.28]], dtype=torch.float64)
    torch.testing.assert_close(sur.loss.detach(), -weight * 2.0 * logp.detach())
    torch.testing.assert_close(logp.grad, -weight * 2.0)                  # no token's gradient is cut
    assert sur.stats["clip_frac_low"].tolist() == [[True, False, False]]
    assert sur.stats["clip_frac_high"].tolist() == [[False, False, True]]
    ppo = logp.detach().clone().requires_grad_()
    losses.ppo_loss(ppo, old, A, 0.2, 0.28, None)[0].sum().backward()
    assert ppo.grad[0, 2] == 0 and ppo.grad[0, 0] != 0                    # PPO: the high one is cut (A > 0)


def test_sapo_is_a_soft_gate_with_pgs_gradient_on_policy():
    """loss_t = -sigmoid(tau (r - 1)) 4 / tau A, tau_pos for A > 0, tau_neg for A < 0: on-policy its
    gradient is the plain policy gradient -A; off-policy it fades as 4 s (1 - s)."""
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    algo = algo_with(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    A = torch.tensor([1.5, -0.5], dtype=torch.float64)
    logp = old.clone().requires_grad_()                                   # on-policy: r = 1
    sur = losses.SURROGATES["sapo"].fn(logp, old, A, torch.ones_like(old), algo)
    sur.loss.sum().backward()
    torch.testing.assert_close(logp.grad, -A[:, None].expand(2, 3))
    torch.testing.assert_close(sur.loss.detach(), torch.tensor([[-3.0] * 3, [0.5] * 3], dtype=torch.float64))
    logp = (old + math.log(3.0)).requires_grad_()                         # r = 3
    sur = losses.SURROGATES["sapo"].fn(logp, old, A, torch.ones_like(old), algo)
    sur.loss.sum().backward()
    for row, (a, tau) in enumerate(((1.5, 1.0), (-0.5, 2.0))):
        s = 1 / (1 + math.exp(-tau * 2.0))
        assert logp.grad[row, 0].item() == pytest.approx(-4 * s * (1 - s) * 3.0 * a)
        assert sur.stats["sapo_grad_weight"][row, 0].item() == pytest.approx(4 * s * (1 - s))


def test_a_surrogate_declares_the_knobs_it_reads():
    assert {"eps_low", "eps_high", "dual_clip"} <= losses.unused_fields(algo_with(surrogate="sapo"))
    assert "dual_clip" in losses.unused_fields(algo_with(surrogate="cispo"))
    assert not {"eps_low", "eps_high"} & losses.unused_fields(algo_with(surrogate="cispo"))
    assert {"sapo_tau_pos", "sapo_tau_neg"} <= losses.unused_fields(algo_with())
    assert losses.off_policy_stats() >= {"clip_frac", "sapo_grad_weight"}
    with pytest.raises(ValueError):
        algo_with(sapo_tau_neg=0.0)


def test_batch_std_and_reinforce_pp_advantages_by_hand():
    R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])            # 4 groups of 2: (1,0) (1,1) (0,0) (0,1)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -0.5, 0.5])
    std_R = R.std().item()                                                 # Bessel, over the batch
    torch.testing.assert_close(losses.group_advantages(R, 2, "batch-std", 0.0), centred / std_R)
    torch.testing.assert_close(losses.group_advantages(R, 2, "reinforce++", 0.0), centred / centred.std())
    # DAPO filler (valid 0) is no part of the batch's moments; a constant group stays exactly 0
    valid = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 0])
    got = losses.group_advantages(R, 2, "batch-std", 0.0, valid=valid)
    torch.testing.assert_close(got[:6], centred[:6] / R[:6].std())
    assert got[2:6].abs().max() == 0


def test_batch_advantages_on_two_ranks_equal_one_process():
    """reduce sums the moments over ranks: each half of the batch on its own 'rank' gives the one-
    process advantages."""
    g = torch.Generator().manual_seed(0)
    R = torch.randint(0, 2, (16,), generator=g).float() + 0.1 * torch.rand(16, generator=g)
    halves = (R[:8], R[8:])
    for kind in losses.BATCH_ADVANTAGES:
        whole = losses.group_advantages(R, 4, kind)
        for i, h in enumerate(halves):
            other = halves[1 - i]

            def reduce(t, other=other, kind=kind):                        # this rank's sums + the other's
                w = torch.ones_like(other)
                x = other if kind == "batch-std" else other - other.view(-1, 4).mean(1).repeat_interleave(4)
                return t + torch.stack([w.sum(), x.sum(), (x * x).sum()]).double()
            torch.testing.assert_close(losses.group_advantages(h, 4, kind, reduce=reduce), whole[8 * i:8 * i + 8])


def test_truncated_rows_carry_no_loss_but_keep_their_baseline():
    from rl.experience import trained_rows
    from rollout import Rollout

    finished = torch.tensor([True, False, True, True])
    ro = Rollout(*(torch.zeros(4, 2, dtype=torch.long) for _ in range(4)), torch.zeros(4, 2), finished)
    valid = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert trained_rows(valid, ro, algo_with(mask_truncated=True)).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert trained_rows(valid, ro, algo_with()).tolist() == [1.0, 1.0, 1.0, 0.0]


def test_the_entropy_bonus_and_the_top_entropy_tokens_by_hand():
    """loss = PG - c * H (H aggregated like PG); with top_entropy_quantile q the PG acts on the tokens
    whose entropy is in the top q of the micro-batch only."""
    B, T = 2, 4
    logp = torch.full((B, T), -1.0, dtype=torch.float64, requires_grad=True)
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.7, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    kw = dict(old_logp=logp.detach(), ref_logp=None, resp_mask=mask, advantages=adv, weights=None,
              prompt_logp=None, prompt_ref_logp=None, prompt_mask=None, num_tokens=7.0, num_seqs=2, max_len=T)
    base = algo_with(kl="none", beta=0.0)
    pg, _ = losses.rl_loss(base, logp=logp, **kw)
    loss, st = losses.rl_loss(algo_with(kl="none", beta=0.0, entropy_coef=0.1), logp=logp, entropy=ent, **kw)
    H = (ent * mask).sum() / 7
    assert loss.item() == pytest.approx(pg.item() - 0.1 * H.item()) and st["entropy_bonus"] == pytest.approx(H.item())
    g, = torch.autograd.grad(loss, ent)
    torch.testing.assert_close(g, -0.1 * mask / 7)                       # the bonus raises entropy
    kept = losses.high_entropy_tokens(ent, mask, 0.5)                      # 7 tokens: the 4 above the median
    assert kept.tolist() == [[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
    top, _ = losses.rl_loss(algo_with(kl="none", beta=0.0, top_entropy_quantile=0.5), logp=logp, entropy=ent, **kw)
    per_token = -adv[:, None] * torch.ones(B, T, dtype=torch.float64)     # on-policy PPO: -A r, r = 1
    assert top.item() == pytest.approx(((per_token * kept * mask).sum() / 7).item())
    with pytest.raises(ValueError, match="entropy"):
        losses.rl_loss(algo_with(entropy_coef=0.1, kl="none", beta=0.0), logp=logp, **kw)
    with pytest.raises(ValueError):
        algo_with(top_entropy_quantile=0.0)


# Each new loss term / option of issue #33, run for 2 RL steps (2 optimizer steps each) in-process.
MENU = {
    "cispo": ["--surrogate", "cispo", "--eps-low", "0.99", "--eps-high", "1.0"],
    "sapo": ["--surrogate", "sapo"],
    "batch-std": ["--adv", "batch-std"],
    "reinforce++": ["--adv", "reinforce++"],
    "maxrl": ["--adv", "maxrl"],
    "k3-ratio": ["--kl", "k3-ratio", "--beta", "0.01"],
    "mask-truncated": ["--mask-truncated", "--max-new-tokens", "40"],
    "tis": ["--tis-cap", "2"],
    "lr-linear": ["--lr-schedule", "linear", "--lr-floor", "0.1"],
    "lr-cosine": ["--lr-schedule", "cosine"],
    "entropy-bonus": ["--entropy-coef", "0.01"],
    "top-entropy": ["--top-entropy-quantile", "0.2"],
    "passk": ["--adv", "passk", "--passk-k", "2"],
    "entropy-target": ["--entropy-target", "100", "--entropy-coef-delta", "0.01"],
}


@pytest.mark.parametrize("name", sorted(MENU))
def test_each_option_trains_two_steps(name, tmp_path, small_data):
    train.main(["--algo", "erpo", "--model", WARM, "--train-data", small_data, "--out", str(tmp_path), "--steps", "2",
                "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--max-new-tokens", "24",
                "--eval-every", "0", "--save-every", "0", "--no-signal", "step", *MENU[name]])
    with open(tmp_path / "metrics.jsonl") as f:
        ms = [json.loads(line) for line in f]
    assert [m["step"] for m in ms] == [1, 2] and all(math.isfinite(m["loss"]) for m in ms)
    assert ms[1]["query_kl"] > 0                                          # the policy moved
    if name == "sapo":
        assert 0 < ms[1]["sapo_grad_weight"] <= 1 and "clip_frac" not in ms[1]
    if name == "mask-truncated":
        assert all(m["truncated_frac"] > 0 for m in ms)                   # there were some to mask
    if name == "entropy-bonus":
        assert all(m["entropy_bonus"] > 0 for m in ms)
    if name == "entropy-target":          # entropy below the target: the coefficient rises by delta
        assert [m["entropy_coef"] for m in ms] == [0.0, 0.01] and "entropy_bonus" in ms[1]
    if name.startswith("lr-"):            # 4 optimizer steps, decay over 4: each step's first one's lr
        assert ms[0]["lr"] == 2e-4 and ms[1]["lr"] == pytest.approx(2e-4 * (0.55 if name == "lr-linear" else 0.5))


def test_lr_schedules_by_hand():
    from train import lr_factor
    W, D = 2, 10                                                          # 2 warm-up steps, decay to step 10
    assert [lr_factor(s, "constant", W, D) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, "linear", W, D) for s in (0, 1, 2, 6, 10, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert lr_factor(6, "linear", W, D, floor=0.2) == pytest.approx(0.6)
    cos = [lr_factor(s, "cosine", 0, 8, floor=0.1) for s in (0, 2, 4, 8, 9)]
    assert cos == pytest.approx([1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1, 0.1])
    from plumbing import optimizer                                        # SFT's warm-up: the same factors
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    for w in (0, 1, 3):
        factor = optimizer.warmup_then_constant(opt, w).lr_lambdas[0]
        assert [factor(s) for s in range(6)] == [lr_factor(s, "constant", w) for s in range(6)]


def test_a_decaying_schedule_follows_steps_on_resume(tmp_path, small_data, capsys):
    """--lr-schedule linear, a run of --steps 2 (2 optimizer steps each) resumed to --steps 4: the
    horizon is --steps (lr_decay_steps 0 in config.json), so the resumed run decays over 4 steps
    from step 3 on (not at lr 0 after step 2, issue #40), and the resume line says so. The lr logged
    is the one the step's first optimizer step used."""
    base = ["--algo", "grpo", "--model", WARM, "--train-data", small_data, "--rollout-batch", "8",
            "--update-batch", "4", "--group-size", "4", "--max-new-tokens", "16", "--eval-every", "0",
            "--save-every", "2", "--no-signal", "step", "--lr-schedule", "linear", "--lr", "1e-3"]
    train.main([*base, "--out", str(tmp_path / "a"), "--steps", "2"])
    capsys.readouterr()
    train.main([*base, "--out", str(tmp_path / "a"), "--steps", "4", "--resume"])
    assert ("steps 2 -> 4 (the linear LR schedule's horizon follows --steps: it decays over 4 steps, not 2"
            in capsys.readouterr().out)
    with open(tmp_path / "a" / "metrics.jsonl") as f:
        lrs = [json.loads(line)["lr"] for line in f]
    # optimizer steps 0, 2 of horizon 2 x 2 = 4; then 4, 6 of horizon 2 x 4 = 8
    assert lrs == pytest.approx([1e-3, 1e-3 * 0.5, 1e-3 * 0.5, 1e-3 * 0.25], abs=1e-12)
    assert json.load(open(tmp_path / "a" / "config.json"))["lr_decay_steps"] == 0
