"""Train a policy with ERPO, GRPO or a relative of theirs, or warm-start it with SFT.

    torchrun train.py --algo erpo --alpha 0.01            # ERPO on the embedded tiny world (CPU ok)
    torchrun train.py --algo grpo                         # the GRPO baseline, same setup
    torchrun --nproc_per_node=8 train.py --config configs/paper_qwen7b.json --algo erpo
    python train.py --algo sft --export data/tinymath/warmstart   # the warm start (from data/tinymath/base)

One RL step reads top to bottom in `rl_step`: pick prompts -> sample G responses each -> rewards ->
advantages (x query weights) -> PPO updates over micro-batches -> log. What distinguishes the
algorithms is a row of `losses.ALGOS`; every loss term is in `losses.py` (equations: docs/method.md).
"""

import functools
import math
import os
import random
import sys
import time

from plumbing import threads

os.environ.update(threads.short_spin(os.environ))  # OpenMP's threads: a short spin, then sleep (before torch)

try:                                       # Ctrl-C during these imports: one line, no traceback
    import torch
    from tqdm import tqdm
    from rl import experience
    from modeling import logprobs
    from modeling import lora
    import losses
    from rl import memory_measure
    from modeling import models
    from rl import query_reference
    import sft
    from data import prompts
    import tasks
    from evaluation.heldout import check_fits
    from plumbing import (batching, checkpoints, distributed, errors, faults, interrupts, memory_plan,
                          extension, optimizer, options, run_dir, run_summary, time_check, time_model)
    from plumbing.distributed import all_sums, print0
    from plumbing.options import HOW_IT_RUNS, MAY_CHANGE, NEW, opt
    from rl import controllers, monitors, run_setup, scale_step
    from rl.run_setup import needs_reference_model, old_rows, setup_rl
except KeyboardInterrupt:
    os.write(2, b"interrupted (SIGINT): stopped while starting, nothing written\n")
    raise SystemExit(130) from None

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinymath")

# ----------------------------------------------------------------------------------------------
# Options: the embedded tiny world, minutes on 2 CPU cores; the paper's setup is
# configs/paper_qwen7b.json (--config; flags override it). Loss knobs (--alpha, --beta, --kl, ...)
# are generated from losses.Algo's fields.
# One row an option (plumbing/options.Option): name, default, help [, choices or a range], then
# its rules, where they are not the usual ones:
#   acts=    (acts(args), what it cannot act under, why): an option that acts only with another; given
#            where it cannot act, refused as an inert loss knob is (options.check_inert_options)
#   resume=  MAY_CHANGE: --resume may change it (it applies from the resumed step; config.json's
#            "resumed" records it); HOW_IT_RUNS: how this command runs, not what the run is. Every
#            other option (and loss knob) fixes what the run is and must not change on --resume.
#   before=  its value for a run made before the option existed (a value, or a function of the old
#            config.json), which --resume then continues as it trained; none: today's default then
#            too (run_dir.older_config says which)
_DECAYS = (lambda a: a.lr_schedule != "constant", "under --lr-schedule constant",
           "the LR does not decay (give --lr-schedule linear or cosine)")
_LORA = (lambda a: a.lora_rank > 0, "without --lora-rank",
         "the run fine-tunes every weight, no adapters (give --lora-rank r)")
