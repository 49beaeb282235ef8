"""Train a policy with ERPO, GRPO or a relative of theirs, or warm-start it with SFT.

    torchrun train.py --algo erpo --alpha 0.01            # ERPO on the embedded tiny world (CPU ok)
    torchrun train.py --algo grpo                         # the GRPO baseline, same setup
    torchrun --nproc_per_node=8 train.py --config configs/paper_qwen7b.json --algo erpo
    python train.py --algo sft --export data/tinymath/warmstart   # the warm start (from data/tinymath/base)

One RL step reads top to bottom in `rl_step`: pick prompts -> sample G responses each -> rewards ->
advantages (x query weights) -> PPO updates over micro-batches -> log. What distinguishes the
algorithms is a row of `losses.ALGOS`; every loss term is in `losses.py` (equations: docs/method.md).
"""

import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm import tqdm

import batching
import distributed
import errors
import faults
import interrupts
import losses
import memory_measure
import memory_plan
import metrics
import optimizer
import options
import query_cache
import reward
import rollout
import run_dir
import sft
import timer
from data.prompts import PromptSet, load_prompt_set, step_indices
from distributed import all_max, all_sum, print0
from heldout import check_fits, heldout_accuracy

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinymath")

# ----------------------------------------------------------------------------------------------
# Options: the embedded tiny world, minutes on 2 CPU cores; the paper's setup is configs/paper_qwen7b.json
# (--config; flags override it). Loss knobs (--alpha, --beta, --kl, ...) are generated from losses.Algo's fields.
OPTIONS = [
    # name                default                              help [, choices or a range]
    ("algo",              "erpo",                              "sft, or a row of losses.ALGOS", ["sft", *losses.ALGOS]),
    ("model",             os.path.join(TINY, "warmstart"),     "HF folder or hub id of the policy (also the reference model)"),
    ("train_data",        os.path.join(TINY, "train.jsonl"),   "training problems: JSONL path or benchmark name"),
    ("eval_data",         ["tiny-test", "tiny-ood", "tiny-hard"], "held-out sets for periodic evaluation (names or paths)"),
    ("template",          "plain",                             "prompt template (data/prompts.py)", ["plain", "paper"]),
    ("out",               None,                                "run folder (config.json, metrics.jsonl, ckpt/); default runs/<algo>"),
    ("seed",              0,                                   "seed of prompt order and of every sampled row"),
    # rollout: prompts per step, responses per prompt, sampling
    ("steps",             50,                                  "RL steps (one rollout batch each)", ">=0"),
    ("rollout_batch",     32,                                  "prompts sampled per RL step (global, all ranks)", ">=1"),
    ("update_batch",      16,                                  "prompts per optimizer step (global); rollout/update = optimizer steps per RL step", ">=1"),
    ("group_size",        8,                                   "responses per prompt (G)", ">=2"),
    ("temperature",       1.0,                                 "rollout temperature; log-probs are computed on logits/T", ">0"),
    ("top_p",             1.0,                                 "nucleus sampling (1 = off)", "(0,1]"),
    ("max_prompt_len",    128,                                 "longer prompts are dropped from the training set", ">=1"),
    ("max_new_tokens",    96,                                  "response length limit", ">=1"),
    ("sampler",           "kv",                                "our KV-cache sampler or HF generate", ["kv", "hf"]),
    ("gen_batch",         256,                                 "rows per sampler call, at most", ">=1"),
    ("kv_budget",         0,                                   "KV-cache positions per sampler call (0: 40% of free GPU memory; CPU: no cap)", ">=0"),
    ("max_resample_rounds", 4,                                 "dynamic sampling: extra sampling rounds at most", ">=0"),
    ("reward",            "acc",                               "binary accuracy, or 0.9*acc + 0.1*format", ["acc", "acc+format"]),
    # optimisation
    ("lr",                2e-4,                                "AdamW learning rate", ">0"),
    ("weight_decay",      0.01,                                "AdamW weight decay", ">=0"),
    ("warmup",            0,                                   "linear warm-up, in optimizer steps", ">=0"),
    ("grad_clip",         1.0,                                 "clip the global grad norm (0 = off)", ">=0"),
    ("ppo_epochs",        1,                                   "passes over each rollout batch", ">=1"),
    ("micro_batch",       64,                                  "sequences per forward/backward on each rank", ">=1"),
    ("micro_tokens",      0,                                   "also at most this many padded tokens per micro-batch (0 = no cap)", ">=0"),
    ("dtype",             "auto",                              "bf16-mixed: fp32 weights + bf16 autocast (2x faster matmuls on CPUs with AVX512-BF16/AMX); auto: that on CUDA, fp32 on CPU", ["auto", "float32", "bfloat16", "bf16-mixed"]),
    ("fsdp",              False,                               "shard the policy (and reference) with FSDP2 instead of DDP replicas (large models)"),
    ("grad_ckpt",         False,                               "activation checkpointing of every decoder layer (long sequences)"),
    ("share_prompts",     True,                                "training forwards run each prompt once for its G responses (not with --fsdp/--grad-ckpt)"),
    ("dry_run",           False,                               "print the per-GPU memory plan (memory_plan.py) and exit; no weights loaded"),
    ("plan_gpus",         8,                                   "GPUs the --dry-run plan assumes", ">=1"),
    ("query_cache_dir",   os.environ.get("ERPO_CACHE", "~/.cache/erpo/query_cache"), "reuse Query-KL reference caches of earlier runs from here ('' = always build)"),
    ("measure_policy_kl", True,                                "keep a reference model to log Policy-KL even when the loss has none"),
    ("max_bad_steps",     3,                                   "consecutive non-finite (skipped) optimizer steps that end the run", ">=1"),
    ("strict_data",       False,                               "training rows without a problem or an answer are an error, not skipped"),
    # evaluation / checkpoints
    ("eval_every",        10,                                  "held-out evaluation every N steps (0 = never)", ">=0"),
    ("eval_temperature",  1.0,                                 "held-out sampling temperature", ">=0"),
    ("eval_limit",        200,                                 "problems per held-out set (0 = all)", ">=0"),
    ("save_every",        20,                                  "checkpoint every N steps and at the end (0 = never)", ">=0"),
    ("resume",            False,                               "continue the run in --out from its checkpoint (options "
                                                               "that fix the run must not change; those in "
                                                               "RESUME_MAY_CHANGE may)"),
    ("overwrite",         False,                               "replace the run already in --out (a fresh run into it "
                                                               "is an error otherwise)"),
    ("export",            None,                                "after training, save the final model + tokenizer to this folder"),
    ("export_dtype",      "auto",                              "dtype of exported HF folders (--export; an FSDP2 run's <out>/hf): "
                                                               "auto = bfloat16 when the run computes in bf16, else the weights' own; "
                                                               "checkpoints keep float32", list(run_dir.EXPORT_DTYPES)),
    ("nccl_timeout",      120.0,                               "minutes a rank waits at a collective (NCCL's default 10 can fire "
                                                               "during a long evaluation or export)", ">0"),
    ("log",               "jsonl",                             "also mirror metrics.jsonl to TensorBoard or W&B", ["jsonl", "tensorboard", "wandb"]),
] + sft.OPTIONS  # --sft-data, --sft-steps, ...: the warm start's own options, in sft.py

