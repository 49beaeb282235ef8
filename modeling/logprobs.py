"""Log-probs of [prompt | response] rows: the training forward.

Every forward of a training step (the rollout policy's pi_old, the reference, the update's
gradient pass) and the Query-KL cache go through `score_tokens`: one forward over the `Packed`
layout [left-padded prompt | right-padded response] gives the response log-probs (policy loss) and
the prompt log-probs (Query-KL, method.md §3), on logits / T in float32 (`token_logprobs`). The
model's forward stops at its final hidden states; lm_head's logits are made in float32 block by
block, fused with the log-softmax and recomputed in backward (`_TokenLogprob`): no (B, L, V) tensor,
and no bf16 rounding of logits (~0.03-0.06 nat at |z| ~ 16-32) under the 1e-3-scale KL monitors.

GRPO repeats each prompt for its G responses: `score_tokens(group=G)` runs a repeated prompt
through the model once and gives its G rows copies of its KV cache; causal attention makes that the
same math as G full rows (`shared_prompt_scores`). `MicroBatch` and `Packed.trimmed` cut a step's
rows into forwards without all-padding columns, decided on the host (scale_step.plan_step).

--pack (the full-row path: --share-prompts false, or --fsdp / --grad-ckpt, where prompts are not
shared): a micro-batch's rows run concatenated, their real tokens only, position_ids restarting
at 0 for each row and no attention_mask (`packed_row_scores`, `PackLayout`). transformers builds
the block-causal mask from those positions (masking_utils.find_packed_sequence_indices: SDPA,
eager) and flash-attn runs varlen on the cu_seqlens passed beside them: no token attends across
rows, each sees its own row's earlier tokens at the padded forward's positions: the same math.
Under flash-attn (the GPU path) the forward is one (1, N) sequence of exactly the N real tokens
(the padded rows are 1.19-1.30x that on the paper config, 1.20x on the tiny world); SDPA and eager
compute the whole (L, L) mask, so there the rows are dealt first-fit into bins as wide as the
longest row, each bin's tail a filler sequence of its own (1.10x the real tokens on the tiny
world, never more than the padded rows). Only positions whose next token is in the same row are
scored (targets never cross a row's end); the scores land in the same (B, P-1) / (B, R) arrays as
the padded forward's, so nothing downstream changes. The shared-prompt path (score_tokens(group=G))
stays padded, by measurement (bench/bench_rl.py --vs pack, docs/speed.md): running each prompt
once, it already computes 0.66x the rows' real tokens, fewer than any packing of full rows; and its
responses attend to a KV cache of the prompt, which the position-based packed mask cannot express.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from plumbing import distributed


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward and the width of their trimmed layout (Packed.trimmed): decided on the
    host from Packed.lengths, so a micro-batch loop reads nothing back from the device."""
    rows: torch.Tensor                 # (n,) row indices into the Packed
    prompt_len: int                    # the rows' longest prompt (the trimmed layout's P, >= 1)
    response_len: int                  # their longest response (>= 1)
    lengths: tuple = ()                # host (prompt, response) real tokens of each row
    pack: bool = False                 # the full-row forward runs the real tokens only (packed_row_scores)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)

    @property
    def real_tokens(self) -> int:
        return sum(p + r for p, r in self.lengths)

    @property
    def tokens(self) -> int:
        """Tokens its full-row forward runs: the real ones when packed, else the padded layout's."""
        return self.real_tokens if self.pack else self.padded_tokens


