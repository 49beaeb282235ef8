"""Setting up an RL run: the `Run` record every part of a step works with, built once from the
options by `setup_rl`: the policy (wrapped for DDP / FSDP2; --lora-rank: with adapters), the
reference model where one is needed, the Query-KL reference and its cache, the optimizer and its
schedule, the sampler's spec. train.py's story (rl_step and the loop) starts from a Run.
"""

import os
import shutil
from dataclasses import dataclass, field
from typing import Callable

import torch

import losses
from modeling import lora
from modeling import models
from rl import controllers, experience, query_reference
import rollout
import tasks
from data.prompts import PromptSet
from plumbing import batching, checkpoints, distributed, extension, memory_plan, optimizer, step_guard
from plumbing.distributed import print0


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
    data: PromptSet                     # the training problems (each row's "task" scores it)
    qref: query_reference.QueryReference  # the Query-KL reference (--qkl-ref)
    cache: query_reference.QueryCache | None  # the initial policy's prompt log-probs, where needed:
                                        # --qkl-ref cache, the paper's weights, the monitor
    spec: rollout.SampleSpec
    timer: experience.Phases            # seconds per phase of a step (time_gen, time_update, ...)
    task_names: tuple = ()              # the tasks of the training rows (train_acc per task if > 1)
    guard: step_guard.StepGuard = None  # non-finite steps, idle steps, the trusted checkpoint
    # (policy, dtype) -> a context giving the model the sampler decodes with, freed on exit: a LoRA
    # policy's merged copy (lora.decoding_copy), else the policy itself (FSDP2: its gathered copy)
    decoding_copy: Callable = distributed.gathered
    controllers: dict = field(default_factory=dict)  # the active rows of controllers.CONTROLLERS, made for
                                        # this run: each step's loss coefficients (extension.steer)
    fast: bool = False                  # a fast path of the step is on: rl/scale_step.py runs it


# The fast paths, each an option (the GPU configs turn them on); train.rl_step is the plain step.
# The sampler's is a seam of its own (rollout.sample_with); the others send the step to
# rl/scale_step.py. {name: (is it on (args, bf16), what it does)}
FAST_PATHS = {
    "sampler": (lambda a, bf16: a.sampler == "kv", "--sampler kv: the one-pass KV-cache sampler (sampler/)"),
    "pack": (lambda a, bf16: a.pack, "--pack: training forwards run the real tokens, packed"),
    "share_prompts": (lambda a, bf16: a.share_prompts, "--share-prompts: a prompt runs once for its G responses"),
    "micro_tokens": (lambda a, bf16: a.micro_tokens > 0, "--micro-tokens: micro-batches planned under a token cap"),
    "fsdp": (lambda a, bf16: a.fsdp, "--fsdp: sharded forwards in lockstep"),
    "fused_head": (lambda a, bf16: bf16, "bf16 (--dtype): log-probs from a float32 head fused with the "
                   "log-softmax (bf16 logits would round them)"),
}


def fast_paths(args, bf16=False) -> list[str]:
    """The names of FAST_PATHS that are on."""
    return [name for name, (on, _) in FAST_PATHS.items() if on(args, bf16)]


def describe_fast_paths(args, bf16=False) -> str:
    """Start-up's one line: which fast paths are on."""
    on = [FAST_PATHS[name][1] for name in fast_paths(args, bf16)]
    return "fast paths: " + ("; ".join(on) if on else "none (the plain step, train.rl_step)")


def old_rows(args, algo) -> float:
    """The fraction of rows pi_old's own forward scores: all but the first update's (on_policy_rows)."""
    return 1.0 if algo.needs_pi_old_first else 1.0 - args.update_batch / args.rollout_batch


def needs_reference_model(args, algo) -> bool:
    """A Policy-KL in the loss or the reward, measured (--measure-policy-kl: off by default, so ERPO
    loads none unless asked), or a Query-KL reference that reads a model (--qkl-ref live, model)."""
    live = query_reference.REFERENCES[args.qkl_ref].needs_model
    return algo.kl is not None or args.measure_policy_kl or live