# --resume continues the run its config.json describes: these options may change (they apply from
# the resumed step and are recorded in config.json's "resumed"); every other option and loss knob
# fixes what the run is (the algorithm, the data and its order, the sampled rows) and must not.
RESUME_MAY_CHANGE = {"steps", "lr", "weight_decay", "warmup", "grad_clip", "max_bad_steps", "eval_every",
                     "save_every", "log", "export", "export_dtype", "nccl_timeout", "query_cache_dir",
                     "micro_batch", "micro_tokens", "grad_ckpt", "share_prompts", "gen_batch", "kv_budget",
                     "measure_policy_kl"}
NOT_THE_RUN = {"resume", "overwrite", "out", "dry_run", "plan_gpus"}   # how this command runs, not what


@dataclass
class Run:
    """Everything an RL step works with, built once by `setup_rl`."""
    args: object                        # the parsed options
    algo: losses.Algo
    dist: distributed.Dist
    policy: torch.nn.Module             # wrapped in DDP / FSDP2 under torchrun
    ref: torch.nn.Module | None         # only where a Policy-KL is in the loss, reward or measured
    tokenizer: object
    opt: torch.optim.Optimizer
    sched: object
    data: PromptSet                     # the training problems
    cache: query_cache.QueryCache       # the Query-KL reference (ERPO needs no reference model)
    spec: rollout.SampleSpec
    timer: timer.Phases                 # seconds per phase of a step (time_gen, time_update, ...)
    bad_streak: int = 0                 # optimizer steps skipped in a row (non-finite loss or gradient)
    ckpt_checked: bool = True           # the latest checkpoint's weights have given a finite loss


# ----------------------------------------------------------------------------------------------
# RL, part 1: rollouts and rewards


@dataclass
class Collected:
    """This rank's share of one RL step's rollouts: rows of a group are consecutive."""
    ro: rollout.Rollout
    rewards: torch.Tensor               # (B,) the rewards that enter the advantages
    valid: torch.Tensor                 # (B,) 0 for DAPO filler groups (no loss)
    prompt_idx: list[int]               # (B / G,) training-set index of each group's prompt
    first_rewards: torch.Tensor         # the first sampling round's rewards and accuracies:
    first_acc: torch.Tensor             # what reward / train_acc report
    info: dict                          # grader outcome counts, zero_var_frac, resampling


def my_prompts(run, step, round_=0):
    """Training-set indices of this rank's prompts of an RL step (a sampling round of it)."""
    a = run.args
    order = step_indices(len(run.data), step if round_ == 0 else step * 7919 + round_, a.rollout_batch, a.seed + round_)
    return batching.rank_share(order, run.dist.rank, run.dist.world, a.rollout_batch, a.update_batch)


def sample_and_score(run, decoder, prompt_idx, step, round_) -> rollout.Graded:
    """G responses per prompt (consecutive rows), graded; DAPO's overlong penalty enters the rewards."""
    G, fmt = run.args.group_size, run.args.reward == "acc+format"
    with run.timer("gen"):
        ro = rollout.sample_with(decoder, [run.data.ids[i] for i in prompt_idx for _ in range(G)],
                                 run.spec, temperature=run.args.temperature, top_p=run.args.top_p,
                                 seeds=[rollout.row_seed(run.args.seed, step, round_, i, j) for i in prompt_idx for j in range(G)])
    with run.timer("reward"):
        answers = [run.data.rows[i]["answer"] for i in prompt_idx for _ in range(G)]
        scores, counts = reward.score_batch(rollout.decode_responses(run.tokenizer, ro), answers, format_reward=fmt)
    scores = torch.tensor(scores)
    rewards = scores.clone()
    if run.algo.overlong:
        L = run.args.max_new_tokens
        rewards += losses.overlong_penalty(ro.response_mask.sum(1).float(), L, run.algo.overlong_cache_len(L))
    acc, counts["new_turn"] = (scores >= 0.9).float() if fmt else scores, rollout.new_turns(run.tokenizer, ro)
    return rollout.Graded(ro, rewards, acc, prompt_idx, counts, keep=losses.nonconstant_groups(acc, G))


