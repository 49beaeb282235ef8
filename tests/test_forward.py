"""The training forward's numerics (issue #32): padding rows that cannot NaN (every query row of
the mask SDPA receives has a key), the attention kernel chosen by the run's compute dtype for
the policy and the reference alike, log-probs from a float32 lm_head fused with the chunked
log-softmax (no (B, L, V) tensor, gradients to the hidden states and the weight), and the
entropy's gradient."""

import sys
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sampler import kv_cache
from modeling import logprobs
from modeling import models
from rl import query_reference
from tests.rounding import assert_rounding

V = 96


def tiny_model(attn=models.SDPA, tied=True, dtype=torch.float32, seed=0, head_scale=1.0, vocab=V):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      max_position_embeddings=128, initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model


def padded_batch(lengths, width, seed=0):
    """Left-padded rows (pad id 0) of the given real lengths: most of the batch is padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(2, V, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@contextmanager
def sdpa_masks():
    """Every attn_mask handed to torch's scaled_dot_product_attention while inside."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask, *a, **kw)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
        yield seen


def empty_rows(masks) -> int:
    return sum(int((~m.any(-1)).sum()) for m in masks if m is not None and m.dtype == torch.bool)


# ----------------------------------------------------------------------------------------------
# Item 2: padding that cannot NaN


def forwards_that_run_sdpa(model, ids, mask):
    """The training forward (and its shared-prompt pass), the query cache, the sampler's prefills
    (the chunked loop's and the one pass's admission into slots)."""
    G = 2
    packed = logprobs.Packed(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0),
                             mask[:, 1:].repeat_interleave(G, 0), ids.shape[1] - 3)
    with torch.no_grad():
        yield "token_logprobs", lambda: logprobs.token_logprobs(model, ids, mask)
        yield "shared prompts", lambda: logprobs.score_tokens(model, packed, 1.0, group=G)
        prompts = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
        yield "query cache", lambda: query_reference.build(model, prompts, 0, 1.0, "cpu")
        yield "prefill", lambda: kv_cache.prefill(model, prompts, 0, 4)
        slots = list(range(len(prompts)))
        yield "admit", lambda: kv_cache.admit(model, kv_cache.slot_cache(model, len(slots), 16), prompts, slots, 0)