@dataclass
class Packed:
    """A rollout row is [left-padded prompt | right-padded response], width P + R. One forward
    over it gives both the response log-probs (policy loss) and the prompt log-probs (Query-KL,
    method.md §3). Position j of a token_logprobs output scores token j+1, so the prompt slice
    [:, :P-1] scores the prompt tokens after the first one (prompt_tok_mask needs the previous
    token to be a real prompt token too) and the response slice is [:, P-1:]."""
    input_ids: torch.LongTensor        # (B, P+R)
    attention_mask: torch.LongTensor   # (B, P+R)
    prompt_tok_mask: torch.LongTensor  # (B, P-1)
    P: int
    lengths: list[tuple[int, int]] | None = None  # host copy: (prompt, response) tokens of each row
    pack: bool = False                 # score_tokens' full-row forward packs the real tokens

    def rows(self, sl) -> "Packed":
        lengths = None if self.lengths is None else self.lengths[sl]
        return Packed(self.input_ids[sl], self.attention_mask[sl], self.prompt_tok_mask[sl], self.P, lengths,
                      self.pack)

    def micro_batch(self, rows: list[int], pack=False) -> MicroBatch:
        """Rows as a MicroBatch, its widths from the host lengths."""
        lengths = tuple(tuple(self.lengths[i]) for i in rows)
        return MicroBatch(torch.tensor(rows, device=self.input_ids.device),
                          max(1, max(p for p, _ in lengths)), max(1, max(r for _, r in lengths)),
                          lengths, pack)

    def trimmed(self, mb) -> tuple["Packed", slice, slice]:
        """The rows of a MicroBatch (or an index tensor: widths then read from the mask) without the
        columns that are padding in all of them (a shorter forward), and which columns of the
        full-width (B, P-1) prompt and (B, R) response score arrays the trimmed rows' scores cover.
        Positions come from the attention mask, so a row's scores do not depend on how much
        padding surrounds it."""
        if not isinstance(mb, MicroBatch):
            mask = self.attention_mask[mb]
            mb = MicroBatch(mb, max(1, int(mask[:, :self.P].sum(1).max())),
                            max(1, int(mask[:, self.P:].sum(1).max())))
        idx, p, r = mb.rows, mb.prompt_len, mb.response_len
        mask = self.attention_mask[idx]
        cols = slice(self.P - p, self.P + r)
        return (Packed(self.input_ids[idx][:, cols], mask[:, cols],
                       self.prompt_tok_mask[idx][:, self.P - p:self.P - 1], p, list(mb.lengths) or None,
                       mb.pack),
                slice(self.P - p, self.P - 1), slice(0, r))


@dataclass
class TokenScores:
    response: torch.Tensor             # (B, R) log p of each response token (on logits / T)
    prompt: torch.Tensor               # (B, P-1) log p of prompt tokens 2..P (mask: prompt_tok_mask)
    entropy: torch.Tensor | None       # (B, R) entropy of each response position, or None


def score_tokens(model, packed: Packed, temperature, with_entropy=False, group=1,
                 checked=False, entropy_grad=False) -> TokenScores:
    """One forward over [prompt | response] -> response and prompt log-probs (and entropy, with
    its gradient when entropy_grad: an entropy bonus in the loss).
    group = G > 1: the rows come in consecutive groups of G that repeat one prompt (GRPO's G
    responses), and each prompt runs once (shared_prompt_scores), unless a group's prompts differ or
    the model has sliding-window layers (whose cache keeps only a window of the prompt). checked:
    the caller has verified shares_prompts already (a host read; train.py does it once per step)."""
    if (group > 1 and full_attention(distributed.unwrap(model).config)
            and (checked or shares_prompts(packed, group))):
        return shared_prompt_scores(model, packed, temperature, with_entropy, group, entropy_grad)
    if packed.pack:
        return packed_row_scores(model, packed, temperature, with_entropy, entropy_grad)
    logp, ent = token_logprobs(model, packed.input_ids, packed.attention_mask, temperature, with_entropy,
                               entropy_grad=entropy_grad)
    P = packed.P
    return TokenScores(logp[:, P - 1:], logp[:, :P - 1], None if ent is None else ent[:, P - 1:])


