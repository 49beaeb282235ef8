"""One RL step's experience: this rank's prompts, G responses to each from the rollout policy,
graded by their tasks, and (DAPO) more sampling rounds where groups carry no signal (`collect` ->
Collected); then, once train.py has scored the rows, the rollout policy's and the reference's
log-probs (RolloutScores) and everything the PPO update reads (UpdateBatch).

train.rl_step calls `collect` once per step, on the decoding copy of the policy
(distributed.gathered). What a row is worth is its task's business (tasks.score_rows, which sees
the whole row); what enters the advantages here is that reward, plus DAPO's overlong penalty.

The step's metrics (`step_metrics`): what an RL step logs (metrics.jsonl), reduced over ranks. The
monitors are measured on the rollout (pre-update) policy for every algorithm, whatever its
loss, so GRPO and ERPO runs compare line by line (paper Fig. 1, Table 3): Query-KL (k3, prompt
tokens against the initial policy, method.md §2), Policy-KL (k3 against the reference model, when
one is loaded), the released code's prompt / response / all-token KL, entropy; then rewards,
lengths, the update's statistics (`update_statistics`) and query weights. Arguments come from
train.rl_step: `c` its experience.Collected, `batch` its experience.UpdateBatch.
"""

import hashlib
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

import losses
import rollout
import tasks
from modeling import logprobs
from plumbing import distributed, extension
from plumbing.distributed import all_max, all_sum, all_sums
from rl import query_reference


@dataclass
class Collected:
    """This rank's share of one RL step's rollouts: rows of a group are consecutive."""
    ro: rollout.Rollout
    rewards: torch.Tensor               # (B,) the rewards that enter the advantages
    valid: torch.Tensor                 # (B,) 0 where a row carries no loss: trained_rows
    prompt_idx: list[int]               # (B / G,) training-set index of each group's prompt
    first_rewards: torch.Tensor         # the first sampling round's rewards and accuracies:
    first_acc: torch.Tensor             # what reward / train_acc report
    info: dict                          # grader outcome counts, zero_var_frac, resampling


def my_prompts(run, step, round_=0) -> list[int]:
    """Training-set indices of this rank's prompts of an RL step (a sampling round of it), a function
    of (seed, step, round) (step_indices)."""
    args = run.args
    order = step_indices(len(run.data.ids), step if round_ == 0 else step * 7919 + round_,
                         args.rollout_batch, args.seed + round_)
    return rank_share(order, run.dist.rank, run.dist.world, args.rollout_batch, args.update_batch)


def step_indices(n_data, step, batch, seed) -> list[int]:
    """Indices of the problems of step `step`: an epoch-wise shuffle (drop_last), so a run is a
    function of (seed, step) and resuming needs no data-loader state."""
    per_epoch = n_data // batch
    if per_epoch == 0:
        raise ValueError(f"batch {batch} is larger than the data set ({n_data})")
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_data, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return perm[k * batch:(k + 1) * batch]


def rank_share(order, rank, world, rollout_batch, update_batch):
    """The entries of a rollout batch's prompt `order` that this rank samples: each update batch is
    split evenly across ranks, so every optimizer step sees the same global prompts at any world size."""
    per = update_batch // world
    return [order[u + rank * per + i] for u in range(0, rollout_batch, update_batch) for i in range(per)]


def update_batches(n, args, world) -> list[slice]:
    """The rows of each optimizer step among a rank's n: consecutive slices of --update-batch prompts
    (global, split over `world` ranks) x G responses."""
    size = args.update_batch // world * args.group_size
    return [slice(s, min(n, s + size)) for s in range(0, n, size)]


