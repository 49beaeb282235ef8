"""Math tests for losses.py: KL directions, advantages, Proposition 1, aggregation, the ALGOS table."""

import math
import random

import pytest
import torch

from losses import (AGG_MODES, ALGOS, Algo, aggregate, group_advantages, kl_penalized_rewards, make_algo,
                    nonconstant_groups, overlong_penalty, policy_kl, query_kl, query_weights, rl_loss,
                    unused_fields)
from losses import SURROGATES, clip_masks, ppo_loss
import losses
from tests.loss_cases import (ADVANTAGE_CASES, CONSTANT_GROUPS, K3_CASES, KL_PQ, KL_QP, P, PPO_CASES, Q,
                              QUERY_KL_HAND, QUERY_WEIGHT_CASES, query_kl_case)
from tests.rounding import assert_rounding

# -----------------------------------------------------------------------------
# KL estimators on a 5-category toy where both KL directions are exact and clearly different
# (P = pi_theta, Q = pi_ref: tests/loss_cases.py, which labs/grade.py shares)


def test_toy_kl_directions_differ():
    assert abs(KL_PQ - KL_QP) > 0.4


def test_kl_estimators_values_match_exact_kl():
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(P, 400_000, replacement=True, generator=g)     # tokens sampled from pi_theta
    logp, ref = P.log()[x], Q.log()[x]
    k1, k2, k3 = (policy_kl(logp, ref, k) for k in ("k1", "k2", "k3"))
    for k in (k1, k3):                                                    # unbiased for KL(p||q)
        assert k.mean().item() == pytest.approx(KL_PQ, abs=0.02)
        assert abs(k.mean().item() - KL_QP) > 0.3                         # ... and not the reverse
    assert (k3 >= 0).all() and (k2 >= 0).all()
    assert (k1 < 0).any()                                                 # k1 can be negative per token
    exact_k2 = float((P * 0.5 * (Q / P).log() ** 2).sum())
    assert k2.mean().item() == pytest.approx(exact_k2, abs=0.02)
    assert abs(exact_k2 - KL_PQ) > 0.1                                    # k2 is biased


def test_k3_hand_values():
    for logp, ref, k3 in K3_CASES:
        assert policy_kl(torch.tensor(logp), torch.tensor(ref), "k3").item() == pytest.approx(k3, abs=1e-6)


def test_kl_clamp():
    logp = torch.tensor([0.0, -30.0])
    ref = torch.tensor([-30.0, 0.0])
    k3 = policy_kl(logp, ref, "k3", clamp=10.0)
    assert torch.isfinite(k3).all() and (k3 <= 10.0).all()
    assert k3[0].item() == pytest.approx(10.0) and k3[1].item() == pytest.approx(10.0)
    with pytest.raises(ValueError, match="k1"):
        policy_kl(logp, ref, "k4")


def test_kl_clamp_acts_on_k3_alone():
    """k1/k2 are never clamped (no reference implementation does; a clamped k2 loses its gradient
    where |log r| > sqrt(20) = 4.47): values and gradients equal the unclamped ones."""
    logp = torch.tensor([0.0, -8.0, -1.0], requires_grad=True)
    ref = torch.tensor([-9.0, 0.0, -1.5])
    for kind in ("k1", "k2"):
        a = policy_kl(logp, ref, kind, clamp=10.0)
        b = policy_kl(logp, ref, kind, clamp=None)
        torch.testing.assert_close(a, b)
        (ga,) = torch.autograd.grad(a.sum(), logp)
        (gb,) = torch.autograd.grad(b.sum(), logp)
        torch.testing.assert_close(ga, gb)
    k2 = policy_kl(logp, ref, "k2", clamp=10.0)
    assert k2[0].item() == pytest.approx(40.5) and k2[1].item() == pytest.approx(32.0)   # > 10
    (g,) = torch.autograd.grad(k2.sum(), logp)
    assert g[0].item() == pytest.approx(9.0) and g[1].item() == pytest.approx(-8.0)      # not cut
    algo = make_algo("grpo", kl="k2")
    kw = dict(_inputs(), weights=None)
    kw["ref_logp"] = kw["logp"].detach() - 6.0                                           # |log r| = 6
    loss, stats = rl_loss(algo, **kw)
    assert stats["policy_kl"].item() == pytest.approx(18.0)                               # 0.5 * 6^2


def _expected_grad(kind):
    """Exact E_{x~pi_theta}[grad_theta k(x)]: sum over categories with DETACHED pi_theta weights
    (the sampling distribution is not differentiated), k computed on differentiable log-probs."""
    theta = P.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    (P.detach() * policy_kl(logp, Q.log(), kind)).sum().backward()
    return theta.grad


