"""Hand-value cases of the loss functions, shared by tests/test_losses.py (the repo's functions) and
labs/grade.py (the lab's exercises, graded on the same cases). Data only: each test file asserts.

Values are worked out by hand in the comments; the exact toy categorical gives both KL directions.
"""

import math

import torch

# -----------------------------------------------------------------------------
# KL: a 5-category toy where both KL directions are exact and clearly different (method.md §8)

P = torch.tensor([0.70, 0.10, 0.10, 0.05, 0.05], dtype=torch.float64)    # pi_theta
Q = torch.tensor([0.05, 0.20, 0.25, 0.25, 0.25], dtype=torch.float64)    # pi_ref
KL_PQ = float((P * (P / Q).log()).sum())                                  # KL(pi_theta || pi_ref) ~ 1.53
KL_QP = float((Q * (Q / P).log()).sum())                                  # KL(pi_ref || pi_theta) ~ 1.04

# k3 per token, (log pi_theta, log pi_ref, k3): log r = log pi_ref - log pi_theta, k3 = r - 1 - log r
K3_CASES = [
    (math.log(0.5), math.log(0.25), 0.5 - 1 + math.log(2)),              # r = 1/2: 0.1931
    (math.log(0.25), math.log(0.5), 2 - 1 - math.log(2)),                # r = 2:   0.3069 (the other sign)
    (math.log(0.3), math.log(0.3), 0.0),                                  # r = 1:   0
    (-3.0, -1.0, math.exp(2) - 1 - 2),                                    # log r = 2: 4.389
]

# -----------------------------------------------------------------------------
# Group advantages (method.md §8.2): (rewards, G, expected) per estimator

_A = 0.5 / (math.sqrt(1 / 3) + 1e-6)                                      # unbiased std of [1,0,0,1]
ADVANTAGE_CASES = {
    "grpo": [([1.0, 0.0, 0.0, 1.0], 4, [_A, -_A, -_A, _A]),
             # two groups of 3: [1, 0, 0] has mean 1/3, unbiased std sqrt(1/3); [1, 1, 1] is all equal
             ([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 3,
              [(2 / 3) / (math.sqrt(1 / 3) + 1e-6), (-1 / 3) / (math.sqrt(1 / 3) + 1e-6),
               (-1 / 3) / (math.sqrt(1 / 3) + 1e-6), 0.0, 0.0, 0.0])],
    "drgrpo": [([1.0, 0.0, 0.0, 1.0], 4, [0.5, -0.5, -0.5, 0.5])],
    "rloo": [([1.0, 0.0, 0.0, 1.0], 4, [2 / 3, -2 / 3, -2 / 3, 2 / 3])],
}
# groups whose rewards are all equal get EXACTLY 0: (rewards, G, how many leading rows must be 0).
# Float rewards like 0.1 (format-only) or 0.9 leave round-off in R - mean that, divided by a ~0 std,
# gives ~0.007 or ~0.06, not 0. The last case's second group is not constant (a mixed batch).
CONSTANT_GROUPS = [([1.0] * 4, 4, 4), ([0.1] * 8, 8, 8), ([0.9] * 8 + [1.0, 0.0] * 4, 8, 8)]

# -----------------------------------------------------------------------------
# Query-KL (method.md §3): per-prompt mean of k3 over the masked prompt tokens


def query_kl_case():
    """(logp, ref_logp, mask) (3, 6), random but seeded; row 1's mask covers tokens 1..5."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 6, generator=g) * 3
    ref = -torch.rand(3, 6, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]])
    return logp, ref, mask


# by hand: row 0 has tokens with r = 1/2 and r = 2 (k3 0.1931, 0.3069: mean 0.25) and a masked junk
# token; row 1 one token with r = 1 (0)
QUERY_KL_HAND = (torch.tensor([[math.log(0.5), math.log(0.25), -50.0], [-1.0, -7.0, -7.0]]),   # logp
                 torch.tensor([[math.log(0.25), math.log(0.5), -1.0], [-1.0, -2.0, -3.0]]),    # ref_logp
                 torch.tensor([[1, 1, 0], [1, 0, 0]]),                                          # mask
                 [0.25, 0.0])                                                                   # expected

# -----------------------------------------------------------------------------
# Query weights (method.md §4): (nll, mean_nll, clip, expected weights)

QUERY_WEIGHT_CASES = [
    ([3.0, 6.0], None, None, [1.5, 0.75]),                                # code: s-bar = batch mean 4.5
    ([0.1, 1.0, 4.0, 1000.0], 1.0, (0.0, 2.0), [2.0, 1.0, 0.25, 0.001]),  # paper: clip(s-bar / s_i, 0, 2)
]

# -----------------------------------------------------------------------------
# PPO-clip with dual-clip (method.md §8.3), one token: (ratio, A, kwargs, loss, clipped, d loss / d logp)
# defaults eps_low 0.2, eps_high 0.3, dual_clip 3; None: not checked. A clipped token's gradient is 0.

PPO_CASES = [
    (1.0, 2.0, {}, -2.0, False, -2.0),                 # on-policy: -r A, gradient -r A
    (1.0, -2.0, {}, 2.0, False, None),
    (1.25, 1.0, {}, -1.25, False, None),               # A > 0: upper clip at 1 + eps_high = 1.3
    (1.25, 1.0, {"eps_high": 0.2}, -1.2, True, None),
    (1.5, 1.0, {}, -1.3, True, 0.0),
    (0.5, 1.0, {}, -0.5, False, None),                 # A > 0 is never clipped from below
    (0.5, -1.0, {}, 0.8, True, 0.0),                   # A < 0: lower clip at 1 - eps_low = 0.8
    (0.7, -1.0, {"eps_low": 0.4}, 0.7, False, None),
    (2.0, -1.5, {}, 3.0, False, None),                 # A < 0, r > 1: not clipped (below c |A| = 4.5)
    (100.0, -1.5, {}, 4.5, True, 0.0),                 # dual clip bounds the loss at c |A|
    (100.0, -1.5, {"dual_clip": None}, 150.0, False, None),
    (100.0, 1.5, {}, -1.95, True, None),               # dual clip is for A < 0 only
]
