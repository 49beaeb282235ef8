"""Per-GPU memory of a training run, term by term, from the architecture alone (`--dry-run`).

    python train.py --config configs/paper_qwen7b.json --dry-run

No weights are loaded: the architecture is the model folder's config.json, or for a hub id the
copy shipped in configs/models/ (Qwen2.5-Math-7B, Qwen2.5-32B). Every term is a formula over the
config; tests/test_scale.py checks the parameter, gradient, optimizer and KV-cache terms against
the bytes of real tensors of a ~100M-parameter model. The two phases of an RL step peak apart:

    rollout: parameters + optimizer state + reference + the gathered bf16 decoding copy (FSDP2)
             + the KV cache of one sampler chunk (gradients are freed after every step)
    update:  parameters + gradients + optimizer state + reference + the activations of one
             micro-batch + its logits
"""

import json
import os
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
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
        """Qwen2: q/k/v projections with bias, o without, SwiGLU MLP, two RMSNorms per layer."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        layer = (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * self.inter + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def kv_bytes_per_position(self, dtype_bytes=2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token_layer(self, dtype_bytes=2) -> int:
        """What one decoder layer keeps for backward per token: its input and norm outputs, q/k/v,
        the attention output, the MLP's gate/up/activation/product (about 170 KB at 7B in bf16)."""
        kv = self.kv_heads * self.head_dim
        return dtype_bytes * (4 * self.hidden + self.heads * self.head_dim + 2 * kv + 4 * self.inter)


def arch_for(model: str) -> Arch:
    """From a local folder's config.json, or the shipped configs/models/<name>.json of a hub id."""
    for path in (os.path.join(model, "config.json"),
                 os.path.join(HERE, "configs", "models", os.path.basename(model.rstrip("/")) + ".json")):
        if os.path.isfile(path):
            with open(path) as f:
                return Arch.from_config(json.load(f))
    raise SystemExit(f"error: no config.json for {model!r} (a model folder, or one of "
                     f"{sorted(os.listdir(os.path.join(HERE, 'configs', 'models')))} in configs/models/)")


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    phase: str    # "both", "rollout" or "update"
    note: str


def terms(arch: Arch, a, gpus: int, needs_ref: bool, kv_rows: int, master_bytes=4, compute_bytes=2) -> list[Term]:
    """The per-GPU terms for options `a` (train.py's) on `gpus` GPUs (FSDP2 shards over all of
    them; DDP keeps full replicas)."""
    P, shard = arch.params(), (gpus if a.fsdp else 1)
    seq = a.max_prompt_len + a.max_new_tokens
    micro_tokens = micro_batch_tokens(a)
    layers_kept = 1 if a.grad_ckpt else arch.layers
    act = micro_tokens * (arch.activation_bytes_per_token_layer(compute_bytes) * layers_kept +
                          (arch.layers * arch.hidden * compute_bytes if a.grad_ckpt else 0))
    chunk = min(2 ** 26, micro_tokens * arch.vocab)  # rollout.token_logprobs' float32 working set
    return [
        Term("parameters", P * master_bytes / shard, "both", f"{P / 1e9:.2f}B x {master_bytes} B / {shard}"),
        Term("gradients", P * master_bytes / shard, "update", "freed (set_to_none) outside the update"),
        Term("Adam state", 2 * P * 4 / shard, "both", "exp_avg + exp_avg_sq, float32"),
        Term("reference", P * compute_bytes / shard if needs_ref else 0, "both",
             "bf16, sharded like the policy" if needs_ref else "none (no Policy-KL used or measured)"),
        Term("decoding copy", P * compute_bytes if a.fsdp else 0, "rollout",
             "the gathered bf16 policy, one per GPU while sampling" if a.fsdp else "DDP decodes its replica"),
        Term("KV cache chunk", kv_rows * seq * arch.kv_bytes_per_position(compute_bytes), "rollout",
             f"{kv_rows} rows x {seq} positions"),
        Term("activations", act, "update", f"micro-batch of {micro_tokens} tokens (at most), "
             + ("checkpointed layer inputs + one layer" if a.grad_ckpt else "every layer")),
        Term("logits", micro_tokens * arch.vocab * compute_bytes + 3 * 4 * chunk, "update",
             "the micro-batch's logits + the float32 log-softmax chunk"),
    ]


def micro_batch_tokens(a) -> int:
    """The most padded tokens one micro-batch holds: --micro-batch rows of the longest sequence,
    capped by --micro-tokens (a single longest row always fits: it goes alone)."""
    seq = a.max_prompt_len + a.max_new_tokens
    cap = getattr(a, "micro_tokens", 0)
    return max(seq, min(a.micro_batch * seq, cap)) if cap else a.micro_batch * seq


def kv_rows(a, gpus) -> int:
    """Rows one sampler call decodes on a GPU: this rank's responses, at most --gen-batch, and at
    most --kv-budget positions (0 on GPU: a share of free memory, unknown here, so not capped)."""
    rows = min(a.rollout_batch // gpus * a.group_size, a.gen_batch)
    if a.kv_budget:
        rows = min(rows, max(1, a.kv_budget // (a.max_prompt_len + a.max_new_tokens)))
    return rows


def report(a, gpus: int, needs_ref: bool) -> str:
    arch = arch_for(a.model)
    rows = kv_rows(a, gpus)
    ts = terms(arch, a, gpus, needs_ref, rows)
    peaks = {ph: sum(t.bytes for t in ts if t.phase in ("both", ph)) for ph in ("rollout", "update")}
    phase = max(peaks, key=peaks.get)
    lines = [f"memory plan per GPU: {a.model} ({arch.params() / 1e9:.2f}B parameters), {gpus} GPU(s), "
             f"{'FSDP2' if a.fsdp else 'DDP'}{', activation checkpointing' if a.grad_ckpt else ''}"]
    lines += [f"  {t.name:16s} {t.bytes / GIB:8.2f} GiB  [{t.phase}]  {t.note}" for t in ts]
    lines += [f"  {'rollout peak':16s} {peaks['rollout'] / GIB:8.2f} GiB", f"  {'update peak':16s} {peaks['update'] / GIB:8.2f} GiB",
              f"plan: peak_gib_per_gpu={peaks[phase] / GIB:.1f} gpus={gpus} phase={phase} decode_rows={rows} "
              f"micro_tokens={micro_batch_tokens(a)}"]
    return "\n".join(lines)
