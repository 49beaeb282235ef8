"""What one RL step costs on GPUs, estimated from the config and the architecture before launch
(`train.py --dry-run` prints it above the memory plan). A model, not a measurement: every term is a
formula whose assumption is named beside its number, so a user can see which one to doubt.

The step's phases, per rank (the ranks run in parallel):
    decode   one pass over the rank's rows with S rows decoding at once (sampler/kv_cache.py, S =
             memory_plan.kv_rows); each decode step reads the bf16 weights and the slots' KV cache up
             to the longest slot's length (memory-bound), or is bound by launching its eager
             kernels, whichever is slower
    prefill  the distinct prompts through the model once (compute-bound, 2 N FLOPs per token)
    score    pi_old's no-grad forward over the rows (and the reference's, where one is loaded)
    update   forward + backward (6 N FLOPs per token, 8 N with activation checkpointing; LoRA: 2 N
             less, the frozen base's weight gradients), and under FSDP2 the weights gathered twice and
             the gradients reduce-scattered per micro-batch
Two response lengths bound it: every row to --max-new-tokens (the worst case, and what a fixed-size
chunk of rows costs when one of its rows runs to the limit), and a mean of half the limit.
"""

import math
from dataclasses import dataclass

from plumbing import memory_plan


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float                  # dense bf16 peak
    hbm_tbs: float                      # memory bandwidth, TB/s
    link_gbs: float                     # NVLink bandwidth per GPU, one direction, GB/s


GPUS = {"h100": GPU("H100 SXM", 989.0, 3.35, 450.0), "h200": GPU("H200", 989.0, 4.8, 450.0),
        "a100": GPU("A100 80GB", 312.0, 2.0, 300.0)}
# The assumptions, named (each printed beside the term it sets):
MFU = 0.4                  # achieved / peak FLOPs of the training and scoring forwards
PREFILL_MFU = 0.5          # of the prefill (large dense matmuls, no backward)
KERNELS_PER_LAYER = 43     # eager kernels of one decoder layer's decode step (~1,200 at 28 layers,
LAUNCH_US = 5.0            # counted on CPU), each this many microseconds to launch
LINK_EFFICIENCY = 0.7      # of NVLink's bandwidth an all-gather / reduce-scatter reaches


@dataclass
class Term:
    name: str
    seconds: tuple[float, float]        # (every row to the limit, mean half the limit)
    note: str


def decode_terms(arch, a, gpus, gpu: GPU, lengths) -> list[Term]:
    rows, slots = a.rollout_batch // gpus * a.group_size, memory_plan.kv_rows(a, gpus)
    # bf16 bytes read per step: every weight but the input embedding (a lookup of S rows; tied, it is
    # lm_head's matrix, read anyway)
    weights = 2 * (arch.params() - (0 if arch.tied else arch.vocab * arch.hidden))
    steps, step_s = [], []
    for L in lengths:
        # the slots stay full until the queue drains, then the last rows finish (at most L more)
        n = L if rows <= slots else math.ceil(rows * L / slots) + (a.max_new_tokens - L)
        # each slot reads the columns up to the LONGEST slot's (sampler/kv_cache.py): ~ prompt + L refilled
        kv = slots * (a.max_prompt_len + L) * arch.kv_bytes_per_position()
        read = (weights + kv) / (gpu.hbm_tbs * 1e12)
        launch = KERNELS_PER_LAYER * arch.layers * LAUNCH_US * 1e-6
        steps.append(n), step_s.append(max(read, launch))
    note = (f"{steps[0]:,} / {steps[1]:,} decode steps of {rows} rows in {slots} slots; each reads "
            f"{weights / 1e9:.1f} GB of bf16 weights + the slots' KV cache at {gpu.hbm_tbs} TB/s, or "
            f"launches "
            f"{KERNELS_PER_LAYER * arch.layers} kernels at {LAUNCH_US:g} us: {step_s[0] * 1e3:.1f} / "
            f"{step_s[1] * 1e3:.1f} ms per step")
    return [Term("decode", (steps[0] * step_s[0], steps[1] * step_s[1]), note)]


