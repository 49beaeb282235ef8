"""One decoding step -- one new token for each slot of the sampler's KV cache -- over a Hugging Face
Llama / Qwen2 model's own weights, without transformers' forward.

Why: after the prompt, the sampler runs the model on ONE token per row, once per generated token.
The arithmetic of such a step is small, and transformers' forward (attention-mask building, cache
objects, module hooks, ~45 small tensor ops per layer) costs more than the arithmetic on a CPU or
a small GPU batch. `LeanStep` does the same math in ~20 ops per layer: q/k/v and gate/up as one
matmul each (CPU: the weights concatenated once per sampler call), one rotary for q and k
together, attention against the slots of the preallocated KV cache (kv_cache.SlotLayer), whose
prompts the HF forward filled (kv_cache.admit). Each slot has its own length: a step writes each
slot's K/V at its own column and masks the columns beyond it (sampler/kv_cache.py refills finished slots).

Attention scores and their softmax are float32 whatever the cache's dtype: a float32 cache (CPU)
goes through two batched matmuls as before; a bf16/fp16 cache through scaled_dot_product_attention
on the cache itself, whose kernels (CUDA's memory-efficient one, CPU's flash one) accumulate the
scores and the softmax in float32 as the training forward's SDPA / flash-attn do -- the sampler's
pi is then the trainer's pi_old up to the cache's rounding, not a bf16 softmax's, and
no float32 copy of the cache is made.

Same math, not the same rounding: its logits agree with the HF forward to ~1e-6 relative in float32
(tests/test_rollout.py), so a sampled token can differ where two candidates tie to that precision.
Models it does not implement (other architectures, sliding windows, dynamic RoPE, q/k norms, a
sharded model) get `HFStep`, the HF forward per step, in rollout.py's chunked loop.

`CapturedStep` (--compile-decode): the same step through torch.compile, in CUDA graphs on CUDA.
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
    """Llama/Qwen2 decoding from the model's weights (no copies, except the fused CPU matmuls), over
    the slots of a kv_cache.slot_cache."""

    def __init__(self, model, cache):
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
        self.dev = w0.device.type
        # Under autocast the fused copies are made in its dtype: cast once, not at every token.
        cast = torch.get_autocast_dtype(self.dev) if fuse and torch.is_autocast_enabled(self.dev) else None
        self.layers = [_Layer(layer, fuse, cast) for layer in inner.layers]

    def select(self, slots):
        """Keep only `slots` (an index tensor), in that order."""
        self.cache.batch_select_indices(slots)

    def __call__(self, tok, pos, width: int):
        """tok, pos: (S,) each slot's token and its position, which is also the cache column its K/V
        are written to (a slot's prompt fills columns [0, P) unpadded); width: cache columns read,
        > every pos (a host int: no device read). -> (S, V) float32 logits of each slot's next token.
        Every slot reads `width` columns, masked beyond its own length."""
        return self.step(tok, pos, width)

    def step(self, tok, pos, width: int):
        """The step's math (CapturedStep compiles it): tensor ops only, no host read, no branch on a
        device value; its shapes are S = tok's rows and `width`. The cache's buffers are read as the
        first S slots of the whole (k_all, v_all: fixed addresses, SlotLayer)."""
        S, Hq, Hkv, D = tok.shape[0], self.Hq, self.Hkv, self.D
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]     # (S, 1, D)
        x = self.embed(tok)                                             # (S, H)
        C = self.cache.layers[0].k_all.shape[2]     # (the capacity, as a size: a traced graph's symbol)
        # each (slot, kv head)'s row of a (S * Hkv * C, D) view of a layer's buffer: its slot's column
        at = ((torch.arange(S, device=tok.device)[:, None] * Hkv + torch.arange(Hkv, device=tok.device)) * C
              + pos[:, None]).view(-1)                                 # (S * Hkv,)
        own = torch.arange(width, device=tok.device)[None, :] <= pos[:, None]   # (S, width)
        mask = own if self.cache.layers[0].k_all.dtype != torch.float32 else _bias(own, Hkv)
        for w, c in zip(self.layers, self.cache.layers):
            K, V = c.k_all[:S], c.v_all[:S]                              # (S, Hkv, C, D): the live slots
            qkv = w.qkv(_rms(x, w.n1, self.eps)).view(S, Hq + 2 * Hkv, D)
            qk = _rotate(qkv[:, :Hq + Hkv], cos, sin)                    # q and k heads at once
            K.view(-1, D).index_copy_(0, at, qk[:, Hq:].reshape(-1, D).to(K.dtype))
            V.view(-1, D).index_copy_(0, at, qkv[:, Hq + Hkv:].reshape(-1, D).to(V.dtype))
            q = qk[:, :Hq].view(S, Hkv, Hq // Hkv, D)                   # GQA: a kv head's q heads
            with torch.autocast(self.dev, enabled=False):               # scores: see _attend
                a = _attend(q, K[:, :, :width], V[:, :, :width], mask, self.scale)
            x = x + w.o(a.reshape(S, Hq * D))
            x = x + w.mlp(_rms(x, w.n2, self.eps))
        return self.lm(_rms(x, self.norm, self.eps)).float()


# CapturedStep reads the cache in widths of capacity / WIDTH_BUCKETS (rounded up), and compacts to
# a power of two of slots: shapes that change rarely, each a compiled graph (a CUDA graph) of its own.
WIDTH_BUCKETS = 8
_COMPILED = {}                                   # (backend, mode) -> torch.compile(LeanStep.step)


class CapturedStep(LeanStep):
    """LeanStep's step through torch.compile(fullgraph=True): on CUDA with inductor in mode
    "reduce-overhead", which captures it in CUDA graphs and replays them -- one launch per step
    instead of ~20 kernels per layer, the launch overhead that dominates a small decode batch.
    A graph needs fixed shapes and fixed addresses: the cache's whole buffers are static inputs
    (compaction moves slots in place, SlotLayer), the columns read are bucketed (WIDTH_BUCKETS) and
    the slots compacted to a power of two (`bucket_rows`), so a pass records a few graphs, not one per
    step. The widths read beyond a slot's own length are masked: the same logits as LeanStep's up
    to the rounding of a longer sum. backend: torch.compile's ("inductor"; "aot_eager" / "eager"
    trace the same graph without a C compiler). Unmeasured on a GPU: float32 weights under bf16
    autocast (DDP without LoRA) are cast inside the graph at every step -- autocast's cache of
    casts is the eager step's only -- while FSDP2's gathered and LoRA's merged copies are bf16.
    Never a run's end: a compiler error (the recompile limit, which fullgraph=True makes one) gives the
    eager step for the rest of the process (fall_back)."""

    def __init__(self, model, cache, backend="inductor"):
        super().__init__(model, cache)
        for t in [self.cos, self.sin] + [b for c in cache.layers for b in (c.k_all, c.v_all)]:
            torch._dynamo.mark_static_address(t)     # fixed addresses: a graph reads (writes) them in place
        _dynamic(self.cos, self.sin)                 # (its length is the capacity, new every pass)
        _dynamic(*(b for c in cache.layers for b in (c.k_all, c.v_all)), dims=(0, 2))
        mode = "reduce-overhead" if self.dev == "cuda" and backend == "inductor" else None
        if (backend, mode) not in _COMPILED:             # one wrapper: its graphs serve every pass
            _COMPILED[backend, mode] = torch.compile(LeanStep.step, backend=backend, mode=mode,
                                                     fullgraph=True)
        self.key, self.compiled = (backend, mode), _COMPILED[backend, mode]

    def __call__(self, tok, pos, width: int):
        if self.key in FELL_BACK:                       # compiling failed once: eager for the run's rest
            return self.step(tok, pos, width)
        C = self.cache.layers[0].capacity
        q = -(-C // WIDTH_BUCKETS)
        _dynamic(tok, pos)
        try:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            logits = self.compiled(self, tok, pos, min(C, -(-width // q) * q))
        except Exception as e:                          # a compile failure must not end the run: fall_back
            fall_back(self.key, e)
            return self.step(tok, pos, width)
        return logits.clone() if self.dev == "cuda" else logits  # (a graph's output is overwritten)


# (backend, mode) -> why its compiled step was given up for LeanStep's eager one, in this process.
FELL_BACK = {}


def fall_back(key, error):
    """Give up the compiled step of `key` for the rest of the process, and say so once. Why not raise:
    fullgraph=True turns Dynamo's recompile limit (torch._dynamo.config.recompile_limit, 8 graphs) into
    an error (FailOnRecompileLimitHit), and a run's passes bring new slot counts, capacities and
    decoding copies; a missing C compiler or a graph break raises too. The eager step is the same math
    (its logits are the compiled graph's up to the rounding of the bucketed width's masked sums), and
    re-running it is safe: a step only writes each slot's K/V at its own column, the same values again.
    An error that is not the compiler's recurs in the eager step and ends the run there."""
    FELL_BACK[key] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    print(f"--compile-decode: the compiled decode step failed ({FELL_BACK[key]}); decoding eagerly "
          "(decode.LeanStep) from here on", flush=True)