LR_SCHEDULES = ("constant", "linear", "cosine")                      # --lr-schedule: lr_factor
OPTIONS = [
    # name                default                              help [, choices or a range]
    opt("algo",           "erpo",                              "sft, or a row of losses.ALGOS", ["sft", *losses.ALGOS]),
    opt("task",           "math",                              "what the rows ask and how a completion is scored "
                                                               "(tasks/; its sets are the defaults of --train-data "
                                                               "and --eval-data)", tasks.TASKS, before="math"),
    opt("model",          os.path.join(TINY, "warmstart"),     "HF folder or hub id of the policy (also the reference model)"),
    opt("train_data",     tasks.get("math").train_data,        "training problems: JSONL path or set name (default: "
                                                               "--task's)"),
    opt("eval_data",      list(tasks.get("math").heldout),     "held-out sets for periodic evaluation, names or paths "
                                                               "(default: --task's)"),
    opt("template",       "plain",                             "prompt template (data/prompts.TEMPLATES; default: --task's)",
                                                               prompts.TEMPLATES),
    opt("out",            None,                                "run folder (config.json, metrics.jsonl, ckpt/); default runs/<algo>", resume=HOW_IT_RUNS),
    opt("seed",           0,                                   "seed of prompt order and of every sampled row"),
    # rollout: prompts per step, responses per prompt, sampling
    opt("steps",          50,                                  "RL steps (one rollout batch each)", ">=0", resume=MAY_CHANGE),
    opt("rollout_batch",  32,                                  "prompts sampled per RL step (global, all ranks)", ">=1"),
    opt("update_batch",   16,                                  "prompts per optimizer step (global); rollout/update = optimizer steps per RL step", ">=1"),
    opt("group_size",     8,                                   "responses per prompt (G)", ">=2"),
    opt("temperature",    1.0,                                 "rollout temperature; log-probs are computed on logits/T", ">0"),
    opt("top_p",          1.0,                                 "nucleus sampling (1 = off)", "(0,1]"),
    opt("max_prompt_len", 128,                                 "longer prompts are dropped from the training set", ">=1"),
    opt("max_new_tokens", 96,                                  "response length limit", ">=1"),
    opt("sampler",        "hf",                                "HF generate with the seeded per-row draw (plain), or "
                                                               "the one-pass KV-cache sampler (kv: fast, sampler/)", ["hf", "kv"]),
    opt("gen_batch",      256,                                 "rows per sampler call, at most", ">=1", resume=MAY_CHANGE),
    opt("kv_budget",      0,                                   "KV-cache positions per sampler call (0 on CUDA: what fits in the memory free at each "
                                                               "pass beside the rollout's other allocations, less 10% of the card; CPU: no cap)", ">=0", resume=MAY_CHANGE),
    opt("compile_decode", False,                               "the sampler's decode step through torch.compile (CUDA graphs); off until measured on a GPU", resume=MAY_CHANGE),
    opt("max_resample_rounds", 4,                                 "dynamic sampling: extra sampling rounds at most", ">=0"),
    opt("reward",         "acc",                               "binary accuracy, or 0.9*acc + 0.1*format", ["acc", "acc+format"]),
    # optimisation
    opt("lr",             2e-4,                                "AdamW learning rate", ">0", resume=MAY_CHANGE),
    opt("weight_decay",   0.01,                                "AdamW weight decay", ">=0", resume=MAY_CHANGE),
    opt("warmup",         0,                                   "linear warm-up, in optimizer steps", ">=0", resume=MAY_CHANGE),
    opt("lr_schedule",    "constant",                          "the LR after warm-up: constant, or decayed to --lr-floor "
                                                               "(lr_factor)", list(LR_SCHEDULES), before="constant"),
    opt("lr_floor",       0.0,                                 "a decaying schedule's final LR, as a fraction of --lr", "[0,1]", acts=_DECAYS),
    opt("lr_decay_steps", 0,                                   "RL steps over which the LR decays (0: --steps, which it "
                                                               "follows when --resume changes --steps)", ">=0", acts=_DECAYS, resume=MAY_CHANGE),
    opt("grad_clip",      1.0,                                 "clip the global grad norm (0 = off)", ">=0", resume=MAY_CHANGE),
    opt("ppo_epochs",     1,                                   "passes over each rollout batch", ">=1"),
    opt("micro_batch",    64,                                  "sequences per forward/backward on each rank", ">=1", resume=MAY_CHANGE),
    opt("micro_tokens",   0,                                   "also at most this many tokens per micro-batch: real tokens when --pack packs the forward, else padded (0 = no cap)", ">=0", resume=MAY_CHANGE),
    opt("pack",           False,                               "fast path: full-row training forwards run each micro-batch's real tokens, packed (no padding; modeling/logprobs.py)", resume=MAY_CHANGE),
    opt("dtype",          "auto",                              "bf16-mixed: fp32 weights + bf16 autocast (2x faster matmuls on CPUs with AVX512-BF16/AMX); auto: that on CUDA, fp32 on CPU", ["auto", "float32", "bfloat16", "bf16-mixed"]),
    opt("fsdp",           False,                               "shard the policy (and reference) with FSDP2 instead of DDP replicas (large models)"),
    opt("lora_rank",      0,                                   "LoRA: train rank-r adapters on the policy's linear layers, "
                                                               "the rest frozen and the reference model (modeling/lora.py; 0 = "
                                                               "full fine-tuning)", ">=0", before=0),
    opt("lora_alpha",     16.0,                                "LoRA: the adapters' update is (alpha / r) B A", ">0", acts=_LORA),
    opt("lora_dropout",   0.0,                                 "LoRA: dropout on the adapters' input", "[0,1)", acts=_LORA),
    opt("lora_targets",   "all-linear",                        "LoRA: peft's target_modules, 'all-linear' or names "
                                                               "joined by commas (q_proj,v_proj)", acts=_LORA),
    opt("grad_ckpt",      memory_plan.AUTO,                    "activation checkpointing of every decoder layer: true, false, or "
                                                               "auto = on only where the update micro-batch does not fit the "
                                                               "card without it (memory_plan.needs_checkpointing; CPU: off)", resume=MAY_CHANGE),
    opt("share_prompts",  False,                               "fast path: training forwards run each prompt once for its G responses (not with --fsdp/--grad-ckpt)", resume=MAY_CHANGE),
    opt("dry_run",        False,                               "print the per-GPU memory plan (plumbing/memory_plan.py) and exit; no weights loaded", resume=HOW_IT_RUNS),
    opt("plan_gpus",      8,                                   "GPUs the --dry-run plan assumes", ">=1", resume=HOW_IT_RUNS),
    opt("plan_gpu",       "h100",                              "the GPU --dry-run's time model assumes (plumbing/time_model.py)",
                                                               list(time_model.GPUS), resume=HOW_IT_RUNS),
    opt("plan_lengths",   None,                                "--dry-run's time model: measured lengths (an evaluate.py "
                                                               "samples.jsonl, a run's metrics.jsonl, or a "
                                                               "time_model.prompt_histogram JSON); default: the review "
                                                               "case of configs/lengths/ (plumbing/time_model.py)", resume=HOW_IT_RUNS),
    opt("plan_constants", None,                                "--dry-run's time model: a bench/gpu_check.py results JSON whose "
                                                               "measured constants replace the assumed ones "
                                                               "(plumbing/time_model.py CONSTANTS)", resume=HOW_IT_RUNS),
    opt("qkl_ref",        "cache",                             "the Query-KL reference (rl/query_reference.py): the "
                                                               "initial policy's prompt log-probs cached before RL "
                                                               "(the paper); the reference model's forward over "
                                                               "each step's prompts (live: what the released code "
                                                               "means); zeros (released-zeros: what it computes); "
                                                               "an anchor that moves (ema, refresh); another "
                                                               "model's, from --qkl-ref-model (model)",
                                                               query_reference.REFERENCES, before="cache"),
    opt("query_cache_dir",   os.environ.get("ERPO_CACHE", "~/.cache/erpo/query_cache"), "reuse Query-KL reference caches of earlier runs from here ('' = always build)", resume=MAY_CHANGE),
    opt("measure_policy_kl", False,                               "keep a reference model to log Policy-KL even when the loss has none "
                                                               "(ERPO's Table 3 Policy-KL column: true; +23 s a paper step, 9.0 -> 10.5 h)", resume=MAY_CHANGE),
    opt("no_signal",      "skip",                              "an update batch whose every advantage is ~0 (its "
                                                               "groups' rewards all equal): skip its step (no AdamW "
                                                               "update, no weight decay, the LR schedule waits), or "
                                                               "step on the KL terms alone (method.md §8.6)",
                                                               ["skip", "step"], before="step"),
    opt("max_bad_steps",  3,                                   "consecutive non-finite (skipped) optimizer steps that end the run", ">=1", resume=MAY_CHANGE),
    opt("strict_data",    False,                               "training rows without a problem or an answer are an error, not skipped"),
    # evaluation / checkpoints
    opt("eval_every",     10,                                  "held-out evaluation every N steps (0 = never)", ">=0", resume=MAY_CHANGE),
    opt("eval_temperatures", [1.0],                               "held-out sampling temperatures: eval_acc* are the "
                                                               "first's; with several, each is also logged as "
                                                               "eval_acc@T<t>*", ">=0", before=lambda saved: [saved.get("eval_temperature", 1.0)]),
    opt("eval_limit",     200,                                 "problems per held-out set (0 = all)", ">=0"),
    opt("monitor_every",  10,                                  "each loss term's gradient norm, cosine to the PG's, every N steps (0 = never; not with --fsdp)", ">=0", resume=MAY_CHANGE),
    opt("save_every",     20,                                  "checkpoint every N steps and at the end (0 = never)", ">=0", resume=MAY_CHANGE),
    opt("resume",         False,                               "continue the run in --out from its checkpoint (options "
                                                               "that fix the run must not change; those in "
                                                               "RESUME_MAY_CHANGE may)", resume=HOW_IT_RUNS),
    opt("overwrite",      False,                               "replace the run already in --out (a fresh run into it "
                                                               "is an error otherwise)", resume=HOW_IT_RUNS),
    opt("export",         None,                                "after training, save the final model + tokenizer to this folder", resume=MAY_CHANGE),
    opt("export_dtype",   "auto",                              "dtype of exported HF folders (--export; an FSDP2 run's <out>/hf): "
                                                               "auto = bfloat16 when the run computes in bf16, else the weights' own; "
                                                               "checkpoints keep float32", list(checkpoints.EXPORT_DTYPES), resume=MAY_CHANGE),
    opt("nccl_timeout",   120.0,                               "minutes a rank waits at a collective (NCCL's default 10 can fire "
                                                               "during a long evaluation or export)", ">0", resume=MAY_CHANGE),
    opt("extensions",     [],                                  "modules imported before the options are read: their rows of the "
                                                               "extension tables and their options (dotted names or .py files; "
                                                               "plumbing/extension.py); --resume imports the run's again"),
    opt("shaping",        [],                                  "reward-shaping terms applied after grading, rows of "
                                                               "rl/experience.SHAPING (an extension's): each sees the graded "
                                                               "rollout and logs its own metrics"),
    opt("log",            "jsonl",                             "also mirror metrics.jsonl to TensorBoard or W&B", ["jsonl", "tensorboard", "wandb"], resume=MAY_CHANGE),
] + sft.OPTIONS + query_reference.reference_options()  # the warm start's (--sft-*), the references' (--qkl-ref-*)

