"""
The policy-gradient surrogates, side by side: PPO-clip (GRPO's and ERPO's), GSPO, CISPO and SAPO,
each a function and a row of `SURROGATES`, and truncated importance sampling on top of any of them
(`surrogate_loss`). losses.rl_loss aggregates the per-token loss they return into PG(A * w).

Conventions as in losses.py: B sequences, T padded response length; logp / old_logp (B, T) the
log-probs of the sampled tokens under pi_theta / pi_old; advantages (B,) or (B, T); masks 0/1.
This file imports only torch and the standard library (method.md §8.3 writes out the equations).
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


def ppo_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    """PPO clipped surrogate, per token.

    logp, old_logp: (B, T); advantages: (B,) (broadcast over tokens) or (B, T).
      r = pi_theta / pi_old = exp(logp - old_logp)
      loss_t = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)              (clip-higher when eps_high > eps_low)
      A < 0 and dual_clip=c: loss_t = min(loss_t, c*|A|)                 (dual-clip: bounds the loss of
                             a huge ratio on a bad token; c > 1, None disables)
    Returns (loss_tok (B, T), clipped (B, T) bool): clipped marks tokens where a clip was active,
    i.e. whose gradient was cut to zero; its masked mean is the usual "clip fraction".
    """
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    # the log-ratio is bounded only to keep exp() finite; any clip decision is made far inside it
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
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
    if advantages.dim() == ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
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
    """Where a clip was active (the gradient cut), where the ratio left [1 - eps_low, 1 + eps_high]
    whatever the advantage's sign (the released ERPO code's clip_frac_low / _high), and where
    dual-clip bound the loss."""
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
    (on-policy), so metrics.update_statistics averages them over the later steps only."""
    return {name for row in SURROGATES.values() for name in row.stats}


def truncated_is_weights(old_logp, sampler_logp, cap):
    """Truncated importance sampling (TIS, method.md §3): the tokens were drawn by the sampler
    pi_s, which is pi_old computed by other kernels (a decoding step, bf16 on GPUs), not pi_old
    exactly. (B, T) -> (B, T) per-token weights min(pi_old / pi_s, cap), no gradient, that multiply
    the surrogate's per-token loss: the policy gradient as if the tokens had come from pi_old, its
    variance bounded by `cap` (TRL's vllm_importance_sampling_correction, verl's rollout_is)."""
    return torch.exp((old_logp - sampler_logp).clamp(-20.0, 20.0)).clamp_max(cap).detach()


def surrogate_loss(algo, logp, old_logp, advantages, mask, sampler_logp=None) -> Surrogate:
    """The policy-gradient term per token: algo.surrogate's row, its loss weighted by truncated
    importance sampling when algo.tis_cap > 0 (whatever the surrogate; sampler_logp required then),
    whose statistics tis_weight / tis_capped_frac join the row's."""
    sur = SURROGATES[algo.surrogate].fn(logp, old_logp, advantages, mask, algo)
    if algo.tis_cap <= 0:
        return sur
    if sampler_logp is None:
        raise ValueError("algo.tis_cap > 0: sampler_logp (the sampler's log-probs) is required")
    tis = truncated_is_weights(old_logp, sampler_logp, algo.tis_cap)
    stats = {**sur.stats, "tis_weight": tis, "tis_capped_frac": tis >= algo.tis_cap}
    return Surrogate(sur.loss * tis, sur.ratio, stats)