def _kl_grad(direction):
    """Exact gradient w.r.t. the logits of KL(p||q) ("reverse") or KL(q||p) ("forward"), p = pi_theta."""
    theta = P.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    if direction == "reverse":
        kl = (logp.exp() * (logp - Q.log())).sum()
    else:
        kl = (Q * (Q.log() - logp)).sum()
    kl.backward()
    return theta.grad


def test_kl_estimator_gradients():
    grad_reverse = _kl_grad("reverse")   # grad KL(pi_theta || pi_ref)
    grad_forward = _kl_grad("forward")    # grad KL(pi_ref || pi_theta)
    assert (grad_reverse - grad_forward).abs().max() > 0.1
    torch.testing.assert_close(_expected_grad("k3"), grad_forward)
    torch.testing.assert_close(_expected_grad("k2"), grad_reverse)
    torch.testing.assert_close(_expected_grad("k1"), torch.zeros(5, dtype=torch.float64))


def test_k3_monte_carlo_gradient_is_forward_kl_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(P, 400_000, replacement=True, generator=g)
    theta = P.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)[x]
    policy_kl(logp, Q.log()[x], "k3").mean().backward()
    torch.testing.assert_close(theta.grad, _kl_grad("forward"), atol=0.03, rtol=0)


def test_k3_ratio_hand_values():
    """k3-ratio = (pi_theta / pi_old) * k3: ratios 2 and 1/2, both with r = pi_ref / pi_theta = 1/2,
    k3 = 1/2 - 1 + ln 2; with pi_theta = pi_old it is k3 exactly, clamp included."""
    logp = torch.tensor([0.5, 0.2], dtype=torch.float64).log()
    old = torch.tensor([0.25, 0.4], dtype=torch.float64).log()
    ref = torch.tensor([0.25, 0.1], dtype=torch.float64).log()
    k3 = 0.5 - 1 + math.log(2)
    got = policy_kl(logp, ref, "k3-ratio", old_logp=old)
    torch.testing.assert_close(got, torch.tensor([2 * k3, 0.5 * k3], dtype=torch.float64))
    assert got[0].item() == pytest.approx(2 * math.log(2) - 1, abs=1e-12)
    x = torch.tensor([0.0, -1.0, -2.0, -30.0], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([-30.0, -1.5, -0.5, 0.0], dtype=torch.float64)
    for clamp in (None, 10.0):
        a = policy_kl(x, r, "k3-ratio", clamp=clamp, old_logp=x.detach())
        assert torch.equal(a, policy_kl(x, r, "k3", clamp=clamp))                       # same values
    a = policy_kl(x, r, "k3-ratio", clamp=None, old_logp=x.detach())
    (g,) = torch.autograd.grad(a.sum(), x)                       # the ratio's gradient is kept:
    torch.testing.assert_close(g, a.detach() + 1 - (r - x.detach()).exp())            # k3 + (1 - r)
    with pytest.raises(ValueError, match="old_logp"):
        policy_kl(x, r, "k3-ratio")


def test_k3_ratio_on_pi_old_samples_is_unbiased_in_value_and_gradient():
    """Exact expectation over tokens sampled from pi_old = O (not pi_theta = P): E_O[(P/O) k3] =
    KL(P||Q), and its gradient is grad KL(P||Q) (k3's own is the other direction's, and its value
    on pi_old's tokens is biased); also on-policy, O = P with old_logp = logp.detach()."""
    O = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.4], dtype=torch.float64)                 # pi_old
    for old in (O, P):
        theta = P.log().clone().requires_grad_(True)
        logp = torch.log_softmax(theta, 0)
        old_logp = logp.detach() if old is P else old.log()
        value = (old * policy_kl(logp, Q.log(), "k3-ratio", old_logp=old_logp)).sum()
        assert value.item() == pytest.approx(KL_PQ, abs=1e-12)
        value.backward()
        torch.testing.assert_close(theta.grad, _kl_grad("reverse"))
    assert abs((O * policy_kl(P.log(), Q.log(), "k3")).sum().item() - KL_PQ) > 0.3     # plain k3 on O: biased


def test_k3_ratio_in_the_loss_and_its_limits():
    kw = dict(_inputs(), weights=None)
    loss, stats = rl_loss(make_algo("grpo", kl="k3-ratio"), **kw)
    want = aggregate(policy_kl(kw["logp"], kw["ref_logp"], "k3-ratio", 10.0, kw["old_logp"]), kw["resp_mask"])
    assert stats["policy_kl"].item() == pytest.approx(want.item())
    assert stats["policy_kl"].item() != pytest.approx(rl_loss(make_algo("grpo"), **kw)[1]["policy_kl"].item())
    assert "kl_clamp" not in unused_fields(make_algo("grpo", kl="k3-ratio"))
    with pytest.raises(ValueError, match="k3-ratio"):
        make_algo("rloo", kl="k3-ratio")                                  # the KL in the reward: ratio 1
    with pytest.raises(ValueError):
        make_algo("erpo", qkl_estimator="k3-ratio")                       # prompts are not sampled