# The rules of the table's rows, as the checks read them (plumbing/options.Option's columns)
ACTS_ONLY_WITH = {o.name: o.acts for o in OPTIONS if getattr(o, "acts", None)}
RESUME_MAY_CHANGE = {o.name for o in OPTIONS if getattr(o, "resume", None) == MAY_CHANGE}
NOT_THE_RUN = {o.name for o in OPTIONS if getattr(o, "resume", None) == HOW_IT_RUNS}
BEFORE_OPTION = {o.name: o.before for o in OPTIONS if getattr(o, "before", NEW) is not NEW}


# ----------------------------------------------------------------------------------------------
# RL, part 1: the step, plain. Sampling and grading are rl/experience.py's (with rollout.py and
# reward.py), the loss terms losses.py's (equations: docs/method.md). Each fast path of the GPU configs
# is an option that sends the step to rl/scale_step.py instead (run_setup.FAST_PATHS), held equal to
# this one by the golden runs (tests/test_golden.py).


def rl_step(run, step, before_update=None) -> experience.StepResult:
    """One RL step, returning what it computed (the loop logs it): this rank's prompts, G responses
    each, graded -> pi_old's log-probs -> advantages A and query weights w -> --ppo-epochs passes of
    PPO updates."""
    if run.fast:
        return scale_step.rl_step(run, step, before_update)     # a fast path on: rl/scale_step.py
    G, dev = run.args.group_size, run.dist.device
    with run.decoding_copy(run.policy, run.spec.weights_dtype) as decoder:
        collected = experience.collect(run, decoder, step)              # G responses per prompt, graded
    ro, valid = collected.ro.to(dev), collected.valid.to(dev)           # valid (B,): rows with a loss
    packed = ro.packed()                                                 # [prompt | response] rows
    resp_mask = ro.response_mask.float() * valid[:, None]               # (B, R)
    prompt_mask = packed.prompt_tok_mask.float() * valid[:, None]       # (B, P-1) prompt tokens 2..P
    with run.timer("score"):
        scores = score_old(run, packed)                                  # pi_old (and the reference)
    prompts = query_reference.PromptBatch(collected.prompt_idx, G, packed.P - 1, scores.prompt, prompt_mask,
                                          scores.ref_prompt, step, packed.input_ids[:, :packed.P])
    qref = run.qref.prompt_logp(prompts)                                 # (B, P-1) Query-KL's reference
    adv, signal = experience.advantages(run, collected.rewards.to(dev), scores, resp_mask, valid)  # A
    w = query_weights(run, collected.prompt_idx, scores.prompt, prompt_mask, valid)              # w(q)
    batch = experience.UpdateBatch(packed, resp_mask, prompt_mask, valid, scores, qref, adv, w, ro.logprobs,
                                   signal)
    if before_update is not None:                                        # the monitors, at pi_old
        before_update(batch, None)
    with run.timer("update"):
        update = ppo_update(run, batch, signal)
    return experience.StepResult(collected, ro, batch, prompts, qref, update)