def collect(run, decoder, step) -> Collected:
    """Sample and grade this rank's prompts. DAPO's dynamic sampling then drops groups whose
    accuracies are all equal and samples more prompts (at most --max-resample-rounds extra rounds)
    until this rank's share is full; unfilled slots become zero-weight filler groups, so every rank
    still runs the same number of micro-batches (DDP and FSDP2 need that)."""
    G, mine = run.args.group_size, my_prompts(run, step)
    first = sample_and_score(run, decoder, mine, step, 0)
    info = {"zero_var_frac": 1 - first.keep.float().mean().item(), "resample_rounds": 0, **first.counts}
    if not run.algo.dynamic_sampling:
        return Collected(first.ro, first.rewards, torch.ones(len(mine) * G), mine, first.rewards, first.acc, info)
    rounds, have = [first], int(first.keep.sum())
    for r in range(1, run.args.max_resample_rounds + 1):
        if all_sum(torch.tensor(float(have < len(mine)))).item() == 0:  # every rank full (they
            break                                                      # sample together: FSDP2)
        rounds.append(sample_and_score(run, decoder, my_prompts(run, step, r), step, r))
        have += int(rounds[-1].keep.sum())
        info["resample_rounds"] = r
    kept = rollout.fill_groups(rounds, len(mine), G, run.tokenizer.pad_token_id)
    info["kept_groups"] = int(kept.valid.sum()) // G
    return Collected(kept.ro, kept.rewards, kept.valid, kept.prompt_idx, first.rewards, first.acc, info)


# ----------------------------------------------------------------------------------------------
# RL, part 2: log-probs, advantages, query weights, PPO updates


@dataclass
class OldScores:
    """The rollout policy's log-probs over the rollout rows (B rows), before any update."""
    old: torch.Tensor                   # (B, R) response log-probs of the rollout policy (PPO's pi_old)
    prompt: torch.Tensor                # (B, P-1) its prompt log-probs (Query-KL monitor, code weights)
    entropy: torch.Tensor               # (B, R)
    ref: torch.Tensor | None            # (B, R) reference response log-probs, if a reference is loaded
    fresh: slice                        # rows whose old/prompt/entropy the first update forward fills in


def on_policy_rows(run, upd_rows) -> slice:
    """Rows that need no old-policy forward of their own: the first optimizer step's, in the first
    PPO epoch. Their update forward runs on the rollout's weights, so it IS pi_old (ratio exactly
    1) and yields the monitors too. Not where something needs them before the update: RLOO's
    KL-penalised rewards, the code weights."""
    rloo_like, code = run.algo.kl is not None and run.algo.kl_in == "reward", run.algo.weights == "code"
    return slice(0, 0) if rloo_like or code else upd_rows[0]


@dataclass
class UpdatePlan:
    """One optimizer step: its micro-batches and the global counts its loss is divided by."""
    micro_batches: list[rollout.MicroBatch]
    num_tokens: float                   # valid response tokens of the update batch, all ranks (>= 1)
    num_seqs: float                     # valid rows of the update batch, all ranks (0: DAPO filler only)


@dataclass
class StepPlan:
    """Every host-side decision of a step's forwards, made once from the rollout's lengths: the
    loops below then read nothing back from the device until the step's scalars (which is also
    what lets memory_measure run them on fake tensors)."""
    old: list[rollout.MicroBatch]       # no-grad pi_old forwards: the rows after `fresh`
    fresh: list[rollout.MicroBatch]     # the rows the first update forward scores as pi_old
    ref: list[rollout.MicroBatch]       # reference forwards, all rows (none without a reference)
    updates: list[UpdatePlan]           # one per update batch (each PPO epoch repeats them)
    group: int                          # G where each prompt runs once for its G rows, else 1


def micro_batches(run, packed: rollout.Packed, rows: range) -> list[rollout.MicroBatch]:
    """Rows as micro-batches, longest first: <= --micro-batch rows, <= --micro-tokens padded tokens,
    whole groups if prompts are shared, as many on every rank (FSDP2 gathers per forward)."""
    a, lens = run.args, [packed.lengths[i] for i in rows]
    plan = lambda k=0: batching.microbatch_plan(lens, a.micro_batch, a.micro_tokens, k, batching.prompt_group(a))  # noqa: E731
    return [packed.micro_batch([rows.start + i for i in mb]) for mb in plan(int(all_max(torch.tensor(len(plan())))))]