@pytest.mark.parametrize("bf16", [False, True])
def test_every_query_row_of_every_sdpa_mask_has_a_key_on_a_mostly_padding_batch(bf16):
    """torch 2.13's CPU SDPA gives finite values on an empty row (GPU kernels may give NaN), so
    the mask is checked, not the output: with the pad-safe attention no row of any mask is
    empty, in each forward that runs SDPA; with transformers' plain "sdpa" the same batch has
    empty rows (the check can fail)."""
    ids, mask = padded_batch([2, 1, 12, 3], 12)
    attn = models.attention_for("cpu", torch.float32, bf16).implementation
    assert attn == (models.SDPA_FLOAT32 if bf16 else models.SDPA)
    safe, plain = tiny_model(attn), tiny_model("sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for name, run in forwards_that_run_sdpa(safe, ids, mask):
            with sdpa_masks() as seen:
                run()
            assert any(m is not None for m in seen), name
            assert empty_rows(seen) == 0, name
    with sdpa_masks() as seen:
        with torch.no_grad():
            logprobs.token_logprobs(plain, ids, mask)
    assert empty_rows(seen) > 0


def test_real_rows_are_bit_for_bit_what_they_were():
    """The fix changes only rows that attended to nothing: real tokens' logits, log-probs and
    gradients are identical with and without it (float32 on a CPU)."""
    ids, mask = padded_batch([5, 1, 9, 3], 9, seed=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    safe, plain = tiny_model(models.SDPA), tiny_model("sdpa")
    real = mask.bool()
    a = safe(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    b = plain(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(a[real], b[real])
    scored = (mask[:, :-1] * mask[:, 1:]).bool()     # a real token after a real one (Packed.prompt_tok_mask)
    grads = []
    for model in (safe, plain):
        logp, _ = logprobs.token_logprobs(model, ids, mask)
        (logp * scored).sum().backward()
        grads.append((logp.detach()[scored], [p.grad for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(x, y) for x, y in zip(grads[0][1], grads[1][1]))


def test_a_pad_query_attends_to_its_own_position_under_a_cache_offset():
    """With a KV cache the queries sit after the cached positions (q_offset): an empty row gets
    the key at its own absolute position, never an unwritten or foreign one."""
    attention_mask = torch.tensor([[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]]).bool()
    m = models._padsafe_sdpa_mask(batch_size=2, q_length=2, kv_length=6, q_offset=4, kv_offset=0,
                                  attention_mask=attention_mask, allow_is_causal_skip=False)
    assert m.shape == (2, 1, 2, 6) and m.any(-1).all()
    assert m[0, 0, 0].tolist() == [False, False, False, False, True, False]     # query 4: key 4
    assert m[0, 0, 1].tolist() == [False] * 5 + [True]                          # a real row, as it was
    assert m[1, 0, 1].all() and not m[1, 0, 0, 5]                               # causal rows unchanged


# ----------------------------------------------------------------------------------------------
# Item 4: the attention kernel follows the compute dtype, for the policy and the reference


@pytest.mark.parametrize("installed", [True, False])
def test_attention_follows_the_compute_dtype(monkeypatch, installed):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", object() if installed else None)   # None: ImportError
    bf16_run = models.FLASH if installed else models.SDPA
    policy = models.attention_for("auto", torch.float32, bf16=True)     # float32 master weights, bf16 compute
    reference = models.attention_for("cuda", torch.bfloat16, bf16=True)
    assert policy == reference and policy.implementation == bf16_run
    assert models.attention_for("cuda", torch.bfloat16).implementation == bf16_run   # --dtype bfloat16
    assert models.attention_for("cuda", torch.float32).implementation == models.SDPA  # --dtype float32
    assert ("not installed" in policy.description) != installed and "\n" not in policy.description
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.attention_for("auto", torch.float32, bf16=True).implementation == models.SDPA_FLOAT32
    assert models.attention_for("auto", torch.float32).implementation == models.SDPA


def test_load_for_training_hands_the_loader_the_choice_outside_autocast(monkeypatch):
    """train.py loads both models outside autocast: the choice comes from (device, dtype, bf16),
    so the float32-master policy gets flash-attn exactly when its bf16 reference does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", object())
    got = []
    monkeypatch.setattr(models, "load_policy", lambda path, **kw: got.append(kw["attn_implementation"]))
    assert not torch.is_autocast_enabled("cuda")
    models.load_for_training(models.TINY_WORLD, "cuda", torch.float32, bf16=True)      # the policy
    models.load_for_training(models.TINY_WORLD, "cuda", torch.bfloat16, bf16=True)     # its reference
    models.load_for_training(models.TINY_WORLD, "cuda", torch.float32, bf16=False)
    models.load_for_training(models.TINY_WORLD, "cpu", torch.float32, bf16=True)
    assert got == [models.FLASH, models.FLASH, models.SDPA, models.SDPA_FLOAT32]


# ----------------------------------------------------------------------------------------------
# Item 7: log-probs from a float32 lm_head, fused with the chunked log-softmax


def hidden_and_weight(model, ids, mask):
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    head = logprobs.plain_head(model)
    with torch.no_grad(), logprobs.hidden_states_out(head):
        h = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return h, head.weight


def float64_logprobs(h, w, targets, T):
    z = (h.double() @ w.double().t())[:, :targets.shape[1]] / T
    return z.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logprobs_match_float64_and_beat_bf16_logits(dtype):
    """Logits at |z| ~ 16-32 (lm_head scaled up): the fused float32 product matches a float64
    reference of the same hidden states and weights to float32 rounding (a measured tolerance, ~1e-5),
    for float32 and for bf16 weights; the model's own bf16 logits miss it by rounding (~0.03-0.06 nat)."""
    model = tiny_model(tied=False, dtype=dtype, head_scale=5.0)
    ids, mask = padded_batch([16] * 4, 16, seed=2)
    T = 0.9
    h, w = hidden_and_weight(model, ids, mask)
    assert 16 <= (h.double() @ w.double().t()).abs().max() <= 64
    ref = float64_logprobs(h, w, ids[:, 1:], T)
    with torch.no_grad():
        fused, _ = logprobs.token_logprobs(model, ids, mask, T, chunk_elems=V * 4 * 5)
        own = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / T
    fused_err = (fused.double() - ref).abs().max().item()
    own_err = (own.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1).double() - ref).abs().max().item()
    assert fused.dtype == torch.float32
    assert_rounding(f"forward.fused_vs_float64.{str(dtype)[6:]}", fused, ref)
    if dtype == torch.bfloat16:
        assert own_err > 1e-2 and own_err > 100 * fused_err


def plain_formula(model, ids, mask, T):
    """log p and entropy from the model's own logits, in float32 autograd."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float() / T
    lp = z.log_softmax(-1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("tied", [True, False])
def test_fused_gradients_match_autograd_of_the_plain_formula(tied):
    """Several position chunks in forward and vocabulary slices in backward (a tiny chunk_elems):
    log-probs, entropies and every parameter's gradient (lm_head's, tied to the embedding or
    not) equal autograd's through the plain formula; the entropy's gradient too (entropy_grad)."""
    model = tiny_model(tied=tied, seed=3).train()
    ids, mask = padded_batch([9, 4, 9], 9, seed=3)
    T = 0.7
    wl, we = torch.randn(3, 8), torch.randn(3, 8)

    def grads(f):
        model.zero_grad()
        logp, ent = f()
        ((logp * wl + ent * we) * mask[:, 1:]).sum().backward()
        return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = grads(lambda: plain_formula(model, ids, mask, T))
    got = grads(lambda: logprobs.token_logprobs(model, ids, mask, T, with_entropy=True, entropy_grad=True,
                                                chunk_elems=V * 3 * 2))
    assert_rounding("forward.fused_vs_plain.logp", got[0], ref[0])
    assert_rounding("forward.fused_vs_plain.entropy", got[1], ref[1])
    for n in ref[2]:
        assert_rounding(f"forward.fused_vs_plain.grad.{n}", got[2][n], ref[2][n])
    _, ent = logprobs.token_logprobs(model, ids, mask, T, with_entropy=True)
    assert not ent.requires_grad                                        # no gradient asked: none kept


def test_entropy_gradient_from_logits_and_through_shared_prompts():
    """A model whose head is not plain lm_head(h) keeps its own logits (weight None): the same
    log-probs, entropies and gradients; and a group's shared prompt pass gives the full rows'."""
    T = 1.3
    logits = torch.randn(2, 7, V, dtype=torch.float64).mul(4).float().requires_grad_()
    targets = torch.randint(0, V, (2, 6))
    wl, we = torch.randn(2, 6), torch.randn(2, 6)
    logp, ent = logprobs._TokenLogprob.apply(logits, None, targets, T, V * 2, True, True)
    (logp * wl + ent * we).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    lp = (logits[:, :6] / T).log_softmax(-1)
    ((lp.gather(-1, targets[..., None]).squeeze(-1) * wl) - ((lp.exp() * lp).sum(-1) * we)).sum().backward()
    assert_rounding("forward.logits_head_vs_autograd.grad", got, logits.grad)

    model = tiny_model(seed=4).train()
    ids, mask = padded_batch([3, 5], 5, seed=4)
    G = 3
    resp = torch.randint(2, V, (2 * G, 4))
    packed = logprobs.Packed(torch.cat([ids.repeat_interleave(G, 0), resp], 1),
                             torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(resp)], 1),
                             mask[:, 1:].repeat_interleave(G, 0), 5)
    w = torch.randn(2 * G, 4)

    def run(group):
        model.zero_grad()
        s = logprobs.score_tokens(model, packed, T, with_entropy=True, group=group, entropy_grad=True)
        ((s.response + s.entropy) * w).sum().backward()
        return s.entropy.detach(), [p.grad.clone() for p in model.parameters()]
    (a, ga), (b, gb) = run(G), run(1)
    assert_rounding("forward.shared_prompt_pass.entropy", a, b)
    for n, x, y in zip([n for n, _ in model.named_parameters()], ga, gb):
        assert_rounding(f"forward.shared_prompt_pass.grad.{n}", x, y)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates while inside, and of any float32 one."""

    def __init__(self):
        super().__init__()
        self.most = self.most_float32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
                if t.dtype == torch.float32:
                    self.most_float32 = max(self.most_float32, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits_is_ever_made():
    """Forward and backward of the scoring make nothing of (B, L, V) size: the logits exist only
    as blocks of chunk_elems elements (the model's own logits would be B L V)."""
    vocab = 1024
    model = tiny_model(tied=False, seed=5, vocab=vocab).train()
    ids, mask = padded_batch([40] * 6, 40, seed=5)
    B, L = ids.shape
    elems = B * 5 * vocab
    with LargestTensor() as seen:
        logp, ent = logprobs.token_logprobs(model, ids, mask, 1.0, True, chunk_elems=elems, entropy_grad=True)
        (logp.sum() + ent.sum()).backward()
    assert seen.most <= max(elems, vocab * model.config.hidden_size) < B * L * vocab // 4
    with LargestTensor() as seen:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert seen.most >= B * L * vocab                                    # (the check can fail)


def test_bf16_operands_give_a_float32_product_on_tensor_cores():
    """What a GPU runs, on fake tensors (no CUDA here): bf16 hidden states and weight go into one
    GEMM with a float32 output (torch.mm out_dtype), forward and backward, no float32 weight copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(V, 32, dtype=torch.bfloat16, requires_grad=True)
        gemm = logprobs._Gemm.of(h, w)
        assert gemm.dtype == torch.bfloat16
        with LargestTensor() as seen:
            logp, ent = logprobs._TokenLogprob.apply(h, w, torch.zeros(2, 8, dtype=torch.long), 1.0, 2 ** 26,
                                                     True, True)
            (logp.sum() + ent.sum()).backward()
        assert logp.dtype == ent.dtype == torch.float32
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and w.grad.shape == w.shape
        with torch.autocast("cpu", dtype=torch.bfloat16):                # float32 master weights under autocast
            assert logprobs._Gemm.of(h.float(), w.float()).dtype == torch.bfloat16
    assert logprobs._Gemm.of(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.float32
    assert seen.most_float32 <= 2 * 9 * V < V * 32                    # logit blocks; no float32 weight