# -----------------------------------------------------------------------------
# Group advantages

def test_group_advantages_hand_values():
    for kind, cases in ADVANTAGE_CASES.items():               # [1,0,0,1]: unbiased std (GRPO), R - mean, RLOO
        for rewards, G, want in cases:
            torch.testing.assert_close(group_advantages(torch.tensor(rewards), G, kind), torch.tensor(want))
    for kind in ("grpo", "drgrpo", "rloo"):
        # all-equal groups, float rewards like 0.1 (format-only) too, give exactly zero
        for rewards, G, zero_rows in CONSTANT_GROUPS:
            assert (group_advantages(torch.tensor(rewards), G, kind)[:zero_rows] == 0).all()


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="whole number of groups"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="one of"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_maxrl_advantages_by_hand():
    """MaxRL: A_i = (R_i - mean) / mean (eps = 0), 0 for unsolved and all-solved groups."""
    R = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    want = torch.tensor([3.0, -1, -1, -1, 1, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0])
    assert torch.equal(group_advantages(R, 4, "maxrl", eps=0.0), want)
    got = group_advantages(R, 4, "maxrl")                                 # eps 1e-6: (R - mean) / (mean + eps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert got[0].item() == pytest.approx(0.75 / (0.25 + 1e-6)) and (got[8:] == 0).all()
    torch.testing.assert_close(group_advantages(torch.tensor([0.9, 0.1]), 2, "maxrl", eps=0.0),
                               torch.tensor([0.8, -0.8]))                 # (0.9 - 0.5) / 0.5
    with pytest.raises(ValueError, match=">= 0"):
        group_advantages(torch.tensor([1.0, -1.0]), 2, "maxrl")
    for name in ("dapo", "rloo"):                                         # overlong / KL in the reward
        with pytest.raises(ValueError, match="maxrl"):
            make_algo(name, adv="maxrl")
    assert make_algo("rloo-erpo", adv="maxrl").adv == "maxrl"


def test_maxrl_gradient_is_grad_of_the_maxrl_objective():
    """Exact expectation over all G-tuples from a categorical policy (outcomes 0, 1 correct; p = 0.1):
    E[(1/G) sum_i A_i grad log pi(y_i)] = (1 - (1-p)^(G-1)) grad log p = grad J^(G-1), MaxRL's
    truncated objective J^(N) = -sum_{k<=N} (1-p)^k / k (-> log p); G = 2 gives grad p (REINFORCE).
    With A_i = -1 kept in unsolved groups (the mean-score control variate there too) it is
    (1 - (1-p)^G) grad log p = grad J^(G)."""
    import itertools
    pi = torch.tensor([0.05, 0.05, 0.5, 0.4], dtype=torch.float64)
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    theta_p = pi.log().clone().requires_grad_(True)
    p = (torch.softmax(theta_p, 0) * correct).sum()
    (grad_p,) = torch.autograd.grad(p, theta_p)
    q = 1 - p.item()
    for G in (2, 3, 5):
        theta = pi.log().clone().requires_grad_(True)
        logpi = torch.log_softmax(theta, 0)
        total, kept = 0.0, 0.0
        for ys in itertools.product(range(4), repeat=G):
            ys = torch.tensor(ys)
            A = group_advantages(correct[ys], G, "maxrl", eps=0.0).double()
            weight = pi[ys].prod() / G
            total = total + weight * (A * logpi[ys]).sum()
            kept = kept + weight * ((A if correct[ys].any() else -torch.ones(G)) * logpi[ys]).sum()
        (got,) = torch.autograd.grad(total, theta, retain_graph=True)
        (got_kept,) = torch.autograd.grad(kept, theta)
        torch.testing.assert_close(got, (1 - q ** (G - 1)) * grad_p / p.item())
        torch.testing.assert_close(got_kept, (1 - q ** G) * grad_p / p.item())
        if G == 2:
            torch.testing.assert_close(got, grad_p)


def _loop_advantages(rewards, G, kind, eps=1e-6):
    out = []
    for k in range(0, len(rewards), G):
        g = rewards[k:k + G]
        mean = sum(g) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (G - 1))
        for x in g:
            if all(y == g[0] for y in g):
                out.append(0.0)
            elif kind == "grpo":
                out.append((x - mean) / (std + eps))
            elif kind == "drgrpo":
                out.append(x - mean)
            else:
                out.append(x - (sum(g) - x) / (G - 1))                    # leave-one-out mean
    return out


