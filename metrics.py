"""What an RL step logs (metrics.jsonl), reduced over ranks.

The monitors are measured on the rollout (pre-update) policy for every algorithm, whatever its
loss, so GRPO and ERPO runs compare line by line (paper Fig. 1, Table 3): Query-KL (k3, prompt
tokens against the initial policy, method.md §2), Policy-KL (k3 against the reference model, when
one is loaded), the released code's prompt / response / all-token KL, entropy; then rewards,
lengths, the update's statistics (`update_statistics`) and query weights. Arguments come from
train.rl_step: `c` its experience.Collected, `batch` its experience.UpdateBatch.
"""

import torch

import losses
import surrogates
from plumbing import distributed
from plumbing.distributed import all_max, all_sums


def released_kl_terms(sc, qmask, resp_mask, agg) -> dict:
    """The released code's monitors prompt_kl / response_kl / all_kl: k3 (clamped as in the loss) of
    the pi_old forward against the reference model over the prompt tokens, the response tokens and
    both, per row; -> {name: (sum, count)} to be summed over ranks. agg "seq-mean-token-mean" (the
    released recipe's) averages per-row token means over rows; any other agg, tokens."""
    def k3(logp, ref):
        return losses.policy_kl(logp, ref, "k3", clamp=losses.K3_CLAMP)
    parts = {"prompt_kl": (k3(sc.prompt, sc.ref_prompt), qmask),
             "response_kl": (k3(sc.old, sc.ref), resp_mask)}
    parts["all_kl"] = tuple(torch.cat([p, r], 1) for p, r in zip(parts["prompt_kl"], parts["response_kl"]))
    out = {}
    for name, (kl, mask) in parts.items():
        tokens = mask.sum(1)
        if agg == "seq-mean-token-mean":                    # a row counts once, whatever its length
            rows = tokens > 0
            out[name] = (((kl * mask).sum(1) / tokens.clamp_min(1))[rows].sum(), rows.sum())
        else:
            out[name] = ((kl * mask).sum(), tokens.sum())
    return out


def sampler_vs_old(sampler, old, mask) -> dict:
    """How far the sampler is from pi_old (method.md §3): the tokens were drawn from the decoding
    step's log-probs `sampler`, which the trainer's forward recomputes as `old` (B, R) in other
    kernels. Per valid response token (mask): |log pi_s - log pi_old| and k3 of KL(pi_s || pi_old),
    log r = log pi_old - log pi_s (the tokens are pi_s's samples); sums, for the step's line."""
    log_r = (old - sampler) * mask
    return {"samp_gap": log_r.abs(), "samp_kl": losses.policy_kl(sampler, old, "k3") * mask}


def update_statistics(applied: list[dict]) -> dict:
    """The applied optimizer steps' statistics (each a dict of this rank's sums, grad_norm global),
    summed over ranks: rl_loss's averaged over the steps; the clip fractions over those that can
    clip (until one step is applied the policy is the rollout's: ratio 1, nothing clipped);
    grad_norm (None: every step was skipped). Every rank applies the same steps."""
    stats, clip_stats, norms, off_policy = {}, {}, [], surrogates.off_policy_stats()
    for i, host in enumerate(applied):
        norms.append(host.pop("grad_norm"))
        for key, v in host.items():
            into = clip_stats if key in off_policy else stats
            if into is stats or i > 0:                                   # an earlier step moved the policy
                into[key] = into.get(key, 0.0) + v
    n_opt, n_clip = max(1, len(norms)), len(norms) - 1
    sums = distributed.all_sums({**stats, **clip_stats})  # (the module's: memory_measure stubs it)
    out = {k: v / (n_clip if k in off_policy else n_opt) for k, v in sums.items()}
    out["grad_norm"] = sum(norms) / n_opt if norms else None
    return out