def sample_and_score(run, decoder, prompt_idx, step, round_) -> rollout.Graded:
    """G responses per prompt (consecutive rows), each graded by its row's task against the whole
    row; DAPO's overlong penalty enters the rewards, not the accuracies."""
    args, G = run.args, run.args.group_size
    with run.timer("gen"):
        seeds = [rollout.row_seed(args.seed, step, round_, i, j) for i in prompt_idx for j in range(G)]
        ro = rollout.sample_with(decoder, [run.data.ids[i] for i in prompt_idx for _ in range(G)], run.spec,
                                 temperature=args.temperature, top_p=args.top_p, seeds=seeds)
    with run.timer("reward"):
        rows = [run.data.rows[i] for i in prompt_idx for _ in range(G)]
        scores, correct, counts = tasks.score_rows(rollout.decode_responses(run.tokenizer, ro), rows,
                                                   format_reward=args.reward == "acc+format")
    rewards = torch.tensor(scores)
    if run.algo.overlong:
        L = args.max_new_tokens
        rewards += losses.overlong_penalty(ro.response_mask.sum(1).float(), L, run.algo.overlong_cache_len(L))
    acc = torch.tensor(correct).float()
    graded = rollout.Graded(ro, rewards, acc, prompt_idx, counts, keep=losses.nonconstant_groups(acc, G))
    return shaped(run, graded) if getattr(args, "shaping", None) else graded


# Reward shaping (--shaping NAME ...): an extension table (plumbing/extension.py). A row is a function
# (graded: rollout.Graded, run) -> (rewards (B,), {metric: value}): it sees the graded rollout (the
# tokens, their lengths, the accuracies, the rows' prompts) and returns the rewards that enter the
# advantages and the metrics it logs (this rank's mean of each; the step's line has their mean over
# ranks as shaping/<metric>). Rows apply in the order --shaping names them, after grading.
SHAPING: dict = extension.declare("shaping", {})


def shaped(run, graded: rollout.Graded) -> rollout.Graded:
    """The --shaping rows applied to one sampling round's rewards; their metrics join its counts."""
    rewards, counts = graded.rewards, dict(graded.counts)
    for name in run.args.shaping:
        rewards, metrics = SHAPING[name](replace(graded, rewards=rewards), run)
        counts.update({f"shaping/{k}": float(v) for k, v in metrics.items()})
    return replace(graded, rewards=torch.as_tensor(rewards, dtype=torch.float32), counts=counts)


def collect(run, decoder, step) -> Collected:
    """Sample and grade this rank's prompts, G responses each (DAPO: resample_groups)."""
    G, mine = run.args.group_size, my_prompts(run, step)
    first = sample_and_score(run, decoder, mine, step, 0)
    info = {"zero_var_frac": 1 - first.keep.float().mean().item(), "resample_rounds": 0, **first.counts}
    if run.algo.dynamic_sampling:
        return resample_groups(run, decoder, step, mine, first, info)
    everyone = trained_rows(torch.ones(len(mine) * G), first.ro, run.algo)
    return Collected(first.ro, first.rewards, everyone, mine, first.rewards, first.acc, info)


def resample_groups(run, decoder, step, mine, first, info) -> Collected:
    """DAPO's dynamic sampling: drop groups whose accuracies are all equal and sample more prompts (at
    most --max-resample-rounds extra rounds) until this rank's share is full; unfilled slots become
    zero-weight filler groups, so every rank still runs the same number of micro-batches (DDP and
    FSDP2 need that)."""
    G, rounds, have = run.args.group_size, [first], int(first.keep.sum())
    for r in range(1, run.args.max_resample_rounds + 1):
        if all_sum(torch.tensor(float(have < len(mine)))).item() == 0:  # every rank full (they
            break                                                      # sample together: FSDP2)
        rounds.append(sample_and_score(run, decoder, my_prompts(run, step, r), step, r))
        have += int(rounds[-1].keep.sum())
        info["resample_rounds"] = r
    kept = rollout.fill_groups(rounds, len(mine), G, run.tokenizer.pad_token_id)
    info["kept_groups"] = int(kept.valid.sum()) // G
    valid = trained_rows(kept.valid, kept.ro, run.algo)
    return Collected(kept.ro, kept.rewards, valid, kept.prompt_idx, first.rewards, first.acc, info)


def trained_rows(valid, ro: rollout.Rollout, algo) -> torch.Tensor:
    """(B,) 1 where a row carries loss: not DAPO filler, and with algo.mask_truncated not cut at the
    length limit (its reward still enters its group's baseline: the advantages use every row)."""
    return valid * ro.finished.to(valid.dtype).cpu() if algo.mask_truncated else valid