def test_group_advantages_loop_equivalence():
    rng = random.Random(0)
    for G in (2, 3, 4, 8, 16):
        for n_groups in (1, 3, 7):
            rewards = []
            for _ in range(n_groups):
                style = rng.choice(["binary", "float", "const"])
                if style == "binary":
                    rewards += [float(rng.random() < 0.4) for _ in range(G)]
                elif style == "float":
                    rewards += [rng.choice([0.0, 0.1, 0.9, 1.0]) + rng.random() * 0.01 for _ in range(G)]
                else:
                    rewards += [0.9] * G
            for kind in ("grpo", "drgrpo", "rloo"):
                got = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, kind)
                want = torch.tensor(_loop_advantages(rewards, G, kind), dtype=torch.float32)
                assert_rounding("losses.group_advantages_vs_loop", got, want)


def test_nonconstant_groups():
    r = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 0.9, 0.9, 0.9, 0.9, 0, 0, 0, 1])
    assert nonconstant_groups(r, 4).tolist() == [True, False, False, True]


def test_overlong_penalty_boundaries():
    L = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    got = overlong_penalty(L, max_len=20, cache_len=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty(L, max_len=20, cache_len=0)


def test_kl_penalized_rewards():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = kl_penalized_rewards(torch.tensor([1.0, 0.0]), logp, ref, mask, beta=0.1)
    # k1 = logp - ref summed over the mask: row0 0.5 - 1 + 0 = -0.5, row1 0.5 + 0.5 = 1.0
    torch.testing.assert_close(out, torch.tensor([1.05, -0.1]))
    assert not out.requires_grad


# -----------------------------------------------------------------------------
# Query-KL and Proposition 1

def test_query_kl_mask_and_zero():
    logp, ref, mask = query_kl_case()
    assert (query_kl(logp, logp.clone(), mask) == 0).all()
    base = query_kl(logp, ref, mask)
    assert (base > 0).all()
    changed = logp.clone()
    changed[0, 0] -= 5.0                                                 # unmasked positions only
    changed[0, 4] += 1.0
    changed[2, 3] -= 2.0
    torch.testing.assert_close(query_kl(changed, ref, mask), base)
    changed[0, 2] -= 1.0                                                  # a masked one does count
    assert not torch.allclose(query_kl(changed, ref, mask)[0], base[0])
    # per-sequence token mean of the k3 values
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(base[1], k3[1, 1:].mean())
    logp, ref, mask, want = QUERY_KL_HAND
    torch.testing.assert_close(query_kl(logp, ref, mask), torch.tensor(want))


def _tiny_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def _token_logp(model, ids):
    """(B, L) ids -> (B, L-1) log p(ids[:, t+1] | ids[:, :t+1]) from ONE forward pass."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_proposition1_query_kl_gradient_ignores_responses():
    model = _tiny_lm()
    P_len, R_len, B = 7, 6, 2
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50, (B, P_len), generator=g)
    resp_a = torch.randint(0, 50, (B, R_len), generator=g)
    resp_b = torch.randint(0, 50, (B, R_len), generator=g)
    ref_prompt_logp = -torch.rand(B, P_len - 1, generator=g) * 4 - 1     # fixed "cached" reference
    prompt_mask = torch.ones(B, P_len - 1)                                 # prompt tokens after the first
    adv = torch.tensor([1.0, -1.0])
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(resp, term):
        model.zero_grad()
        lp = _token_logp(model, torch.cat([prompt, resp], 1))             # one pass over prompt+response
        prompt_lp, resp_lp = lp[:, :P_len - 1], lp[:, P_len - 1:]
        if term == "qkl":
            loss = aggregate(query_kl(prompt_lp, ref_prompt_logp, prompt_mask), None, "seq-mean")
        else:
            loss = aggregate(ppo_loss(resp_lp, resp_lp.detach(), adv)[0], torch.ones_like(resp_lp))
        loss.backward()
        return torch.cat([p.grad.flatten() for p in params]).clone(), prompt_lp.detach()

    q_a, prompt_lp_a = grads(resp_a, "qkl")
    q_b, prompt_lp_b = grads(resp_b, "qkl")
    assert q_a.abs().max() > 0
    assert_rounding("losses.query_kl_grad_independent_of_response", q_a, q_b)
    assert_rounding("losses.prompt_logp_independent_of_response", prompt_lp_a, prompt_lp_b)
    # the prompt slice of the joint pass equals a prompt-only pass (no extra forward is needed)
    assert_rounding("losses.joint_vs_prompt_only_pass", prompt_lp_a, _token_logp(model, prompt))
    pg_a, _ = grads(resp_a, "pg")
    pg_b, _ = grads(resp_b, "pg")
    assert (pg_a - pg_b).abs().max() > 1e-4                               # the response term does see them


# -----------------------------------------------------------------------------
# Query weights

def test_query_weights():
    for nll, mean_nll, clip, want in QUERY_WEIGHT_CASES:     # [3, 6] -> [1.5, 0.75]; the paper's clip [0, 2]
        torch.testing.assert_close(query_weights(torch.tensor(nll), mean_nll=mean_nll, clip=clip),
                                   torch.tensor(want))
    nll = torch.tensor([2.0, 4.0], requires_grad=True)
    assert not query_weights(nll).requires_grad
    with pytest.raises(ValueError, match="log-likelihood"):
        query_weights(torch.tensor([-3.0, 1.0]))


# -----------------------------------------------------------------------------
# PPO surrogate

def _ppo(ratio, A, **kw):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, clipped = ppo_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([A], dtype=torch.float64), **kw)
    loss.sum().backward()
    return loss.item(), bool(clipped.item()), logp.grad.item()


def test_ppo_loss_cases():
    # A > 0: upper clip at 1 + eps_high; A < 0: lower clip at 1 - eps_low, and dual clip bounds the
    # loss at c * |A|; a clipped token's gradient is exactly 0
    for ratio, A, kw, loss, clipped, grad in PPO_CASES:
        got = _ppo(ratio, A, **kw)
        assert got[:2] == (pytest.approx(loss), clipped), (ratio, A, kw)
        if grad is not None:
            assert got[2] == (0.0 if grad == 0 else pytest.approx(grad)), (ratio, A, kw)


def test_clip_masks_mark_the_ratio_outside_the_range_whatever_the_advantage():
    ratio = torch.tensor([[0.5, 0.79, 0.81, 1.0, 1.29, 1.31, 2.0, 3.5]], dtype=torch.float64)
    for A in (1.0, -1.0):                    # low / high do not depend on the advantage's sign
        m = clip_masks(ratio, torch.tensor([A], dtype=torch.float64), eps_low=0.2, eps_high=0.3, dual_clip=3.0)
        assert m["low"].tolist() == [[True, True, False, False, False, False, False, False]]
        assert m["high"].tolist() == [[False, False, False, False, False, True, True, True]]
        assert m["dual"].tolist() == [[False] * 7 + [A < 0]]       # r = 3.5 > c = 3, and only for A < 0
    # the dual mask is where ppo_loss bounded the loss at c * |A|
    for r in (2.0, 2.9, 3.1, 10.0):
        loss, _ = ppo_loss(torch.tensor([[math.log(r)]]), torch.zeros(1, 1), torch.tensor([-1.5]))
        dual = clip_masks(torch.tensor([[r]]), torch.tensor([-1.5]))["dual"]
        assert bool(dual) == (loss.item() == pytest.approx(4.5) and r > 3)
    assert not clip_masks(ratio, torch.tensor([-1.0], dtype=torch.float64), dual_clip=None)["dual"].any()


def test_gspo_is_the_clipped_sequence_ratio_with_gspos_gradient():
    """GSPO-token aggregated seq-mean-token-mean = GSPO written per sequence: value and gradient,
    clipped sequences included (a wide range here, so that some are clipped and some not)."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp0 = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.tensor([7, 5, 3, 7, 1, 6])[:, None]).double()
    A = torch.tensor([1.0, -0.5, -2.0, 1.5, -0.7, 0.2], dtype=torch.float64)
    algo = ALGOS["gspo"].__class__(**{**vars(ALGOS["gspo"]), "eps_low": 0.05, "eps_high": 0.08})

    logp = logp0.clone().requires_grad_(True)
    sur = SURROGATES["gspo"].fn(logp, old, A, mask, algo)
    aggregate(sur.loss, mask, "seq-mean-token-mean").backward()

    ref = logp0.clone().requires_grad_(True)
    s = torch.exp(((ref - old) * mask).sum(-1) / mask.sum(-1))          # (B,) sequence ratio
    per_seq = -torch.minimum(s * A, s.clamp(1 - 0.05, 1 + 0.08) * A)
    per_seq.mean().backward()

    torch.testing.assert_close(aggregate(sur.loss, mask, "seq-mean-token-mean"), per_seq.mean().detach())
    torch.testing.assert_close(logp.grad, ref.grad)
    clipped_seq = (s.clamp(1 - 0.05, 1 + 0.08) * A < s * A).detach()    # where -min picks the clipped term
    assert 0 < int(clipped_seq.sum()) < B                               # both kinds of sequence occur
    assert torch.equal(sur.stats["clip_frac"].any(-1), clipped_seq) and torch.allclose(sur.ratio, s.detach()[:, None].expand(B, T))


def test_ppo_advantage_broadcast():
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    A = torch.tensor([1.0, -2.0, 0.5])
    a, ca = ppo_loss(logp, old, A)
    b, cb = ppo_loss(logp, old, A[:, None].expand(3, 5))
    torch.testing.assert_close(a, b)
    assert torch.equal(ca, cb)


# -----------------------------------------------------------------------------
# Aggregation: micro-batching with global denominators == one big batch

def _batch(seed=0, B=8, T=9):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return theta, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_microbatch_invariance(mode):
    theta, mask = _batch()
    def f(t):                                                            # any per-token loss
        return torch.sin(t) * t ** 2
    full = aggregate(f(theta), mask, mode, max_len=9)
    (g_full,) = torch.autograd.grad(full, theta)
    denom = dict(num_tokens=mask.sum(), num_seqs=mask.shape[0], max_len=9)
    total, naive = 0.0, 0.0
    for sl in (slice(0, 1), slice(1, 3), slice(3, 8)):                  # uneven micro-batches
        total = total + aggregate(f(theta[sl]), mask[sl], mode, **denom)
        naive = naive + aggregate(f(theta[sl]), mask[sl], mode, max_len=9) / 3
    (g_micro,) = torch.autograd.grad(total, theta)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_micro, g_full)
    assert abs(naive.item() - full.item()) > 1e-3                        # per-micro-batch means would differ