def micro_batches(run, rows: slice) -> list[slice]:
    """Consecutive slices of at most --micro-batch rows: every rank runs as many (same row counts)."""
    size = run.args.micro_batch
    return [slice(s, min(rows.stop, s + size)) for s in range(rows.start, rows.stop, size)]


def score(model, packed, rows, temperature, with_entropy=False) -> logprobs.TokenScores:
    """One forward over [prompt | response] rows -> every token's log-prob under softmax(logits / T):
    the response's (policy loss) and the prompt's (Query-KL) from the same forward (method.md §3)."""
    ids, mask, P = packed.input_ids[rows], packed.attention_mask[rows], packed.P   # (b, P+R)
    pos = (mask.cumsum(1) - 1).clamp(min=0)                   # left-padded: positions count real tokens
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)  # (b, P+R-1, V): j predicts j+1
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)                  # (b, P+R-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, P - 1:] if with_entropy else None
    return logprobs.TokenScores(tok[:, P - 1:], tok[:, :P - 1], entropy)  # response (b, R), prompt (b, P-1)


@torch.no_grad()
def score_old(run, packed) -> experience.RolloutScores:
    """pi_old's log-probs and entropy (the policy before this step's updates), and the reference
    model's log-probs where one is loaded, micro-batch by micro-batch."""
    T, everything = run.args.temperature, slice(0, packed.input_ids.shape[0])
    parts = micro_batches(run, everything)
    mine = [score(distributed.unwrap(run.policy), packed, rows, T, with_entropy=True) for rows in parts]
    ref = None if run.ref is None else [score(run.ref, packed, rows, T) for rows in parts]

    def cat(parts, field):
        return None if parts is None else torch.cat([getattr(p, field) for p in parts])
    return experience.RolloutScores(cat(mine, "response"), cat(mine, "prompt"), cat(mine, "entropy"),
                                cat(ref, "response"), cat(ref, "prompt"))


def query_weights(run, prompt_idx, prompt_logp, prompt_mask, valid):
    """Per-row query weights w(q) by algo.weights (losses.query_weights, method.md §4: paper, from the
    cached reference NLLs; code, the policy's over each update batch), or None."""
    algo, G = run.algo, run.args.group_size
    if algo.weights == "paper":
        w = losses.query_weights(run.cache.nll[torch.tensor(prompt_idx)], mean_nll=run.cache.nll_mean,
                                 clip=algo.weight_clip)
        return w.repeat_interleave(G).to(valid.device)
    if algo.weights == "code":
        rows = experience.update_batches(len(valid), run.args, run.dist.world)
        return experience.code_query_weights(prompt_logp, prompt_mask, valid, rows)
    return None


def ppo_update(run, batch: experience.UpdateBatch, signal) -> dict:
    """--ppo-epochs passes over the update batches, an optimizer step each -> each applied step's
    statistics (rl_loss's, grad_norm), skipped_steps (non-finite), no_signal_steps, the lr. Every
    loss term is divided by its update batch's GLOBAL count (tokens or rows, all micro-batches and
    ranks), so any micro-batch size and world size give the gradient of one big batch."""
    applied, skipped, no_signal, lr = [], 0, 0, run.opt.param_groups[0]["lr"]   # (the step's first lr)
    for _epoch in range(run.args.ppo_epochs):
        for rows in experience.update_batches(len(batch.valid), run.args, run.dist.world):
            n = all_sums({"tokens": batch.resp_mask[rows], "seqs": batch.valid[rows],
                          "signal": signal[rows].float() * batch.valid[rows]})
            if n["seqs"] == 0 or (n["signal"] == 0 and run.args.no_signal == "skip"):  # no signal (§8.6):
                no_signal += 1                                           # AdamW would still move every
                continue                                                 # weight by ~lr
            stats = accumulate_gradient(run, batch, rows, max(1.0, n["tokens"]), n["seqs"])
            norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), run.args.grad_clip or math.inf)
            host = distributed.read_scalars({**stats, "grad_norm": norm}, finite=("loss", "grad_norm"))
            if host is None:                                             # not finite on some rank: not
                run.guard.bad_step(run.opt, run.sched)                   # applied; too many end the run
                skipped += 1
                continue
            run.opt.step()                                               # AdamW at lr x lr_factor(step)
            run.sched.step()
            run.opt.zero_grad(set_to_none=True)
            applied.append(host)
    return {"applied": applied, "skipped_steps": skipped, "no_signal_steps": no_signal, "lr": lr}


def accumulate_gradient(run, batch: experience.UpdateBatch, rows: slice, num_tokens, num_seqs) -> dict:
    """Forward + backward of each micro-batch of one update batch -> its loss statistics, summed."""
    args, algo, scores, stats = run.args, run.algo, batch.scores, {}
    parts = micro_batches(run, rows)
    for k, mb in enumerate(parts):
        if run.dist.world > 1:                                           # DDP: reduce at the last only
            run.policy.require_backward_grad_sync = k == len(parts) - 1
        now = score(run.policy, batch.packed, mb, args.temperature, algo.uses_entropy)
        loss, st = losses.rl_loss(                               # PG(A*w) [+ b*PolicyKL] [+ a*QueryKL]
            algo, logp=now.response, old_logp=scores.old[mb],
            ref_logp=scores.ref[mb] if algo.has_policy_kl_loss else None,
            resp_mask=batch.resp_mask[mb], advantages=batch.adv[mb],
            weights=None if batch.weights is None else batch.weights[mb],
            prompt_logp=now.prompt, prompt_ref_logp=batch.qref[mb], prompt_mask=batch.prompt_mask[mb],
            num_tokens=num_tokens, num_seqs=num_seqs, max_len=args.max_new_tokens,
            sampler_logp=batch.sampler[mb], entropy=now.entropy)
        (loss * run.dist.world).backward()                     # DDP averages over ranks: we want the sum
        if faults.ARMED:                                       # the fault tests' kill point
            faults.point("mid-step")
        for key, v in st.items():
            stats[key] = stats.get(key, 0.0) + v.detach().double()
    return stats