# ----------------------------------------------------------------------------------------------
# After scoring: pi_old's and the reference's log-probs of the rows, and what the update reads


@dataclass
class RolloutScores:
    """The rollout rows' log-probs before any update (B rows): the rollout policy's (PPO's pi_old:
    old, prompt, entropy) and, where one is loaded, the reference model's (ref, ref_prompt)."""
    old: torch.Tensor                   # (B, R) response log-probs of the rollout policy (PPO's pi_old)
    prompt: torch.Tensor                # (B, P-1) its prompt log-probs (Query-KL monitor, code weights)
    entropy: torch.Tensor               # (B, R)
    ref: torch.Tensor | None            # (B, R) reference response log-probs, if a reference is loaded
    ref_prompt: torch.Tensor | None     # (B, P-1) and its prompt log-probs (--qkl-ref live)
    fresh: slice | None = None          # the step at scale: rows whose old/prompt/entropy its first
                                        # update forward fills in (scale_step.on_policy_rows)

    @classmethod
    def empty(cls, packed: logprobs.Packed, fresh: slice, has_ref: bool) -> "RolloutScores":
        B, P, R = packed.input_ids.shape[0], packed.P, packed.input_ids.shape[1] - packed.P

        def zeros(n):
            return torch.zeros(B, n, device=packed.input_ids.device)
        return cls(zeros(R), zeros(P - 1), zeros(R), zeros(R) if has_ref else None,
                   zeros(P - 1) if has_ref else None, fresh)

    def record(self, rows, prompt_cols, resp_cols, s: logprobs.TokenScores):
        """pi_old's scores of some rows (a micro-batch's, at its trimmed columns)."""
        self.old[rows, resp_cols], self.prompt[rows, prompt_cols] = s.response.detach(), s.prompt.detach()
        self.entropy[rows, resp_cols] = s.entropy.detach()             # (with grad under a bonus)


@dataclass
class UpdateBatch:
    """What the PPO update needs, per rollout row (B rows on this rank)."""
    packed: logprobs.Packed
    resp_mask: torch.Tensor             # (B, R) response tokens of valid rows
    prompt_mask: torch.Tensor           # (B, P-1) prompt tokens of valid rows
    valid: torch.Tensor                 # (B,)
    scores: RolloutScores               # pi_old's and the reference's log-probs of the rows
    qref: torch.Tensor                  # (B, P-1) the Query-KL reference's prompt log-probs
    adv: torch.Tensor                   # (B,)
    weights: torch.Tensor | None        # (B,) query weights
    sampler: torch.Tensor | None = None  # (B, R) the sampler's log-probs of the tokens (rollout.Rollout's)
    signal: torch.Tensor | None = None  # (B,) bool: the row's advantage carries a signal (§8.6)


@dataclass
class StepResult:
    """What one RL step computed (train.rl_step, scale_step.rl_step), for the loop's metrics and hooks."""
    collected: Collected                # this rank's rollouts, graded
    ro: rollout.Rollout                 # collected.ro on the device
    batch: "UpdateBatch"                # masks, pi_old's scores, A, w: what the update read
    prompts: query_reference.PromptBatch  # what the Query-KL reference saw
    qref: torch.Tensor                  # (B, P-1) the Query-KL reference's prompt log-probs
    update: dict                        # the update's statistics (ppo_update)


def code_query_weights(prompt_logp, prompt_mask, valid, update_rows: list[slice]) -> torch.Tensor:
    """The released code's query weights (B,): the current policy's prompt NLL (no grad) against its
    mean over each global update batch, unclipped (method.md §4). DAPO filler rows keep 1."""
    nll = -torch.where(prompt_mask > 0, prompt_logp, 0.0).sum(1)          # (B,) sequence NLL of each prompt
    w = torch.ones_like(nll)
    for rows in update_rows:
        ok = valid[rows] > 0
        mean = (all_sum(nll[rows][ok].sum()) / all_sum(ok.sum().float()).clamp_min(1)).item()
        w[rows] = torch.where(ok, losses.query_weights(nll[rows].clamp_min(1e-8), mean_nll=mean), 1.0)
    return w


