"""Log-probs of [prompt | response] rows: the training forward.

Every forward of a training step (the rollout policy's pi_old, the reference, the update's
gradient pass) and the Query-KL cache go through `score_tokens`: one forward over the `Packed`
layout [left-padded prompt | right-padded response] gives the response log-probs (policy loss) and
the prompt log-probs (Query-KL, method.md §3), on logits / T in float32 (`token_logprobs`, chunked
along the sequence so a 152k vocabulary never needs several (B, L, V) float32 copies).

GRPO repeats each prompt for its G responses: `score_tokens(group=G)` runs a repeated prompt
through the model once and gives its G rows copies of its KV cache; causal attention makes that the
same math as G full rows (`shared_prompt_scores`). `MicroBatch` and `Packed.trimmed` cut a step's
rows into forwards without all-padding columns, decided on the host (step_plan.plan_step).
"""

import inspect
from dataclasses import dataclass

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

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)


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

    def rows(self, sl) -> "Packed":
        lengths = None if self.lengths is None else self.lengths[sl]
        return Packed(self.input_ids[sl], self.attention_mask[sl], self.prompt_tok_mask[sl], self.P, lengths)

    def micro_batch(self, rows: list[int]) -> MicroBatch:
        """Rows as a MicroBatch, its widths from the host lengths."""
        return MicroBatch(torch.tensor(rows, device=self.input_ids.device),
                          max(1, max(self.lengths[i][0] for i in rows)),
                          max(1, max(self.lengths[i][1] for i in rows)))

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
                       self.prompt_tok_mask[idx][:, self.P - p:self.P - 1], p),
                slice(self.P - p, self.P - 1), slice(0, r))


@dataclass
class TokenScores:
    response: torch.Tensor             # (B, R) log p of each response token (on logits / T)
    prompt: torch.Tensor               # (B, P-1) log p of prompt tokens 2..P (mask: prompt_tok_mask)
    entropy: torch.Tensor | None       # (B, R) entropy of each response position, or None


def score_tokens(model, packed: Packed, temperature, with_entropy=False, group=1,
                 checked=False) -> TokenScores:
    """One forward over [prompt | response] -> response and prompt log-probs (and entropy).
    group = G > 1: the rows come in consecutive groups of G that repeat one prompt (GRPO's G
    responses), and each prompt runs once (shared_prompt_scores), unless a group's prompts differ or
    the model has sliding-window layers (whose cache keeps only a window of the prompt). checked:
    the caller has verified shares_prompts already (a host read; train.py does it once per step)."""
    if (group > 1 and full_attention(distributed.unwrap(model).config)
            and (checked or shares_prompts(packed, group))):
        return shared_prompt_scores(model, packed, temperature, with_entropy, group)
    logp, ent = token_logprobs(model, packed.input_ids, packed.attention_mask, temperature, with_entropy)
    P = packed.P
    return TokenScores(logp[:, P - 1:], logp[:, :P - 1], None if ent is None else ent[:, P - 1:])


def shares_prompts(packed: Packed, G) -> bool:
    """Rows come in consecutive groups of G with the same (left-padded) prompt tokens."""
    B, P = packed.input_ids.shape[0], packed.P
    if B % G:
        return False
    ids = packed.input_ids[:, :P].view(B // G, G, P)
    return bool((ids == ids[:, :1]).all())


def shared_prompt_scores(model, packed: Packed, temperature, with_entropy, G) -> TokenScores:
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
    plogits = inner(input_ids=ids[first, :P], attention_mask=mask[first, :P], position_ids=pos[first, :P],
                    use_cache=True, **{cache_kw: cache}).logits        # (U, P, V)
    cache.batch_repeat_interleave(G)                                    # (B, Hkv, P, D) per layer
    rlogits = model(input_ids=ids[:, P:], attention_mask=mask, position_ids=pos[:, P:],
                    use_cache=True, **{cache_kw: cache}).logits        # (B, R, V)
    chunk = _logprob_chunk(B, rlogits.shape[-1])
    # (unsliced: see _TokenLogprob)
    prompt, _ = _TokenLogprob.apply(plogits, ids[first, 1:P], float(temperature), chunk, False)
    # Response token 0 is scored by the prompt's last position, tokens 1.. by the responses' own.
    logits = torch.cat([plogits[:, -1:].repeat_interleave(G, 0), rlogits[:, :-1]], 1)  # (B, R, V)
    response, ent = _TokenLogprob.apply(logits, ids[:, P:], float(temperature), chunk, bool(with_entropy))
    return TokenScores(response, prompt.repeat_interleave(G, 0), ent)


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
# Scoring: per-token log-probs (and entropy) of given sequences


class _TokenLogprob(torch.autograd.Function):
    """logp[b, l] = log_softmax(logits[b, l] / T)[targets[b, l]] in float32, plus the entropy of
    that distribution (no grad). Chunked along l in forward AND backward, saving only the
    (model-dtype) logits and the (B, L) log-normalisers, so no (B, L, V) float32 copy is ever
    held: backward recomputes softmax per chunk (d logp / d logits = (onehot - softmax) / T).
    targets (B, L) may be shorter than logits (B, L', V): positions >= L are not scored. That lets
    a caller pass the model's logits unsliced: the backward of a slice logits[:, :-1] would
    allocate a second zero-filled (B, L', V) gradient next to this one."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy):
        B, L = targets.shape
        logp = torch.empty((B, L), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            z = logits[:, s:e].float() / temperature  # (B, c, V) float32
            lse_c = torch.logsumexp(z, -1)
            lse[:, s:e] = lse_c
            logp[:, s:e] = z.gather(-1, targets[:, s:e, None]).squeeze(-1) - lse_c
            if with_entropy:  # H = lse - sum_j p_j z_j
                ent[:, s:e] = lse_c - (torch.exp(z - lse_c[..., None]) * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        if with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse = ctx.saved_tensors
        T, chunk, L = ctx.temperature, ctx.chunk, targets.shape[1]
        grad = torch.empty_like(logits)
        grad[:, L:].zero_()                     # unscored positions
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            z = logits[:, s:e].float() / T
            g = g_logp[:, s:e, None]  # (B, c, 1)
            gl = -torch.exp(z - lse[:, s:e, None]) * g
            gl.scatter_add_(-1, targets[:, s:e, None], g)
            grad[:, s:e] = (gl / T).to(grad.dtype)
        return grad, None, None, None, None


def _logprob_chunk(B, V, elems=2**26) -> int:
    """Positions per log-softmax chunk so that a (B, chunk, V) float32 block has <= elems elements."""
    return max(1, elems // max(1, B * V))


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=False,
                   chunk_elems=2**26):
    """One forward over prompt+response (left padding allowed).

    input_ids, attention_mask: (B, L). Returns (logp, entropy), each (B, L-1) float32, with
    logp[:, j] = log p(input_ids[:, j+1] | input_ids[:, :j+1]) under softmax(logits / T), and
    entropy[:, j] the entropy of that distribution (None unless with_entropy; never has grad).
    Positions whose target is padding carry garbage: mask them with attention_mask[:, 1:].
    Gradients flow through logp (wrap in torch.no_grad() when not needed). chunk_elems bounds the
    float32 working set (B * chunk * V elements) of the log-softmax.
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
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                   use_cache=False).logits  # (B, L, V) in the model dtype; the last scores nothing
    chunk = _logprob_chunk(logits.shape[0], logits.shape[2], chunk_elems)
    return _TokenLogprob.apply(logits, input_ids[:, 1:], float(temperature), chunk,
                               bool(with_entropy))
