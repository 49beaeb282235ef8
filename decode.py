"""One decoding step -- one new token for each row -- over a Hugging Face Llama / Qwen2 model's
own weights, without transformers' forward.

Why: after the prompt, the sampler runs the model on ONE token per row, once per generated token.
The arithmetic of such a step is small, and transformers' forward (attention-mask building, cache
objects, module hooks, ~45 small tensor ops per layer) costs more than the arithmetic on a CPU or
a small GPU batch. `LeanStep` does the same math in ~20 ops per layer: q/k/v and gate/up as one
matmul each (CPU: the weights concatenated once per sampler call), one rotary for q and k
together, attention as two batched matmuls against the preallocated KV cache
(kv_cache.PreallocatedLayer), which the HF forward filled with the prompts.

Same math, not the same rounding: its logits agree with the HF forward to ~1e-6 relative in float32
(tests/test_rollout.py), so a sampled token can differ where two candidates tie to that precision.
Models it does not implement (other architectures, sliding windows, dynamic RoPE, q/k norms, a
sharded model) get `HFStep`, the HF forward per step; `stepper` picks.
"""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

ARCHS = {"qwen2", "llama"}                       # the decoder layer LeanStep implements
STATIC_ROPE = {"default", "linear", "llama3"}    # RoPE types with a fixed inv_freq


def supports(model) -> bool:
    """LeanStep computes exactly this model's decoder (else the HF forward is used)."""
    cfg, inner = model.config, getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if cfg.model_type not in ARCHS or layers is None or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if (getattr(cfg, "use_sliding_window", False)
            or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or [])):
        return False
    if getattr(inner.rotary_emb, "rope_type", "default") not in STATIC_ROPE:
        return False
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):  # FSDP2 shards: gathered() first
        return False
    return not any(hasattr(layers[0].self_attn, n) for n in ("q_norm", "k_norm"))


def stepper(model, cache, mask, cache_kw, keep):
    """The decoding step for `model` whose cache `cache` holds the prompts (mask (B, P))."""
    if supports(model) and all(hasattr(layer, "k_buf") for layer in cache.layers):
        return LeanStep(model, cache, mask)
    return HFStep(model, cache, mask, cache_kw, keep)


class HFStep:
    """The reference: transformers' forward on one token per row, with a growing attention mask."""

    def __init__(self, model, cache, mask, cache_kw, keep):
        self.model, self.cache, self.attn, self.kw = model, cache, mask, {cache_kw: cache, **keep}

    def select(self, rows):
        self.attn = self.attn[rows]
        self.cache.batch_select_indices(rows)

    def __call__(self, tok, pos):
        """tok, pos: (B,) -> (B, V) float32 logits of the next token."""
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], 1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=pos[:, None],
                         use_cache=True, **self.kw)
        return out.logits[:, -1].float()