def policy_and_reference(args, algo, dist, model, state):
    """The wrapped policy (--lora-rank: with adapters, restored on --resume) and the reference model
    where one is needed: a bf16 copy sharded like the policy, or a LoRA policy's frozen base. (ERPO
    with --measure-policy-kl false keeps none: its Query-KL reads the cache.)"""
    bf16 = distributed.uses_bf16(args.dtype, dist.device)
    if args.lora_rank:                                                   # only the adapters train
        model = lora.wrap(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_targets)
        if state is not None:
            lora.load_adapters(model, checkpoints.checkpoint_dir(args.out))
        print0("LoRA rank {}: {:,} of {:,} parameters train".format(args.lora_rank, *lora.trainable(model)))
    policy = distributed.wrap_model(model, dist.device, args.fsdp, bf16=bf16, grad_ckpt=args.grad_ckpt)
    if not needs_reference_model(args, algo):
        return policy, None
    if args.lora_rank:
        return policy, lora.Base(policy)
    shard = distributed.sharder(args.fsdp, dist.device, bf16, trainable=False)  # sharded like the policy
    ref_dtype = torch.bfloat16 if bf16 else distributed.precision(args.dtype, dist.device)[0]  # a bf16 copy
    attention = models.attention_for(dist.device, ref_dtype, bf16)     # suffices; the policy's kernel
    ref = models.load_for_training(args.model, dist.device, ref_dtype, shard, bf16, attention)[0]
    return policy, ref.eval().requires_grad_(False)


def resolve_grad_ckpt(args, algo, world: int, device) -> bool:
    """--grad-ckpt auto, resolved once (every later reader sees a bool): the memory plan's rule
    (memory_plan.needs_checkpointing) on this card -- on where the update micro-batch would not fit
    without checkpointing; a CPU has no card: off. true / false (and an old config.json's booleans)
    stay as given."""
    if args.grad_ckpt == "auto":
        card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        args.grad_ckpt = memory_plan.resolve_grad_ckpt(args, world, needs_reference_model(args, algo), card,
                                                       device.type)
        if card:
            print0(f"--grad-ckpt auto: {'on' if args.grad_ckpt else 'off'} (the update micro-batch "
                   f"{'does not fit' if args.grad_ckpt else 'fits'} {card / memory_plan.GIB:.1f} GiB less "
                   f"{memory_plan.KV_MARGIN:.0%} without it)")
    return bool(args.grad_ckpt)


def setup_rl(args, algo, dist, model, tokenizer, data, state, lr_schedule) -> Run:
    """The reference model (needs_reference_model), the wrapped policy, the Query-KL reference and
    the cache it or the query weights need, the optimizer and its LR schedule (lr_schedule: optimizer
    step -> LR multiplier, train.lr_schedule)."""
    resolve_grad_ckpt(args, algo, dist.world, dist.device)
    print0(batching.describe(args, dist.world, len(data)))
    print0(describe_fast_paths(args, distributed.uses_bf16(args.dtype, dist.device)))
    bf16 = distributed.uses_bf16(args.dtype, dist.device)
    dtype, amp = distributed.precision(args.dtype, dist.device)
    policy, ref = policy_and_reference(args, algo, dist, model, state)

    def cache() -> query_reference.QueryCache:                               # the initial policy's, before RL
        with amp():                                                      # the training forward's numerics
            return query_reference.cache_for_run(args, dist, policy, data.ids, tokenizer.pad_token_id,
                                       resuming=state is not None)

    def score_prompts() -> list[torch.Tensor]:                          # the current policy's (a moving
        with amp(), phases("qkl_ref"):                                   # Query-KL reference's forward)
            return query_reference.build(distributed.unwrap(policy), data.ids, tokenizer.pad_token_id,
                                     args.temperature, dist.device, args.micro_batch)
    phases = experience.Phases(dist.device)
    qref, cached = query_reference.for_run(args.qkl_ref, cache, algo.weights, ref is not None, state, args,
                                           score_prompts, dist=dist, prompt_ids=data.ids, tokenizer=tokenizer)
    opt = optimizer.adamw(policy, args.lr, args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule)         # train.lr_factor, per optimizer step
    checkpoints.restore(state, policy, opt, sched, args.out)             # on --resume (else state is None)
    if state is not None:                                                # the new --lr, not the saved one
        optimizer.set_hyperparameters(opt, sched, args.lr, args.weight_decay)
    spec = rollout.SampleSpec.make(model, tokenizer, args.max_new_tokens, args.sampler, args.gen_batch,
                                   args.kv_budget, bf16, opt, args.compile_decode)
    start_norm = ((state and state.extra.get("weight_norm"))               # (an older checkpoint: its own)
                  or step_guard.weight_norm(policy))
    guard = step_guard.StepGuard(args.out, args.max_bad_steps, start_norm,
                                 ckpt_checked=state is None or checkpoints.is_checked(args.out))
    rules = extension.start(controllers.CONTROLLERS, args, algo)        # switched on by their options
    extension.load_state(rules, state and state.extra.get("controllers"))  # --resume: as they were
    return Run(args, algo, dist, policy, ref, tokenizer, opt, sched, data, qref, cached, spec, phases,
               task_names=tuple(tasks.task_names_in(data.rows)), guard=guard,
               decoding_copy=lora.decoding_copy if args.lora_rank else distributed.gathered,
               controllers=rules, fast=bool(set(fast_paths(args, bf16)) - {"sampler"}))