def shares_prompts(packed: Packed, G) -> bool:
    """Rows come in consecutive groups of G with the same (left-padded) prompt tokens."""
    B, P = packed.input_ids.shape[0], packed.P
    if B % G:
        return False
    ids = packed.input_ids[:, :P].view(B // G, G, P)
    return bool((ids == ids[:, :1]).all())


def shared_prompt_scores(model, packed: Packed, temperature, with_entropy, G,
                         entropy_grad=False) -> TokenScores:
    """score_tokens for groups of G rows with one prompt each: the U = B / G prompts run through the
    model once, filling a KV cache; copied G times, it serves the responses' forward. Causal
    attention makes this the same math as B full rows (a prompt's states never see its response),
    for (U P + B R) / (B (P + R)) of the work: half of it here (short prompts, short answers), less
    where responses dwarf prompts. Gradients flow through both forwards (the cache copies sum
    theirs back into the prompt's). The prompt pass uses the unwrapped module: DDP sees the one
    forward per backward it expects, and its gradient hooks still fire once per parameter."""
    ids, mask, P = packed.input_ids, packed.attention_mask, packed.P
    B = ids.shape[0]
    first = torch.arange(0, B, G, device=ids.device)                   # (U,) one row per group
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)                      # (B, P+R) as in token_logprobs
    inner = distributed.unwrap(model)
    cache_kw, _ = forward_kwargs(inner)
    cache = DynamicCache(config=inner.config)
    head = plain_head(inner)
    with hidden_states_out(head):  # hidden states (., ., D), or the model's logits (., ., V)
        px = inner(input_ids=ids[first, :P], attention_mask=mask[first, :P], position_ids=pos[first, :P],
                   use_cache=True, **{cache_kw: cache}).logits          # (U, P, .)
        cache.batch_repeat_interleave(G)                                # (B, Hkv, P, D) per layer
        rx = model(input_ids=ids[:, P:], attention_mask=mask, position_ids=pos[:, P:],
                   use_cache=True, **{cache_kw: cache}).logits          # (B, R, .)
    w, T, elems = None if head is None else head.weight, float(temperature), 2**26
    # (unsliced: see _TokenLogprob)
    prompt, _ = _TokenLogprob.apply(px, w, ids[first, 1:P], T, elems, False, False)
    # Response token 0 is scored by the prompt's last position, tokens 1.. by the responses' own.
    x = torch.cat([px[:, -1:].repeat_interleave(G, 0), rx[:, :-1]], 1)  # (B, R, .)
    response, ent = _TokenLogprob.apply(x, w, ids[:, P:], T, elems, bool(with_entropy), bool(entropy_grad))
    return TokenScores(response, prompt.repeat_interleave(G, 0), ent)


@dataclass
class PackLayout:
    """Where each real token of a [left-padded prompt | right-padded response] batch (n, W) sits in
    the packed forward (bins, width), and where its scores go back. Row i's tokens are its columns
    P - p_i .. P + r_i - 1, contiguous; each bin holds whole rows one after another, positions
    restarting at 0 in each, then (SDPA/eager) a tail of filler tokens that is a sequence of its own
    (positions from 0 again). Flat slot t scores slot t + 1 only where both are the same row's
    (`src`): no target crosses a row's end."""
    take: torch.Tensor                 # (T,) flat indices into input_ids.view(-1): the real tokens
    slots: torch.Tensor                # (T,) their flat slots in the (bins, width) forward
    positions: torch.Tensor            # (bins, width) position of each slot within its sequence
    src: torch.Tensor                  # (M,) flat slots that score a token (all but each row's last)
    dst: torch.Tensor                  # (M,) flat indices into the (n, W-1) scores of the padded layout
    cu_seqlens: torch.Tensor           # (rows + 1,) int32 row boundaries in one bin (flash-attn varlen)
    max_len: int                       # the longest row (flash-attn's max_seqlen)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)

    @classmethod
    def of(cls, lengths, P, W, device, width=None) -> "PackLayout":
        """From the host (prompt, response) lengths: numpy and Python, no device read (and no
        data-dependent op on memory_measure's fake tensors). width None: one bin of every real
        token (flash-attn: attention costs sum L_i^2 whatever the bin); else bins of `width` >= the
        longest row, filled first-fit longest first (SDPA and eager mask the whole bin: a bin costs
        width^2, so one long bin would cost N^2). Rows of no tokens are left out."""
        L = [p + r for p, r in lengths]
        rows = sorted((i for i in range(len(L)) if L[i]), key=lambda i: -L[i])
        width = width or sum(L)
        bins, room = [], []                                           # rows of each bin, space left
        for i in rows:
            j = next((j for j, left in enumerate(room) if left >= L[i]), len(bins))
            if j == len(bins):
                bins.append([]), room.append(width)
            bins[j].append(i)
            room[j] -= L[i]
        take, slots, pos, src, dst = [], [], np.zeros((len(bins), width), dtype=np.int64), [], []
        for j, members in enumerate(bins):
            o = 0
            for i in members:
                n, col = L[i], P - lengths[i][0]                      # its tokens' first column
                at = j * width + o
                take.append(i * W + col + np.arange(n))
                slots.append(at + np.arange(n))
                pos[j, o:o + n] = np.arange(n)
                src.append(at + np.arange(n - 1))
                dst.append(i * (W - 1) + col + np.arange(n - 1))      # logp column c scores column c + 1
                o += n
            pos[j, o:] = np.arange(width - o)                         # the filler: a sequence of its own
        cat = lambda parts: torch.as_tensor(np.concatenate(parts or [np.zeros(0, np.int64)]),  # noqa: E731
                                            dtype=torch.long, device=device)
        cu = np.concatenate([[0], np.cumsum([L[i] for i in rows])])
        return cls(cat(take), cat(slots), torch.as_tensor(pos, device=device), cat(src), cat(dst),
                   torch.as_tensor(cu, dtype=torch.int32, device=device), max(L, default=0))


