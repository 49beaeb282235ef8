"""What an RL step logs (metrics.jsonl), reduced over ranks.

The monitors are measured on the rollout (pre-update) policy for every algorithm, whatever its
loss, so GRPO and ERPO runs compare line by line (paper Fig. 1, Table 3): Query-KL (k3, prompt
tokens against the cached reference, method.md §2), Policy-KL (k3 against the reference model,
when one is loaded), entropy; then rewards, lengths, the update's statistics and query weights.
Arguments come from train.rl_step: `c` its Collected rollouts, `sc` its OldScores.
"""

import torch

import losses
from distributed import all_max, all_sums


def rl_step(step, c, ro, sc, qref, qmask, resp_mask, w, upd, *, world, lr, dynamic_sampling, seconds,
            update_tokens) -> dict:
    """One metrics line. Sums go over ranks in one collective; rates divide by global counts.
    seconds: this rank's timer.Phases seconds so far (gen, update, ...); update_tokens: the tokens
    the update's forwards covered (x PPO epochs), for tokens/s."""
    info, mask = c.info, ro.response_mask                               # mask: (B, R) response tokens
    kl = 0.0 if sc.ref is None else losses.policy_kl(sc.old, sc.ref, "k3") * resp_mask  # k3 of KL(pi || ref)
    s = all_sums({
        "rows": len(c.first_rewards), "tok": mask.sum(), "valid": c.valid, "kl_tok": resp_mask.sum(),
        "reward": c.first_rewards, "acc": c.first_acc,                  # the first sampling round's
        "qkl": losses.query_kl(sc.prompt, qref, qmask),                 # (B,) per-row Query-KL (k3)
        "ent": sc.entropy * mask, "kl": kl, "w": 0.0 if w is None else w,
        "trunc": (~ro.finished).float(), "new_turn": info["new_turn"], "zero_var": info["zero_var_frac"],
        "kept_groups": info.get("kept_groups", 0), "update_tokens": update_tokens,
        **{f"reward_{k}": info.get(k, 0) for k in ("timeout", "error", "no_answer")}})
    n = s["rows"]
    m = {"step": step + 1, "reward": s["reward"] / n, "train_acc": s["acc"] / n,
         "query_kl": s["qkl"] / max(1.0, s["valid"]), "entropy": s["ent"] / s["tok"],
         "response_len": s["tok"] / n, "response_tokens": s["tok"], "truncated_frac": s["trunc"] / n,
         "new_turn_frac": s["new_turn"] / n, "zero_var_frac": s["zero_var"] / world,
         # every statistic of the update (losses.rl_loss's, grad_norm, skipped_steps); its KL terms are
         # named loss_* (the loss's own, over the update's policies; the monitors above are pi_old's)
         **{f"loss_{k}" if k in ("policy_kl", "query_kl") else k: v for k, v in upd.items()}, "lr": lr,
         "gen_tok_per_s": s["tok"] / seconds["gen"], "update_tok_per_s": s["update_tokens"] / seconds["update"],
         **{k: s[k] for k in ("reward_timeout", "reward_error", "reward_no_answer")}}
    if sc.ref is not None:
        m["policy_kl"] = s["kl"] / max(1.0, s["kl_tok"])
    if w is not None:
        m.update(weight_mean=s["w"] / n, weight_min=-all_max(-w.min()).item(), weight_max=all_max(w.max()).item())
    if dynamic_sampling:
        m["resample_rounds"] = all_max(torch.tensor(float(info["resample_rounds"]))).item()
        m["kept_groups"] = s["kept_groups"]
    return m