def save(run, step, final):
    """The run's checkpoint of `step` (<out>/ckpt; the final one also exported where the policy holds
    LoRA adapters), with what a --resume needs besides the weights and the optimizer."""
    a, bf16 = run.args, distributed.uses_bf16(run.args.dtype, run.dist.device)
    extra = {"query_reference": run.qref.state_dict(), "query_cache": run.cache and run.cache.meta,
             "weight_norm": run.guard.start_norm,                               # (weights_diverged's start)
             "controllers": extension.state_of(run.controllers)}                # (their coefficients)
    checkpoints.save_checkpoint(a.out, run.policy, run.tokenizer, run.opt, run.sched, step, final=final,
                                export_dtype=a.export_dtype, bf16=bf16, extra=extra)
    if final and lora.is_lora(run.policy):                               # checkpoints hold adapters: the
        final_export(run, step)                                          # merged model is <out>/hf
    run.guard.saved()                                                    # trusted at the next finite loss


def exportable(run):
    """What --export writes: the policy, or a LoRA policy with its adapters merged (a plain model)."""
    return lora.merged(run.policy) if lora.is_lora(run.policy) else run.policy


def final_export(run, step):
    """<out>/hf, the final export of a LoRA or FSDP2 run (FSDP2's first, in save_checkpoint): written
    with its record (checkpoints.export_damage); a failed write names the way back."""
    a, hf = run.args, os.path.join(run.args.out, "hf")
    try:
        checkpoints.export(exportable(run), run.tokenizer, hf, a.export_dtype, record=True,
                           bf16=distributed.uses_bf16(a.dtype, run.dist.device))
    except SystemExit as e:
        raise SystemExit(f"{e.code}; the checkpoint of step {step} is saved: --resume rebuilds {hf} once the "
                         "disk has room") from None


def check_final_export(run, step):
    """--resume of a finished run (no step left): a LoRA or FSDP2 run's <out>/hf, damaged or left
    half-written (a full disk), is rebuilt from the checkpoint of the last step, saying so."""
    if not (lora.is_lora(run.policy) or distributed.is_fsdp(run.policy)):
        return
    hf = os.path.join(run.args.out, "hf")
    why = distributed.all_gather_list([checkpoints.export_damage(hf) if run.dist.main else None])[0]
    if why:
        print0(f"--resume: {hf} is not complete ({why}): rebuilding it from the checkpoint of step {step}")
        if run.dist.main:
            shutil.rmtree(hf, ignore_errors=True)
        final_export(run, step)
