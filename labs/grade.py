"""The lab's grading tests: the six functions of labs/exercises.py on the hand-value cases that
tests/test_losses.py checks the repo against (tests/loss_cases.py), and the KL direction on an
exact toy categorical.

    python -m pytest -q labs/grade.py                 # your labs/exercises.py
    python -m pytest -q labs/grade.py --impl repo     # the repo's functions: every test passes
    python -m pytest -q labs/grade.py -k k3           # one exercise

(Not collected by `pytest tests`: the stubs fail by design. tests/test_labs.py runs this file both ways.)
"""

import math

import pytest
import torch

from tests.loss_cases import (ADVANTAGE_CASES, CONSTANT_GROUPS, K3_CASES, KL_PQ, KL_QP, P, PPO_CASES, Q,
                              QUERY_KL_HAND, QUERY_WEIGHT_CASES, query_kl_case)

# -----------------------------------------------------------------------------
# 1. group_advantages (method.md §8.2)


def test_group_advantages_hand_values(impl):
    for rewards, G, want in ADVANTAGE_CASES["grpo"]:
        got = impl.group_advantages(torch.tensor(rewards), G)
        torch.testing.assert_close(got, torch.tensor(want), msg=f"rewards {rewards}, G = {G}")


def test_group_advantages_all_equal_groups_are_exactly_zero(impl):
    for rewards, G, zero_rows in CONSTANT_GROUPS:
        got = impl.group_advantages(torch.tensor(rewards), G)
        assert (got[:zero_rows] == 0).all(), f"rewards {rewards[:zero_rows]} must give exactly 0, got {got}"
    mixed = impl.group_advantages(torch.tensor(CONSTANT_GROUPS[-1][0]), 8)
    assert (mixed[8:] != 0).all(), "the second group's rewards differ: its advantages are not 0"


# -----------------------------------------------------------------------------
# 2. k3, and the direction of the KL it estimates (method.md §8.1)


def test_k3_hand_values(impl):
    for logp, ref, want in K3_CASES:
        got = impl.k3(torch.tensor(logp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64))
        assert got.item() == pytest.approx(want, abs=1e-9), f"k3(logp={logp:.4f}, ref_logp={ref:.4f})"


def test_k3_expectation_is_kl_theta_ref_on_the_exact_toy(impl):
    """E_{x ~ pi_theta}[k3(x)] summed exactly over the 5 categories is KL(pi_theta || pi_ref): with
    log r built the other way round it is neither that nor KL(pi_ref || pi_theta)."""
    per_category = impl.k3(P.log(), Q.log())
    assert (per_category >= 0).all()
    expected = float((P * per_category).sum())
    assert expected == pytest.approx(KL_PQ, abs=1e-9), \
        f"E[k3] = {expected:.4f}, KL(pi_theta||pi_ref) = {KL_PQ:.4f}, KL(pi_ref||pi_theta) = {KL_QP:.4f}"


def test_k3_as_a_loss_follows_the_gradient_of_the_other_direction(impl):
    """Its expected gradient is grad KL(pi_ref || pi_theta), not grad KL(pi_theta || pi_ref)
    (method.md §8.1): exact, over the categories, pi_theta's sampling weights held fixed."""
    theta = P.log().clone().requires_grad_(True)
    expected = (P * impl.k3(torch.log_softmax(theta, 0), Q.log())).sum()
    assert expected.requires_grad, "k3's gradient must flow through logp (it is a loss term)"
    expected.backward()
    torch.testing.assert_close(theta.grad, _kl_grad(reverse=False))
    assert (theta.grad - _kl_grad(reverse=True)).abs().max() > 0.1


def _kl_grad(reverse):
    """Exact gradient w.r.t. the logits of KL(p||q) (reverse) or KL(q||p), p = softmax(logits)."""
    theta = P.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - Q.log())).sum() if reverse else (Q * (Q.log() - logp)).sum()
    kl.backward()
    return theta.grad


# -----------------------------------------------------------------------------
# 3. query_kl (method.md §3)


def test_query_kl_hand_values(impl):
    logp, ref, mask, want = QUERY_KL_HAND
    torch.testing.assert_close(impl.query_kl(logp, ref, mask), torch.tensor(want))
    empty = impl.query_kl(logp[:1], ref[:1], torch.zeros_like(mask[:1]))
    assert empty.tolist() == [0.0], "a row with no prompt token to score gives 0"


def test_query_kl_masks_and_zero(impl):
    logp, ref, mask = query_kl_case()
    assert (impl.query_kl(logp, logp.clone(), mask) == 0).all()
    base = impl.query_kl(logp, ref, mask)
    assert base.shape == (3,) and (base > 0).all()
    changed = logp.clone()
    changed[0, 0] -= 5.0                                                  # positions outside the mask
    changed[0, 4] += 1.0
    changed[2, 3] -= 2.0
    torch.testing.assert_close(impl.query_kl(changed, ref, mask), base)
    changed[0, 2] -= 1.0                                                  # one inside it counts
    assert not torch.allclose(impl.query_kl(changed, ref, mask)[0], base[0])
    k3 = torch.exp(ref - logp) - (ref - logp) - 1                         # a mean per row, not a sum
    torch.testing.assert_close(base[1], k3[1, 1:].mean())


# -----------------------------------------------------------------------------
# 4. query_weights (method.md §4)


def test_query_weights_hand_values(impl):
    for nll, mean_nll, clip, want in QUERY_WEIGHT_CASES:
        got = impl.query_weights(torch.tensor(nll), mean_nll=mean_nll, clip=clip)
        torch.testing.assert_close(got, torch.tensor(want), msg=f"nll {nll}, mean_nll {mean_nll}, "
                                                                f"clip {clip}")


def test_query_weights_carry_no_gradient_and_refuse_log_likelihoods(impl):
    assert not impl.query_weights(torch.tensor([2.0, 4.0], requires_grad=True)).requires_grad
    with pytest.raises(ValueError, match="log-likelihood"):
        impl.query_weights(torch.tensor([-3.0, 1.0]))


# -----------------------------------------------------------------------------
# 5. ppo_loss (method.md §8.3)


def _one_token(impl, ratio, A, **kw):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, clipped = impl.ppo_loss(logp, torch.zeros(1, 1, dtype=torch.float64),
                                  torch.tensor([A], dtype=torch.float64), **kw)
    loss.sum().backward()
    return loss.item(), bool(clipped.item()), logp.grad.item()


@pytest.mark.parametrize("case", PPO_CASES, ids=[f"r={c[0]},A={c[1]},{c[2]}" for c in PPO_CASES])
def test_ppo_loss_cases(impl, case):
    ratio, A, kw, loss, clipped, grad = case
    got = _one_token(impl, ratio, A, **kw)
    assert got[0] == pytest.approx(loss), "loss"
    assert got[1] == clipped, "clipped"
    if grad is not None:
        assert got[2] == pytest.approx(grad, abs=1e-12), "d loss / d logp"


def test_ppo_loss_advantage_per_row_or_per_token(impl):
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    A = torch.tensor([1.0, -2.0, 0.5])
    a, ca = impl.ppo_loss(logp, old, A)
    b, cb = impl.ppo_loss(logp, old, A[:, None].expand(3, 5))
    assert a.shape == (3, 5) and ca.dtype == torch.bool
    torch.testing.assert_close(a, b)
    assert torch.equal(ca, cb)


# -----------------------------------------------------------------------------
# 6. GRPO's implicit per-prompt weight (docs/teaching.md, part D)

GRPO_WEIGHT_CASES = [   # (p, G, weight): 1 / (sigma + eps), sigma^2 = G/(G-1) p(1-p) (Bessel)
    (1 / 4, 4, 1 / (0.5 + 1e-6)),                  # sigma^2 = 4/3 * 3/16 = 1/4 (population: 3/16)
    (1 / 2, 8, 1 / (math.sqrt(2 / 7) + 1e-6)),     # 8/7 * 1/4
    (1 / 8, 8, 1 / (math.sqrt(1 / 8) + 1e-6)),     # 8/7 * 7/64
    (3 / 4, 4, 1 / (0.5 + 1e-6)),                  # symmetric in p <-> 1 - p
    (0.0, 8, 0.0), (1.0, 8, 0.0), (0.0, 2, 0.0),   # no signal: 0, not 1 / eps
]


def test_grpo_prompt_weight_hand_values(impl):
    for p, G, want in GRPO_WEIGHT_CASES:
        got = impl.grpo_prompt_weight(p, G)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), f"p = {p}, G = {G}"


def test_grpo_prompt_weight_times_centred_rewards_is_the_advantage(impl):
    """c(p) (R_i - p) is GRPO's advantage of every response, for each K of G = 8 (and G = 5)."""
    for G in (5, 8):
        for k in range(1, G):
            r = torch.tensor([1.0] * k + [0.0] * (G - k), dtype=torch.float64)
            want = (r - r.mean()) / (r.std() + 1e-6)
            got = impl.grpo_prompt_weight(k / G, G) * (r - k / G)
            torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), want,
                                       msg=f"{k} successes of {G}")