def advantages(run, rewards, scores: RolloutScores, resp_mask, valid) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B,), by the row --adv chooses of losses.ADVANTAGES (its own options from the run's), and
    (B,) bool: the rows whose advantage carries a signal (losses.carries_signal; method.md §8.6).
    RLOO's KL penalty in the reward (R - beta sum_t KL_t) is a regularizer, not a signal: the
    signal is judged on the advantages of the rewards before it."""
    algo, G = run.algo, run.args.group_size
    row = losses.ADVANTAGES[algo.adv]
    own = extension.option_values(row, run.args) if getattr(row, "OPTIONS", ()) else {}   # (its own knobs)

    def estimate(r):
        return losses.group_advantages(r, G, algo.adv, algo.adv_eps, valid, reduce=all_sum, options=own)
    adv = signal = estimate(rewards)
    if algo.kl is not None and algo.kl_in == "reward":                   # RLOO: R - beta * sum_t KL_t
        adv = estimate(losses.kl_penalized_rewards(rewards, scores.old, scores.ref, resp_mask, algo.beta,
                                                   algo.kl))
    return adv, losses.carries_signal(signal, rewards, G)


# ----------------------------------------------------------------------------------------------
# The step's metrics: its line of metrics.jsonl

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


def update_statistics(update: dict) -> dict:
    """What the loop logs of a step's update (ppo_update's: "applied", the applied optimizer steps'
    statistics, each a dict of this rank's sums, grad_norm global; its counts and lr, kept):
    summed over ranks: rl_loss's averaged over the steps; the clip fractions over those that can
    clip (until one step is applied the policy is the rollout's: ratio 1, nothing clipped);
    grad_norm (None: every step was skipped). Every rank applies the same steps."""
    applied, kept = update["applied"], {k: v for k, v in update.items() if k != "applied"}
    stats, clip_stats, norms, off_policy = {}, {}, [], losses.off_policy_stats()
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
    return {**out, **kept}


def step_metrics(run, step, c, ro, batch, qref, upd) -> dict:
    """One metrics line of train.rl_step. Sums go over ranks in one collective; rates divide by
    global counts. c: the step's experience.Collected; batch: its experience.UpdateBatch (masks, pi_old
    scores, weights); qref: (B, P-1) the initial policy's prompt log-probs (the query_kl monitor's
    reference); upd: the update's statistics. With more than one task among the training rows,
    train_acc/<task> too (the same keys on every rank). The premise meter premise_r (premise_sums,
    method.md §11) every step, its prompt NLLs the Query-KL cache's where the run has one (else
    qref's); at step 1, sample_digest (a GRPO / ERPO pair of one seed shares it)."""
    sc, qmask, resp_mask, w = batch.scores, batch.prompt_mask, batch.resp_mask, batch.weights
    world, seconds = run.dist.world, run.timer.seconds                  # seconds per phase on this rank
    update_tokens = batch.packed.attention_mask.sum() * run.args.ppo_epochs  # the update's forwards
    per_task = list(run.task_names) if len(run.task_names) > 1 else []
    released = {} if sc.ref_prompt is None else released_kl_terms(sc, qmask, resp_mask, run.algo.agg)
    info, mask = c.info, ro.response_mask                               # mask: (B, R) response tokens
    kl = 0.0 if sc.ref is None else losses.policy_kl(sc.old, sc.ref, "k3") * resp_mask  # k3 of KL(pi || ref)
    sampler = sampler_vs_old(batch.sampler, sc.old, resp_mask)
    G = run.args.group_size                                             # premise_r's prompt NLLs: the cache's
    ref = qref if run.cache is None else run.cache.ref_logp(c.prompt_idx, G, qmask.shape[1]).to(qmask.device)
    s = all_sums({
        "rows": len(c.first_rewards), "tok": mask.sum(), "valid": c.valid, "kl_tok": resp_mask.sum(),
        "reward": c.first_rewards, "acc": c.first_acc,                  # the first sampling round's
        "qkl": losses.query_kl(sc.prompt, qref, qmask),                 # (B,) per-row Query-KL (k3)
        "ent": sc.entropy * mask, "kl": kl, "w": 0.0 if w is None else w, "kept": info.get("kept_groups", 0),
        "trunc": (~ro.finished).float(), "zero_var": info["zero_var_frac"],
        "new_turn": rollout.new_turns(run.tokenizer, ro), "update_tokens": update_tokens, **sampler,
        **{f"reward_{k}": info.get(k, 0) for k in ("timeout", "error", "no_answer")},
        **{f"{k}/{t}": info.get(f"{k}/{t}", 0) for t in per_task for k in ("total", "correct")},
        **{f"{k}_{part}": v for k, pair in released.items() for part, v in zip(("sum", "n"), pair)},
        **premise_sums(ref, qmask, sc.old, resp_mask, batch.valid, G),
        **{k: v for k, v in info.items() if k.startswith("shaping/")}})
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
         **premise_meter(s),       # r(prompt NLL under pi_0, response NLL under pi_old), its 95% interval
         "update_tok_per_s": s["update_tokens"] / seconds["update"],
         **{k: s[k] for k in ("reward_timeout", "reward_error", "reward_no_answer")},
         **{k: s[k] / world for k in s if k.startswith("shaping/")}}      # (each rank's mean)
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
        m["kept_groups"] = s["kept"]
    if step == 0:                                       # a GRPO and an ERPO run of one seed sample alike
        m["sample_digest"] = sample_digest(ro)          # at step 1 (study.headline pairs them by it)
    return m