def plan_step(run, packed: rollout.Packed, valid: list[float], upd_rows: list[slice], fresh: slice) -> StepPlan:
    """The step's plan from the host lengths and validity of its rows: one collective for the
    global counts, one per forward loop (the most micro-batches any rank runs), one host read
    (do a group's rows share their prompt?)."""
    B, G = len(packed.lengths), run.args.group_size
    local = {}
    for u, rows in enumerate(upd_rows):
        lengths, v = packed.lengths[rows], valid[rows]
        local[f"tokens{u}"] = sum(r * ok for (_, r), ok in zip(lengths, v))   # valid response tokens
        local[f"seqs{u}"] = sum(v)
    counts = distributed.all_sums(local)
    updates = [UpdatePlan(micro_batches(run, packed, range(rows.start, rows.stop)), max(1.0, counts[f"tokens{u}"]),
                          counts[f"seqs{u}"]) for u, rows in enumerate(upd_rows)]
    group = batching.prompt_group(run.args)
    group = group if group > 1 and rollout.shares_prompts(packed, G) else 1
    return StepPlan(old=micro_batches(run, packed, range(fresh.stop, B)),
                    fresh=micro_batches(run, packed, range(fresh.start, fresh.stop)),
                    ref=micro_batches(run, packed, range(B)) if run.ref is not None else [], updates=updates, group=group)


@torch.no_grad()
def score_old(run, packed: rollout.Packed, sc: OldScores, mbs: list[rollout.MicroBatch], group):
    for mb in mbs:
        pk, pc, rc = packed.trimmed(mb)                                # no all-padding columns
        s = rollout.score_tokens(distributed.unwrap(run.policy), pk, run.args.temperature, True, group, checked=True)
        sc.old[mb.rows, rc], sc.prompt[mb.rows, pc], sc.entropy[mb.rows, rc] = s.response, s.prompt, s.entropy


@torch.no_grad()
def score_old_and_ref(run, packed: rollout.Packed, fresh: slice, plan: StepPlan) -> OldScores:
    """No-grad forwards: the policy over the rows after `fresh`, the reference over all rows."""
    B, P, R = packed.input_ids.shape[0], packed.P, packed.input_ids.shape[1] - packed.P
    z = lambda n: torch.zeros(B, n, device=packed.input_ids.device)  # noqa: E731
    sc = OldScores(z(R), z(P - 1), z(R), None if run.ref is None else z(R), fresh)
    score_old(run, packed, sc, plan.old, plan.group)
    for mb in plan.ref:
        pk, _, rc = packed.trimmed(mb)
        sc.ref[mb.rows, rc] = rollout.score_tokens(run.ref, pk, run.args.temperature, group=plan.group, checked=True).response
    distributed.reshard(run.ref)  # FSDP2 keeps the root gathered after a forward with no backward
    return sc


def row_weights(run, prompt_idx, prompt_logp, qmask, valid, upd_rows):
    """Per-row query weights (method.md §4), or None. paper: cached reference NLL, dataset mean,
    clipped to algo.weight_clip. code: current-policy NLL (no grad), mean over each global
    optimizer batch, unclipped."""
    algo, G = run.algo, run.args.group_size
    if algo.weights == "none":
        return None
    if algo.weights == "paper":
        w = losses.query_weights(run.cache.nll[torch.tensor(prompt_idx)], mean_nll=run.cache.nll_mean,
                                 clip=algo.weight_clip)
        return w.repeat_interleave(G)
    nll = -torch.where(qmask > 0, prompt_logp, 0.0).sum(1)  # (B,) sequence NLL of each row's prompt
    w = torch.ones_like(nll)  # DAPO filler rows (valid = 0) keep 1: they carry no loss anyway
    for rows in upd_rows:
        v = valid[rows] > 0
        mean = (all_sum(nll[rows][v].sum()) / all_sum(v.sum().float()).clamp_min(1)).item()
        w[rows] = torch.where(v, losses.query_weights(nll[rows].clamp_min(1e-8), mean_nll=mean), 1.0)
    return w


@dataclass
class UpdateBatch:
    """What the PPO update needs, per rollout row (B rows on this rank)."""
    packed: rollout.Packed
    resp_mask: torch.Tensor             # (B, R) response tokens of valid rows
    qmask: torch.Tensor                 # (B, P-1) prompt tokens of valid rows
    valid: torch.Tensor                 # (B,)
    sc: OldScores                       # old, ref (B, R); the update fills in rows sc.fresh
    qref: torch.Tensor                  # (B, P-1) cached reference prompt log-probs
    adv: torch.Tensor                   # (B,)
    weights: torch.Tensor | None        # (B,) query weights


def accumulate_gradient(run, b: UpdateBatch, upd: UpdatePlan, fresh: bool, group: int) -> dict[str, torch.Tensor]:
    """Forward + backward of each micro-batch of one optimizer step; -> its loss statistics, summed
    over micro-batches as float64 tensors (no host read here). fresh: this forward is pi_old's too."""
    a, algo, stats = run.args, run.algo, {}
    for k, mb in enumerate(upd.micro_batches):
        pk, pc, rc = b.packed.trimmed(mb)                                # r: rows, pc/rc: columns
        r = mb.rows
        with distributed.grad_sync(run.policy, k == len(upd.micro_batches) - 1):
            s = rollout.score_tokens(run.policy, pk, a.temperature, fresh, group, checked=True)  # one pass per prompt
            if fresh:
                b.sc.old[r, rc], b.sc.prompt[r, pc], b.sc.entropy[r, rc] = s.response.detach(), s.prompt.detach(), s.entropy
            loss, st = losses.rl_loss(                                   # PG(A*w) [+ b*PolicyKL] [+ a*QueryKL]
                algo, logp=s.response, old_logp=b.sc.old[r, rc],
                ref_logp=b.sc.ref[r, rc] if algo.has_policy_kl_loss else None,
                resp_mask=b.resp_mask[r, rc], advantages=b.adv[r],
                weights=None if b.weights is None else b.weights[r],
                prompt_logp=s.prompt, prompt_ref_logp=b.qref[r, pc], prompt_mask=b.qmask[r, pc],
                num_tokens=upd.num_tokens, num_seqs=upd.num_seqs, max_len=a.max_new_tokens)
            (loss * run.dist.world).backward()
        faults.point("mid-step")
        for key, v in st.items():
            stats[key] = stats.get(key, 0.0) + v.detach().double()
    return stats


