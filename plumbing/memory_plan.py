"""Per-GPU memory of an RL step, phase by phase and term by term, from the architecture alone.

    python train.py --config configs/paper_qwen7b.json --dry-run     # beside it: the step measured

No weights are loaded: the architecture is the model folder's config.json, or for a hub id the
copy shipped in configs/models/ (Qwen2.5-Math-7B, Qwen2.5-32B). Every term is a formula of the
config and options; no constant is fitted to a configuration. A step's phases peak apart:

    rollout    weights, Adam state, reference + the decoding copy (FSDP2), one sampler call's
               KV cache, the prefill's working set
    score      the same, less the rollout's + one no-grad micro-batch's forward (FSDP2: the
               gathered root and two layers)
    update     + the gradients, the micro-batch's saved activations, lm_head's backward in blocks
    optimizer  weights, Adam state, reference, gradients + foreach AdamW's temporaries

rl/memory_measure.py measures the same phases by running the step's code (real tensors on a CPU, or
fake ones at the paper's size); tests/test_memory.py holds plan and measurement within 15%.
"""

import argparse
import json
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (configs/)
GIB = 2 ** 30


@dataclass(frozen=True)
class Arch:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_config(cls, c: dict) -> "Arch":
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                   c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"]), head_dim,
                   bool(c.get("tie_word_embeddings", False)))

    def params(self) -> int:
        return self.embedding_params() + self.layers * self.layer_params() + self.hidden

    def embedding_params(self) -> int:
        """The input embedding and (untied) lm_head: what FSDP2's root module holds."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def layer_params(self) -> int:
        """Qwen2: q/k/v projections with bias, o without, SwiGLU MLP, two RMSNorms per layer."""
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim
        return (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * self.inter + 2 * h

    def qkv_params(self) -> int:
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim

    def kv_bytes_per_position(self, dtype_bytes=2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token_layer(self, dtype_bytes=2) -> int:
        """What one decoder layer keeps for backward per token (about 225 KB at 7B in bf16):
        - each RMSNorm its input upcast to float32 (for the variance) and its normed output;
        - attention: q after the rotary embedding, K and V repeated to every query head (the padded
          path's SDPA with a mask repeats them: transformers' repeat_kv), SDPA's output, and o_proj's
          input (a contiguous copy of it);
        - the MLP's gate, up, activation and product.
        Was (to issue #42) 4h + q + 2kv + 4I elements: 18% under the fake-tensor measurement of the
        paper step at 8,192 tokens without checkpointing (73.2 GiB; a real H100 measured the same);
        this count is within 4% of it at 4,096 and 8,192 tokens (tests/test_memory.py)."""
        q = self.heads * self.head_dim
        norms = 2 * (4 + dtype_bytes) * self.hidden
        return norms + dtype_bytes * (5 * q + 4 * self.inter)


# The cards the plan knows: their memory as torch.cuda reports it (total_memory), in GiB -- what
# --kv-budget 0 and --grad-ckpt auto are planned against (--plan-gpu; time_model.GPUS has their speeds).
CARD_GIB = {"h100": 79.1, "h200": 139.8, "a100": 79.3, "a100-40gb": 39.4, "l40s": 44.4}


def card_bytes(a) -> float:
    """The memory of --plan-gpu's card (H100 unless the options say otherwise)."""
    return CARD_GIB[getattr(a, "plan_gpu", None) or "h100"] * GIB


class OnOffAuto(str):
    """The type of an option that is true, false or auto (--grad-ckpt): true and false parse as
    options.parse_bool's words do and come back as bools (an old config.json's booleans too); auto
    comes back as the string "auto", which the run resolves once at set-up (resolve)."""

    def __new__(cls, text="auto"):
        word = str(text).lower()
        if word == "auto":
            return str.__new__(cls, "auto")
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}")


AUTO = OnOffAuto("auto")


def config_path(model: str) -> str:
    """A local folder's config.json, or the shipped configs/models/<name>.json of a hub id."""
    for path in (os.path.join(model, "config.json"),
                 os.path.join(ROOT, "configs", "models", os.path.basename(model.rstrip("/")) + ".json")):
        if os.path.isfile(path):
            return path
    raise SystemExit(f"error: no config.json for {model!r} (a model folder, or one of "
                     f"{sorted(os.listdir(os.path.join(ROOT, 'configs', 'models')))} in configs/models/)")