def sample_digest(ro: rollout.Rollout) -> str:
    """16 hex digits of sha256 over every rank's sampled response ids (padding zeroed), in rank order:
    equal for two runs that sampled the same tokens at the same world size."""
    ids = (ro.response_ids * ro.response_mask).cpu().numpy()
    mine = hashlib.sha256(str(ids.shape).encode() + ids.tobytes()).hexdigest()
    return hashlib.sha256("".join(distributed.all_gather_list([mine])).encode()).hexdigest()[:16]


# The premise meter (issue #43; method.md §11): the paper's App. D coupling, live, from the step's tensors

def premise_sums(ref_prompt, prompt_mask, old, resp_mask, valid, group_size) -> dict[str, torch.Tensor]:
    """This rank's sums for premise_r over its prompts with a valid row. ref_prompt (B, P-1): the
    initial policy's prompt log-probs; old (B, R): pi_old's response log-probs; the masks are 0 on
    invalid rows (DAPO's filler); rows of a prompt consecutive. x: the prompt's mean per-token NLL,
    y: the mean over its valid rows of each response's mean per-token NLL (float64)."""
    pm, rm = prompt_mask.double(), resp_mask.double()
    q = -(ref_prompt.double() * pm).sum(1) / pm.sum(1).clamp_min(1.0)                  # (B,)
    r = -(old.double() * rm).sum(1) / rm.sum(1).clamp_min(1.0)                          # (B,)
    v = valid.double().view(-1, group_size)
    rows = v.sum(1)
    ok = rows > 0
    x = ((q.view(-1, group_size) * v).sum(1) / rows.clamp_min(1.0))[ok]
    y = ((r.view(-1, group_size) * v).sum(1) / rows.clamp_min(1.0))[ok]
    return {"premise_n": ok.sum(), "premise_x": x.sum(), "premise_y": y.sum(), "premise_xx": (x * x).sum(),
            "premise_yy": (y * y).sum(), "premise_xy": (x * y).sum()}


PREMISE_Z = 1.959964       # the normal's 97.5% quantile: premise_r's two-sided 95% interval