def ppo_update(run, b: UpdateBatch, plan: StepPlan):
    """One optimizer step per global update batch (x ppo_epochs), micro-batched with gradient
    accumulation. Every loss term is divided by the GLOBAL count of its update batch (tokens or
    sequences over all micro-batches and ranks), so the gradient equals that of one big batch at
    any micro-batch size and world size (DDP averages over ranks, hence the `* world`). A step
    whose loss or gradient is not finite on any rank is skipped on every rank. -> the statistics
    of rl_loss averaged over the applied steps; the clip fractions over those that can clip: until
    a step is applied the policy is the rollout's (ratio 1, nothing clipped)."""
    a = run.args
    stats, clip_stats, norms, skipped = {}, {}, [], 0
    for epoch in range(a.ppo_epochs):
        for u, upd in enumerate(plan.updates):
            fresh = epoch == u == 0 and b.sc.fresh.stop > 0              # this forward is pi_old's too
            if upd.num_seqs == 0:  # only DAPO filler groups (every rank sees the same count): no step
                score_old(run, b.packed, b.sc, plan.fresh, plan.group) if fresh else None
                continue
            step_stats = accumulate_gradient(run, b, upd, fresh, plan.group)
            norm = optimizer.clip_grad(run.policy, a.grad_clip)
            host = distributed.read_scalars({**step_stats, "grad_norm": norm}, finite=("loss", "grad_norm"))
            if host is None:
                skip_bad_step(run)
                skipped += 1
                continue
            run.bad_streak = 0
            if not run.ckpt_checked:                                     # its weights gave this finite loss
                run_dir.mark_checked(a.out)
                run.ckpt_checked = True
            can_clip = len(norms) > 0                                    # an earlier step moved the policy
            norms.append(host.pop("grad_norm"))
            for key, v in host.items():
                into = clip_stats if key in losses.CLIP_STATS else stats
                if into is stats or can_clip:
                    into[key] = into.get(key, 0.0) + v
            optimizer.step(run.opt, run.sched)
    n_opt, n_clip = max(1, len(norms)), len(norms) - 1
    sums = distributed.all_sums({**stats, **clip_stats})
    out = {k: v / (n_clip if k in losses.CLIP_STATS else n_opt) for k, v in sums.items()}
    out["grad_norm"] = sum(norms) / n_opt if norms else None  # None: every optimizer step was skipped
    out["skipped_steps"] = skipped
    return out


def skip_bad_step(run):
    """An optimizer step whose loss or gradient is not finite is not applied. --max-bad-steps of
    them in a row end the run; a checkpoint saved since the last finite loss holds the weights that
    diverged (their loss was never finite), so it is set aside and --resume continues from the one
    before it (run_dir.roll_back)."""
    run.opt.zero_grad(set_to_none=True)                                  # the weights stay as they were
    run.bad_streak += 1
    if run.bad_streak < run.args.max_bad_steps:
        return
    unchecked, step = not run.ckpt_checked, run_dir.roll_back(run.args.out)
    ckpt = run_dir.checkpoint_dir(run.args.out)
    where = f"--resume continues from step {step} ({ckpt}/)" if step is not None else \
        "--resume starts from the initial model (no checkpoint before the divergence)"
    aside = f" (the checkpoint saved after it diverged: {ckpt}.diverged/)" if unchecked else ""
    raise SystemExit(f"error: {run.bad_streak} optimizer steps in a row had a non-finite loss or gradient "
                     f"(--max-bad-steps); {where}{aside}; resume with a lower --lr")


def rollouts(run, step) -> Collected:
    """The step's rollouts, sampled from a decoding copy (FSDP2: the gathered weights) that is
    freed when this returns, before scoring and the update need the memory."""
    with distributed.gathered(run.policy, run.spec.weights_dtype) as decoder:
        return collect(run, decoder, step)


