"""Tests for rollout.py: sampler parity, logprob consistency, per-row seeds, the sampling
distribution, EOS handling and the load_policy tokenizer round trip. All on a tiny random Qwen2."""

import math

import pytest
import torch

from sampler import kv_cache
from modeling import logprobs
from modeling import models
import rollout as R
from tests.rounding import assert_rounding

V = 64


def tiny_model(seed=0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    # initializer_range 0.3 (not 0.02) so the random model's next-token distributions are far from
    # "repeat the last token" and greedy outputs actually depend on positions and padding.
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=128, initializer_range=0.3)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP spin-waits
    # make every small op ~30x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model()


def prompts_of_lengths(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of_lengths([3, 7, 1, 5, 2, 6])


def test_greedy_kv_matches_hf_and_unpadded(model):
    kw = dict(max_new_tokens=12, eos_ids=[1], pad_id=0, temperature=0)
    kv = R.sample(model, PROMPTS, sampler="kv", **kw)
    hf = R.sample(model, PROMPTS, sampler="hf", **kw)
    assert torch.equal(kv.response_ids, hf.response_ids)
    assert torch.equal(kv.response_mask, hf.response_mask)
    assert torch.equal(kv.finished, hf.finished)
    assert_rounding("rollout.greedy_kv_vs_hf_logprobs", kv.logprobs, hf.logprobs)
    # Left padding must not change anything: each prompt decoded alone (no padding) agrees.
    for i, p in enumerate(PROMPTS):
        one = R.sample(model, [p], sampler="kv", **kw)
        n = int(one.lengths[0])
        assert one.response_ids[0, :n].tolist() == kv.response_ids[i, :n].tolist()
    # Greedy outputs are not trivial (guards against a degenerate model making parity vacuous).
    assert len({tuple(r) for r in kv.response_ids.tolist()}) == len(PROMPTS)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_sampled_logprobs_match_recomputed(model, temperature, top_p):
    ro = R.sample(model, PROMPTS * 2, max_new_tokens=10, eos_ids=[1], pad_id=0,
                  temperature=temperature, top_p=top_p, seeds=list(range(12)))
    packed = ro.packed()
    ids, mask, P = packed.input_ids, packed.attention_mask, packed.P
    resp_logp = logprobs.score_tokens(model, packed, temperature).response * ro.response_mask
    assert ro.logprobs.dtype == torch.float32
    assert_rounding("rollout.sampled_vs_recomputed_logprobs", ro.logprobs, resp_logp)
    assert (ro.logprobs[ro.response_mask == 0] == 0).all()
    # The test can fail: log-probs at another temperature differ by far more than the tolerance.
    other, _ = logprobs.token_logprobs(model, ids, mask, temperature=temperature + 0.3)
    assert (ro.logprobs - other[:, P - 1 :] * ro.response_mask).abs().max() > 1e-2


def test_token_logprobs_values_entropy_and_grad(model):
    ids = torch.randint(2, V, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in row 0
    ids[0, :4] = 0
    T = 0.8
    # Reference: full log_softmax on the whole (B, L, V) float32 tensor.
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float() / T
    ref_all = logits.log_softmax(-1)
    ref = ref_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    (ref * mask[:, 1:]).sum().backward()
    ref_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # Ours, with a tiny chunk so several chunks are used in forward and backward.
    logp, ent = logprobs.token_logprobs(model, ids, mask, temperature=T, with_entropy=True, chunk_elems=V * 3 * 2)
    assert_rounding("rollout.token_logprobs_vs_log_softmax", logp, ref)
    assert_rounding("rollout.token_entropy_vs_log_softmax", ent, ref_ent)
    assert not ent.requires_grad
    (logp * mask[:, 1:]).sum().backward()
    for (n, p), g in zip(model.named_parameters(), ref_grad):
        assert_rounding(f"rollout.token_logprobs_grad.{n}", p.grad, g)
    model.zero_grad()


def test_per_row_seeds_independent_of_batch(model):
    kw = dict(max_new_tokens=10, eos_ids=[1], pad_id=0, temperature=1.0, top_p=0.9)
    seeds = [11, 12, 13, 14, 15, 2**40 + 7]
    whole = R.sample(model, PROMPTS, seeds=seeds, **kw)

    def rows(ro):
        return [ro.response_ids[i, : ro.lengths[i]].tolist() for i in range(len(ro.lengths))]

    ref = rows(whole)
    assert rows(R.sample(model, PROMPTS, seeds=seeds, batch_size=2, **kw)) == ref
    assert rows(R.sample(model, PROMPTS[::-1], seeds=seeds[::-1], **kw)) == ref[::-1]
    extra = prompts_of_lengths([9, 4], seed=5)
    mixed = R.sample(model, extra[:1] + PROMPTS + extra[1:], seeds=[99] + seeds + [98], **kw)
    assert rows(mixed)[1:-1] == ref
    # The "hf" sampler with seeds draws the very same tokens.
    assert rows(R.sample(model, PROMPTS, seeds=seeds, sampler="hf", **kw)) == ref
    # ... and the seed matters: other seeds (or the same prompt with 2 seeds) give other samples.
    assert rows(R.sample(model, PROMPTS, seeds=[s + 100 for s in seeds], **kw)) != ref
    two = rows(R.sample(model, [PROMPTS[1]] * 2, seeds=[1, 2], **kw))
    assert two[0] != two[1]


def test_repeated_prompts_are_prefilled_once_and_sample_alike(model, monkeypatch):
    """A group's G rows repeat its prompt: the sampler prefills each distinct prompt once and copies
    its cache rows. Each row must still draw what it draws alone (batch_size=1: nothing shared)."""
    kw = dict(max_new_tokens=10, eos_ids=[1], pad_id=0, temperature=1.0, top_p=1.0)
    prompts = [p for p in PROMPTS[:3] for _ in range(4)]
    seeds = list(range(100, 112))
    widths = []
    forward = type(model).forward

    def spy(self, *a, **k):
        widths.append(tuple(k["input_ids"].shape))
        return forward(self, *a, **k)

    monkeypatch.setattr(type(model), "forward", spy)
    shared = R.sample(model, prompts, seeds=seeds, **kw)
    assert widths[0] == (3, 7)                      # the prefill: 3 distinct prompts, not 12
    monkeypatch.setattr(type(model), "forward", forward)
    alone = R.sample(model, prompts, seeds=seeds, batch_size=1, **kw)
    assert torch.equal(shared.response_ids, alone.response_ids)
    assert_rounding("rollout.shared_prefill_vs_alone_logprobs", shared.logprobs, alone.logprobs)
    assert len({tuple(r.tolist()) for r in shared.response_ids[:4]}) > 1  # the copies sample apart


def _chi2(counts, probs):
    n = counts.sum()
    exp = n * probs
    big = exp >= 5  # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = ex > 0
    stat = ((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def _chi2_ok(stat, df):
    return stat < df + 5 * math.sqrt(2 * df)  # ~ p < 1e-4 for these dfs


@pytest.mark.parametrize("seeded", [True, False])
def test_one_step_distribution_matches_softmax(model, seeded):
    prompt, T, N = PROMPTS[1], 0.7, 6000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = (logits / T).softmax(-1)
    torch.manual_seed(123)
    ro = R.sample(model, [prompt] * N, max_new_tokens=1, eos_ids=[1], pad_id=0, temperature=T,
                  seeds=list(range(N)) if seeded else None)
    counts = torch.bincount(ro.response_ids[:, 0], minlength=V).float()
    stat, df = _chi2(counts, probs)
    assert _chi2_ok(stat, df), (stat, df)
    # Power check: the same counts are clearly rejected against the T=1 distribution.
    stat_wrong, df_wrong = _chi2(counts, logits.softmax(-1))
    assert not _chi2_ok(stat_wrong, df_wrong), (stat_wrong, df_wrong)


def test_top_p_restricts_to_nucleus(model):
    prompt, T, top_p, N = PROMPTS[3], 1.0, 0.6, 4000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = (logits / T).softmax(-1)
    sp, si = probs.sort(descending=True)
    k = int(((sp.cumsum(0) - sp) < top_p).sum())  # nucleus size
    assert k >= 3, "test prompt should have a non-trivial nucleus"
    nucleus = torch.zeros(V, dtype=torch.bool)
    nucleus[si[:k]] = True
    ro = R.sample(model, [prompt] * N, max_new_tokens=1, eos_ids=[1], pad_id=0, temperature=T,
                  top_p=top_p, seeds=list(range(N)))
    counts = torch.bincount(ro.response_ids[:, 0], minlength=V).float()
    assert counts[~nucleus].sum() == 0  # support is exactly inside the nucleus
    assert (counts[nucleus] > 0).all()
    renorm = torch.where(nucleus, probs, torch.zeros_like(probs))
    stat, df = _chi2(counts, renorm / renorm.sum())
    assert _chi2_ok(stat, df), (stat, df)
    # Reported log-probs are NOT renormalised over the nucleus (what training recomputes).
    assert_rounding("rollout.nucleus_logprobs_vs_full_softmax", ro.logprobs[:, 0], probs.log()[ro.response_ids[:, 0]])


@pytest.mark.parametrize("sampler", ["kv", "hf"])
def test_eos_masking_finished_and_truncation(model, sampler):
    prompts = PROMPTS + prompts_of_lengths([4, 4], seed=9)
    seeds, M = list(range(40, 48)), 12
    kw = dict(max_new_tokens=M, pad_id=0, temperature=1.0, seeds=seeds, sampler=sampler)
    free = R.sample(model, prompts, eos_ids=[], **kw)  # no EOS: every row runs to M tokens
    assert free.response_ids.shape == (8, M) and (free.lengths == M).all() and not free.finished.any()
    # Two EOS ids taken from the free run, so several rows stop early at different steps.
    eos = [free.response_ids[0, 2].item(), free.response_ids[1, 1].item()]
    ro = R.sample(model, prompts, eos_ids=eos, **kw)
    assert ro.response_ids.shape[1] <= M
    for i in range(8):
        full = free.response_ids[i].tolist()
        hits = [t for t, x in enumerate(full) if x in eos]
        n = hits[0] + 1 if hits else M  # length includes the EOS token itself
        assert ro.lengths[i] == n
        assert bool(ro.finished[i]) == bool(hits)
        assert ro.response_ids[i, :n].tolist() == full[:n]  # same seeds -> same prefix
        assert (ro.response_ids[i, n:] == 0).all() and (ro.response_mask[i, n:] == 0).all()
        assert (ro.response_mask[i, :n] == 1).all() and (ro.logprobs[i, n:] == 0).all()
        assert_rounding("rollout.eos_vs_free_logprobs", ro.logprobs[i, :n], free.logprobs[i, :n])
    assert ro.finished.sum() >= 2 and (~ro.finished).sum() >= 1


def test_load_policy_roundtrip_keeps_custom_tokenizer(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    # Spaces are tokens and digits are split one by one: Qwen2Tokenizer's own pre-tokenizer would
    # drop the spaces (the transformers-5 pitfall this guards against).
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", " ", *"0123456789", "+", "="])}
    tk = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="isolated"), pre_tokenizers.Digits(individual_digits=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    text = "12 + 34 = 46"
    before = tok(text, add_special_tokens=False)["input_ids"]
    assert before == [vocab[c] for c in "12 + 34 = 46"]

    m = tiny_model()
    m.generation_config.eos_token_id = [7, 1]
    m.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2, tok2 = models.load_policy(tmp_path)
    assert tok2(text, add_special_tokens=False)["input_ids"] == before
    assert tok2.padding_side == "left" and tok2.pad_token_id == tok2.eos_token_id == 1
    assert R.eos_token_ids(m2, tok2) == [7, 1]
    assert next(m2.parameters()).dtype == torch.float32
    x = torch.tensor([before])
    with torch.no_grad():
        torch.testing.assert_close(m2(input_ids=x).logits, m(input_ids=x).logits)


def test_bad_input_raises(model):
    with pytest.raises(ValueError):
        R.sample(model, [[3, 4]], max_new_tokens=2, eos_ids=[1], pad_id=0, seeds=[1, 2])
    with pytest.raises(ValueError):
        R.sample(model, [[3, 4]], max_new_tokens=2, eos_ids=[1], pad_id=0, sampler="vllm")
    with pytest.raises(ValueError):
        logprobs.token_logprobs(model, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4), temperature=0)


def _arch_model(arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    cfg = {"qwen2": lambda: Qwen2Config(**kw, tie_word_embeddings=True),
           "llama": lambda: LlamaConfig(**kw, attention_bias=True, mlp_bias=True, rope_parameters={
               "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
           "qwen3": lambda: Qwen3Config(**kw, head_dim=8)}[arch]()
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


KEEP = torch.tensor([0, 2, 3, 5])  # the rows decoding on after a compaction


def _fed_tokens(n=6, seed=4):
    """(n, rows) tokens fed to both decoding paths, so they compute the same logits (no greedy ties)."""
    return torch.randint(2, V, (n, len(PROMPTS)), generator=torch.Generator().manual_seed(seed))


def _lean_steps(model, tokens, drop_at=3):
    """PROMPTS into the slots of a slot cache (kv_cache.admit), then decode.LeanStep fed `tokens`,
    slots dropped midway (compaction). -> each step's (rows, V) logits, the prefill's first."""
    from sampler import decode

    with torch.no_grad():
        cache = kv_cache.slot_cache(model, len(PROMPTS), max(map(len, PROMPTS)) + len(tokens))
        logits = [kv_cache.admit(model, cache, PROMPTS, list(range(len(PROMPTS))), 0)]
        step, pos = decode.LeanStep(model, cache), torch.tensor([len(p) for p in PROMPTS])
        for t, tok in enumerate(tokens):
            if t == drop_at:
                step.select(KEEP)
                pos = pos[KEEP]
            logits.append(step(tok[KEEP] if t >= drop_at else tok, pos, int(pos.max()) + 1))
            pos = pos + 1
    return logits


def _hf_steps(model, tokens, drop_at=3):
    """The reference of _lean_steps: left-padded prompts through the HF forward (kv_cache.prefill),
    then decode.HFStep, the HF forward per token."""
    with torch.no_grad():
        pre = kv_cache.prefill(model, PROMPTS, 0, len(tokens))
        logits, step, pos = [pre.logits], pre.step, pre.pos[:, -1] + 1
        for t, tok in enumerate(tokens):
            if t == drop_at:
                step.select(KEEP)
                pos = pos[KEEP]
            logits.append(step(tok[KEEP] if t >= drop_at else tok, pos))
            pos = pos + 1
    return logits


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lean_decode_step_matches_the_hf_forward(arch):
    from sampler import decode

    model = _arch_model(arch)
    assert decode.supports(model)
    tokens = _fed_tokens()
    lean, hf = _lean_steps(model, tokens), _hf_steps(model, tokens)
    assert len(lean) == len(hf) == len(tokens) + 1 and lean[-1].shape == (len(KEEP), V)
    for a, b in zip(lean, hf):  # same math; float32 rounding differs (fused matmuls, unpadded slots)
        assert_rounding(f"rollout.lean_decode_vs_hf_logits.{arch}", a, b)
    assert (lean[1] - lean[2]).abs().max() > 0.1  # the fed tokens matter (the test can fail)


def test_lean_decode_under_bf16_autocast():
    """--dtype bf16-mixed on CPU: LeanStep casts its fused weight copies once (not per token) and
    attends in float32 (the cache's dtype on a CPU); its logits stay close to the HF forward's under
    the same autocast."""
    from sampler import decode

    model, tokens = _arch_model("qwen2"), _fed_tokens()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lean, hf = _lean_steps(model, tokens), _hf_steps(model, tokens)
        step = decode.LeanStep(model, kv_cache.slot_cache(model, 1, 8))
    assert step.layers[0].qkv.parts[0][0].dtype == torch.bfloat16
    assert step.cache.layers[0].k_buf.dtype == torch.float32
    for a, b in zip(lean, hf):
        assert (a - b).abs().max() < 0.05 * b.abs().max()       # bf16: ~3 significant digits


def _bf16_scores(q, K, V, mask, scale):
    """decode._attend before #32: scores and softmax in the cache's dtype (bf16), autocast off."""
    S, Hkv, g, D = q.shape
    W = K.shape[2]
    bias = torch.zeros(mask.shape, dtype=K.dtype).masked_fill_(~mask, float("-inf"))
    bias = bias[:, None, None].expand(-1, Hkv, 1, -1).reshape(S * Hkv, 1, W)
    p = torch.baddbmm(bias, q.reshape(S * Hkv, g, D).to(K.dtype), K.reshape(S * Hkv, W, D).transpose(1, 2),
                      alpha=scale).softmax(-1)
    return torch.bmm(p, V.reshape(S * Hkv, W, D)).view(S, Hkv, g, D)


def _reference_attention(q, K, V, mask, scale):
    """float64 attention of (S, Hkv, g, D) queries against (S, Hkv, W, D) keys/values, mask (S, W)."""
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))[:, None, None]
    return ((q.double() @ K.double().transpose(-1, -2)) * scale + bias).softmax(-1) @ V.double()


def test_decode_attention_scores_are_float32_on_a_bf16_cache():
    """Synthetic heads (scores of a few units, 1,024 columns, slots of different lengths): against a
    float64 reference on the same bf16 inputs, LeanStep's attention errs less than the bf16-score
    math it replaced (measured ~4-8x less) and within a few bf16 roundings of its output."""
    from sampler import decode

    g = torch.Generator().manual_seed(0)
    S, Hkv, G, D, W = 6, 2, 4, 64, 1024
    q, K, Vv = (torch.randn(S, Hkv, n, D, generator=g) for n in (G, W, W))
    q, K, Vv = (q * 3).bfloat16(), K.bfloat16(), Vv.bfloat16()
    mask = torch.arange(W)[None, :] < torch.tensor([W, 900, 513, 200, 64, 1])[:, None]
    ref = _reference_attention(q, K, Vv, mask, D ** -0.5)
    new = (decode._attend(q, K, Vv, mask, D ** -0.5).double() - ref).abs()
    old = (_bf16_scores(q, K, Vv, mask, D ** -0.5).double() - ref).abs()
    assert new.mean() < old.mean() / 2.5 and new.max() < old.max()
    assert new.max() <= 4 * 2.0 ** -8 * ref.abs().max()  # the bf16 output's rounding, a few times over


def test_lean_decode_on_bf16_weights_is_closer_to_the_hf_forward(monkeypatch):
    """bf16 weights (a bf16 cache): LeanStep's logits against the HF forward's (SDPA, float32
    scores) and a float64 reference: no farther from the reference than the HF forward's bf16
    logits are (x1.5), and closer than with the bf16-score attention it replaced."""
    import copy

    from sampler import decode

    model, tokens = _arch_model("qwen2"), _fed_tokens()
    ref = _hf_steps(copy.deepcopy(model).double(), tokens)
    bf = copy.deepcopy(model).to(torch.bfloat16)
    hf, lean = _hf_steps(bf, tokens), _lean_steps(bf, tokens)
    monkeypatch.setattr(decode, "_attend", _bf16_scores)
    before = _lean_steps(bf, tokens)

    def err(xs):
        return torch.stack([(a.double() - r).abs().mean() for a, r in zip(xs, ref)]).mean().item()

    print(f"mean |logit - float64|: HF bf16 {err(hf):.4g}, LeanStep {err(lean):.4g}, before {err(before):.4g}")
    assert err(lean) <= 1.5 * err(hf) and err(lean) < err(before)


def test_models_lean_step_does_not_implement_decode_in_chunks(monkeypatch):
    """q/k norms (Qwen3) are not what LeanStep computes: the sampler decodes such a model in
    chunks through the HF forward (decode.HFStep), never through the one pass, with HF generate's tokens."""
    from sampler import decode
    from sampler import kv_cache

    model = _arch_model("qwen3")
    assert not decode.supports(model) and not kv_cache.supports(model, lockstep=False)
    assert kv_cache.supports(_arch_model("qwen2"), lockstep=False) and not kv_cache.supports(_arch_model("qwen2"), True)
    monkeypatch.setattr(kv_cache, "decode_pass", lambda *a, **k: pytest.fail("one pass on an unsupported model"))
    kw = dict(max_new_tokens=8, eos_ids=[1], pad_id=0, temperature=1.0, seeds=list(range(6)))
    kv, hf = R.sample(model, PROMPTS, batch_size=4, **kw), R.sample(model, PROMPTS, sampler="hf", **kw)
    assert torch.equal(kv.response_ids, hf.response_ids) and torch.equal(kv.response_mask, hf.response_mask)


def test_a_group_scores_its_prompt_once_with_the_same_values_and_gradients():
    """shared_prompt_scores (each prompt once, its KV cache copied to the group's G rows) against
    the plain forward over every full row: log-probs, entropies and parameter gradients agree."""
    model = tiny_model(3)
    G, prompts = 3, prompts_of_lengths([4, 7, 2], seed=7)
    ro = R.sample(model, [p for p in prompts for _ in range(G)], max_new_tokens=6, eos_ids=[1], pad_id=0,
                  temperature=1.0, seeds=list(range(9)))
    packed = ro.packed()
    assert logprobs.shares_prompts(packed, G) and not logprobs.shares_prompts(packed, 2)
    w = torch.randn(packed.input_ids.shape[0], packed.input_ids.shape[1] - 1)

    def run(group):
        model.zero_grad()
        s = logprobs.score_tokens(model, packed, 0.8, with_entropy=True, group=group)
        m = ro.response_mask.float()
        ((s.response * m * w[:, packed.P - 1:]).sum() + (s.prompt * packed.prompt_tok_mask * w[:, :packed.P - 1]).sum()).backward()
        return s, {n: p.grad.clone() for n, p in model.named_parameters()}

    (a, ga), (b, gb) = run(G), run(1)
    m, q = ro.response_mask.bool(), packed.prompt_tok_mask.bool()
    assert_rounding("rollout.group_prompt_once.response", a.response[m], b.response[m])
    assert_rounding("rollout.group_prompt_once.prompt", a.prompt[q], b.prompt[q])
    assert_rounding("rollout.group_prompt_once.entropy", a.entropy[m], b.entropy[m])
    for n in ga:
        assert_rounding(f"rollout.group_prompt_once.grad.{n}", ga[n], gb[n])


def test_sliding_window_models_score_full_rows(monkeypatch):
    """A sliding-window layer's cache keeps only a window of the prompt: no shared prompt pass."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ro = R.sample(model, [PROMPTS[1]] * 2, max_new_tokens=4, eos_ids=[], pad_id=0, seeds=[1, 2])
    monkeypatch.setattr(logprobs, "shared_prompt_scores", lambda *a: pytest.fail("shared pass on a sliding window"))
    with torch.no_grad():
        logprobs.score_tokens(model, ro.packed(), 1.0, group=2)


def test_trimmed_rows_score_like_the_full_width(model):
    """Packed.trimmed drops the columns that are padding in every chosen row; the scores it gives
    land in the full-width arrays where the full forward puts them."""
    ro = R.sample(model, PROMPTS, max_new_tokens=10, eos_ids=[1, 5, 9], pad_id=0, temperature=1.0, seeds=list(range(6)))
    packed = ro.packed()
    with torch.no_grad():
        full = logprobs.score_tokens(model, packed, 1.0)
        idx = torch.tensor([4, 2])  # short prompts (lengths 2 and 1): most columns go
        pk, pc, rc = packed.trimmed(idx)
        part = logprobs.score_tokens(model, pk, 1.0)
    assert pk.input_ids.shape[1] < packed.input_ids.shape[1]
    m_resp, m_prompt = ro.response_mask[idx][:, rc].bool(), packed.prompt_tok_mask[idx][:, pc].bool()
    assert ro.response_mask[idx][:, rc.stop:].sum() == 0 and packed.prompt_tok_mask[idx][:, :pc.start].sum() == 0
    assert_rounding("rollout.trimmed_vs_full.response", part.response[m_resp], full.response[idx][:, rc][m_resp])
    assert_rounding("rollout.trimmed_vs_full.prompt", part.prompt[m_prompt], full.prompt[idx][:, pc][m_prompt])