def premise_interval(r, n) -> dict:
    """premise_r_lo / premise_r_hi: Fisher's z interval of an r over n prompts, tanh(atanh(r) +- z /
    sqrt(n - 3)), null where r is or n <= 3. One step's prompts are few (32 by default: about +-0.33
    around r = 0.2), so a single step's r says little; the interval says how little."""
    if r is None or n <= 3:
        return {"premise_r_lo": None, "premise_r_hi": None}
    z, half = math.atanh(max(-1 + 1e-12, min(1 - 1e-12, r))), PREMISE_Z / math.sqrt(n - 3)
    return {"premise_r_lo": math.tanh(z - half), "premise_r_hi": math.tanh(z + half)}


def premise_meter(s: dict) -> dict:
    """premise_r and its interval (premise_interval) from premise_sums' sums over ranks."""
    r = premise_r(s)
    return {"premise_r": r, **premise_interval(r, s["premise_n"])}


def premise_r(s: dict) -> float:
    """Pearson's r from premise_sums' sums (over ranks); None (null in metrics.jsonl, which a NaN would
    not compare equal to) under 2 prompts or a constant side."""
    n = s["premise_n"]
    sxx, syy = n * s["premise_xx"] - s["premise_x"] ** 2, n * s["premise_yy"] - s["premise_y"] ** 2
    if n < 2 or sxx <= 0 or syy <= 0:
        return None
    return (n * s["premise_xy"] - s["premise_x"] * s["premise_y"]) / math.sqrt(sxx * syy)

# ----------------------------------------------------------------------------------------------
# The step's clock (Run.timer)
# Where an RL step's time (and GPU memory) goes: wall seconds per phase (verl logs the same as
# timing_s/*), and on CUDA each phase's memory.
#
#     t = Phases(device)
#     with t("gen"): ...                  # sampling
#     with t("reward"): ...               # grading
#     m.update(t.metrics())               # {"time_gen": s, "time_reward": s, ...}; the clock restarts
#
# Phases may repeat within a step (DAPO resampling rounds); their times add up. On CUDA the queue is
# synchronised at each phase boundary, so kernels are charged to the phase that launched them (the
# sync costs little next to a phase, which is at least one whole forward pass).
#
# On CUDA each phase also records, in GiB, the most of any rank (metrics() reduces over ranks):
#   mem_alloc_<phase>     the allocator's peak of live tensors in the phase (max_memory_allocated)
#   mem_reserved_<phase>  its peak of memory held, cached blocks and fragmentation included
#   mem_used_<phase>      the driver's used memory at the phase's end (total - free: the CUDA context,
#                         NCCL's buffers, other processes too) -- what no fake-tensor measurement sees
# These are what --dry-run's plan (plumbing/memory_plan.py) predicts from the code, measured in a run.



GIB = 2.0**30
MEMORY = ("alloc", "reserved", "used")


class Phases:
    def __init__(self, device, cuda=torch.cuda):
        self.is_cuda = torch.device(device).type == "cuda"
        self.cuda = cuda                                # (a stand-in in the tests)
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}             # "mem_<kind>_<phase>" -> GiB, this rank

    @contextmanager
    def __call__(self, name):
        if self.is_cuda:
            self.cuda.synchronize()
            self.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.is_cuda:
                self.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if self.is_cuda:
                self._record_memory(name)

    def _record_memory(self, name):
        free, total = self.cuda.mem_get_info()
        now = {"alloc": self.cuda.max_memory_allocated(), "reserved": self.cuda.max_memory_reserved(),
               "used": total - free}
        for kind, b in now.items():                    # a repeated phase: its largest
            key = f"mem_{kind}_{name}"
            self.memory[key] = max(self.memory.get(key, 0.0), b / GIB)

    def metrics(self) -> dict[str, float]:
        """{"time_<phase>": seconds} since the last call (and on CUDA {"mem_<kind>_<phase>": GiB}, the
        most of any rank: a collective, so every rank calls it), then start afresh."""
        out = {f"time_{k}": v for k, v in self.seconds.items()}
        if self.memory:                                 # one collective for all of them
            keys = sorted(self.memory)
            most = all_max(torch.tensor([self.memory[k] for k in keys], dtype=torch.float64))
            out.update(zip(keys, most.tolist()))
        self.seconds, self.memory = {}, {}
        return out
