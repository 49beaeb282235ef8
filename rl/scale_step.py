"""The RL step at scale: the same step as train.rl_step, with its fast paths on.

train.rl_step reads top to bottom and runs by default (the embedded tiny world, one process). The
GPU configs turn on the options that send each step here instead (train.fast_paths says which):

- scoring (modeling/logprobs.score_tokens): each prompt runs once for its G responses
  (--share-prompts), or each micro-batch's real tokens run packed without padding (--pack), through
  a fused float32 head (hidden states x lm_head in chunks: no (B, L, V) logits in memory);
- the step's plan (rl/plan_step): micro-batches longest first under a token cap
  (--micro-tokens), as many on every rank (FSDP2 gathers the weights in each forward: --fsdp),
  trimmed to their own width; groups dealt to the ranks by length (deal_by_length);
- pi_old's forward elided for the first update batch: that update's own first forward IS pi_old's
  (on_policy_rows, is_pi_old_forward);
- the step's scalars read back from the device once per optimizer step (distributed.read_scalars).

tests/test_golden.py holds this step and train.rl_step to the same golden runs (the same tokens,
rewards and counts; losses, KLs and gradient norms within the measured rounding of
tests/golden/tolerances.json).
"""

from dataclasses import dataclass, replace

import torch

import losses
import rollout
from modeling import logprobs
from plumbing import batching, distributed, faults, optimizer
from rl import experience, query_reference


def rl_step(run, step, before_update=None) -> experience.StepResult:
    """train.rl_step with the fast paths on (module doc); returns what it computed."""
    G, dev = run.args.group_size, run.dist.device
    collected = rollouts(run, step)                                      # G responses per prompt, graded
    ro, valid = collected.ro.to(dev), collected.valid.to(dev)
    packed = ro.packed()                               # [prompt | response] rows
    resp_mask = ro.response_mask.float() * valid[:, None]
    prompt_mask = packed.prompt_tok_mask.float() * valid[:, None]
    update_rows = experience.update_batches(len(ro.finished), run.args, run.dist.world)
    fresh = on_policy_rows(run, update_rows)
    plan = plan_step(run.args, packed, collected.valid.tolist(), update_rows, fresh,
                                has_ref=run.ref is not None)
    with run.timer("score"):
        scores = score_old_and_ref(run, packed, fresh, plan)             # pi_old, reference
    prompts = query_reference.PromptBatch(collected.prompt_idx, G, packed.P - 1, scores.prompt, prompt_mask,
                                          scores.ref_prompt, step, packed.input_ids[:, :packed.P])
    qref = run.qref.prompt_logp(prompts)                                 # Query-KL's reference
    adv, signal = experience.advantages(run, collected.rewards.to(dev), scores, resp_mask, valid)  # A
    judge_signal(plan, signal, valid, update_rows)           # which updates step (§8.6)
    w = row_weights(run, collected.prompt_idx, scores.prompt, prompt_mask, valid, update_rows)  # w(q)
    batch = experience.UpdateBatch(packed, resp_mask, prompt_mask, valid, scores, qref, adv, w, ro.logprobs)
    if before_update is not None:                                        # the monitors, at pi_old
        before_update(batch, plan)
    with run.timer("update"):
        update = ppo_update(run, batch, plan)
    return experience.StepResult(collected, ro, batch, prompts, qref, update)


def rollouts(run, step) -> experience.Collected:
    """The step's rollouts from a decoding copy (a LoRA policy's merged copy, freed before scoring
    needs the memory), their groups dealt to the ranks by length."""
    with run.decoding_copy(run.policy, run.spec.weights_dtype) as decoder:
        collected = experience.collect(run, decoder, step)
    return deal_by_length(run, collected)                   # the ranks' work evened out


def on_policy_rows(run, update_rows) -> slice:
    """Rows that get no pi_old forward of their own: the first update batch's, unless something needs
    pi_old's log-probs before the update (RLOO's KL-penalised rewards, the code weights:
    losses.Algo.needs_pi_old_first). The update's first forward scores them (is_pi_old_forward)."""
    return slice(0, 0) if run.algo.needs_pi_old_first else update_rows[0]


def is_pi_old_forward(epoch: int, u: int, fresh: slice) -> bool:
    """Is this update forward also pi_old's (recorded as the old log-probs and the monitors)?"""
    # Exact, not an approximation: the first PPO epoch's first optimizer step runs its forward on the
    # rollout's weights (nothing is applied yet), so its log-probs ARE pi_old's: the ratio is exactly 1.
    return epoch == u == 0 and fresh.stop > 0