def rl_step(run, step, c, ro, batch, qref, upd) -> dict:
    """One metrics line of train.rl_step. Sums go over ranks in one collective; rates divide by
    global counts. c: the step's experience.Collected; batch: its experience.UpdateBatch (masks, pi_old
    scores, weights); qref: (B, P-1) the initial policy's prompt log-probs (the query_kl monitor's
    reference); upd: the update's statistics. With more than one task among the training rows,
    train_acc/<task> too (the same keys on every rank)."""
    sc, qmask, resp_mask, w = batch.scores, batch.prompt_mask, batch.resp_mask, batch.weights
    world, seconds = run.dist.world, run.timer.seconds                  # seconds per phase on this rank
    update_tokens = batch.packed.attention_mask.sum() * run.args.ppo_epochs  # the update's forwards
    per_task = list(run.task_names) if len(run.task_names) > 1 else []
    released = {} if sc.ref_prompt is None else released_kl_terms(sc, qmask, resp_mask, run.algo.agg)
    info, mask = c.info, ro.response_mask                               # mask: (B, R) response tokens
    kl = 0.0 if sc.ref is None else losses.policy_kl(sc.old, sc.ref, "k3") * resp_mask  # k3 of KL(pi || ref)
    sampler = sampler_vs_old(batch.sampler, sc.old, resp_mask)
    s = all_sums({
        "rows": len(c.first_rewards), "tok": mask.sum(), "valid": c.valid, "kl_tok": resp_mask.sum(),
        "reward": c.first_rewards, "acc": c.first_acc,                  # the first sampling round's
        "qkl": losses.query_kl(sc.prompt, qref, qmask),                 # (B,) per-row Query-KL (k3)
        "ent": sc.entropy * mask, "kl": kl, "w": 0.0 if w is None else w,
        "trunc": (~ro.finished).float(), "new_turn": info["new_turn"], "zero_var": info["zero_var_frac"],
        "kept_groups": info.get("kept_groups", 0), "update_tokens": update_tokens, **sampler,
        **{f"reward_{k}": info.get(k, 0) for k in ("timeout", "error", "no_answer")},
        **{f"{k}/{t}": info.get(f"{k}/{t}", 0) for t in per_task for k in ("total", "correct")},
        **{f"{k}_{part}": v for k, pair in released.items() for part, v in zip(("sum", "n"), pair)}})
    n = s["rows"]
    m = {"step": step + 1, "reward": s["reward"] / n, "train_acc": s["acc"] / n,
         "query_kl": s["qkl"] / max(1.0, s["valid"]), "entropy": s["ent"] / s["tok"],
         "sampler_logp_gap": s["samp_gap"] / max(1.0, s["kl_tok"]),
         "sampler_kl": s["samp_kl"] / max(1.0, s["kl_tok"]),
         "response_len": s["tok"] / n, "response_tokens": s["tok"], "truncated_frac": s["trunc"] / n,
         "new_turn_frac": s["new_turn"] / n, "zero_var_frac": s["zero_var"] / world,
         # every statistic of the update (losses.rl_loss's, grad_norm, skipped_steps); its KL terms are
         # named loss_* (the loss's own, over the update's policies; the monitors above are pi_old's)
         **{f"loss_{k}" if k in ("policy_kl", "query_kl") else k: v for k, v in upd.items() if k != "lr"},
         "lr": upd["lr"], "gen_tok_per_s": s["tok"] / seconds["gen"],
         "update_tok_per_s": s["update_tokens"] / seconds["update"],
         **{k: s[k] for k in ("reward_timeout", "reward_error", "reward_no_answer")}}
    for k in released:
        m[k] = s[f"{k}_sum"] / max(1.0, s[f"{k}_n"])
    for t in per_task:                                                  # (the first sampling round's)
        m[f"train_acc/{t}"] = s[f"correct/{t}"] / max(1.0, s[f"total/{t}"])
    if sc.ref is not None:
        m["policy_kl"] = s["kl"] / max(1.0, s["kl_tok"])
    if w is not None:
        m.update(weight_mean=s["w"] / n, weight_min=-all_max(-w.min()).item(),
                 weight_max=all_max(w.max()).item())
    if run.algo.dynamic_sampling:
        m["resample_rounds"] = all_max(torch.tensor(float(info["resample_rounds"]))).item()
        m["kept_groups"] = s["kept_groups"]
    return m