def test_aggregate_hand_values_and_errors():
    v = torch.tensor([[1.0, 2.0, 99.0], [3.0, float("nan"), float("nan")]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx(2.0)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregate(v, m, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(6.0 / 8)
    assert aggregate(torch.tensor([1.0, 3.0]), None, "seq-mean", num_seqs=4).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(v, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq-mean"):
        aggregate(torch.tensor([1.0]), None, "token-mean")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(v, m, "mean")


# -----------------------------------------------------------------------------
# The algorithm table and rl_loss

def _inputs(seed=0, B=4, Tr=6, Tp=5):
    g = torch.Generator().manual_seed(seed)
    def lp(*s):
        return -torch.rand(*s, generator=g, dtype=torch.float64) * 3
    logp = lp(B, Tr).requires_grad_(True)
    prompt_logp = lp(B, Tp).requires_grad_(True)
    resp_mask = (torch.arange(Tr)[None] < torch.tensor([6, 3, 4, 1])[:, None]).long()
    prompt_mask = torch.ones(B, Tp, dtype=torch.long)
    prompt_mask[:, 0] = 0
    return dict(logp=logp, old_logp=logp.detach() + 0.1 * lp(B, Tr), ref_logp=lp(B, Tr),
                resp_mask=resp_mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
                weights=torch.tensor([1.5, 0.5, 1.0, 2.0], dtype=torch.float64),
                prompt_logp=prompt_logp, prompt_ref_logp=lp(B, Tp), prompt_mask=prompt_mask,
                num_tokens=resp_mask.sum(), num_seqs=B, max_len=Tr)


def _grads(name, **changes):
    algo = ALGOS[name]
    kw = _inputs()
    if algo.weights == "none":
        kw["weights"] = None
    kw.update(changes)
    loss, stats = rl_loss(algo, **kw)
    g1, g2 = torch.autograd.grad(loss, [kw["logp"], kw["prompt_logp"]], allow_unused=True)
    def zero(g, like):
        return torch.zeros_like(like) if g is None else g
    return torch.cat([zero(g1, kw["logp"]).flatten(), zero(g2, kw["prompt_logp"]).flatten()]), stats


def _other_ref(key):
    return _inputs(seed=5)[key]


@pytest.mark.parametrize("name", [n for n, a in ALGOS.items() if not a.has_policy_kl_loss])
def test_algos_without_policy_kl_term(name):
    base, _ = _grads(name)
    torch.testing.assert_close(_grads(name, ref_logp=_other_ref("ref_logp"))[0], base)
    torch.testing.assert_close(_grads(name, ref_logp=None)[0], base)


@pytest.mark.parametrize("name", [n for n, a in ALGOS.items() if a.has_policy_kl_loss])
def test_algos_with_policy_kl_term(name):
    base, stats = _grads(name)
    assert (_grads(name, ref_logp=_other_ref("ref_logp"))[0] - base).abs().max() > 1e-6
    torch.testing.assert_close(_grads(name, prompt_ref_logp=_other_ref("prompt_ref_logp"))[0], base)
    assert "query_kl" in stats                                           # still reported (Table 3)
    with pytest.raises(ValueError, match="ref_logp"):
        _grads(name, ref_logp=None)


@pytest.mark.parametrize("name", [n for n, a in ALGOS.items() if a.alpha > 0])
def test_algos_with_query_kl_term(name):
    base, _ = _grads(name)
    assert (_grads(name, prompt_ref_logp=_other_ref("prompt_ref_logp"))[0] - base).abs().max() > 1e-6


def test_weights_scale_pg_only():
    assert ALGOS["erpo"].weights == ALGOS["grpo-star"].weights == "paper"
    assert ALGOS["qkl"].weights == ALGOS["grpo"].weights == "none"
    base, _ = _grads("erpo")
    assert (_grads("erpo", weights=torch.ones(4, dtype=torch.float64))[0] - base).abs().max() > 1e-6
    # with zero advantages only the Query-KL term is left: the weights must not touch it
    zero_adv = dict(advantages=torch.zeros(4, dtype=torch.float64))
    g_w, _ = _grads("erpo", **zero_adv)
    g_1, _ = _grads("erpo", weights=torch.ones(4, dtype=torch.float64), **zero_adv)
    assert g_w.abs().max() > 0
    torch.testing.assert_close(g_w, g_1)
    with pytest.raises(ValueError, match="weights"):
        _grads("erpo", weights=None)


def test_rl_loss_on_policy_values():
    kw = _inputs()
    kw.update(old_logp=kw["logp"].detach(), ref_logp=kw["logp"].detach(), weights=None,
              prompt_ref_logp=kw["prompt_logp"].detach())
    loss, stats = rl_loss(ALGOS["grpo"], **kw)
    # on-policy ratio 1, KL 0: loss = -(token-weighted mean advantage) = -(6*1 - 3 + 4*.5 - .5)/14
    assert loss.item() == pytest.approx(-(6 - 3 + 2 - 0.5) / 14)
    assert stats["policy_kl"].item() == 0 and stats["query_kl"].item() == 0 and stats["clip_frac"].item() == 0
    assert all(not v.requires_grad for v in stats.values())


def test_make_algo():
    for name in ALGOS:
        assert make_algo(name) == ALGOS[name] and ALGOS[name].doc
    a = make_algo("grpo", eps_high=0.28, alpha=None, beta=None)
    assert a.eps_high == 0.28 and a.beta == 0.01 and a.alpha == 0.0
    assert make_algo("grpo", kl="none").kl is None
    assert make_algo("grpo", dual_clip="none").dual_clip is None
    assert make_algo("erpo", weights="code").weights == "code"
    assert make_algo("erpo", kl="k3", beta=0.01).has_policy_kl_loss
    bad = [("foo", {}), ("grpo", {"adv": "ppo"}), ("grpo", {"weights": "yes"}), ("grpo", {"agg": "mean"}),
           ("grpo", {"kl": "k4"}), ("grpo", {"kl_in": "both"}), ("grpo", {"dual_clip": 0.5}),
           ("grpo", {"beta": -1.0}), ("grpo", {"betaa": 0.1}), ("erpo", {"beta": 0.05})]
    for name, kw in bad:
        with pytest.raises(ValueError):
            make_algo(name, **kw)
    with pytest.raises(ValueError, match="drgrpo"):                       # message lists allowed values
        make_algo("grpo", adv="ppo")


def test_algo_table_parts():
    A = ALGOS
    assert A["grpo"] == Algo(doc=A["grpo"].doc)                            # grpo = the defaults
    assert A["grpo"].has_policy_kl_loss and A["grpo"].kl == "k3" and A["grpo"].alpha == 0
    assert (A["grpo"].eps_low, A["grpo"].eps_high, A["grpo"].dual_clip) == (0.2, 0.3, 3.0)
    for n in ("erpo", "qkl", "dapo-erpo", "rloo-erpo"):
        assert A[n].alpha == 0.01 and not A[n].has_policy_kl_loss
    d = A["dapo"]
    assert (d.eps_high, d.dual_clip, d.dynamic_sampling, d.overlong, d.kl) == (0.28, None, True, True, None)
    assert A["dapo-erpo"].dynamic_sampling and A["dapo-erpo"].weights == "paper"
    assert (A["drgrpo"].adv, A["drgrpo"].agg, A["drgrpo"].eps_high) == ("drgrpo", "seq-mean-token-sum-norm", 0.2)
    assert (A["rloo"].adv, A["rloo"].kl_in, A["rloo"].kl, A["rloo"].beta) == ("rloo", "reward", "k1", 0.01)
    assert A["rloo-erpo"].adv == "rloo"


def test_unused_fields_and_weight_clip():
    from losses import unused_fields
    assert {"kl", "kl_in", "beta"} <= unused_fields(ALGOS["erpo"]) and "kl_clamp" not in unused_fields(ALGOS["erpo"]) and \
        "qkl_estimator" not in unused_fields(ALGOS["erpo"]) and "weight_clip" not in unused_fields(ALGOS["erpo"])
    assert {"qkl_estimator", "weight_clip", "overlong_cache"} <= unused_fields(ALGOS["grpo"])
    assert "kl" not in unused_fields(ALGOS["grpo"]) and "overlong_cache" not in unused_fields(ALGOS["dapo"])
    assert "kl" not in unused_fields(make_algo("erpo", kl="k2", beta=0.01))            # ERPO + Policy-KL
    assert make_algo("erpo", weight_clip=[0.5, 1.5]).weight_clip == (0.5, 1.5)
    with pytest.raises(ValueError, match="weight_clip"):
        make_algo("erpo", weight_clip=(1.0, 0.5))


# -----------------------------------------------------------------------------
# The advantage table, pass@k, the signal rule, the adaptive entropy coefficient

def test_every_advantage_is_a_row_of_the_table_and_its_knobs_are_beside_it():
    assert set(losses.ADVANTAGES) == {"grpo", "drgrpo", "rloo", "batch-std", "reinforce++", "maxrl", "passk"}
    assert losses.BATCH_ADVANTAGES == ("batch-std", "reinforce++")
    for kind in ("drgrpo", "rloo"):                                       # they read no epsilon
        assert "adv_eps" in unused_fields(make_algo("grpo", adv=kind))
    for kind in ("grpo", "batch-std", "reinforce++", "maxrl", "passk"):
        assert "adv_eps" not in unused_fields(make_algo("grpo", adv=kind))
    for name in ("dapo", "rloo"):                                          # success rewards: no shaping
        with pytest.raises(ValueError, match="passk"):
            make_algo(name, adv="passk")


def test_passk_advantages_by_hand():
    """Chen et al. 2025's closed form, G = 4, k = 2: one correct row -> mean 1 - C(3,2)/C(4,2) = 1/2,
    std 1/2, A_pos = 1, A_neg = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3; two -> mean 5/6, std sqrt(5)/6,
    A = +-1/sqrt(5); three -> mean 1, std 0: every row 0; none or all: 0."""
    R = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    s = 5 ** -0.5
    want = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, s, s, -s, -s] + [0.0] * 12)
    got = group_advantages(R, 4, "passk", eps=0.0, options={"passk_k": 2})
    torch.testing.assert_close(got, want)
    A_pos = group_advantages(R[:4], 4, "passk", options={"passk_k": 2})[0].item()   # eps 1e-6, as the
    assert A_pos == pytest.approx(0.5 / (0.5 + 1e-6), rel=1e-6)                     # released code
    assert (got[8:] == 0).all()
    for g in got.view(-1, 4):                                             # c A_pos + N_neg A_neg = 0
        assert abs(g.sum().item()) < 1e-6
    pop = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.75 * 0.25) ** 0.5  # k = 1: GRPO, population std
    torch.testing.assert_close(group_advantages(R[:4], 4, "passk", 0.0, options={"passk_k": 1}), pop)
    assert (group_advantages(R, 4, "passk", options={"passk_k": 4}) == 0).all()  # k = G: one correct = 1
    torch.testing.assert_close(group_advantages(R[:4], 4, "passk"),                # the default k is 4
                               group_advantages(R[:4], 4, "passk", options={"passk_k": 4}))
    with pytest.raises(ValueError, match="passk_k"):
        group_advantages(R, 4, "passk", options={"passk_k": 5})
    with pytest.raises(ValueError, match="binary"):
        group_advantages(torch.tensor([1.0, 0.1, 0, 0]), 4, "passk", options={"passk_k": 2})


def test_a_signal_is_an_advantage_above_the_reward_scales_epsilon():
    """losses.carries_signal: |A_i| > 1e-6 * max(1, the group's largest |R|)."""
    R = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.0, 5e6, 5e6, 5e6, 5e6 + 1])
    A = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5, 6.0, 6.0, 6.0, 6.0])
    assert losses.carries_signal(A, R, 4).tolist() == [False] * 4 + [True] * 8
    A[:4] = 5e-7                                                          # round-off of shaped rewards
    assert not losses.carries_signal(A, R, 4)[:4].any()
    assert not losses.carries_signal(A[8:] / 2, R[8:], 4).any()          # 3 < 1e-6 * 5e6