# ----------------------------------------------------------------------------------------------
# RL, part 2: log-probs, query weights, PPO updates


@torch.no_grad()
def score_old(run, packed: logprobs.Packed, scores: experience.RolloutScores, mbs: list[logprobs.MicroBatch],
              group):
    """pi_old's log-probs and entropy of the rows of `mbs` (no grad, the unwrapped policy)."""
    for mb in mbs:
        part, prompt_cols, resp_cols = packed.trimmed(mb)                # no all-padding columns
        s = logprobs.score_tokens(distributed.unwrap(run.policy), part, run.args.temperature, True, group,
                                  checked=True)
        scores.record(mb.rows, prompt_cols, resp_cols, s)
    distributed.reshard(run.policy)  # FSDP2 keeps the root gathered after a no-grad forward


@torch.no_grad()
def score_old_and_ref(run, packed: logprobs.Packed, fresh: slice,
                      plan: "StepPlan") -> experience.RolloutScores:
    """No-grad forwards: the policy over the rows after `fresh`, the reference over all rows."""
    scores = experience.RolloutScores.empty(packed, fresh, has_ref=run.ref is not None)
    score_old(run, packed, scores, plan.old, plan.group)
    for mb in plan.ref:
        part, prompt_cols, resp_cols = packed.trimmed(mb)
        s = logprobs.score_tokens(run.ref, part, run.args.temperature, group=plan.group, checked=True)
        scores.ref[mb.rows, resp_cols], scores.ref_prompt[mb.rows, prompt_cols] = s.response, s.prompt
    distributed.reshard(run.ref)  # FSDP2 keeps the root gathered after a forward with no backward
    return scores


def row_weights(run, prompt_idx, prompt_logp, prompt_mask, valid, update_rows):
    """Per-row query weights (method.md §4), or None: train.query_weights's, over this step's
    update batches."""
    algo, G = run.algo, run.args.group_size
    if algo.weights == "none":
        return None
    if algo.weights == "paper":
        w = losses.query_weights(run.cache.nll[torch.tensor(prompt_idx)], mean_nll=run.cache.nll_mean,
                                 clip=algo.weight_clip)
        return w.repeat_interleave(G).to(valid.device)
    return experience.code_query_weights(prompt_logp, prompt_mask, valid, update_rows)


def ppo_update(run, batch: experience.UpdateBatch, plan: "StepPlan") -> dict:
    """One optimizer step per global update batch with a signal (UpdatePlan.takes_step), x ppo_epochs
    -> train.ppo_update's record (each applied step's statistics, the counts, the lr). The first
    update forward is pi_old's for the on-policy rows (on_policy_rows):
    if that update takes no step, they are scored on their own."""
    applied, skipped, no_signal = [], 0, 0
    lr = run.opt.param_groups[0]["lr"]                                   # the step's (its first update's)
    for epoch in range(run.args.ppo_epochs):
        for u, update in enumerate(plan.updates):
            is_pi_old = is_pi_old_forward(epoch, u, batch.scores.fresh)
            if not update.takes_step(run.args.no_signal):               # no signal (the same on every rank)
                if is_pi_old:
                    score_old(run, batch.packed, batch.scores, plan.fresh, plan.group)
                no_signal += 1
                continue
            stats = optimizer_step(run, batch, update, is_pi_old, plan.group)
            if stats is None:
                skipped += 1
            else:
                applied.append(stats)
    return {"applied": applied, "skipped_steps": skipped, "no_signal_steps": no_signal, "lr": lr}


def optimizer_step(run, batch: experience.UpdateBatch, update: "UpdatePlan", is_pi_old: bool,
                   group: int):
    """Gradient of one update batch, clipped, applied if its loss and gradient are finite on every
    rank -> its statistics on the host (this rank's sums; grad_norm global), or None if skipped."""
    stats = accumulate_gradient(run, batch, update, is_pi_old, group)
    norm = optimizer.clip_grad(run.policy, run.args.grad_clip)
    host = distributed.read_scalars({**stats, "grad_norm": norm}, finite=("loss", "grad_norm"))
    if host is None:
        run.guard.bad_step(run.opt, run.sched)                           # not applied; too many: the end
        return None
    optimizer.step(run.opt, run.sched)
    return host