class LeanStep:
    """Llama/Qwen2 decoding from the model's weights (no copies, except the fused CPU matmuls)."""

    def __init__(self, model, cache, mask):
        cfg, inner, w0 = model.config, model.model, next(model.parameters())
        attn0 = inner.layers[0].self_attn
        self.cache, self.eps, self.lm = cache, cfg.rms_norm_eps, model.lm_head
        self.embed, self.norm = inner.embed_tokens, inner.norm.weight
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, attn0.head_dim
        self.scale = attn0.scaling
        rope = inner.rotary_emb  # cos/sin tables over all positions, as the HF rotary computes them
        freqs = (torch.arange(cache.layers[0].capacity, device=w0.device).float()[:, None]
                 * rope.inv_freq.float()[None])
        emb = torch.cat((freqs, freqs), -1)
        self.cos = (emb.cos() * rope.attention_scaling).to(w0.dtype)
        self.sin = (emb.sin() * rope.attention_scaling).to(w0.dtype)
        # One matmul instead of three (two) on CPU; costs a weight copy. (Fake tensors, which
        # memory_measure uses to measure a GPU's step on a CPU, stand for a GPU's: no copy.)
        fuse = w0.device.type == "cpu" and not is_fake(w0)
        dev = w0.device.type
        # Under autocast the fused copies are made in its dtype: cast once, not at every token.
        cast = torch.get_autocast_dtype(dev) if fuse and torch.is_autocast_enabled(dev) else None
        self.layers = [_Layer(layer, fuse, cast) for layer in inner.layers]
        # Additive attention bias over cache positions, one row per (row, kv head): -inf on prompt
        # padding, 0 on real tokens and on every generated position (finished rows decode on,
        # ignored). (B * Hkv, 1, capacity)
        B, P = mask.shape
        bias = torch.zeros(B, self.Hkv, 1, cache.layers[0].capacity, dtype=cache.layers[0].k_buf.dtype,
                           device=w0.device)
        bias[..., :P].masked_fill_(mask[:, None, None, :] == 0, float("-inf"))
        self.bias, self.dev = bias, dev

    def select(self, rows):
        self.bias = self.bias[rows]
        self.cache.batch_select_indices(rows)

    def __call__(self, tok, pos):
        """tok, pos: (B,) -> (B, V) float32 logits of the next token; appends K/V at the cache end."""
        B, Hq, Hkv, D = tok.shape[0], self.Hq, self.Hkv, self.D
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]     # (B, 1, D)
        x = self.embed(tok)                                             # (B, H)
        L = self.cache.layers[0].length + 1                            # cache length after this token
        bias = self.bias.view(B * Hkv, 1, -1)[..., :L]                   # (B*Hkv, 1, L)
        for w, c in zip(self.layers, self.cache.layers):
            qkv = w.qkv(_rms(x, w.n1, self.eps)).view(B, Hq + 2 * Hkv, D)
            qk = _rotate(qkv[:, :Hq + Hkv], cos, sin)                    # q and k heads at once
            c.k_buf[:, :, L - 1] = qk[:, Hq:]
            c.v_buf[:, :, L - 1] = qkv[:, Hq + Hkv:]
            c.length = L
            K = c.k_buf[:, :, :L].reshape(B * Hkv, L, D)               # views: dims 0, 1 merge
            V = c.v_buf[:, :, :L].reshape(B * Hkv, L, D)
            q = qk[:, :Hq].reshape(B * Hkv, Hq // Hkv, D)               # GQA: a kv head's q heads
            with torch.autocast(self.dev, enabled=False):  # the cache's dtype: bf16 is slower here on CPU
                # (B*Hkv, g, L)
                p = torch.baddbmm(bias, q.to(K.dtype), K.transpose(1, 2), alpha=self.scale).softmax(-1)
                a = torch.bmm(p, V).view(B, Hq * D)
            x = x + w.o(a)
            x = x + w.mlp(_rms(x, w.n2, self.eps))
        return self.lm(_rms(x, self.norm, self.eps)).float()


class _Linear:
    """x @ W^T + b over one or more nn.Linear, concatenated along the output (fused) or not."""

    def __init__(self, mods, fuse, cast=None):
        self.parts = [(m.weight, m.bias) for m in mods]
        if fuse and len(mods) > 1:
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in mods]) \
                if any(m.bias is not None for m in mods) else None
            self.parts = [(torch.cat([m.weight for m in mods]), bias)]
        if cast is not None:
            self.parts = [(w.to(cast), None if b is None else b.to(cast)) for w, b in self.parts]

    def __call__(self, x):
        outs = [F.linear(x, w, b) for w, b in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


class _Layer:
    def __init__(self, layer, fuse, cast):
        a, mlp = layer.self_attn, layer.mlp
        self.n1, self.n2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv = _Linear([a.q_proj, a.k_proj, a.v_proj], fuse, cast)
        self.o = _Linear([a.o_proj], fuse, cast)
        self.gate_up = _Linear([mlp.gate_proj, mlp.up_proj], fuse, cast)
        self.down, self.inter = _Linear([mlp.down_proj], fuse, cast), mlp.gate_proj.out_features

    def mlp(self, x):
        gu = self.gate_up(x)                                            # (B, 2I): SwiGLU
        return self.down(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])


def _rms(x, w, eps):
    """RMSNorm as transformers computes it: normalised in float32, scaled in the model dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x, cos, sin):
    """RoPE on (B, heads, D) with cos/sin (B, 1, D): x * cos + rotate_half(x) * sin."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin
