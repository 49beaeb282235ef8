"""Padding-free packing of the full-row training forwards (--pack, issue #42): a micro-batch's rows
concatenated, their real tokens only, positions restarting at 0 in each row
(logprobs.packed_row_scores). The same log-probs, entropies and gradients as the padded
[left-padded prompt | right-padded response] forward, in float32 on the tiny world's model; no
target crosses a row's end; the forward's tokens are the real ones; the micro-batch plan counts
real tokens against --micro-tokens."""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from modeling import logprobs
from plumbing import batching
from rl import scale_step
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
# Rows of different prompt and response lengths: a 1-token prompt, a row with no response, a row
# as long as the layout's widest prompt plus widest response, and one that fits beside another.
LENGTHS = [(3, 5), (7, 2), (1, 6), (5, 0), (2, 1), (7, 6), (4, 3)]


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(WARM, attn_implementation="sdpa", dtype=torch.float32)


def padded_rows(lengths, vocab, seed=0) -> logprobs.Packed:
    """[left-padded prompt | right-padded response] rows of these real lengths, random tokens."""
    g = torch.Generator().manual_seed(seed)
    P, R = max(p for p, _ in lengths), max(r for _, r in lengths)
    ids = torch.zeros(len(lengths), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(lengths):
        ids[i, P - p:P + r] = torch.randint(3, vocab, (p + r,), generator=g)
        mask[i, P - p:P + r] = 1
    return logprobs.Packed(ids, mask, mask[:, 1:P] * mask[:, :P - 1], P, list(lengths))


def scores_and_grads(model, packed, pack):
    """score_tokens (T = 0.7, entropy with its gradient) and the parameters' gradients of a loss
    that weighs every scored prompt token, response token and entropy differently."""
    model.zero_grad()
    s = logprobs.score_tokens(model, replace(packed, pack=pack), 0.7, with_entropy=True, entropy_grad=True)
    g = torch.Generator().manual_seed(1)
    resp, prompt = packed.attention_mask[:, packed.P:].float(), packed.prompt_tok_mask.float()
    loss = ((s.response * resp * torch.rand(resp.shape, generator=g)).sum()
            + (s.prompt * prompt * torch.rand(prompt.shape, generator=g)).sum()
            + 0.1 * (s.entropy * resp * torch.rand(resp.shape, generator=g)).sum())
    loss.backward()
    return s, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_math(model, packed):
    """Packed and padded forwards agree on every real score (float32 rounding: the packed bins
    run other matrix shapes) and on every parameter's gradient."""
    (a, ga), (b, gb) = scores_and_grads(model, packed, True), scores_and_grads(model, packed, False)
    resp, prompt = packed.attention_mask[:, packed.P:].bool(), packed.prompt_tok_mask.bool()
    for what, got, want, m in (("response log-probs", a.response, b.response, resp),
                               ("prompt log-probs", a.prompt, b.prompt, prompt),
                               ("entropies", a.entropy, b.entropy, resp)):
        assert_rounding(f"packed vs padded forward: {what}", got[m], want[m])
        assert (got[~m] == 0).all()                                   # nothing lands on padding
    assert ga.keys() == gb.keys()                 # each parameter's gradient, over its own largest value
    unit = {n: float(gb[n].abs().max()) or 1.0 for n in gb}
    relative = lambda grads: torch.cat([(grads[n] / unit[n]).flatten() for n in gb])   # noqa: E731
    assert_rounding("packed vs padded forward: gradients / each parameter's largest",
                    relative(ga), relative(gb))


def test_packed_scores_and_gradients_are_the_padded_forwards(tiny):
    """SDPA's bins (rows dealt first-fit into bins as wide as the longest row)."""
    packed = padded_rows(LENGTHS, tiny.config.vocab_size)
    assert logprobs.PackLayout.of(LENGTHS, packed.P, packed.input_ids.shape[1], "cpu", 13).shape[0] < len(LENGTHS)
    assert_same_math(tiny, packed)


def test_one_packed_sequence_is_the_padded_forward(tiny, monkeypatch):
    """flash-attn's layout, one (1, N) sequence of every real token: here SDPA and eager build the
    block-causal mask from the positions alone (the cu_seqlens flash-attn reads are ignored)."""
    monkeypatch.setattr(logprobs, "varlen_attention", lambda model: True)
    packed = padded_rows(LENGTHS, tiny.config.vocab_size, seed=2)
    assert_same_math(tiny, packed)
    eager = AutoModelForCausalLM.from_pretrained(WARM, attn_implementation="eager", dtype=torch.float32)
    assert_same_math(eager, packed)


def test_flash_attn_gets_the_row_boundaries(tiny, monkeypatch):
    """A stand-in for flash-attn's varlen kernel (plain attention within each cu_seqlens segment,
    nothing else: it sees no mask) gives the padded forward's scores: the boundaries are right.
    (An implementation named flash* makes transformers load the real kernel: varlen_attention is
    patched to say yes instead.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    seen = []

    def varlen(module, q, k, v, attention_mask, scaling=None, cu_seq_lens_q=None, max_length_q=None, **kw):
        seen.append((attention_mask, cu_seq_lens_q.tolist(), max_length_q))
        k, v = (t.repeat_interleave(module.num_key_value_groups, 1) for t in (k, v))     # (1, H, N, d)
        out = torch.empty_like(q)
        for s, e in zip(cu_seq_lens_q[:-1].tolist(), cu_seq_lens_q[1:].tolist()):
            out[:, :, s:e] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    AttentionInterface.register("varlen_stand_in", varlen)
    AttentionMaskInterface.register("varlen_stand_in", flash_attention_mask)
    model = AutoModelForCausalLM.from_pretrained(WARM, attn_implementation="sdpa", dtype=torch.float32)
    model.set_attn_implementation("varlen_stand_in")
    monkeypatch.setattr(logprobs, "varlen_attention", lambda m: m.config._attn_implementation == "varlen_stand_in")
    packed = padded_rows(LENGTHS, tiny.config.vocab_size, seed=3)
    with torch.no_grad():
        got = logprobs.score_tokens(model, replace(packed, pack=True), 1.0)
        want = logprobs.score_tokens(tiny, packed, 1.0)
    totals = sorted((p + r for p, r in LENGTHS), reverse=True)
    assert seen and all(m is None and c == [sum(totals[:j]) for j in range(len(totals) + 1)] and n == 13
                        for m, c, n in seen)
    resp, prompt = packed.attention_mask[:, packed.P:].bool(), packed.prompt_tok_mask.bool()
    for what, m in (("response", resp), ("prompt", prompt)):
        assert_rounding(f"varlen stand-in vs padded forward: {what} log-probs", getattr(got, what)[m],
                        getattr(want, what)[m])


def test_targets_never_cross_a_row_boundary():
    """By hand: rows (prompt, response) = (2, 1), (1, 2), (3, 0) in a P = 3, R = 2 layout (W = 5),
    one packed sequence a a' b | c d e | f f' f'' (positions 0 1 2 | 0 1 2 | 0 1 2)."""
    lay = logprobs.PackLayout.of([(2, 1), (1, 2), (3, 0)], 3, 5, "cpu")
    # row 0 = columns 1, 2, 3; row 1 = columns 2, 3, 4; row 2 = columns 0, 1, 2 (first-fit keeps
    # the order of equally long rows)
    assert lay.take.tolist() == [1, 2, 3, 7, 8, 9, 10, 11, 12]
    assert lay.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2]]
    assert lay.src.tolist() == [0, 1, 3, 4, 6, 7]                       # never a row's last token (2, 5, 8)
    # the score of packed slot t lands where the padded forward scores the same target: row i, logp
    # column c (scoring column c + 1), flat i * (W - 1) + c
    assert lay.dst.tolist() == [0 * 4 + 1, 0 * 4 + 2, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert lay.cu_seqlens.tolist() == [0, 3, 6, 9] and lay.max_len == 3


@pytest.mark.parametrize("width", [None, 40])
def test_every_scored_target_is_the_next_token_of_its_own_row(width):
    """On random lengths: the packed targets are exactly the padded layout's real (token, next
    token) pairs, each once, and the forward holds each real token once."""
    g = torch.Generator().manual_seed(0)
    lengths = [(int(p), int(r)) for p, r in zip(torch.randint(1, 20, (30,), generator=g),
                                                 torch.randint(0, 21, (30,), generator=g))]
    packed = padded_rows(lengths, 100)
    ids, mask, W = packed.input_ids, packed.attention_mask, packed.input_ids.shape[1]
    lay = logprobs.PackLayout.of(lengths, packed.P, W, "cpu", width)
    grid = ids.new_zeros(lay.shape[0] * lay.shape[1]).index_copy(0, lay.slots, ids.reshape(-1)[lay.take])
    real_pairs = (mask[:, :-1] * mask[:, 1:]).reshape(-1).nonzero().view(-1)   # logp columns of real targets
    assert sorted(lay.dst.tolist()) == real_pairs.tolist()
    row, col = lay.dst // (W - 1), lay.dst % (W - 1)
    assert torch.equal(grid[lay.src], ids[row, col]) and torch.equal(grid[lay.src + 1], ids[row, col + 1])
    assert sorted(lay.take.tolist()) == mask.reshape(-1).nonzero().view(-1).tolist()


def test_the_forward_runs_the_real_tokens():
    """flash-attn's one sequence: exactly the real tokens. Bins: at least those, at most the padded
    rows'. A MicroBatch counts both."""
    lengths = LENGTHS
    P, R = 7, 6
    real, padded = sum(p + r for p, r in lengths), len(lengths) * (P + R)
    assert logprobs.PackLayout.of(lengths, P, P + R, "cpu").shape == (1, real)
    bins = logprobs.PackLayout.of(lengths, P, P + R, "cpu", max(p + r for p, r in lengths)).shape
    assert bins[1] == 13 and real <= bins[0] * bins[1] <= padded
    packed = padded_rows(lengths, 100)
    mb = packed.micro_batch(list(range(len(lengths))), pack=True)
    assert (mb.real_tokens, mb.padded_tokens, mb.tokens) == (real, padded, real) == (52, 91, 52)
    assert packed.micro_batch([0, 1]).tokens == 2 * (7 + 5)


def test_the_plan_counts_real_tokens_against_micro_tokens():
    """Packed, a micro-batch holds rows up to --micro-tokens REAL tokens (a longer row alone):
    more rows each, fewer micro-batches than padded under the same cap."""
    g = torch.Generator().manual_seed(0)
    lengths = [(int(p), int(r)) for p, r in zip(torch.randint(1, 200, (64,), generator=g),
                                                 torch.randint(1, 300, (64,), generator=g))]
    for cap in (300, 1000, 4096):
        packed = batching.microbatch_plan(lengths, 16, cap, packed=True)
        padded = batching.microbatch_plan(lengths, 16, cap)
        assert sorted(i for mb in packed for i in mb) == list(range(64))
        for mb in packed:
            assert len(mb) <= 16 and (len(mb) == 1 or sum(sum(lengths[i]) for i in mb) <= cap)
            # full: the next row would not have fitted (rows go longest first)
        assert len(packed) <= len(padded)
    assert len(batching.microbatch_plan(lengths, 64, 4096, packed=True)) < len(batching.microbatch_plan(lengths, 64, 4096))
    with pytest.raises(ValueError):
        batching.microbatch_plan(lengths, 16, 1000, group=4, packed=True)


@pytest.mark.parametrize("pack, share, fsdp, packs", [(True, False, False, True), (True, True, True, True),
                                                      (True, True, False, False), (False, False, False, False)])
def test_micro_batches_pack_the_full_row_path_only(pack, share, fsdp, packs):
    """scale_step.micro_batches: --pack applies where the forward runs full rows (prompts not
    shared: --share-prompts false, or --fsdp), and the trimmed rows carry it to score_tokens."""
    lengths = [(5, 40), (6, 10), (5, 12), (6, 30), (2, 3), (2, 9), (3, 3), (3, 1)]
    packed = padded_rows(lengths, 100)
    args = SimpleNamespace(pack=pack, share_prompts=share, fsdp=fsdp, grad_ckpt=False, group_size=2,
                           micro_batch=8, micro_tokens=60)
    mbs = scale_step.micro_batches(args, packed, range(8))
    assert sorted(i for mb in mbs for i in mb.rows.tolist()) == list(range(8))
    assert all(mb.pack == packs and packed.trimmed(mb)[0].pack == packs for mb in mbs)
    if packs:        # totals 45 16 17 36 5 11 6 4, longest first, <= 60 real tokens (padded: 4 micro-batches)
        assert [mb.rows.tolist() for mb in mbs] == [[0], [3, 2], [1, 5, 6, 4, 7]]
        assert [mb.real_tokens for mb in mbs] == [45, 53, 42] and all(mb.tokens == mb.real_tokens for mb in mbs)