def lr_factor(s, kind="constant", warmup_steps=0, decay_steps=0, floor=0.0) -> float:
    """The LR multiplier of optimizer step s (0-based): (s + 1) / warmup_steps during the warm-up;
    then 1 ("constant"), or decaying from 1 at the warm-up's end to `floor` at step decay_steps, and
    `floor` after: linear, or cosine, floor + (1 - floor) (1 + cos(pi t)) / 2 with t the fraction of
    the decay done. Why constant by default, and the horizon on --resume: plumbing/optimizer.py."""
    if s < warmup_steps:
        return (s + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    t = min(1.0, (s - warmup_steps) / max(1, decay_steps - warmup_steps))
    shape = 1.0 - t if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return floor + (1.0 - floor) * shape


def lr_schedule(args):
    """lr_factor with the run's options, as torch's LambdaLR calls it (step s -> multiplier). The decay
    runs over --lr-decay-steps RL steps, or (0) --steps, in optimizer steps."""
    per_rl_step = args.rollout_batch // args.update_batch * args.ppo_epochs      # optimizer steps
    horizon = args.lr_decay_steps or args.steps                          # (0: the run's --steps, resumed too)
    return functools.partial(lr_factor, kind=args.lr_schedule, warmup_steps=args.warmup,
                             decay_steps=horizon * per_rl_step, floor=args.lr_floor)



# ----------------------------------------------------------------------------------------------
# Set-up and the loop


def train_rl(run, evalsets, log, start, amp):
    """Steps start..--steps, each logged, with held-out evaluations and checkpoints at their
    cadence. Ctrl-C / SIGTERM end the run at the next step boundary, with a checkpoint."""
    args = run.args
    evaluation = monitors.Evaluation(run, evalsets, amp, start)         # accuracy, held-out Query-KL
    evaluation.first(log)                                                # the starting point (step 0)
    bar = tqdm(range(start, args.steps), desc=args.algo, initial=start, total=args.steps,
               disable=not run.dist.main)
    shown = ("train_acc", "eval_acc", "query_kl", "policy_kl", "entropy")
    said_no_signal = False
    check = time_check.FirstSteps(args, run.dist, needs_reference_model(args, run.algo),  # on a GPU: the
                                  old_rows(args, run.algo), start, say=print0)  # time model vs steps 2-3
    with interrupts.deferred() as stop:
        for step in bar:
            t0 = time.time()
            with amp():
                m = {**logged_step(run, step), "step_time": time.time() - t0}
            last = step + 1 == args.steps
            m.update(evaluation.at(step + 1, last))                      # every --eval-every steps, the last
            log(check({**m, **run.timer.metrics()}))                     # + time_gen, time_reward, ...
            if m["no_signal_steps"] and not said_no_signal:
                said_no_signal = print0(NO_SIGNAL) or True
            if run.guard.idle_streak == IDLE_STEPS:                           # said once per such streak
                print0(IDLE.format(n=IDLE_STEPS, first=step + 2 - IDLE_STEPS, last=step + 1,
                                   acc=m.get("train_acc", float("nan"))))
            bar.set_postfix({k: f"{m[k]:.3f}" for k in shown if k in m} | {"s/step": f"{m['step_time']:.1f}"})
            saved = args.save_every and ((step + 1) % args.save_every == 0 or last)
            if saved:
                run_setup.save(run, step + 1, final=last)
            if not last and stop.requested():                            # every rank: the same step
                if not saved:
                    run_setup.save(run, step + 1, final=False)
                bar.close()
                ckpt = checkpoints.checkpoint_dir(args.out)
                raise stop.exit(f"saved the checkpoint of step {step + 1} ({ckpt}/); continue with --resume")


def logged_step(run, step) -> dict:
    """rl_step between the hooks of the loop: the controllers' coefficients before it (§8.7), the
    term monitors at pi_old every --monitor-every steps, and after it the guard of steps that applied
    nothing, the moving Query-KL references' update, the step's metrics line (reduced over ranks)."""
    run.algo = extension.steer(run.algo, run.controllers)                # per-step coefficients (§8.7)
    every, grads = run.args.monitor_every, {}
    due = every and (step + 1) % every == 0

    def monitor(batch, plan):                                            # each term's gradient
        grads.update(monitors.term_gradients(run, batch, plan))
    res = rl_step(run, step, monitor if due else None)
    update = experience.update_statistics(res.update)                    # over the applied steps
    if update["grad_norm"] is None:                                  # no optimizer step applied: are
        run.guard.no_step(step, run.policy)                              # the weights sound? (their norm)
    else:                                                                # a finite one: the latest
        run.guard.finite_step()                                          # checkpoint is trusted
    run.qref.after_step(res.prompts)                                     # (its prompt scores are complete)
    initial = query_reference.monitor_logp(run.qref, res.qref, res.prompts, run.cache)  # drift from pi_0
    m = experience.step_metrics(run, step, res.collected, res.ro, res.batch, initial, update)
    return extension.after_step(run.controllers, {**m, **grads})         # + the coefficients it used


NO_SIGNAL = ("no signal: an update batch whose every advantage is ~0 (its groups' rewards all equal) took no "
             "optimizer step (no_signal_steps in metrics.jsonl; method.md §8.6); --no-signal step takes such "
             "steps on the KL terms alone")

# A run whose last IDLE_STEPS RL steps applied no optimizer step at all (every update batch without
# signal, or non-finite) is not training: said in one line when the streak reaches it.
IDLE_STEPS = 10
IDLE = ("no optimizer step in {n} RL steps in a row (steps {first}-{last}; train_acc {acc:.3f}): every "
        "update batch had no signal (its groups' rewards all equal) or a non-finite loss, so the policy is "
        "not training; check the rewards (--task, --reward, --max-new-tokens), or take such steps with "
        "--no-signal step")


# The extension tables (plumbing/extension.py): a row registered from outside with its own options is
# one call; the parser, built at parse time, has its options and its name as a choice.
for _option, _table in (("adv", losses.ADVANTAGES), ("surrogate", losses.SURROGATES),
                        ("kl", losses.KL_ESTIMATORS), ("controllers", controllers.CONTROLLERS)):
    extension.declare(_option, _table)


def option_table() -> list:
    """OPTIONS and, as registered now, the extension rows' own options (--passk-k, --entropy-target)."""
    names = {row[0] for row in OPTIONS}
    return OPTIONS + [row for row in extension.own_options() if row[0] not in names]


def parse_args(argv=None):
    extension.load_named(sys.argv[1:] if argv is None else argv)      # before the parser: their rows
    rows = ["sft        supervised warm start, prompt tokens in the loss",
            *(f"{k:10s} {v.doc}" for k, v in losses.ALGOS.items())]
    doc = __doc__ + "\nalgorithms (--algo):\n" + "\n".join(f"  {row}" for row in rows)
    parsed = options.parse(argv, option_table(), doc)
    args = parsed.args
    if args.algo == "sft" and "model" not in parsed.cli | parsed.config_keys:
        args.model = os.path.join(TINY, "base")  # the warm start trains the untrained base model
    args.out = args.out or os.path.join("runs", args.algo)
    task = tasks.get(args.task)                                          # its own sets, where it has them
    own = {"train_data": task.train_data, "eval_data": list(task.heldout),
           "max_new_tokens": task.max_new_tokens, "template": task.template}
    options.fill(parsed, {k: v for k, v in own.items() if v})
    options.absolute_paths(parsed, ("model", "train_data", "eval_data", "sft_data", "export",
                                    "qkl_ref_model", "plan_constants", "extensions"))
    if args.resume:                                     # what the command does not say, config.json does
        saved = run_dir.read_config(args.out) or {}
        options.fill(parsed, saved, skip=NOT_THE_RUN)
        if saved:                                       # options newer than the run: as it trained
            options.fill(parsed, {k: v(saved) if callable(v) else v for k, v in BEFORE_OPTION.items()
                                  if k not in saved}, skip=NOT_THE_RUN)
    unknown = sorted(set(args.shaping) - set(experience.SHAPING))
    if unknown:
        parsed.error(f"--shaping {' '.join(unknown)}: no such row of rl/experience.SHAPING (an --extensions "
                     "module registers them)")
    if args.resume and args.overwrite:
        parsed.error("--resume continues the run in --out, --overwrite replaces it: choose one")
    if args.lora_rank and (args.fsdp or args.algo == "sft"):
        parsed.error(f"--lora-rank with {'--fsdp' if args.fsdp else '--algo sft'}: LoRA trains the RL policy "
                     "in one process or under DDP (modeling/lora.py); drop --lora-rank, or train without "
                     "--fsdp")
    if args.resume and args.algo == "sft":
        parsed.error("--resume: the SFT warm start does not resume (it saves HF folders, sft-<step>/, not "
                     "training state); start it again (--overwrite)")
    options.check_inert_options(parsed, ACTS_ONLY_WITH)                  # (after --resume's config.json)
    optimizer.check_horizon(parsed)
    # less than the task's solutions need: a warning, not a refusal -- a shorter limit can be meant (cheaper
    # steps, --mask-truncated, a study of truncation), but not without a word
    if task.max_new_tokens and args.max_new_tokens < task.max_new_tokens:
        print0(f"warning: --max-new-tokens {args.max_new_tokens} is below the {task.max_new_tokens} tokens "
               f"--task {args.task}'s solutions need: longer responses are cut (truncated_frac in "
               "metrics.jsonl)")
    algo = options.make_algo(parsed)                                     # None for sft
    options.check_extension_options(parsed, algo, controllers.CONTROLLERS)  # --passk-k, --qkl-ref-decay, ...
    why = algo and controllers.refusal(args, algo)                       # e.g. a start above its bound
    if why:
        parsed.error(why)
    return args, algo


def load_data(args, tokenizer):
    """Held-out sets and the training problems (SFT: sequences), checked before anything is
    written to --out: a bad input ends here with one line."""
    with errors.one_line():
        evalsets = {n: tasks.prompt_set(n, tokenizer, args.template, args.task, limit=args.eval_limit or None)
                    for n in args.eval_data}
        if args.algo == "sft":
            data = sft.load_sequences(args.sft_data, tokenizer, args.template, args.max_seq_len)
        else:
            data = tasks.prompt_set(args.train_data, tokenizer, args.template, args.task, training=True,
                                    max_prompt_len=args.max_prompt_len, strict=args.strict_data)
            errors.check_heldout(evalsets, args.train_data, data, tasks.source_of)  # held-out: not trained on
            misfit = tasks.tokenizer_misfit(args.task, tokenizer, args.model, data.rows)
            if misfit:                                                  # (every reward 0, and no word)
                raise errors.DataError(misfit)
        batching.check_data(len(data), args)
    return evalsets, data


def main(argv=None):
    with interrupts.exit_when_interrupted(lambda: "stopped now, without saving"):  # outside the steps
        return train(*parse_args(argv))                                    # (theirs: train_rl), or twice


def train(args, algo):
    t0 = time.time()
    if args.dry_run:  # the plan's formulas, and the step's memory measured on fake tensors beside them
        measured = memory_measure.measure_memory(args, algo, args.plan_gpus) if algo else None
        has_ref = bool(algo) and needs_reference_model(args, algo)
        if algo:                                                         # the step's time, modelled
            print(time_model.report(args, args.plan_gpus, has_ref, args.plan_gpu, old_rows(args, algo)))
            print(time_model.disk_report(args, args.plan_gpus))
        return print(memory_plan.report(args, args.plan_gpus, has_ref, measured))
    why = run_dir.refusal(args.out, resume=args.resume, overwrite=args.overwrite, export=args.export,
                          log=args.log, reads={"--qkl-ref-model": args.qkl_ref_model})  # before minutes
                                                                 # of loading, and before the claim
    if why:
        raise SystemExit(f"error: {why}")
    # --fsdp at world size 1: a process group of one
    dist = distributed.setup(fsdp=args.fsdp, timeout_min=args.nccl_timeout)
    batching.check(args, dist.world) if algo else None                   # sizes that do not divide
    if algo is None and args.sft_batch % dist.world:                     # (sft.train_sft's, before claim)
        raise SystemExit(f"error: --sft-batch {args.sft_batch} does not divide by world size {dist.world}")
    torch.manual_seed(args.seed), random.seed(args.seed)
    with run_dir.RunLock(args.out) as lock:                              # released on any exit (a kill too)
        evalsets = train_in_folder(args, algo, dist, lock)
    sizes = {name: len(problems) for name, problems in evalsets.items()}     # (the next: lines' counts)
    print0(run_summary.summary(args.out, time.time() - t0, sizes, args.template, args.save_every))
    distributed.teardown()


def train_in_folder(args, algo, dist, lock):
    """Load, check, claim --out, train; -> the held-out sets (for the summary)."""
    if args.resume:                                                  # resuming may repair ckpt/: lock first
        run_dir.claim(args.out, lock, resume=True, overwrite=False)
    state = checkpoints.resume_point(args.out) if args.resume else None
    changed = run_dir.resume_changes(args, algo, state, RESUME_MAY_CHANGE, NOT_THE_RUN)
    older = run_dir.older_config(args, NOT_THE_RUN, BEFORE_OPTION) if args.resume else {}  # said in one line
    (dtype, amp), bf16 = distributed.precision(args.dtype, dist.device), distributed.uses_bf16(args.dtype,
                                                                                               dist.device)
    if algo is not None:                                             # --grad-ckpt auto: the plan's rule, once
        run_setup.resolve_grad_ckpt(args, algo, dist.world, dist.device)
    shard = distributed.sharder(args.fsdp, dist.device, bf16, args.grad_ckpt is True or (  # SFT's auto:
        args.grad_ckpt == memory_plan.AUTO and args.fsdp))                                # on where sharded
    # --resume: the checkpoint's weights (LoRA: the base, --model; its adapters come with setup_rl)
    source = checkpoints.model_source(args.out, state is not None and not args.lora_rank, args.model)
    attention = models.attention_for(dist.device, dtype, bf16)        # the reference gets the same
    model, tokenizer = models.load_for_training(source, dist.device, dtype, shard, bf16, attention)
    print0(attention.description)
    print0(f"model {args.model}: {model.num_parameters() / 1e6:.2f}M parameters, {dtype}, {dist.device}")
    evalsets, data = load_data(args, tokenizer)                      # bad data: one line, nothing written
    why = lora.unmatched_targets(model, args.lora_targets) if args.lora_rank else None
    if why:                                                          # (peft's traceback, after the claim)
        raise SystemExit(f"error: {why}")
    with errors.one_line():                                          # prompts + responses fit the positions
        check_fits(model, evalsets, args.max_new_tokens)
    run_dir.claim(args.out, lock, resume=args.resume, overwrite=args.overwrite)  # --overwrite: old run goes
    if algo is not None:
        print0(f"algo {args.algo}: {options.algo_summary(algo)}")
        # (a resume refused in here keeps the metrics: the log is opened after it)
        run = setup_rl(args, algo, dist, model, tokenizer, data, state, lr_schedule(args))
    log = run_dir.MetricsLog(args.out, state.step if state else 0, args.log, vars(args))  # after every check
    try:
        run_dir.write_config(args.out, run_dir.with_resume_record(args.out, vars(args), state and state.step,
                                                                  changed, older))
        if algo is None:
            sft.run(args, dist, model, tokenizer, data, evalsets, log, amp)
        else:
            train_rl(run, evalsets, log, state.step if state else 0, amp)
            if state and state.step == args.steps:                       # finished: its <out>/hf complete?
                run_setup.check_final_export(run, state.step)
            checkpoints.export(run_setup.exportable(run), tokenizer, args.export, args.export_dtype,
                               bf16=bf16)
    finally:
        log.close()
    return evalsets


if __name__ == "__main__":
    main()