def _dynamic(*tensors, dims=(0,)):
    """Their `dims` vary between steps or passes (slots, capacity): traced as sizes, not constants, so
    that a new pass's sizes reuse the graphs (automatic dynamic shapes would mark them so only after a
    recompile of its own, each counting towards the limit)."""
    for t in tensors:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


def bucket_rows(live: int, slots: int) -> int:
    """Slots a CapturedStep's pass keeps when it compacts `slots` to `live`: a power of two, at most
    `slots` (the finished ones that pad it decode on, ignored)."""
    return min(slots, 1 << max(0, live - 1).bit_length())


def _bias(own, Hkv):
    """(S, width) bool -> the additive float32 bias (S * Hkv, 1, width) of _attend's float32 path."""
    bias = torch.zeros(own.shape, dtype=torch.float32, device=own.device).masked_fill_(~own, float("-inf"))
    return bias[:, None, None].expand(-1, Hkv, 1, -1).reshape(-1, 1, own.shape[1])


def _attend(q, K, V, mask, scale):
    """One query token per slot against its cache columns, scores and softmax in float32.
    q (S, Hkv, g, D): the g query heads of each KV head as g queries; K, V (S, Hkv, width, D) views
    of the cache. float32 cache: two batched matmuls with the additive bias `mask` (_bias), the same
    math as the HF forward's, with fewer ops. bf16/fp16 cache: SDPA on the cache with the boolean
    `mask` (S, width) -- its kernels keep the scores and softmax in float32 (a bf16 softmax is 4-8x
    the attention error) and make no float32 copy of the cache. -> (S, Hkv, g, D)"""
    S, Hkv, g, D = q.shape
    if K.dtype == torch.float32:
        width = K.shape[2]
        keys = K.reshape(S * Hkv, width, D).transpose(1, 2)            # views: dims 0, 1 merge
        p = torch.baddbmm(mask, q.reshape(S * Hkv, g, D).float(), keys, alpha=scale).softmax(-1)
        return torch.bmm(p, V.reshape(S * Hkv, width, D)).view(S, Hkv, g, D)
    return F.scaled_dot_product_attention(q.to(K.dtype), K, V, attn_mask=mask[:, None, None, :], scale=scale)


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