def arch_for(model: str) -> Arch:
    with open(config_path(model)) as f:
        return Arch.from_config(json.load(f))


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    phases: tuple          # the phases it is alive in, of PHASES
    note: str


PHASES = ("rollout", "score", "update", "optimizer")
ALL = PHASES


@dataclass(frozen=True)
class Precision:
    """The bytes per element of what a run holds: float32 master weights (bf16 with --dtype
    bfloat16), bf16 compute under bf16-mixed (--dtype auto on CUDA)."""
    master: int
    compute: int
    mixed: bool            # float32 weights computing in bf16 (autocast / FSDP2's param_dtype)
    kv: int                # the KV cache's element size (kv_cache.kv_dtype)

    @classmethod
    def of(cls, a, device) -> "Precision":
        name = getattr(a, "dtype", "auto")
        mixed = name == "bf16-mixed" or (name == "auto" and device == "cuda")
        master = 2 if name in ("bfloat16", "float16") else 4
        compute = 2 if mixed else master
        return cls(master, compute, mixed, 4 if mixed and device == "cpu" else compute)


def terms(arch: Arch, a, gpus: int, needs_ref: bool, device="cuda") -> list[Term]:
    """What one GPU (rank) holds in each phase of an RL step under options `a` (train.py's) on
    `gpus` ranks (FSDP2 shards over all of them; DDP keeps full replicas). device "cpu": the
    CPU's choices (LeanStep's fused weight copies, a float32 KV cache under autocast)."""
    card = card_bytes(a) if device != "cpu" else None
    if a.grad_ckpt == "auto":                                          # (the run resolves it at set-up)
        a = _with(a, grad_ckpt=needs_checkpointing(arch, a, gpus, needs_ref, card, device))
    p = Precision.of(a, device)
    return (weight_terms(arch, a, gpus, needs_ref, p) + rollout_terms(arch, a, gpus, p, device)
            + forward_terms(arch, a, p, device, needs_ref))


def lora_params(arch: Arch, rank: int) -> int:
    """Adapter parameters of peft's "all-linear" LoRA on a Qwen2/Llama layer stack: rank x (in + out)
    for q, k, v, o, gate, up and down (fewer --lora-targets: fewer)."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.inter
    return arch.layers * rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))


def trained_params(arch: Arch, a) -> int:
    """The parameters that train, with gradients and Adam state: all, or a LoRA run's adapters."""
    rank = getattr(a, "lora_rank", 0)
    return lora_params(arch, rank) if rank else arch.params()


def weight_terms(arch: Arch, a, gpus, needs_ref, p: Precision) -> list[Term]:
    """The weights, their gradients and optimizer state, the reference, and the copies of them.
    LoRA (--lora-rank): the base is frozen (no gradients, no Adam state: the adapters' only), the
    reference is that base with the adapters off (no copy), and rollouts decode a merged copy."""
    P, fsdp, rank = arch.params(), bool(a.fsdp), getattr(a, "lora_rank", 0)
    T = trained_params(arch, a)
    shard = gpus if fsdp else 1
    ref_note = (("bf16" if p.mixed else "the weights' dtype")
                + (", sharded like the policy" if fsdp else ", a full copy"))
    if rank:
        ref_note = "none: the frozen base with the adapters off (lora.Base)"
    trained = f"LoRA rank {rank}: the adapters' {T / 1e6:.1f}M parameters only; " if rank else ""
    out = [
        Term("parameters", (P + (T if rank else 0)) * p.master / shard, ALL,
             f"{P / 1e9:.2f}B x {p.master} B / {shard}" + (f" + {T / 1e6:.1f}M adapters" if rank else "")),
        Term("Adam state", 2 * T * p.master / shard, ALL,
             trained + "exp_avg + exp_avg_sq (allocated at the first step)"),
        Term("reference", P * p.compute / shard if needs_ref and not rank else 0, ALL,
             ref_note if needs_ref else "none (no Policy-KL used or measured)"),
        Term("gradients", T * p.master / shard, ("update", "optimizer"),
             trained + "sharded under FSDP2 (reduced every micro-batch); freed after each step"),
        Term("optimizer temporaries", T * p.master / shard, ("optimizer",),
             "foreach AdamW: sqrt(exp_avg_sq) of every " + ("adapter " if rank else "") + "parameter"),
    ]
    if rank:
        out.append(Term("decoding copy", P * p.compute, ("rollout",),
                        "lora.merged: the policy with its adapters merged, freed before scoring"))
    if p.mixed and not fsdp:  # autocast casts each float32 matmul weight once per region (the step)
        matmul = P if arch.tied else P - arch.vocab * arch.hidden          # the input embedding is a lookup
        out.append(Term("autocast copies", matmul * 2, ALL,
                        "bf16 copies of the matmul weights, made anew by each micro-batch's forward (their "
                        "gradients freed layer by layer: plumbing/optimizer.step)"))
    if fsdp:
        gathered = (arch.embedding_params() + arch.hidden + 2 * arch.layer_params()) * p.compute
        out.append(Term("gathered layers", gathered, ("score", "update"),
                        "FSDP2: the root (embedding, lm_head) and two decoder layers unsharded at once"))
    return out