def compute_terms(arch, a, gpus, gpu: GPU, needs_ref, lengths, old_rows) -> list[Term]:
    N, flops = arch.params(), gpu.bf16_tflops * 1e12
    rows, prompts = a.rollout_batch // gpus * a.group_size, a.rollout_batch // gpus
    prefill = 2 * N * prompts * a.max_prompt_len / (flops * PREFILL_MFU)
    tokens = [rows * (a.max_prompt_len + L) for L in lengths]
    forwards = old_rows + (1 if needs_ref else 0)                       # pi_old (+ the reference)
    train_flops = 8 if a.grad_ckpt else 6
    # LoRA: a frozen base still passes the activations' gradients back (2N), but computes no weight
    # gradients (2N): 4N (6N recomputing), + 6 FLOPs per adapter parameter
    rank = getattr(a, "lora_rank", 0)
    adapters = memory_plan.lora_params(arch, rank) if rank else 0
    per_token = (train_flops - 2) * N + 6 * adapters if rank else train_flops * N
    micro = [math.ceil(t / memory_plan.micro_batch_tokens(a)) for t in tokens]
    comm = (3 * 2 * N * (gpus - 1) / gpus) / (gpu.link_gbs * 1e9 * LINK_EFFICIENCY) if a.fsdp else 0.0
    return [
        Term("prefill", (prefill, prefill), f"{prompts} distinct prompts x {a.max_prompt_len} tokens, "
             f"2N FLOPs per token at {PREFILL_MFU:.0%} of {gpu.bf16_tflops:g} TFLOP/s"),
        Term("score", tuple(forwards * 2 * N * t / (flops * MFU) for t in tokens),
             f"pi_old over {old_rows:.0%} of the rows{' + the reference over all' if needs_ref else ''}, "
             f"no grad, {tokens[0]:,} / {tokens[1]:,} tokens each at {MFU:.0%} MFU"),
        Term("update", tuple(per_token * t / (flops * MFU) + m * comm for t, m in zip(tokens, micro)),
             (f"{train_flops - 2}N + 6 x {adapters / 1e6:.1f}M FLOPs per token (LoRA rank {rank}: the frozen "
              "base passes gradients back, computes none of its own)" if rank
              else f"{train_flops}N FLOPs per token")
             + f" at {MFU:.0%} MFU"
             + (f"; FSDP2: {micro[0]} / {micro[1]} micro-batches x {comm:.2f} s of all-gather x2 + "
                f"reduce-scatter at {LINK_EFFICIENCY:.0%} of {gpu.link_gbs:g} GB/s" if a.fsdp else "")),
    ]


def report(a, gpus: int, needs_ref: bool, gpu_name: str, old_rows=1.0) -> str:
    """The model's table; old_rows: the fraction of rows pi_old's own forward scores (the first
    update's rows are scored by the update's forward: train.on_policy_rows)."""
    arch, gpu = memory_plan.arch_for(a.model), GPUS[gpu_name]
    lengths = (a.max_new_tokens, max(1, a.max_new_tokens // 2))
    terms = decode_terms(arch, a, gpus, gpu, lengths) + \
        compute_terms(arch, a, gpus, gpu, needs_ref, lengths, old_rows)
    total = [sum(t.seconds[i] for t in terms) for i in (0, 1)]
    lines = [f"time model of one RL step on {gpus} x {gpu.name} (a model from the config, not a measurement; "
             f"--plan-gpu): responses of {lengths[0]} / {lengths[1]} tokens"]
    for t in terms:
        lines.append(f"  {t.name:8s} {t.seconds[0]:8.1f} s / {t.seconds[1]:7.1f} s   {t.note}")
    hours = [s * a.steps / 3600 for s in total]
    lines.append(f"  {'step':8s} {total[0]:8.1f} s / {total[1]:7.1f} s   x {a.steps} steps: "
                 f"{hours[0]:.1f} h / {hours[1]:.1f} h (evaluations and checkpoints not counted)")
    return "\n".join(lines)


def disk_report(a, gpus: int) -> str:
    """What a run writes to --out: two checkpoints at most at any moment (checkpoints.make_room),
    each the float32 master weights and Adam's two moments (12 bytes per parameter; LoRA: the
    adapters'), and the final export in bf16 (<out>/hf under FSDP2 or LoRA, and --export)."""
    arch = memory_plan.arch_for(a.model)
    n = arch.params()
    ckpt = 12 * n if not getattr(a, "lora_rank", 0) else 12 * lora_params(arch, a.lora_rank)
    export = 2 * n
    nodes = math.ceil(gpus / 8)
    shared = (f"; {nodes} nodes: --out must be on a file system every node sees (every rank writes its "
              "shards into it, rank 0 renames)") if nodes > 1 and a.fsdp else ""
    return (f"disk: a checkpoint is {ckpt / 1e9:.1f} GB (float32 weights + Adam), at most 2 on disk at once: "
            f"{2 * ckpt / 1e9:.1f} GB, + {export / 1e9:.1f} GB for the final bf16 export{shared}")


lora_params = memory_plan.lora_params