def accumulate_gradient(run, batch: experience.UpdateBatch, update: "UpdatePlan", is_pi_old: bool,
                        group: int) -> dict[str, torch.Tensor]:
    """Forward + backward of each micro-batch of one optimizer step; -> its loss statistics, summed
    over micro-batches as float64 tensors (no host read here). Every loss term is divided by the
    GLOBAL count of its update batch (tokens or sequences over all micro-batches and ranks), so the
    gradient equals that of one big batch at any micro-batch size and world size (DDP averages
    over ranks, hence the `* world`). is_pi_old: this forward is pi_old's too (record it)."""
    args, algo, scores, stats = run.args, run.algo, batch.scores, {}
    for k, mb in enumerate(update.micro_batches):
        part, pcols, rcols = batch.packed.trimmed(mb)                    # rows mb.rows, fewer columns
        rows = mb.rows
        torch.clear_autocast_cache()      # bf16-mixed: cast the weights anew (plumbing/optimizer.py)
        with distributed.grad_sync(run.policy, k == len(update.micro_batches) - 1):
            now = logprobs.score_tokens(run.policy, part, args.temperature, is_pi_old or algo.uses_entropy,
                                        group, checked=True, entropy_grad=algo.entropy_coef > 0)
            if is_pi_old:
                scores.record(rows, pcols, rcols, now)
            loss, st = losses.rl_loss(                           # PG(A*w) [+ b*PolicyKL] [+ a*QueryKL]
                algo, logp=now.response, old_logp=scores.old[rows, rcols],
                ref_logp=scores.ref[rows, rcols] if algo.has_policy_kl_loss else None,
                resp_mask=batch.resp_mask[rows, rcols], advantages=batch.adv[rows],
                weights=None if batch.weights is None else batch.weights[rows],
                prompt_logp=now.prompt, prompt_ref_logp=batch.qref[rows, pcols],
                prompt_mask=batch.prompt_mask[rows, pcols],
                num_tokens=update.num_tokens, num_seqs=update.num_seqs, max_len=args.max_new_tokens,
                sampler_logp=batch.sampler[rows, rcols], entropy=now.entropy)
            (loss * run.dist.world).backward()
        faults.point("mid-step")
        for key, v in st.items():
            stats[key] = stats.get(key, 0.0) + v.detach().double()
    return stats

# ----------------------------------------------------------------------------------------------
# The step's plan: its optimizer steps and the micro-batches of each forward, planned on the host
# from the rollout's lengths; and the groups dealt to the ranks by length

@dataclass
class Group:
    """One prompt's G rows, as deal_by_length moves them between ranks (on the CPU, trimmed)."""
    ro: rollout.Rollout
    rewards: torch.Tensor               # (G,)
    valid: torch.Tensor                 # (G,)
    prompt_idx: int
    tokens: int                         # prompt + response tokens of its G rows: what scoring it costs


def deal_by_length(run, c: experience.Collected) -> experience.Collected:
    """Whole groups dealt to the ranks by length (batching.deal) within each update batch: the same
    groups make each optimizer step as before, on the same number of rows per rank, but no rank
    gets all the long responses. One all-gather of the step's groups; nothing on one process. The
    first sampling round's rewards (reward / train_acc) stay where they were: they are summed."""
    if run.dist.world == 1:
        return c
    world, G = run.dist.world, run.args.group_size
    ro, per = c.ro.to("cpu"), run.args.update_batch // world       # groups of an update batch, per rank
    mine = []
    for k, idx in enumerate(c.prompt_idx):
        rows = slice(k * G, (k + 1) * G)
        g = trimmed(ro.take(rows))
        tokens = int(g.prompt_mask.sum() + g.response_mask.sum())
        mine.append(Group(g, c.rewards[rows].cpu(), c.valid[rows].cpu(), idx, tokens))
    everyone = distributed.all_gather_list([mine])                     # [rank][group]
    kept = []
    for u in range(0, len(mine), per):                                 # each update batch
        pool = [g for groups in everyone for g in groups[u:u + per]]
        kept += [pool[i] for i in batching.deal([g.tokens for g in pool], world)[run.dist.rank]]
    return replace(c, ro=rollout.cat_rollouts([g.ro for g in kept], run.tokenizer.pad_token_id),
                   rewards=torch.cat([g.rewards for g in kept]), valid=torch.cat([g.valid for g in kept]),
                   prompt_idx=[g.prompt_idx for g in kept])


def trimmed(ro: rollout.Rollout) -> rollout.Rollout:
    """Rows without their all-padding columns (prompts are left-padded, responses right-padded)."""
    left = ro.prompt_ids.shape[1] - int(ro.prompt_mask.sum(1).max())   # padding columns on the left
    R = int(ro.response_mask.sum(1).max())
    return rollout.Rollout(ro.prompt_ids[:, left:], ro.prompt_mask[:, left:], ro.response_ids[:, :R],
                           ro.response_mask[:, :R], ro.logprobs[:, :R], ro.finished)