def rollout_terms(arch: Arch, a, gpus, p: Precision, device) -> list[Term]:
    """The decoding copy, the KV cache of one sampler call, the prefill's working set."""
    h, I = arch.hidden, arch.inter
    rows, seq = kv_rows(a, gpus), a.max_prompt_len + a.max_new_tokens
    prefill_tokens = max(1, rows // a.group_size) * a.max_prompt_len   # each distinct prompt once
    out = [
        Term("KV cache", rows * seq * arch.kv_bytes_per_position(p.kv), ("rollout",),
             f"{rows} rows x {seq} positions, {p.kv} B"),
        Term("prefill", prefill_tokens * (3 * I + 4 * h) * p.compute + rows * arch.vocab * 4 * 2,
             ("rollout",), f"one layer's working set over {prefill_tokens} distinct prompt tokens"),
    ]
    if a.fsdp:
        out.insert(0, Term("decoding copy", arch.params() * p.compute, ("rollout",),
                           "distributed.gathered: the whole policy on every GPU, freed before scoring"))
    if device == "cpu":
        fused = arch.layers * (arch.qkv_params() + 2 * h * I) * (2 if p.mixed else 4)
        out.append(Term("fused copies", fused, ("rollout",),
                        "CPU only: LeanStep's concatenated q/k/v and gate/up weights"))
    return out


def forward_terms(arch: Arch, a, p: Precision, device="cuda", needs_ref=True) -> list[Term]:
    """One micro-batch of scoring (no grad) and of the update. The log-probs come from the final
    hidden states (logprobs._TokenLogprob): lm_head's logits only ever exist as float32 blocks of
    positions -- one, and a second for the entropies of pi_old's forward (run when an update does
    not cover the whole rollout) -- and, in backward, vocabulary slices over all positions: two
    blocks (log p, p), beside the hidden states' float32 gradient and lm_head's weight gradient,
    one per log-softmax call. Under FSDP2 that gradient is unsharded and stays until the end of
    the backward (the root's reduce-scatter), through every decoder layer's backward. On a CPU the
    GEMM operands are float32: a bf16 lm_head (the reference's, FSDP2's) is upcast whole."""
    h, V, L, I = arch.hidden, arch.vocab, arch.layers, arch.inter
    f = forward_shape(a, V)
    block, gpu = 4 * f.block, device != "cpu"
    hidden = f.logit_tokens * h * p.compute
    head_grad = V * h * (p.compute if a.fsdp else p.master)            # lm_head's weight gradient
    head_grad *= 0 if getattr(a, "lora_rank", 0) else 1                # (LoRA: lm_head is frozen)
    upcast = V * h * 4 if not gpu and a.fsdp and p.compute == 2 else 0
    score_upcast = V * h * 4 if not gpu and p.compute == 2 and (a.fsdp or needs_ref) else 0
    score_blocks = 2 if getattr(a, "update_batch", a.rollout_batch) < a.rollout_batch else 1
    per_layer = arch.activation_bytes_per_token_layer(p.compute)
    saved = f.act_tokens * (L * h * p.compute if a.grad_ckpt else L * per_layer) + hidden
    layer_working_set = f.act_tokens * (3 * I + 4 * h) * p.compute
    head_backward = (f.grad_tokens * h * ((p.compute if gpu else 4) + 4) + f.calls * head_grad + upcast
                     + 2 * block)
    layer_backward = (f.act_tokens * per_layer * (2 if a.grad_ckpt else 1)    # (recomputed and) its gradients
                      + (head_grad if a.fsdp else 0))
    # nothing scores where no reference is loaded and one update covers the rollout: its own forward
    # gives pi_old (train.on_policy_rows; an algorithm that needs pi_old first loads a reference)
    scores = needs_ref or score_blocks == 2
    return [
        Term("scoring forward", max(hidden + score_blocks * block + score_upcast, layer_working_set) * scores,
             ("score",),
             f"{f.logit_tokens} tokens' hidden states + float32 logit blocks (or a layer's working set)"),
        Term("saved activations", saved, ("update",),
             ("checkpointed layer inputs" if a.grad_ckpt else "every layer's saved tensors")
             + f" of {f.act_tokens} tokens, and the final hidden states"),
        Term("update working set", max(head_backward, layer_backward), ("update",),
             "lm_head's backward: float32 logit blocks, the hidden states' and weight's gradients (or a "
             + ("recomputed " if a.grad_ckpt else "") + "layer's backward"
             + (" beside lm_head's unsharded gradient)" if a.fsdp else ")")),
    ]


@dataclass(frozen=True)
class ForwardShape:
    """Tokens of one training forward: its final hidden states, their gradient, its activations."""
    logit_tokens: int
    grad_tokens: int
    act_tokens: int
    block: int            # elements of one float32 logit block (logprobs._logprob_chunk)
    calls: int = 1        # log-softmax calls, each with its lm_head gradient (shared prompts: 2)


def forward_shape(a, vocab) -> ForwardShape:
    """One micro-batch's forward. With shared prompts (batching.prompt_group > 1) it is U = rows / G
    prompts once and the B = rows responses (logprobs.shared_prompt_scores): the prompts' hidden
    states, the responses' twice (their own and the copy that lines them up), and the prompts'
    gradient twice (the slice feeding the first response token zero-fills a second one)."""
    G, Pl, R = a.group_size, a.max_prompt_len, a.max_new_tokens
    shared = G > 1 and getattr(a, "share_prompts", True) and not (a.fsdp or a.grad_ckpt)
    if not shared:
        t = micro_batch_tokens(a)
        return ForwardShape(t, t, t, min(2 ** 26, t * vocab))
    cap = getattr(a, "micro_tokens", 0)
    groups = max(1, min(a.micro_batch // G, (cap // G) // (Pl + R) if cap else a.micro_batch))
    return ForwardShape(groups * (Pl + 2 * G * R), groups * (2 * Pl + G * R), groups * (Pl + G * R),
                        min(2 ** 26, max(groups * Pl, groups * G * R) * vocab), calls=2)


def phases(arch: Arch, a, gpus: int, needs_ref: bool, device="cuda") -> dict[str, float]:
    """{phase: planned peak bytes per GPU}."""
    ts = terms(arch, a, gpus, needs_ref, device)
    return {ph: sum(t.bytes for t in ts if ph in t.phases) for ph in PHASES}


def micro_batch_tokens(a) -> int:
    """The most tokens one micro-batch holds: --micro-batch rows of the longest sequence, capped by
    --micro-tokens (a single longest row always fits: it goes alone). Padded rows fill the cap in
    whole longest rows; packed ones (--pack, the full-row path) fill it with real tokens, to the cap."""
    seq = a.max_prompt_len + a.max_new_tokens
    cap = getattr(a, "micro_tokens", 0)
    if not cap:
        return a.micro_batch * seq
    return max(seq, min(a.micro_batch * seq, cap if getattr(a, "pack", True) else cap // seq * seq))


def kv_rows(a, gpus) -> int:
    """Rows one sampler call decodes on a GPU: this rank's responses, at most --gen-batch, and at
    most --kv-budget positions (0: not capped here; the report and the measurement plan it as what
    fits the --plan-gpu card first: as_planned)."""
    rows = min(a.rollout_batch // gpus * a.group_size, a.gen_batch)
    if a.kv_budget:
        rows = min(rows, max(1, a.kv_budget // (a.max_prompt_len + a.max_new_tokens)))
    return rows


# The KV cache sized from free memory (--kv-budget 0) leaves this share of the card unused: what the
# plan does not count (the CUDA context, NCCL's buffers, the allocator's fragmentation; ~3-6 GiB on
# an 80 GB card) and the plan's own error (its tests allow 15%, on the terms that vary).
KV_MARGIN = 0.10


def kv_positions_that_fit(free_bytes: int, card_bytes: int, reserve_bytes: int,
                          per_position_bytes: int) -> int:
    """KV-cache positions that fit in `free_bytes` once `reserve_bytes` still to be allocated (what
    the rollout phase holds beside the cache) and KV_MARGIN of the card are set aside; never
    negative, never more than the card holds."""
    usable = min(free_bytes, card_bytes) - reserve_bytes - KV_MARGIN * card_bytes
    return max(0, int(usable // per_position_bytes))


def planned_kv_budget(arch: Arch, a, gpus: int, needs_ref: bool, card: float, device="cuda") -> int:
    """--kv-budget 0 on a card of `card` bytes: the positions kv_positions_that_fit leaves the cache
    once the rollout phase's other terms are set aside (the prefill's over the rows those positions
    give: a fixed point, reached in a few rounds from the uncapped rows)."""
    per = arch.kv_bytes_per_position(Precision.of(a, device).kv)
    budget = a.gen_batch * (a.max_prompt_len + a.max_new_tokens)
    for _ in range(4):
        b = _with(a, kv_budget=budget)
        others = sum(t.bytes for t in terms(arch, b, gpus, needs_ref, device)
                     if "rollout" in t.phases and t.name != "KV cache")
        budget = max(1, kv_positions_that_fit(int(card), int(card), int(others), per))
    return budget


def needs_checkpointing(arch: Arch, a, gpus: int, needs_ref: bool, card: float | None, device="cuda") -> bool:
    """--grad-ckpt auto: off where the update micro-batch fits the card without checkpointing -- the
    update and optimizer phases of the plan's no-checkpointing terms within the card less KV_MARGIN
    (what the plan does not count, and its error) -- else on. No card (a CPU): off."""
    if not card:
        return False
    plan = phases(arch, _with(a, grad_ckpt=False), gpus, needs_ref, device)
    return max(plan["update"], plan["optimizer"]) > (1 - KV_MARGIN) * card


def resolve_grad_ckpt(a, gpus: int, needs_ref: bool, card: float | None, device="cuda") -> bool:
    """--grad-ckpt as a bool: true and false as given, auto by needs_checkpointing."""
    if a.grad_ckpt != "auto":
        return bool(a.grad_ckpt)
    if device == "cpu":
        return False
    try:
        arch = arch_for(a.model)
    except SystemExit:     # a hub id the plan has no config.json for: checkpoint, the safe side
        return True
    return needs_checkpointing(arch, a, gpus, needs_ref, card, device)


def as_planned(a, gpus: int, needs_ref: bool, device="cuda"):
    """The options as the plan counts them on --plan-gpu's card (card_bytes): --grad-ckpt auto
    resolved (needs_checkpointing), --kv-budget 0 the positions that fit (planned_kv_budget; the
    sampler sizes its cache by the same rule from the memory it finds free). A copy; `a` is kept."""
    card = card_bytes(a) if device != "cpu" else None
    b = _with(a, grad_ckpt=resolve_grad_ckpt(a, gpus, needs_ref, card, device))
    if not b.kv_budget and card:
        b.kv_budget = planned_kv_budget(arch_for(a.model), b, gpus, needs_ref, card, device)
    return b


def _with(a, **changes):
    return argparse.Namespace(**{**vars(a), **changes})


NOT_COUNTED = "not counted (not tensors): the CUDA context, NCCL buffers, allocator fragmentation"


def report(a, gpus: int, needs_ref: bool, measured=None) -> str:
    """The plan, term by term and per phase, and beside it the measurement
    (memory_measure.Measured) if given and run. The last line is for scripts: key=value pairs."""
    skipped = measured.skipped if measured else ""
    measured = None if skipped else measured
    arch, given = arch_for(a.model), a
    a = as_planned(a, gpus, needs_ref)
    ts, plan = terms(arch, a, gpus, needs_ref), phases(arch, a, gpus, needs_ref)
    rank = getattr(a, "lora_rank", 0)
    lora_note = f", LoRA rank {rank} ({lora_params(arch, rank) / 1e6:.1f}M adapter parameters train)" \
        if rank else ""
    card = getattr(a, "plan_gpu", None) or "h100"
    auto = (f" (--grad-ckpt auto: the update {'does not fit' if a.grad_ckpt else 'fits'} the --plan-gpu "
            f"{card} card's {CARD_GIB[card]:g} GiB less {KV_MARGIN:.0%} without it)")
    ckpt = ("activation checkpointing" if a.grad_ckpt else "no activation checkpointing") + \
        (auto if given.grad_ckpt == "auto" else "")
    kv = (f", --kv-budget 0: {a.kv_budget:,} KV positions fit the {card} card's {CARD_GIB[card]:g} GiB "
          f"beside the rollout's other terms, less {KV_MARGIN:.0%}" if not given.kv_budget else "")
    lines = [f"memory plan per GPU: {a.model} ({arch.params() / 1e9:.2f}B parameters), {gpus} GPU(s), "
             f"{'FSDP2' if a.fsdp else 'DDP'}, {ckpt}{kv}" + lora_note]
    for t in ts:
        alive = "all" if t.phases == ALL else ", ".join(t.phases)
        lines += [f"  {t.name:22s} {t.bytes / GIB:8.2f} GiB  [{alive}]  {t.note}"] if t.bytes else []
    lines.append(f"  {'phase':22s} {'plan GiB':>8s}" + (f" {'measured GiB':>13s}" if measured else ""))
    for ph in PHASES:
        got = f" {measured.peaks[ph] / GIB:13.2f}" if measured else ""
        lines.append(f"  {ph:22s} {plan[ph] / GIB:8.2f}{got}")
    if measured:
        lines.append(f"  measured: {'fake' if measured.fake else 'real'} tensors on {measured.world} "
                     f"rank(s) running train.py's step (rl/memory_measure.py; "
                     f"{measured.micro_batches} update micro-batches)")
    if skipped:
        lines.append(f"  not measured: {skipped}")
    lines.append(f"  {NOT_COUNTED}")
    peak, update = max(plan, key=plan.get), max(plan["update"], plan["optimizer"])
    m = ""
    if measured:
        m = (f" measured_update_gib_per_gpu="
             f"{max(measured.peaks['update'], measured.peaks['optimizer']) / GIB:.1f}"
             f" measured_rollout_gib_per_gpu={measured.peaks['rollout'] / GIB:.1f}")
    lines.append(f"plan: peak_gib_per_gpu={plan[peak] / GIB:.1f} update_gib_per_gpu={update / GIB:.1f}{m} "
                 f"gpus={gpus} phase={peak} decode_rows={kv_rows(a, gpus)} "
                 f"micro_tokens={micro_batch_tokens(a)}")
    return "\n".join(lines)


def disk_report(a, gpus: int) -> str:
    """What a run writes to --out: two checkpoints at most at any moment (checkpoints.make_room),
    each the float32 master weights and Adam's two moments (12 bytes per parameter; LoRA: the
    adapters'), and the final export in bf16 (<out>/hf under FSDP2 or LoRA, and --export)."""
    arch = arch_for(a.model)
    n = arch.params()
    ckpt = 12 * n if not getattr(a, "lora_rank", 0) else 12 * lora_params(arch, a.lora_rank)
    export = 2 * n
    nodes = -(-gpus // 8)
    shared = (f"; {nodes} nodes: --out must be on a file system every node sees (every rank writes its "
              "shards into it, rank 0 renames)") if nodes > 1 and a.fsdp else ""
    return (f"disk: a checkpoint is {ckpt / 1e9:.1f} GB (float32 weights + Adam), at most 2 on disk at once: "
            f"{2 * ckpt / 1e9:.1f} GB, + {export / 1e9:.1f} GB for the final bf16 export{shared}")
