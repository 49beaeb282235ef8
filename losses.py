"""
The losses: GRPO, Dr.GRPO, DAPO, RLOO and ERPO as small pure functions side by side.

Read top to bottom, the whole difference between GRPO and ERPO is visible in `rl_loss` at the end:

    GRPO:  loss = PG(A)      + beta  * PolicyKL_k3(response tokens)        (method.md §5, §8)
    ERPO:  loss = PG(A * w)  + alpha * QueryKL_k3(prompt tokens)           (method.md §2-§4)

where A is the group advantage, w the per-query weight (method.md §4) and both KLs are the k3
estimator, one over the response tokens against the reference policy, one over the *prompt*
tokens against the reference model's (cached) prompt log-likelihoods.

Conventions (every function):
  B = sequences (responses) in this micro-batch, T = padded length, G = responses per prompt.
  logp = log pi_theta(token | prefix) of the token that was actually there, shape (B, T).
  Masks are 0/1 tensors of the same shape; padded positions must hold finite values.
  Rows of a group are consecutive: rows [k*G, (k+1)*G) are the G responses to prompt k.

The policy-gradient term PG is a surrogate of the table `SURROGATES` below (PPO-clip for every row
here but GSPO; CISPO, SAPO). This file imports only torch and the standard library. § numbers refer
to docs/method.md, which writes out every equation implemented here.
"""

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable, NamedTuple

import torch

WEIGHT_KINDS = ("none", "paper", "code")
KL_PLACEMENTS = ("loss", "reward")
K3_CLAMP = 10.0  # EasyR1 "low_var_kl" and the released ERPO code clamp per-token k3 to [-10, 10]


# -----------------------------------------------------------------------------
# KL estimators (method.md §8, "KL estimators"): per-token estimates of KL(pi_theta || pi_ref) on
# tokens sampled from pi_theta, each a function of log r = ref_logp - logp and a row of KL_ESTIMATORS
# (a new one is a registered function: tests/test_extensions.py adds one from outside). The sign of
# log r matters: built as logp - ref_logp, k1 and k3 would estimate something else
# (tests/test_losses.py checks the direction on an exact toy categorical).

def k1(log_r):
    """-log r: unbiased for KL(pi_theta||pi_ref), high variance, can be < 0. As a LOSS its expected
    gradient is zero (E_pi[grad log pi] = 0), so k1 belongs in the reward (RLOO), not in the loss."""
    return -log_r


def k2(log_r):
    """(log r)^2 / 2: biased, >= 0, low variance. As a loss its expected gradient is
    grad KL(pi_theta||pi_ref): the gradient of the KL it estimates."""
    return 0.5 * log_r.square()


def k3(log_r):
    """r - 1 - log r: unbiased, >= 0, low variance (GRPO, EasyR1's "low_var_kl"). As a loss its
    expected gradient is grad KL(pi_ref||pi_theta), the *other* direction, since
    E_pi[(1 - r) grad log pi] = -sum_x pi_ref(x) grad log pi(x)."""
    return torch.exp(log_r) - 1.0 - log_r


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}


class _PolicyKLKinds:
    """The Policy-KL's choices (--kl): every estimator, and k3-ratio, which reads pi_old's log-probs
    (the Policy-KL in the loss only)."""
    def __iter__(self):
        return iter([*KL_ESTIMATORS, "k3-ratio"])

    def __contains__(self, kind):
        return kind in KL_ESTIMATORS or kind == "k3-ratio"

    def __repr__(self):
        return repr(tuple(self))


POLICY_KL_KINDS = _PolicyKLKinds()


def token_kl(logp, ref_logp, kind="k3", clamp=None):
    """Per-token KL_ESTIMATORS[kind] of log r = ref_logp - logp, each (...) tensors of the scored
    tokens' log-probs under pi_theta / pi_ref; the same shape back: the Policy-KL's (response tokens)
    and the Query-KL's (prompt tokens). clamp: None, or c > 0 to bound k3 to [-c, c] (EasyR1's
    low_var_kl and the released code: 10), its log r then bounded to [-20, 20] so exp() cannot
    overflow. Only k3 is clamped (method.md §10)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {tuple(KL_ESTIMATORS)}, got {kind!r}")
    log_r = ref_logp - logp
    if kind != "k3" or clamp is None:
        return KL_ESTIMATORS[kind](log_r)
    return k3(log_r.clamp(-20.0, 20.0)).clamp(-clamp, clamp)


def policy_kl(logp, ref_logp, kind="k3", clamp=None, old_logp=None):
    """Per-response-token Policy-KL: token_kl, or kind "k3-ratio": k3_ratio_kl, which also reads
    old_logp (pi_old's log-probs of the tokens)."""
    if kind == "k3-ratio":
        return k3_ratio_kl(logp, ref_logp, old_logp, clamp)
    if kind not in POLICY_KL_KINDS:
        raise ValueError(f"policy_kl kind must be one of {tuple(POLICY_KL_KINDS)}, got {kind!r}")
    return token_kl(logp, ref_logp, kind, clamp)


def k3_ratio_kl(logp, ref_logp, old_logp, clamp=None):
    """(pi_theta / pi_old) * k3 per token, on pi_old's tokens: DeepSeek-V3.2's bias correction
    (arXiv:2512.02556, Eq. 7), TRL's use_bias_correction_kl; the ratio is not detached, so its expected
    gradient is grad KL(pi_theta||pi_ref) (method.md §8.1)."""
    if old_logp is None:
        raise ValueError("policy_kl kind 'k3-ratio' needs old_logp (pi_old's log-probs of the tokens)")
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))           # pi_theta / pi_old, with grad
    return ratio * token_kl(logp, ref_logp, "k3", clamp)