def rl_step(run, step):
    """Everything of one RL step; returns its metrics (reduced over ranks)."""
    t0, G, algo, dev = time.time(), run.args.group_size, run.algo, run.dist.device
    c = rollouts(run, step)                                              # rollouts + rewards
    ro, valid = c.ro.to(dev), c.valid.to(dev)
    packed = ro.packed()
    resp_mask = ro.response_mask.float() * valid[:, None]
    qmask = packed.prompt_tok_mask.float() * valid[:, None]
    upd_rows = batching.microbatches(packed.input_ids.shape[0], run.args.update_batch // run.dist.world * G)
    fresh = on_policy_rows(run, upd_rows)
    plan = plan_step(run, packed, c.valid.tolist(), upd_rows, fresh)
    with run.timer("score"):
        sc = score_old_and_ref(run, packed, fresh, plan)
    qref = run.cache.ref_logp(c.prompt_idx, G, packed.P - 1).to(dev)
    rewards = c.rewards.to(dev)
    if algo.kl is not None and algo.kl_in == "reward":                   # RLOO: R - beta * sum_t KL_t
        rewards = losses.kl_penalized_rewards(rewards, sc.old, sc.ref, resp_mask, algo.beta, algo.kl)
    adv = losses.group_advantages(rewards, G, algo.adv, algo.adv_eps)    # A
    w = row_weights(run, c.prompt_idx, sc.prompt, qmask, valid, upd_rows)  # w(q)
    batch = UpdateBatch(packed, resp_mask, qmask, valid, sc, qref, adv, None if w is None else w.to(dev))
    with run.timer("update"):
        upd = ppo_update(run, batch, plan)
    m = metrics.rl_step(step, c, ro, sc, qref, qmask, resp_mask, w, upd, world=run.dist.world, lr=run.sched.get_last_lr()[0],
                        dynamic_sampling=run.algo.dynamic_sampling, seconds=run.timer.seconds,
                        update_tokens=packed.attention_mask.sum() * run.args.ppo_epochs)
    return {**m, "step_time": time.time() - t0}


# ----------------------------------------------------------------------------------------------
# The step's memory, measured by running it (memory_measure.py; --dry-run prints it beside the plan)


def measure_memory(a, algo, world=1, fake=True, max_micro_batches=3) -> memory_measure.Measured:
    """rl_step's phases on a worst-case rollout of a random model of --model's architecture:
    fake tensors on `world` fake ranks (the paper's widths on a CPU, in seconds), or real tensors
    in the process group this process is in. One optimizer step, of at most max_micro_batches
    micro-batches (each of the config's size: gradients are sharded/reduced per micro-batch, so
    more of them hold no more)."""
    with memory_measure.fake_world(world) if fake else nullcontext((None, None)) as (mesh, _):
        d = distributed.Dist(*distributed.rank_world(), torch.device("cpu"))
        bf16 = distributed.uses_bf16(a.dtype, torch.device("cuda") if fake else d.device)  # fake: what a GPU runs
        m = memory_measure.step_models(a, algo.kl is not None or a.measure_policy_kl, d.device, bf16, fake, mesh)
        run = Run(a, algo, d, m.policy, m.ref, None, m.opt, optimizer.warmup_then_constant(m.opt, a.warmup),
                  None, None, m.spec, timer.Phases("cpu"))
        with memory_measure.real_tensors():                              # the host-side plan: from real masks
            ro = memory_measure.worst_case_rollout(a, a.rollout_batch // d.world * a.group_size,
                                                    distributed.unwrap(m.policy).config.vocab_size)
            packed, B = ro.packed(), ro.response_ids.shape[0]
            upd_rows = batching.microbatches(B, a.update_batch // d.world * a.group_size)[:1]
            fresh = on_policy_rows(run, upd_rows)
            plan = plan_step(run, packed, [1.0] * B, upd_rows, fresh)
            for mbs in (plan.old, plan.ref, plan.updates[0].micro_batches):  # the longest come first
                del mbs[max_micro_batches:]
            prompts = ro.prompt_ids.tolist()
            resp_mask, qmask = ro.response_mask.float(), packed.prompt_tok_mask.float()
            qref = torch.zeros(B, packed.P - 1)
        tracker = memory_measure.PhasePeaks()
        stub = memory_measure.stub_scalar_reads() if fake else nullcontext()
        with tracker, stub, distributed.precision(a.dtype, d.device)[1]():
            tracker.track_external(m.policy, m.opt, *[m.ref] * (m.ref is not None),
                                   packed.input_ids, packed.attention_mask, resp_mask, qmask, qref)
            tracker.optimizer_phase(m.opt)
            with tracker.phase("rollout"):
                memory_measure.decode_once(m.policy, m.spec, prompts, a.max_new_tokens)
            with tracker.phase("score"):
                sc = score_old_and_ref(run, packed, fresh, plan)
            batch = UpdateBatch(packed, resp_mask, qmask, torch.ones(B), sc, qref, torch.randn(B), torch.ones(B))
            with tracker.phase("update"):
                ppo_update(run, batch, plan)
    return memory_measure.Measured(tracker.peaks, d.world, fake, len(plan.updates[0].micro_batches))


# ----------------------------------------------------------------------------------------------
# Set-up and the loop


def load_model(path, d: distributed.Dist, dtype, shard=None, bf16=False):
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.exists(path):   # not a hub id either
        hint = " (the tiny world's: python -m data.tinymath.prepare)" if path.startswith(TINY) else ""
        raise SystemExit(f"error: model folder {path} not found{hint}")
    attn = "sdpa_float32" if bf16 and d.device.type == "cpu" else None  # why: rollout._sdpa_float32
    with errors.one_line((OSError, ValueError), f"cannot load model {path!r}"):  # no folder, no usable config
        return rollout.load_policy(path, device=d.device, dtype=dtype, shard=shard, attn_implementation=attn)


def setup_rl(a, algo, d, model, tokenizer, data, state) -> Run:
    """The reference (if a Policy-KL is used or measured), the wrapped policy, its Query-KL cache, the optimizer."""
    print0(batching.describe(a, d.world, len(data)))
    # ERPO with --measure-policy-kl false keeps no reference model: Query-KL reads the cache.
    bf16, dtype = distributed.uses_bf16(a.dtype, d.device), distributed.precision(a.dtype, d.device)[0]
    ref = None
    if algo.kl is not None or a.measure_policy_kl:  # sharded like the policy under FSDP2
        shard = distributed.sharder(a.fsdp, d.device, bf16, trainable=False)
        ref = load_model(a.model, d, torch.bfloat16 if bf16 else dtype, shard, bf16)[0].eval().requires_grad_(False)
    policy = distributed.wrap_model(model, d.device, a.fsdp, bf16=bf16, grad_ckpt=a.grad_ckpt)
    with distributed.precision(a.dtype, d.device)[1]():  # the training forward: wrapper, dtype, autocast
        cache = query_cache.for_run(a, d, policy, data.ids, tokenizer.pad_token_id, state is not None)
    opt = optimizer.adamw(policy, a.lr, a.weight_decay)
    sched = optimizer.warmup_then_constant(opt, a.warmup)
    run_dir.restore(state, policy, opt, sched, a.out)                    # on --resume (state is None otherwise)
    if state is not None:                                                # the new --lr, not the saved one
        optimizer.set_hyperparameters(opt, sched, a.lr, a.weight_decay)
    spec = rollout.SampleSpec.make(model, tokenizer, a.max_new_tokens, a.sampler, a.gen_batch, a.kv_budget, bf16, opt)
    return Run(a, algo, d, policy, ref, tokenizer, opt, sched, data, cache, spec, timer.Phases(d.device),
               ckpt_checked=state is None or run_dir.is_checked(a.out))


def train_rl(run, evalsets, log, start, amp):
    """Steps start..--steps, each logged, with held-out evaluations and checkpoints at their
    cadence. Ctrl-C / SIGTERM end the run at the next step boundary, with a checkpoint."""
    a = run.args
    if start == 0 and a.eval_every:                                      # the starting point
        with amp():
            m = {"step": 0, **heldout_accuracy(run.policy, run.tokenizer, evalsets, run.spec, a.eval_temperature, a.seed)}
        log(m)
        print0(f"step 0: eval_acc {m.get('eval_acc', float('nan')):.3f}")
    bar = tqdm(range(start, a.steps), desc=a.algo, initial=start, total=a.steps, disable=not run.dist.main)
    with interrupts.deferred() as stop:
        for step in bar:
            with amp():
                m = rl_step(run, step)
            last = step + 1 == a.steps
            if a.eval_every and ((step + 1) % a.eval_every == 0 or last):
                with amp(), run.timer("eval"):
                    m.update(heldout_accuracy(run.policy, run.tokenizer, evalsets, run.spec, a.eval_temperature,
                                              a.seed))
            log({**m, **run.timer.metrics()})                              # + time_gen, time_reward, time_score, ...
            bar.set_postfix({k: f"{m[k]:.3f}" for k in ("train_acc", "eval_acc", "query_kl", "policy_kl", "entropy")
                             if k in m} | {"s/step": f"{m['step_time']:.1f}"})
            saved = a.save_every and ((step + 1) % a.save_every == 0 or last)
            if saved:
                save(run, step + 1, final=last)
            if not last and stop.requested():                              # every rank: the same step
                if not saved:
                    save(run, step + 1, final=False)
                bar.close()
                ckpt = run_dir.checkpoint_dir(a.out)
                raise stop.exit(f"saved the checkpoint of step {step + 1} ({ckpt}/); continue with --resume")


def save(run, step, final):
    a = run.args
    run_dir.save_checkpoint(a.out, run.policy, run.tokenizer, run.opt, run.sched, step, final=final,
                            export_dtype=a.export_dtype, bf16=distributed.uses_bf16(a.dtype, run.dist.device))
    run.ckpt_checked = False                                             # until the next finite loss


def parse_args(argv=None):
    doc = __doc__ + "\nalgorithms (--algo):\n  sft        supervised warm start, prompt tokens in the loss\n" + \
        "\n".join(f"  {k:10s} {v.doc}" for k, v in losses.ALGOS.items())
    parsed = options.parse(argv, OPTIONS, doc)
    a = parsed.args
    if a.algo == "sft" and "model" not in parsed.cli | parsed.config_keys:
        a.model = os.path.join(TINY, "base")  # the warm start trains the untrained base model
    a.out = a.out or os.path.join("runs", a.algo)
    saved = run_dir.read_config(a.out) if a.resume else None
    for k, v in (saved or {}).items():   # --resume: what the command does not say, the run's config.json does
        if hasattr(a, k) and k not in parsed.cli | parsed.config_keys | NOT_THE_RUN:
            setattr(a, k, v)
    if a.resume and a.overwrite:
        parsed.error("--resume continues the run in --out, --overwrite replaces it: choose one")
    if a.resume and a.algo == "sft":
        parsed.error("--resume: the SFT warm start does not resume (it saves HF folders, sft-<step>/, not "
                     "training state); start it again (--overwrite)")
    return a, options.make_algo(parsed)                                 # None for sft


def resume_changes(a, algo, state) -> dict:
    """--resume against the run's config.json (whose values the options not given took, in
    parse_args): {option: (saved, new)} of the options given another value that may change
    (RESUME_MAY_CHANGE); any other change is an error, before anything is loaded."""
    if state is None:                                                    # from scratch: every option applies
        return {}
    if a.steps < state.step:
        raise SystemExit(f"error: --resume: --steps {a.steps} is before the checkpoint's step {state.step}: "
                         "a resumed run continues to a later step (or the same: nothing to do)")
    saved = run_dir.read_config(a.out)
    if saved is None:
        raise SystemExit(f"error: --resume: {a.out}/config.json is missing or unreadable, so nothing says "
                         "which run the checkpoint belongs to; restore it (or start a new run)")
    now, knobs = vars(a), {name for name, *_ in options.algo_knobs()}
    fixed = run_dir.config_changes(saved, now, sorted(set(now) - RESUME_MAY_CHANGE - NOT_THE_RUN - knobs))
    if algo is not None and not fixed and "algo" in saved:               # the knobs as the loss resolves them
        before = losses.make_algo(saved["algo"], **{k: saved.get(k) for k in knobs})
        fixed = run_dir.config_changes(vars(before), vars(algo), knobs)
    if fixed:
        what = "; ".join(f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in fixed.items())
        raise SystemExit(f"error: --resume: {what}: the run in {a.out} was made with the first "
                         "(config.json), and these options fix what a run is; resume with its values, or start "
                         "a new run (another --out)")
    changed = run_dir.config_changes(saved, now, sorted(RESUME_MAY_CHANGE))
    if changed:
        print0("--resume: from step {}: ".format(state.step) +
               ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
    return changed


def load_data(a, tokenizer):
    """Held-out sets and the training problems (SFT: sequences), checked before anything is
    written to --out: a bad input ends here with one line."""
    with errors.one_line():
        evalsets = {n: load_prompt_set(n, tokenizer, a.template, limit=a.eval_limit or None) for n in a.eval_data}
        data = sft.load_sequences(a.sft_data, tokenizer, a.template, a.max_seq_len) if a.algo == "sft" else \
            load_prompt_set(a.train_data, tokenizer, a.template, a.max_prompt_len, training=True, strict=a.strict_data)
        batching.check_data(len(data), a)
    return evalsets, data


def main(argv=None):
    a, algo = parse_args(argv)                                          # bad options: argparse errors
    with interrupts.exit_when_interrupted(lambda: "stopped now, without saving"):  # outside the steps
        return train(a, algo)                                           # (theirs: train_rl), or twice


def train(a, algo):
    t0 = time.time()
    if a.dry_run:  # the plan's formulas, and the step's memory measured on fake tensors beside them
        measured = measure_memory(a, algo, a.plan_gpus) if algo else None
        return print(memory_plan.report(a, a.plan_gpus, bool(algo) and (algo.kl is not None or a.measure_policy_kl), measured))
    why = run_dir.refusal(a.out, resume=a.resume, overwrite=a.overwrite)  # before minutes of loading
    why = why or (a.export and run_dir.check_writable(a.export, "--export"))
    if why:
        raise SystemExit(f"error: {why}")
    d = distributed.setup(fsdp=a.fsdp, timeout_min=a.nccl_timeout)      # --fsdp at world size 1: a group of one
    batching.check(a, d.world) if algo else None                        # sizes that do not divide
    torch.manual_seed(a.seed), random.seed(a.seed)
    with run_dir.RunLock(a.out) as lock:                                # released on any exit (a kill too)
        evalsets = train_in_folder(a, algo, d, lock)
    print0(run_dir.summary(a.out, time.time() - t0, list(evalsets), a.template))
    distributed.teardown()


def train_in_folder(a, algo, d, lock):
    """Load, check, claim --out, train; -> the held-out sets (for the summary)."""
    if a.resume:                                                        # resuming may repair ckpt/: lock first
        run_dir.claim(a.out, lock, resume=True, overwrite=False)
    state = run_dir.resume_point(a.out) if a.resume else None
    changed = resume_changes(a, algo, state)
    (dtype, amp), bf16 = distributed.precision(a.dtype, d.device), distributed.uses_bf16(a.dtype, d.device)
    shard = distributed.sharder(a.fsdp, d.device, bf16, a.grad_ckpt)
    model, tokenizer = load_model(run_dir.model_source(a.out, state is not None, a.model), d, dtype, shard, bf16)
    print0(f"model {a.model}: {model.num_parameters() / 1e6:.2f}M parameters, {dtype}, {d.device}")
    evalsets, data = load_data(a, tokenizer)                            # bad data: one line, nothing written
    with errors.one_line():                                             # prompts + responses within the positions
        check_fits(model, evalsets, a.max_new_tokens)
    run_dir.claim(a.out, lock, resume=a.resume, overwrite=a.overwrite)  # the lock; --overwrite removes the old run
    log = run_dir.MetricsLog(a.out, state.step if state else 0, a.log, vars(a))  # --log's package: checked first
    try:
        if algo is not None:
            print0(f"algo {a.algo}: {options.algo_summary(algo)}")
            run = setup_rl(a, algo, d, model, tokenizer, data, state)    # (a resume it refuses: config kept)
        run_dir.write_config(a.out, run_dir.with_resume_record(a.out, vars(a), state and state.step, changed))
        if algo is None:
            sft.run(a, d, model, tokenizer, data, evalsets, log, amp)
        else:
            train_rl(run, evalsets, log, state.step if state else 0, amp)
            run_dir.export(run.policy, tokenizer, a.export, a.export_dtype, bf16=bf16)
    finally:
        log.close()
    return evalsets


if __name__ == "__main__":
    main()