def varlen_attention(model) -> bool:
    """Does the model's attention run variable-length sequences (flash-attn), rather than masking
    a whole (L, L) block (SDPA, eager)?"""
    return "flash" in str(getattr(model.config, "_attn_implementation", ""))


def packed_row_scores(model, packed: Packed, temperature, with_entropy=False,
                      entropy_grad=False) -> TokenScores:
    """score_tokens' full-row forward on the real tokens (--pack): the rows concatenated, positions
    restarting at 0 in each, no attention_mask, so transformers masks block-causally from the
    positions (find_packed_sequence_indices) and flash-attn runs varlen on cu_seqlens: each token
    sees its own row's earlier tokens at the same positions as in the padded forward, the same
    math. flash-attn: one (1, N) sequence of exactly the real tokens; SDPA/eager: bins as wide as
    the longest row (PackLayout). Scores are scattered into the padded layout's arrays; positions
    that score no real token (padding, before a row's first token) hold 0."""
    if temperature <= 0:
        raise ValueError(f"packed_row_scores needs temperature > 0, got {temperature}")
    ids = packed.input_ids
    n, W = ids.shape
    lengths = packed.lengths
    if lengths is None:                                               # (a host read; plan_step passes them)
        lengths = list(zip(packed.attention_mask[:, :packed.P].sum(1).tolist(),
                           packed.attention_mask[:, packed.P:].sum(1).tolist()))
    inner = distributed.unwrap(model)
    flash = varlen_attention(inner)
    lay = PackLayout.of(lengths, packed.P, W, ids.device, None if flash else max(p + r for p, r in lengths))
    grid = ids.new_zeros(lay.shape[0] * lay.shape[1]).index_copy(0, lay.slots, ids.reshape(-1)[lay.take])
    kw = {}
    if flash:                                                         # varlen without a device read
        kw = dict(cu_seq_lens_q=lay.cu_seqlens, cu_seq_lens_k=lay.cu_seqlens,
                  max_length_q=lay.max_len, max_length_k=lay.max_len)
    head = plain_head(inner)
    with hidden_states_out(head):                                     # (bins, width, D), or logits
        x = model(input_ids=grid.view(lay.shape), attention_mask=None, position_ids=lay.positions,
                  use_cache=False, **kw).logits
    x = x.reshape(1, -1, x.shape[-1])[:, lay.src]                     # (1, M, .) the scoring slots
    logp, ent = _TokenLogprob.apply(x, None if head is None else head.weight, grid[lay.src + 1][None],
                                    float(temperature), 2**26, bool(with_entropy), bool(entropy_grad))

    def padded(v):                                                    # (1, M) -> (n, W-1)
        out = torch.zeros(n * (W - 1), dtype=v.dtype, device=v.device)
        return out.index_copy(0, lay.dst, v[0]).view(n, W - 1)
    logp, P = padded(logp), packed.P
    ent = None if ent is None else padded(ent)
    return TokenScores(logp[:, P - 1:], logp[:, :P - 1], None if ent is None else ent[:, P - 1:])