def query_kl(logp, ref_logp, mask, kind="k3", clamp=K3_CLAMP):
    """Per-prompt Query-KL, ERPO's regularizer R_query = KL(rho_theta || rho_theta0) (method.md §2-3):
    the per-token estimate `kind` (token_kl; the paper's: k3) of the prompt tokens' log-probs logp
    (B, T), from the SAME forward that scores the responses, against the reference's ref_logp (B, T),
    averaged over each row's mask (prompt tokens after the first) -> (B,).
    Proposition 1 (structural decoupling): the gradient flows only through the prompt
    log-likelihoods; a causal LM's prompt log-probs do not see the response, so changing the responses
    leaves this term's gradient unchanged (tests/test_losses.py, with a tiny Qwen2)."""
    kl = token_kl(logp, ref_logp, kind, clamp=clamp)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def kl_penalized_rewards(rewards, logp, ref_logp, mask, beta, kind="k1"):
    """RLOO's KL placement: R_i - beta * sum_t kl_t over the response tokens (no gradient).

    rewards: (B,); logp, ref_logp, mask: (B, T) over response tokens. Returns (B,), detached.
    k1 is the usual choice here: it is unbiased for the sequence KL and, being in the reward, its
    zero-expected-gradient problem as a loss (see policy_kl) does not apply.
    """
    with torch.no_grad():
        kl = policy_kl(logp, ref_logp, kind) * mask.to(logp.dtype)
        return rewards.to(logp.dtype) - beta * kl.sum(-1)


# -----------------------------------------------------------------------------
# Advantages and batch shaping (method.md §8)

def _groups(x, group_size):
    """(B,) -> (n_groups, G) view, with a clear error when B is not a multiple of G."""
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D (B,) tensor of rewards, got shape {tuple(x.shape)}")
    if group_size < 1 or x.numel() % group_size != 0:
        raise ValueError(f"batch of {x.numel()} rewards is not a whole number of groups of {group_size}")
    return x.view(-1, group_size)