@dataclass
class UpdatePlan:
    """One optimizer step: its micro-batches and the global counts its loss is divided by."""
    micro_batches: list[logprobs.MicroBatch]
    num_tokens: float                   # valid response tokens of the update batch, all ranks (>= 1)
    num_seqs: float                     # valid rows of the update batch, all ranks (0: DAPO filler only)
    num_signal: float | None = None     # of those, rows whose advantage is not ~0 (judge_signal; 0: none)

    def takes_step(self, no_signal: str) -> bool:
        """An update batch in which every valid row's advantage is ~0 (losses.carries_signal: what the
        estimator produced, e.g. every group's rewards equal), or of DAPO filler only, takes no
        optimizer step unless no_signal is "step" (--no-signal; method.md §8.6): its loss would be
        the KL terms alone, whose gradient is ~0 near the reference, and AdamW would normalise that
        into a full lr-sized step in every weight. Skipped, the moments, weight decay and the LR
        schedule wait too. Filler only: nothing in the loss, never a step."""
        if self.num_signal is None:
            raise RuntimeError("UpdatePlan.num_signal is set once the advantages exist (judge_signal)")
        return self.num_seqs > 0 and (self.num_signal > 0 or no_signal == "step")


@dataclass
class StepPlan:
    """Every host-side decision of a step's forwards."""
    old: list[logprobs.MicroBatch]      # no-grad pi_old forwards: the rows after the on-policy ones
    fresh: list[logprobs.MicroBatch]    # the on-policy rows, which the first update forward scores as pi_old
    ref: list[logprobs.MicroBatch]      # reference forwards, all rows (none without a reference)
    updates: list[UpdatePlan]           # one per update batch (each PPO epoch repeats them)
    group: int                          # G where each prompt runs once for its G rows, else 1


def micro_batches(args, packed: logprobs.Packed, rows: range) -> list[logprobs.MicroBatch]:
    """Rows as micro-batches, longest first: <= --micro-batch rows, <= --micro-tokens tokens (the
    real ones where the full-row forward is packed: --pack without shared prompts; else padded),
    whole groups if prompts are shared, as many on every rank."""
    lengths, group = [packed.lengths[i] for i in rows], batching.prompt_group(args)
    pack = bool(getattr(args, "pack", False)) and group == 1

    def plan(count=0):
        return batching.microbatch_plan(lengths, args.micro_batch, args.micro_tokens, count, group, pack)
    most = int(distributed.all_max(torch.tensor(len(plan()))))
    return [packed.micro_batch([rows.start + i for i in mb], pack) for mb in plan(most)]


def plan_step(args, packed: logprobs.Packed, valid: list[float], update_rows: list[slice], fresh: slice,
              has_ref: bool) -> StepPlan:
    """The step's plan from the host lengths and validity of its rows: one collective for the
    global counts, one per forward loop (the most micro-batches any rank runs), one host read
    (do a group's rows share their prompt?). fresh: the on-policy rows (train.on_policy_rows). Which
    update batches carry a signal is judged once the advantages exist (judge_signal)."""
    B, G = len(packed.lengths), args.group_size
    local = {}
    for u, rows in enumerate(update_rows):
        lengths, ok = packed.lengths[rows], valid[rows]
        local[f"tokens{u}"] = sum(r * v for (_, r), v in zip(lengths, ok))   # valid response tokens
        local[f"seqs{u}"] = sum(ok)
    counts = distributed.all_sums(local)
    updates = [UpdatePlan(micro_batches(args, packed, range(rows.start, rows.stop)),
                          max(1.0, counts[f"tokens{u}"]), counts[f"seqs{u}"])
               for u, rows in enumerate(update_rows)]
    group = batching.prompt_group(args)
    group = group if group > 1 and logprobs.shares_prompts(packed, G) else 1
    return StepPlan(old=micro_batches(args, packed, range(fresh.stop, B)),
                    fresh=micro_batches(args, packed, range(fresh.start, fresh.stop)),
                    ref=micro_batches(args, packed, range(B)) if has_ref else [],
                    updates=updates, group=group)


def judge_signal(plan: StepPlan, signal, valid, update_rows: list[slice]):
    """Each update batch's num_signal: its valid rows (all ranks) whose advantage carries a signal."""
    ok = (signal.to(valid.dtype) * valid).tolist()
    counts = distributed.all_sums({f"signal{u}": sum(ok[rows]) for u, rows in enumerate(update_rows)})
    for u, update in enumerate(plan.updates):
        update.num_signal = counts[f"signal{u}"]