def right_align(seqs: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D tensors right-aligned into (B, width) (zeros on the left), matching the
    left-padded prompt layout (e.g. cached prompt log-probs next to Packed's prompt slice)."""
    out = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        s = s[-width:] if len(s) > width else s
        if len(s):
            out[i, width - len(s):] = s
    return out


def forward_kwargs(model) -> tuple[str, bool]:
    """(name of the cache kwarg, whether logits_to_keep is supported). transformers 5.24 renamed
    past_key_values -> cache (the old name warns until 5.40)."""
    params = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    return cache_kw, "logits_to_keep" in params


def full_attention(config) -> bool:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return all(t == "full_attention" for t in types) and not getattr(config, "use_sliding_window", False)


# ----------------------------------------------------------------------------------------------
# Scoring: per-token log-probs (and entropy) from the final hidden states

# Model types whose logits are lm_head(final hidden states) and nothing more (no soft-capping, no
# scale, no bias): their log-probs come from the hidden states and lm_head's weight (_TokenLogprob).
PLAIN_HEAD = ("llama", "mistral", "qwen2", "qwen3")


def plain_head(model) -> torch.nn.Linear | None:
    """The lm_head the fused log-softmax multiplies by, or None: the model's own logits are used."""
    inner = distributed.unwrap(model)
    head = inner.get_output_embeddings()
    if (getattr(inner.config, "model_type", None) in PLAIN_HEAD and type(head) is torch.nn.Linear
            and head.bias is None):
        return head
    return None


@contextmanager
def hidden_states_out(head):
    """While inside, the model's forward returns its final hidden states (B, L, D) as `.logits`:
    lm_head runs as the identity. The forward itself stays the wrapped model's (DDP's, FSDP2's
    hooks: the root's parameters, lm_head's included, are gathered by it and stay gathered until
    backward), which calling the body (model.model) would skip. head None: nothing changes."""
    if head is None:
        yield
        return
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _identity(x):
    return x.clone()  # (not the view of the body's output FSDP2 warns about; (B, L, D), no (B, L, V))


def _on_tensor_cores(t) -> bool:
    """torch.mm(..., out_dtype=float32) exists for bf16/fp16 operands here: CUDA (and fake tensors,
    which stand for a GPU's in memory_measure)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_cuda or isinstance(t, FakeTensor)


@dataclass
class _Gemm:
    """lm_head's product in float32. On CUDA the operands take the run's compute dtype (bf16 under
    autocast or FSDP2's bf16 parameters, as lm_head's own matmul would) and one tensor-core GEMM
    returns its float32 accumulator, never rounded to bf16 (at |z| ~ 16-32 bf16 rounds by up to
    0.06: a noise floor under the 1e-3-scale KL monitors); elsewhere the operands are upcast."""
    dtype: torch.dtype                 # the operands' dtype

    @classmethod
    def of(cls, x, weight) -> "_Gemm":
        dev = x.device.type
        if not _on_tensor_cores(x):
            return cls(torch.float32)
        return cls(torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype)

    def operand(self, t):
        return t.to(self.dtype)

    def mm(self, a, b):                # (n, k) @ (k, m) -> (n, m) float32
        if self.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b)

    def mm_into(self, a, b, out):      # out = a @ b in out's dtype: no float32 copy of a bf16 weight
        if out.dtype == self.dtype:
            torch.mm(a, b, out=out)
        else:
            out.copy_(self.mm(a, b))


class _TokenLogprob(torch.autograd.Function):
    """logp[b, l] = log_softmax(z[b, l])[targets[b, l]] with z = logits / T in float32, and the
    entropy H[b, l] of softmax(z[b, l]); gradients flow through logp, and through H when
    entropy_grad (dH/dz_k = -p_k (log p_k + H)).
    x: the final hidden states (B, L', D) with weight, lm_head's (V, D): logits = x W^T are made
    in float32 (_Gemm) block by block and never held whole; or x: the model's logits (B, L', V)
    with weight None. No (B, L', V) float32 tensor is ever held: forward works in blocks of
    positions (B, c, V), saving only x, weight and the (B, L) log-normalisers (and H); backward
    recomputes the logits, in blocks of positions from logits, and from hidden states in slices of
    the vocabulary over all positions (N, v): each slice's lm_head gradient is then one GEMM over
    every position, written once in the weight's dtype (no float32 (V, D) accumulator), the
    hidden states' gradient accumulating in float32 (N, D). `elems` bounds a block's elements.
    targets (B, L) may be shorter than x (B, L', .): positions >= L are not scored, which lets a
    caller pass x unsliced: the backward of a slice x[:, :-1] would allocate a second zero-filled
    (B, L', .) gradient next to this one."""

    @staticmethod
    def forward(ctx, x, weight, targets, temperature, elems, with_entropy, entropy_grad):
        gemm = None if weight is None else _Gemm.of(x, weight)          # (reads autocast: before it is off)
        with torch.autocast(x.device.type, enabled=False):              # float32 as written, not bf16 matmuls
            logp, lse, ent = _scores(x, weight, gemm, targets, temperature, elems, with_entropy)
        entropy_grad = bool(with_entropy and entropy_grad)
        ctx.save_for_backward(x, weight, targets, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.elems, ctx.gemm = temperature, elems, gemm
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, weight, targets, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ent is not None else None
        none = (None,) * 5
        if g_logp is None and g_ent is None:
            return None, None, *none
        with torch.autocast(x.device.type, enabled=False):              # (train.py runs backward under it)
            if weight is None:
                gx = _logits_grad(x, targets, lse, ent, g_logp, g_ent, ctx.temperature, ctx.elems)
                return gx, None, *none
            return *_hidden_grads(x, weight, ctx.gemm, targets, lse, ent, g_logp, g_ent, ctx.temperature,
                                  ctx.elems, ctx.needs_input_grad[:2]), *none


def _scores(x, weight, gemm, targets, T, elems, with_entropy):
    """_TokenLogprob's forward: (log p of the targets, log-normalisers, entropies or None), (B, L)."""
    B, L = targets.shape
    w = None if weight is None else gemm.operand(weight).t()            # (D, V)
    logp = torch.empty((B, L), dtype=torch.float32, device=x.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else None
    V = x.shape[-1] if weight is None else weight.shape[0]
    chunk = _logprob_chunk(B, V, elems)
    for s in range(0, L, chunk):
        e = min(L, s + chunk)
        if weight is None:
            z = x[:, s:e].float() / T                                   # (B, c, V)
        else:
            h = gemm.operand(x[:, s:e]).reshape(-1, x.shape[-1])
            z = gemm.mm(h, w).div_(T).view(B, e - s, V)
        lse_c = torch.logsumexp(z, -1)
        lse[:, s:e] = lse_c
        logp[:, s:e] = z.gather(-1, targets[:, s:e, None]).squeeze(-1) - lse_c
        if with_entropy:  # H = lse - sum_j p_j z_j
            ent[:, s:e] = lse_c - (z - lse_c[..., None]).exp_().mul_(z).sum(-1)
    return logp, lse, ent


def _z_grad(z, lse, ent, targets, v0, g_logp, g_ent):
    """d(sum g_logp logp + g_ent H) / dz over a block z (n, v) of z = logits / T, vocabulary
    columns v0..v0+v: d logp_t / dz_k = [k = t] - p_k, dH / dz_k = -p_k (log p_k + H). z is
    overwritten; two (n, v) blocks at most. lse, ent, targets, g_logp, g_ent: (n,)."""
    lp = z.sub_(lse[:, None])                                           # log p
    p = lp.exp()
    by_ent = None if g_ent is None else lp.add_(ent[:, None]).mul_(p).mul_(g_ent[:, None])
    if g_logp is None:
        return by_ent.neg_()
    g = p.mul_(-g_logp[:, None])
    hit = (targets >= v0) & (targets < v0 + z.shape[1])
    g.scatter_add_(1, (targets - v0).clamp(0, z.shape[1] - 1)[:, None], (g_logp * hit)[:, None])
    return g if by_ent is None else g.sub_(by_ent)


def _logits_grad(logits, targets, lse, ent, g_logp, g_ent, T, elems):
    """The logits' gradient (B, L', V), in blocks of positions."""
    B, L = targets.shape
    V = logits.shape[-1]
    chunk = _logprob_chunk(B, V, elems)
    grad = torch.empty_like(logits)
    grad[:, L:].zero_()                                                 # unscored positions
    for s in range(0, L, chunk):
        e = min(L, s + chunk)
        g = _z_grad(logits[:, s:e].float().reshape(-1, V) / T, lse[:, s:e].reshape(-1), _flat(ent, s, e),
                    targets[:, s:e].reshape(-1), 0, _flat(g_logp, s, e), _flat(g_ent, s, e))
        grad[:, s:e] = g.div_(T).view(B, e - s, V).to(grad.dtype)
    return grad


def _hidden_grads(x, weight, gemm, targets, lse, ent, g_logp, g_ent, T, elems, needs):
    """The gradients of the hidden states (B, L', D) and of lm_head's weight (V, D), in slices of
    the vocabulary over all N = B L scored positions."""
    B, L = targets.shape
    V, D = weight.shape
    h = gemm.operand(x[:, :L]).reshape(-1, D)                           # (N, D)
    gx = torch.zeros(h.shape, dtype=torch.float32, device=x.device) if needs[0] else None
    gw = torch.empty_like(weight) if needs[1] else None
    lse, ent, targets, g_logp, g_ent = (None if t is None else t.reshape(-1)
                                        for t in (lse, ent, targets, g_logp, g_ent))
    vs = _logprob_chunk(h.shape[0], 1, elems)
    for v0 in range(0, V, vs):
        w = gemm.operand(weight[v0:v0 + vs])                            # (v, D)
        g = _z_grad(gemm.mm(h, w.t()).div_(T), lse, ent, targets, v0, g_logp, g_ent)   # (N, v) float32
        g = gemm.operand(g.div_(T))
        if gx is not None:
            gx += gemm.mm(g, w)
        if gw is not None:
            gemm.mm_into(g.t(), h, gw[v0:v0 + vs])
    if gx is not None:
        full = x.new_zeros(x.shape)                                     # unscored positions: 0
        full[:, :L] = gx.view(B, L, D)
        gx = full
    return gx, gw


def _flat(t, s, e):
    return None if t is None else t[:, s:e].reshape(-1)


def _logprob_chunk(B, V, elems=2**26) -> int:
    """Positions per log-softmax chunk so that a (B, chunk, V) float32 block has <= elems elements
    (with B = N positions and V = 1: vocabulary columns per slice of the hidden-state backward)."""
    return max(1, elems // max(1, B * V))


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=False,
                   chunk_elems=2**26, entropy_grad=False):
    """One forward over prompt+response (left padding allowed).

    input_ids, attention_mask: (B, L). Returns (logp, entropy), each (B, L-1) float32, with
    logp[:, j] = log p(input_ids[:, j+1] | input_ids[:, :j+1]) under softmax(logits / T), and
    entropy[:, j] the entropy of that distribution (None unless with_entropy; with gradients only
    when entropy_grad). Positions whose target is padding carry garbage: mask them with
    attention_mask[:, 1:]. Gradients flow through logp (wrap in torch.no_grad() when not needed).
    chunk_elems bounds the float32 working set (B * chunk * V elements) of the log-softmax.
    """
    if temperature <= 0:
        raise ValueError(f"token_logprobs needs temperature > 0, got {temperature}")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (B, L); got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("need sequences of length >= 2 to score any token")
    pos = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    head = plain_head(model)
    with hidden_states_out(head):  # (B, L, D) hidden states (or (B, L, V) logits); the last scores nothing
        x = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                  use_cache=False).logits
    return _TokenLogprob.apply(x, None if head is None else head.weight, input_ids[:, 1:], float(temperature),
                               chunk_elems, bool(with_entropy), bool(entropy_grad))