def group_advantages(rewards, group_size, kind="grpo", eps=1e-6, valid=None, reduce=None, options=None):
    """Advantages by the row `kind` of ADVANTAGES (--adv; method.md §8.2): rewards (B,), B = n_groups * G
    -> (B,). eps: Algo.adv_eps; options: the row's own (its OPTIONS' defaults where absent); valid,
    reduce: a batch row's (batch_moments). A group of equal rewards gets exactly 0 (where the row says
    so: all here), not the round-off of R - mean over a ~0 std."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage kind must be one of {tuple(ADVANTAGES)}, got {kind!r}")
    if group_size < 2:
        raise ValueError(f"group advantages need group_size >= 2 (the baseline comes from the other "
                         f"responses), got {group_size}")
    row = ADVANTAGES[kind]
    r = _groups(rewards.float(), group_size)                           # (n_groups, G)
    own = {opt[0]: opt[1] for opt in getattr(row, "OPTIONS", ())} | (options or {})
    moments = (lambda x: batch_moments(x, valid, reduce)) if getattr(row, "batch", False) else None
    adv = row.fn(AdvantageInputs(r, eps, moments, own))
    if getattr(row, "constant_is_zero", True):
        adv = adv.masked_fill(~nonconstant_groups(rewards, group_size)[:, None], 0.0)
    return adv.reshape(-1)


class AdvantageInputs(NamedTuple):
    rewards: torch.Tensor               # (n_groups, G) float32
    eps: float                          # Algo.adv_eps
    moments: Callable | None            # x (B,) -> (mean, std) over the whole batch (rows with batch=True)
    options: dict                       # the row's own options' values (passk_k)


@dataclass(frozen=True)
class AdvantageRow:
    fn: Callable[[AdvantageInputs], torch.Tensor]   # -> (n_groups, G) advantages
    doc: str                            # one line for --help
    knobs: frozenset = frozenset()      # the Algo fields fn reads (the table's others: unused_fields)
    batch: bool = False                 # reads the whole rollout batch's moments (inputs.moments)
    constant_is_zero: bool = True       # a group whose rewards are all equal gets exactly 0
    rewards: str = "any"                # "success" (>= 0) or "binary" (0/1): no shaping (validate_algo)
    OPTIONS: tuple = ()                 # its own options (rows as train.OPTIONS), inert for other rows


def _centred(r):
    return r - r.mean(dim=1, keepdim=True)


def grpo_advantages(x):                 # unbiased (Bessel) group std, torch.std's default, as verl, EasyR1
    return _centred(x.rewards) / (x.rewards.std(dim=1, keepdim=True) + x.eps)


def drgrpo_advantages(x):               # Dr.GRPO drops the std (which up-weights easy/hard prompts)
    return _centred(x.rewards)


def rloo_advantages(x):                 # R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean R)
    return _centred(x.rewards) * (x.rewards.shape[1] / (x.rewards.shape[1] - 1))


def batch_std_advantages(x):            # the group's mean, the batch's std (TRL's scale_rewards="batch")
    return _centred(x.rewards) / (x.moments(x.rewards.reshape(-1))[1] + x.eps)


def reinforce_pp_advantages(x):         # R - mean, whitened over the batch's responses (verl: its tokens)
    centred = _centred(x.rewards)
    mean, std = x.moments(centred.reshape(-1))
    return (centred - mean) / (std + x.eps)


def maxrl_advantages(x):
    """(R_i - mean R) / (mean R + eps), 0 where mean R <= 0: MaxRL (Tajwar et al., "Maximum Likelihood
    Reinforcement Learning", arXiv:2602.02710; its released "maxrl" estimator). With K >= 1 successes
    of G, (1/G) sum_i A_i grad log pi(y_i) = (1/K) sum_{successes} grad log pi - (1/G) sum_i grad log pi,
    an estimate of grad log p; its expectation (eps = 0) is grad J^(G-1), J^(N) = -sum_{k<=N} (1-p)^k / k
    (method.md §8.2; tests/test_losses.py checks it exactly). Rewards must be >= 0."""
    r = x.rewards
    if (r < 0).any():
        raise ValueError("maxrl advantages need rewards >= 0 (success indicators: MaxRL estimates "
                         "grad log p(success)); got a negative reward")
    mean = r.mean(dim=1, keepdim=True)
    return torch.where(mean > 0, _centred(r) / (mean + x.eps), 0.0)   # normalised by the mean, not std


def passk_advantages(x):
    """Pass@k in closed form (Chen et al., "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv:2508.10751, the analytical derivation, as its code
    computes it: RUCAIBox/Passk_Training calc_adv; method.md §8.2). Binary rewards, N = G rows, N_neg
    incorrect, k = passk_k: mean = 1 - C(N_neg, k) / C(N, k), std = sqrt(mean (1 - mean)), A_pos =
    (1 - mean) / (std + eps), A_neg = (1 - mean - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / (std + eps)."""
    r, k = x.rewards, int(x.options["passk_k"])
    G = r.shape[1]
    if not 1 <= k <= G:
        raise ValueError(f"passk_k must be in [1, G = {G}] (a k-subset of the group), got {k}")
    if ((r != 0) & (r != 1)).any():
        raise ValueError("passk advantages need binary rewards (1 correct, 0 not): --reward acc, no shaping")
    neg = G - r.sum(dim=1).long()                                      # (n_groups,) N_neg
    fail = torch.tensor([math.comb(n, k) / math.comb(G, k) for n in range(G + 1)], dtype=torch.float64)
    alone = torch.tensor([math.comb(n - 1, k - 1) / math.comb(G - 1, k - 1) if n else 0.0
                          for n in range(G + 1)], dtype=torch.float64)
    mean = 1.0 - fail[neg][:, None]
    std = (mean * (1.0 - mean)).sqrt()
    adv = torch.where(r > 0, 1.0 - mean, 1.0 - mean - alone[neg][:, None])
    return torch.where(std > 0, adv / (std + x.eps), 0.0).to(r.dtype)


# The advantage estimators (--adv; §8.2). A new one: a function, a row (extension.register from outside)
_EPS = frozenset({"adv_eps"})
ADVANTAGES: dict[str, AdvantageRow] = {
    "grpo": AdvantageRow(grpo_advantages, "(R - mean) / group std", _EPS),
    "drgrpo": AdvantageRow(drgrpo_advantages, "R - mean"),
    "rloo": AdvantageRow(rloo_advantages, "R - leave-one-out mean"),
    "batch-std": AdvantageRow(batch_std_advantages, "(R - mean) / batch std", _EPS, batch=True),
    "reinforce++": AdvantageRow(reinforce_pp_advantages, "R - mean, whitened over the batch", _EPS, batch=True),
    "maxrl": AdvantageRow(maxrl_advantages, "(R - mean) / mean: MaxRL", _EPS, rewards="success"),
    "passk": AdvantageRow(passk_advantages, "pass@k in closed form (--passk-k)", _EPS, rewards="binary",
                          OPTIONS=(("passk_k", 4, "--adv passk: k of pass@k, <= --group-size", ">=1"),)),
}
BATCH_ADVANTAGES = tuple(k for k, row in ADVANTAGES.items() if row.batch)   # (the built-in ones)
SIGNAL_EPS = 1e-6      # an advantage is a signal above this share of its group's reward scale (§8.6)


def carries_signal(advantages, rewards, group_size):
    """(B,) bool: |A_i| > SIGNAL_EPS * max(1, max_j |R_j| of row i's group): the advantage the
    estimator produced moves the policy; round-off of shaped rewards does not (method.md §8.6)."""
    scale = _groups(rewards.float().abs(), group_size).amax(dim=1).clamp_min(1.0)
    return advantages.abs() > SIGNAL_EPS * scale.repeat_interleave(group_size)


def batch_moments(x, valid=None, reduce=None):
    """Mean and Bessel std of x (B,) over the rows `valid` marks (not DAPO's filler; None: all), on
    every rank (`reduce` sums a tensor over ranks; None: this process only): a batch=True row's."""
    w = torch.ones_like(x) if valid is None else valid.to(x.dtype)
    sums = torch.stack([w.sum(), (w * x).sum(), (w * x * x).sum()]).double()
    n, s, ss = (sums if reduce is None else reduce(sums)).tolist()
    mean = s / max(n, 1.0)
    return mean, max(ss - n * mean * mean, 0.0) ** 0.5 / max(n - 1.0, 1.0) ** 0.5


def nonconstant_groups(rewards, group_size):
    """(B,) -> (n_groups,) bool: True for groups whose rewards are not all equal (an all-equal group
    has zero advantage: no gradient; DAPO's dynamic sampling keeps only the others)."""
    r = _groups(rewards, group_size)
    return (r != r[:, :1]).any(dim=1)


def overlong_penalty(lengths, max_len, cache_len):
    """DAPO soft overlong punishment. lengths (B,) response lengths -> (B,) reward to add.

      0                                   if L <= max_len - cache_len
      ((max_len - cache_len) - L) / cache_len   if max_len - cache_len < L <= max_len  (0 .. -1)
      -1                                  if L > max_len
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    L = lengths.float()
    free = max_len - cache_len
    ramp = (free - L) / cache_len
    return torch.where(L <= free, torch.zeros_like(L), torch.where(L <= max_len, ramp, -torch.ones_like(L)))


def query_weights(nll, mean_nll=None, clip=None):
    """Query reweighting w_i = mean_nll / nll_i (method.md §4): (N,) NLLs -> (N,) weights, no gradient.
    Typical queries (low NLL) count more, strange ones (which breed strange responses) less. A weight
    scales the PG term (the advantage) of every response to its query, never the Query-KL term.
      paper (App. I): the cached REFERENCE-model NLL of each query, mean_nll its mean over the WHOLE
                      training set, clip (0, 2); constant over training.
      code (release): the CURRENT policy's NLL (no gradient), mean_nll None: the mean of the given
                      nll (the optimizer batch's), unclipped. E.g. nll [3, 6] -> weights [1.5, 0.75].
    NLL = -l(q), summed over the prompt tokens, in both."""
    nll = nll.detach().float()
    if (nll < 0).any():
        raise ValueError("query_weights expects NLLs (>= 0); got a negative value - "
                         "did you pass a log-likelihood?")
    mean = nll.mean() if mean_nll is None else torch.as_tensor(mean_nll, dtype=nll.dtype, device=nll.device)
    w = mean / nll.clamp_min(1e-8)
    if clip is not None:
        w = w.clamp(clip[0], clip[1])
    return w


# -----------------------------------------------------------------------------
# Loss aggregation (method.md §8.5): per-token values -> this micro-batch's share of the loss, a SUM
# over the micro-batch divided by a count of the WHOLE optimizer batch (num_tokens, num_seqs: all
# micro-batches and ranks; None: this call's own), so the micro-batches' losses add up to the
# one-big-batch loss and gradient (DDP averages over ranks: the caller multiplies by their number).
# Each mode (--agg) is a function of v (the values, 0 off the mask), m (the mask) and those counts.

def token_mean(v, m, num_tokens, num_seqs, max_len):
    """sum(v*m) / num_tokens: every token weighs the same (DAPO; EasyR1's default)."""
    return v.sum() / (m.sum().clamp_min(1.0) if num_tokens is None else num_tokens)


def seq_mean_token_mean(v, m, num_tokens, num_seqs, max_len):
    """sum_i (sum_t v*m / sum_t m) / num_seqs: each response's token mean, then their mean (the
    original GRPO)."""
    return (v.sum(-1) / m.sum(-1).clamp_min(1.0)).sum() / (v.shape[0] if num_seqs is None else num_seqs)


def seq_mean_token_sum_norm(v, m, num_tokens, num_seqs, max_len):
    """sum(v*m) / (num_seqs * max_len), max_len the configured response limit (Dr.GRPO and TRL's
    dr_grpo; verl divides by max_len only)."""
    if max_len is None:
        raise ValueError("mode 'seq-mean-token-sum-norm' needs max_len (the configured max response length)")
    return v.sum() / ((v.shape[0] if num_seqs is None else num_seqs) * max_len)


AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm}
AGG_MODES = tuple(AGGREGATIONS)


def aggregate(values, mask=None, mode="token-mean", num_tokens=None, num_seqs=None, max_len=None):
    """Per-token (B, T) values, reduced by AGGREGATIONS[mode] (above); per-sequence (B,) values
    (query_kl's) with mode "seq-mean": sum_i v_i m_i / num_seqs."""
    m = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    v = torch.where(m.bool(), values, 0.0)               # where, not *, so junk in padding cannot leak
    if values.dim() == 1 and mode == "seq-mean":
        return v.sum() / (m.sum().clamp_min(1.0) if num_seqs is None else num_seqs)
    if values.dim() == 1 or mode not in AGGREGATIONS:
        raise ValueError(f"aggregate mode for (B, T) values must be one of {AGG_MODES}, and for per-sequence "
                         f"(B,) values 'seq-mean'; got {mode!r} for {values.dim()}-D values")
    return AGGREGATIONS[mode](v, m, num_tokens, num_seqs, max_len)


# =============================================================================
# The policy-gradient surrogates, side by side: PPO-clip (GRPO's and ERPO's), GSPO, CISPO and SAPO,
# each a function and a row of `SURROGATES`, and truncated importance sampling on top of any of them
# (`surrogate_loss`). rl_loss aggregates the per-token loss they return into PG(A * w); method.md
# §8.3 writes out the equations. Conventions as above; advantages (B,) or (B, T).

def ppo_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    """PPO clipped surrogate, per token. logp, old_logp: (B, T); advantages: (B,) (broadcast over
    tokens) or (B, T).
      r = pi_theta / pi_old = exp(logp - old_logp)
      loss_t = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)              (clip-higher when eps_high > eps_low)
      A < 0 and dual_clip=c: loss_t = min(loss_t, c*|A|)                 (dual-clip: bounds the loss of
                             a huge ratio on a bad token; c > 1, None disables)
    Returns (loss_tok (B, T), clipped (B, T) bool): clipped marks tokens where a clip was active,
    i.e. whose gradient was cut to zero; its masked mean is the usual "clip fraction"."""
    advantages = _per_token(advantages, logp)                 # (B, 1) or (B, T)
    ratio = _ratio(logp, old_logp)                            # r
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg3 = -advantages * dual_clip                      # = c*|A| where A < 0
        dual = (advantages < 0) & (pg3 < loss)
        loss = torch.where(dual, pg3, loss)
        clipped = clipped | dual
    return loss, clipped


def clip_masks(ratio, advantages, eps_low=0.2, eps_high=0.3, dual_clip=3.0) -> dict[str, torch.Tensor]:
    """(B, T) bool masks of where the ratio r (a surrogate's, e.g. pi_theta / pi_old per token)
    left the clip range, for the statistics: "low" r < 1 - eps_low, "high" r > 1 + eps_high,
    "dual" A < 0 and the PPO loss |A| max(r, clip(r)) above dual_clip * |A| (ppo_loss bounded it
    there)."""
    advantages = _per_token(advantages, ratio)
    masks = {"low": ratio < 1.0 - eps_low, "high": ratio > 1.0 + eps_high}
    bounded = torch.maximum(ratio, ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is None:
        masks["dual"] = torch.zeros_like(masks["low"])
    else:
        masks["dual"] = (advantages < 0) & (bounded > dual_clip)
    return masks


# -----------------------------------------------------------------------------
# The table of policy-gradient surrogates (Algo.surrogate, method.md §8.3). A row is a function
#     fn(logp, old_logp, advantages, mask, algo) -> Surrogate(loss, ratio, stats),   all (B, T),
# the Algo knobs fn reads (the others of the table's are unused: unused_fields) and the names of
# the statistics it returns, each logged as its mean over the valid response tokens of the optimizer
# steps that can be off-policy (the first of an RL step is not: ratio 1). A new surrogate is one
# function and one row; `surrogate_loss` adds truncated importance sampling to any of them.

class Surrogate(NamedTuple):
    loss: torch.Tensor                  # (B, T) per-token loss, reduced by `aggregate` with algo.agg
    ratio: torch.Tensor                 # (B, T) the importance ratio behind it (detached)
    stats: dict                         # name -> (B, T) bool or float per-token statistic


@dataclass(frozen=True)
class SurrogateRow:
    fn: Callable[..., Surrogate]
    knobs: frozenset                    # the Algo fields fn reads
    stats: tuple                        # the names of the statistics fn returns


def _ratio(logp, old_logp):
    # the log-ratio is bounded only to keep exp() finite; any clip decision is made far inside it
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))


def _per_token(advantages, like):
    return advantages.unsqueeze(-1) if advantages.dim() == like.dim() - 1 else advantages


def _clip_stats(clipped, ratio, advantages, algo) -> dict:
    """clip_frac: where a clip was active (the gradient cut); clip_masks' low and high (the released
    ERPO code's clip_frac_low / _high, whatever the advantage's sign) and dual."""
    masks = clip_masks(ratio, advantages, algo.eps_low, algo.eps_high, algo.dual_clip)
    return {"clip_frac": clipped, "clip_frac_low": masks["low"], "clip_frac_high": masks["high"],
            "dual_clip_frac": masks["dual"]}


def ppo_surrogate(logp, old_logp, advantages, mask, algo) -> Surrogate:
    """PPO-clip on the token ratio r_t = pi_theta(y_t) / pi_old(y_t) (ppo_loss; method.md §8.3)."""
    loss, clipped = ppo_loss(logp, old_logp, advantages, algo.eps_low, algo.eps_high, algo.dual_clip)
    ratio = _ratio(logp, old_logp).detach()
    return Surrogate(loss, ratio, _clip_stats(clipped, ratio, advantages, algo))


def gspo_surrogate(logp, old_logp, advantages, mask, algo) -> Surrogate:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|)
    = exp(mean_t log r_t), clipped like PPO's (GSPO's own range is ~1e-4 wide: ALGOS["gspo"]).
    Written per token as GSPO-token, s_i,t = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]: every
    token carries the value s_i, and aggregated with seq-mean-token-mean the gradient is GSPO's,
    -A_i s_i (1/|y_i|) sum_t grad log pi_theta(y_t) (zero where the sequence is clipped)."""
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp_min(1.0)       # (B,) log s_i
    log_s_tok = log_s.detach()[:, None] + logp - logp.detach()                 # (B, T): value log s_i
    loss, clipped = ppo_loss(log_s_tok, torch.zeros_like(logp), advantages, algo.eps_low, algo.eps_high,
                             algo.dual_clip)
    ratio = _ratio(log_s_tok, 0.0).detach()
    return Surrogate(loss, ratio, _clip_stats(clipped, ratio, advantages, algo))


def cispo_surrogate(logp, old_logp, advantages, mask, algo) -> Surrogate:
    """CISPO (MiniMax-M1, 2025): the importance weight is clipped and detached, and every token
    keeps its gradient:  loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(y_t),
    gradient -clip(r_t) A grad log pi_theta(y_t). PPO-clip zeroes a clipped token's gradient; CISPO
    only bounds its weight, so rare high-ratio tokens (often the "forking" ones) still learn.
    MiniMax-M1 bounds the weight from above only: give --eps-low near 1 (it must stay < 1). Its
    loss value is not PPO's (it is not ~0 on-policy); its gradient is the one above."""
    ratio = _ratio(logp, old_logp).detach()
    weight = ratio.clamp(1.0 - algo.eps_low, 1.0 + algo.eps_high)
    loss = -weight * _per_token(advantages, logp) * logp
    return Surrogate(loss, ratio, {"clip_frac_low": ratio < 1.0 - algo.eps_low,
                                   "clip_frac_high": ratio > 1.0 + algo.eps_high})


def sapo_surrogate(logp, old_logp, advantages, mask, algo) -> Surrogate:
    """SAPO (Qwen, Gao et al. 2025): a soft gate instead of a hard clip,
        loss_t = -f_tau(r_t) A,   f_tau(r) = sigmoid(tau (r - 1)) * 4 / tau,
    tau = sapo_tau_pos where A > 0, sapo_tau_neg where A < 0 (1.0 / 1.05: negative advantages decay
    faster). Its gradient, -4 s (1 - s) r A grad log pi (s the sigmoid), is PG's on-policy (r = 1)
    and fades smoothly as r leaves 1; `sapo_grad_weight` logs 4 s (1 - s), the share that passes."""
    A = _per_token(advantages, logp)
    r = _ratio(logp, old_logp)
    tau = torch.where(A > 0, algo.sapo_tau_pos, algo.sapo_tau_neg).to(logp.dtype)
    s = torch.sigmoid(tau * (r - 1.0))
    return Surrogate(-s * 4.0 / tau * A, r.detach(), {"sapo_grad_weight": (4.0 * s * (1.0 - s)).detach()})


_CLIPPED = frozenset({"eps_low", "eps_high", "dual_clip"})
_CLIP_STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac")
SURROGATES: dict[str, SurrogateRow] = {
    "ppo": SurrogateRow(ppo_surrogate, _CLIPPED, _CLIP_STATS),
    "gspo": SurrogateRow(gspo_surrogate, _CLIPPED, _CLIP_STATS),
    "cispo": SurrogateRow(cispo_surrogate, frozenset({"eps_low", "eps_high"}), ("clip_frac_low", "clip_frac_high")),
    "sapo": SurrogateRow(sapo_surrogate, frozenset({"sapo_tau_pos", "sapo_tau_neg"}), ("sapo_grad_weight",)),
}


def off_policy_stats() -> set:
    """The names of every surrogate's statistics: trivial on the first optimizer step of an RL step
    (on-policy), so experience.update_statistics averages them over the later steps only."""
    return {name for row in SURROGATES.values() for name in row.stats}


def truncated_is_weights(old_logp, sampler_logp, cap):
    """Truncated importance sampling (TIS, method.md §3): the tokens were drawn by the sampler
    pi_s, which is pi_old computed by other kernels (a decoding step, bf16 on GPUs), not pi_old
    exactly. (B, T) -> (B, T) per-token weights min(pi_old / pi_s, cap), no gradient, that multiply
    the surrogate's per-token loss: the policy gradient as if the tokens had come from pi_old, its
    variance bounded by `cap` (TRL's vllm_importance_sampling_correction, verl's rollout_is)."""
    return torch.exp((old_logp - sampler_logp).clamp(-20.0, 20.0)).clamp_max(cap).detach()


def surrogate_loss(algo, logp, old_logp, advantages, mask, sampler_logp=None) -> Surrogate:
    """The policy-gradient term per token: algo.surrogate's row, with truncated importance sampling
    where algo.tis_cap > 0 (truncated_is)."""
    sur = SURROGATES[algo.surrogate].fn(logp, old_logp, advantages, mask, algo)
    return sur if algo.tis_cap <= 0 else truncated_is(sur, old_logp, sampler_logp, algo.tis_cap)


def truncated_is(sur: Surrogate, old_logp, sampler_logp, cap) -> Surrogate:
    """Any surrogate's per-token loss weighted by truncated_is_weights (sampler_logp required), its
    statistics tis_weight / tis_capped_frac joining the surrogate's."""
    if sampler_logp is None:
        raise ValueError("algo.tis_cap > 0: sampler_logp (the sampler's log-probs) is required")
    tis = truncated_is_weights(old_logp, sampler_logp, cap)
    stats = {**sur.stats, "tis_weight": tis, "tis_capped_frac": tis >= cap}
    return Surrogate(sur.loss * tis, sur.ratio, stats)


# -----------------------------------------------------------------------------
# The algorithm table: each name maps to its parts. Every field is a loss hyperparameter and
# becomes a command-line flag of train.py (--adv, --kl, --weight-clip, ...), generated from the
# field's name, default and metadata: a new knob is one line here.

def _knob(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Algo:
    adv: str = _knob("grpo", "advantage estimator, a row of ADVANTAGES (method.md §8.2): grpo = (R - mean) / "
                     "group std; drgrpo = R - mean; rloo = R - leave-one-out mean; batch-std = (R - mean) / "
                     "batch std; reinforce++ = R - mean, whitened over the batch; maxrl = (R - mean) / mean, "
                     "MaxRL's grad log p(success); passk = pass@k in closed form (--passk-k)", ADVANTAGES)
    adv_eps: float = _knob(1e-6, "epsilon of GRPO's (R - mean) / (std + eps) (batch-std's, reinforce++'s, "
                           "passk's too) and MaxRL's / (mean + eps)")
    kl: str | None = _knob("k3", "Policy-KL estimator, r = pi_ref / pi_theta (method.md §8): k1 = -log r; "
                           "k2 = (log r)^2 / 2; k3 = r - 1 - log r; k3-ratio = k3 * pi_theta / pi_old, "
                           "the importance-ratio bias correction (DeepSeek-V3.2, TRL's "
                           "use_bias_correction_kl; loss only); none = no Policy-KL term", POLICY_KL_KINDS)
    beta: float = _knob(0.01, "Policy-KL coefficient")
    kl_in: str = _knob("loss", "where the Policy-KL goes: the loss (GRPO) or the reward (RLOO)",
                       KL_PLACEMENTS)
    kl_clamp: float = _knob(K3_CLAMP, "per-token clamp [-c, c] of k3 estimators (Policy- and Query-KL)")
    alpha: float = _knob(0.0, "Query-KL coefficient (0 = no Query-KL term)")
    qkl_estimator: str = _knob("k3", "per-token estimator of the Query-KL", KL_ESTIMATORS)
    weights: str = _knob("none", "query reweighting (method.md §4)", WEIGHT_KINDS)
    weight_clip: tuple[float, float] = _knob((0.0, 2.0), "clip range of the paper query weights")
    surrogate: str = _knob("ppo", "policy-gradient surrogate (SURROGATES)",
                           SURROGATES)
    eps_low: float = _knob(0.2, "PPO clip: ratio >= 1 - eps_low")
    eps_high: float = _knob(0.3, "PPO clip: ratio <= 1 + eps_high (EasyR1 default; DAPO clip-higher 0.28)")
    dual_clip: float | None = _knob(3.0, "dual-clip constant c > 1 (0 = off)")
    sapo_tau_pos: float = _knob(1.0, "SAPO's gate temperature where A > 0 (--surrogate sapo)")
    sapo_tau_neg: float = _knob(1.05, "SAPO's gate temperature where A < 0 (--surrogate sapo)")
    tis_cap: float = _knob(0.0, "truncated importance sampling: each token's policy-gradient loss "
                           "weighted by min(pi_old / pi_sampler, cap) (0 = off; TRL and verl suggest 2)")
    agg: str = _knob("token-mean", "loss aggregation (aggregate())", AGG_MODES)
    dynamic_sampling: bool = _knob(False, "DAPO: drop groups whose accuracies are all equal, resample")
    overlong: bool = _knob(False, "DAPO soft overlong punishment added to the reward")
    overlong_cache: float = _knob(0.2, "L_cache of the overlong punishment: tokens, or a fraction of "
                                  "L_max = --max-new-tokens if < 1 (DAPO: 4,096 of 20,480 = 0.2)")
    entropy_coef: float = _knob(0.0, "entropy bonus: loss - c * the policy's token entropy over "
                                "response tokens (verl's entropy_coeff; 0 = off)")
    top_entropy_quantile: float = _knob(1.0, "the policy gradient on the top q of each micro-batch's "
                                        "response tokens by entropy (TRL's top_entropy_quantile; 1 = all)")
    mask_truncated: bool = _knob(False, "responses cut at --max-new-tokens (no EOS) carry no loss (TRL's "
                                 "mask_truncated_completions); their rewards still enter the group baseline")
    doc: str = field(default="", compare=False)  # one line: what it changes relative to GRPO

    @property
    def has_policy_kl_loss(self):
        return self.kl is not None and self.kl_in == "loss" and self.beta > 0

    @property
    def uses_entropy(self):
        """The loss reads the policy's token entropy (an entropy bonus or top-entropy tokens)."""
        return self.entropy_coef > 0 or self.top_entropy_quantile < 1

    @property
    def needs_pi_old_first(self):
        """pi_old's log-probs are needed before the update (RLOO's KL-penalised rewards, the code
        weights), so no update forward can stand in for pi_old's own (train.on_policy_rows)."""
        return (self.kl is not None and self.kl_in == "reward") or self.weights == "code"

    def overlong_cache_len(self, max_len) -> int:
        """L_cache in tokens: overlong_cache itself, or that fraction of max_len (at least 1)."""
        c = self.overlong_cache
        return max(1, min(max_len, round(c * max_len if c < 1 else c)))


_DAPO = dict(kl=None, beta=0.0, eps_low=0.2, eps_high=0.28, dual_clip=None,
             dynamic_sampling=True, overlong=True)

ALGOS: dict[str, Algo] = {
    "grpo": Algo(doc="baseline (EasyR1 defaults): group-normalized advantage, k3 Policy-KL in the loss (beta 0.01)"),
    "erpo": Algo(kl=None, beta=0.0, alpha=0.01, weights="paper",
                 doc="GRPO with Policy-KL replaced by Query-KL (alpha 0.01) and paper query weights"),
    "grpo-star": Algo(weights="paper", doc="GRPO* : GRPO (with Policy-KL) + paper query weights, no Query-KL"),
    "qkl": Algo(kl=None, beta=0.0, alpha=0.01,
                doc="'Query-KL only': Query-KL (alpha 0.01) replaces Policy-KL, no query weights"),
    "drgrpo": Algo(adv="drgrpo", kl=None, beta=0.0, eps_high=0.2, dual_clip=None,
                   agg="seq-mean-token-sum-norm",
                   doc="Dr.GRPO: advantage R - mean (no std), no KL, seq-mean-token-sum-norm, clip 0.2/0.2"),
    "dapo": Algo(**_DAPO, doc="DAPO: no KL, clip-higher 0.2/0.28, no dual-clip, dynamic sampling, overlong punishment"),
    "dapo-erpo": Algo(**_DAPO, alpha=0.01, weights="paper", doc="DAPO + Query-KL (alpha 0.01) + paper query weights"),
    "gspo": Algo(surrogate="gspo", kl=None, beta=0.0, eps_low=3e-4, eps_high=4e-4, dual_clip=None,
                 agg="seq-mean-token-mean",
                 doc="GSPO: a clipped sequence-level ratio (range 3e-4/4e-4), seq-mean-token-mean, no KL"),
    "rloo": Algo(adv="rloo", kl_in="reward", kl="k1",
                 doc="RLOO: leave-one-out advantage, k1 KL as a reward penalty (beta 0.01) instead of a loss term"),
    "rloo-erpo": Algo(adv="rloo", kl=None, beta=0.0, alpha=0.01, weights="paper",
                      doc="RLOO advantage, no Policy-KL, Query-KL (alpha 0.01) + paper query weights"),
}


def validate_algo(algo):
    """Raise ValueError (naming the allowed values) if any field of `algo` is out of range."""
    for f in fields(Algo):
        allowed = f.metadata.get("choices")
        value = getattr(algo, f.name)
        if allowed and not (value in allowed or (f.name == "kl" and value is None)):
            raise ValueError(f"Algo.{f.name} must be one of {allowed}, got {value!r}")
    if algo.beta < 0 or algo.alpha < 0:
        raise ValueError(f"beta and alpha must be >= 0, got beta={algo.beta}, alpha={algo.alpha}")
    if not (0 <= algo.eps_low < 1 and algo.eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {algo.eps_low}, {algo.eps_high}")
    if algo.dual_clip is not None and algo.dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {algo.dual_clip}")
    lo, hi = algo.weight_clip
    if not 0 <= lo < hi:
        raise ValueError(f"weight_clip must be (lo, hi) with 0 <= lo < hi, got {algo.weight_clip}")
    if algo.kl_clamp <= 0 or algo.adv_eps < 0 or algo.overlong_cache <= 0 or algo.tis_cap < 0:
        raise ValueError(f"need kl_clamp > 0, adv_eps >= 0, overlong_cache > 0, tis_cap >= 0, got "
                         f"{algo.kl_clamp}, {algo.adv_eps}, {algo.overlong_cache}, {algo.tis_cap}")
    if algo.entropy_coef < 0 or not 0 < algo.top_entropy_quantile <= 1:
        raise ValueError(f"need entropy_coef >= 0 and 0 < top_entropy_quantile <= 1, got "
                         f"{algo.entropy_coef}, {algo.top_entropy_quantile}")
    if algo.sapo_tau_pos <= 0 or algo.sapo_tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got {algo.sapo_tau_pos}, {algo.sapo_tau_neg}")
    if algo.kl == "k3-ratio" and algo.kl_in != "loss":
        raise ValueError("kl 'k3-ratio' weights k3 by pi_theta / pi_old in the loss; in the reward (pi_old's "
                         "own tokens and log-probs) the ratio is 1: use kl 'k3' there")
    shaped = algo.overlong or (algo.kl_in == "reward" and algo.kl is not None and algo.beta > 0)
    if getattr(ADVANTAGES[algo.adv], "rewards", "any") != "any" and shaped:     # (the row says so)
        raise ValueError(f"adv {algo.adv!r} needs success rewards (maxrl: >= 0, it estimates grad log "
                         "p(success); passk: 0/1): no overlong punishment, no KL penalty in the reward")
    return algo


def make_algo(name, **overrides):
    """ALGOS[name] with the non-None overrides applied, validated.

    None means "not given" (e.g. an unset CLI flag), so to switch a part off pass the string
    "none": kl="none" (no Policy-KL term), dual_clip="none" or 0 (no dual-clip).
    Setting beta > 0 on an algorithm without a Policy-KL estimator is an error (say which one).
    """
    if name not in ALGOS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGOS)}")
    known = {f.name for f in fields(Algo)} - {"doc"}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown Algo field(s) {sorted(unknown)}; fields are {sorted(known)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("kl") == "none":
        given["kl"] = None
    if given.get("dual_clip") in ("none", 0, 0.0):
        given["dual_clip"] = None
    if "weight_clip" in given:
        given["weight_clip"] = tuple(given["weight_clip"])
    algo = validate_algo(replace(ALGOS[name], **given))
    if "beta" in given and algo.beta > 0 and algo.kl is None:
        raise ValueError(f"beta={algo.beta} but {name!r} has no Policy-KL term; "
                         f"also pass kl (one of {POLICY_KL_KINDS})")
    return algo


def unused_fields(algo):
    """Fields of `algo` that cannot change its loss or reward (so setting one is a mistake):
    the Policy-KL's estimator and placement when beta = 0, its beta when there is no estimator,
    the Query-KL estimator when alpha = 0, the clip range of weights that are not clipped, ..."""
    policy_kl = algo.kl is not None and algo.beta > 0
    query_kl = algo.alpha > 0
    k3 = (policy_kl and algo.kl_in == "loss" and algo.kl in ("k3", "k3-ratio")) or \
        (query_kl and algo.qkl_estimator == "k3")
    unused = {"kl": algo.beta == 0, "kl_in": not policy_kl, "beta": algo.kl is None,
              "kl_clamp": not k3, "qkl_estimator": not query_kl,
              "weight_clip": algo.weights != "paper",
              "overlong_cache": not algo.overlong}
    unused = {name for name, is_unused in unused.items() if is_unused}
    for table, chosen in ((SURROGATES, algo.surrogate), (ADVANTAGES, algo.adv)):   # each row's knobs:
        unused |= {k for row in table.values() for k in getattr(row, "knobs", ())} - \
            set(getattr(table[chosen], "knobs", ()))                           # (beside the knob)
    return unused


# -----------------------------------------------------------------------------
# The full per-micro-batch loss

def rl_loss(algo, *, logp, old_logp, ref_logp, resp_mask, advantages, weights, prompt_logp,
            prompt_ref_logp, prompt_mask, num_tokens, num_seqs, max_len, sampler_logp=None, entropy=None):
    """loss = PG(A * w) [+ beta * PolicyKL] [+ alpha * QueryKL] for one micro-batch -> (loss, stats:
    its detached contributions, which summed over the micro-batches give the batch's values).
    Response side (B, T_r): logp (with grad), old_logp (pi_old), ref_logp (the reference; None where
      the loss has no Policy-KL), resp_mask; sampler_logp: the sampler's own log-probs (algo.tis_cap
      > 0); entropy: the policy's token entropy (algo.uses_entropy; with grad for a bonus).
    advantages (B,) or (B, T_r); weights (B,): each response's query weight, None where algo.weights
      is "none" (they scale the PG term only, never the Query-KL: method.md §4).
    Prompt side (B, T_p), from the same forward: prompt_logp (with grad), prompt_ref_logp (the
      Query-KL reference), prompt_mask (prompt tokens after the first). None where alpha == 0; given
      with alpha == 0, the Query-KL is still reported (GRPO's drift, Table 3).
    num_tokens, num_seqs, max_len: the whole optimizer batch's denominators (aggregate)."""
    if (weights is None) != (algo.weights == "none"):
        raise ValueError(f"algo.weights={algo.weights!r} but weights is "
                         f"{'None' if weights is None else 'given'}")
    denom = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    adv = advantages if weights is None else advantages * _per_token(weights, advantages)

    if algo.uses_entropy and entropy is None:
        raise ValueError("entropy_coef / top_entropy_quantile: the policy's token entropy is required")
    sur = surrogate_loss(algo, logp, old_logp, adv, resp_mask, sampler_logp)  # PPO-clip, GSPO, ...
    if algo.top_entropy_quantile < 1:                                      # the high-entropy tokens only
        sur = sur._replace(loss=sur.loss * high_entropy_tokens(entropy, resp_mask, algo.top_entropy_quantile))
    pg = aggregate(sur.loss, resp_mask, algo.agg, **denom)                         # PG(A * w)
    loss = pg
    stats = {"pg_loss": pg.detach(), **{k: aggregate(v.float(), resp_mask, "token-mean", num_tokens).detach()
                                        for k, v in sur.stats.items()}}      # the surrogate's, as token means

    if ref_logp is not None:
        kl = aggregate(policy_kl(logp, ref_logp, algo.kl or "k3", clamp=algo.kl_clamp, old_logp=old_logp),
                       resp_mask, algo.agg, **denom)
        if algo.has_policy_kl_loss:
            loss = loss + algo.beta * kl                                           # + beta * PolicyKL
        stats["policy_kl"] = kl.detach()
    elif algo.has_policy_kl_loss:
        raise ValueError("this algorithm has a Policy-KL loss term: ref_logp is required")

    if prompt_logp is not None and prompt_ref_logp is not None:
        qkl = aggregate(query_kl(prompt_logp, prompt_ref_logp, prompt_mask, algo.qkl_estimator,
                                 algo.kl_clamp), None, "seq-mean", num_seqs=num_seqs)
        if algo.alpha > 0:
            loss = loss + algo.alpha * qkl                                         # + alpha * QueryKL
        stats["query_kl"] = qkl.detach()
    elif algo.alpha > 0:
        raise ValueError("this algorithm has a Query-KL term: "
                         "prompt_logp, prompt_ref_logp, prompt_mask are required")

    if algo.entropy_coef > 0:
        loss, stats["entropy_bonus"] = entropy_bonus(loss, algo, entropy, resp_mask, denom)  # - c * H

    stats["loss"] = loss.detach()
    return loss, stats


def entropy_bonus(loss, algo, entropy, mask, denom):
    """loss - c * H, H the policy's token entropy (with grad) aggregated as the PG term is (verl's
    entropy_coeff) -> (that loss, H detached)."""
    ent = aggregate(entropy, mask, algo.agg, **denom)
    return loss - algo.entropy_coef * ent, ent.detach()


def high_entropy_tokens(entropy, mask, q):
    """(B, T) 0/1: the tokens among `mask` whose entropy is in the top fraction q (the policy gradient
    acts on those alone: "Beyond the 80/20 rule", TRL's top_entropy_quantile). The threshold is the
    (1 - q) quantile of this micro-batch's masked entropies, as TRL takes it per batch."""
    ent = entropy.detach().float()
    values = ent[mask.bool()]
    if values.numel() == 0:
        return torch.zeros_like(ent)
    return (ent >= torch.quantile(values, 1.0 - q)).to(entropy.dtype)

