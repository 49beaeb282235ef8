"""The capturable decode step (sampler/decode.py CapturedStep, --compile-decode) on the tiny warm-start
model (data/tinymath/warmstart): torch.compile(fullgraph=True) traces it whole (a graph break raises),
and a pass through the compiled step gives the eager LeanStep's tokens for seeded rows -- with refills,
compaction to a bucket of slots and bucketed cache widths. torch.compile's "eager" backend runs the
traced graph's own ops, so its logits are LeanStep's bit for bit at the same width; "aot_eager" runs
the graph through AOTAutograd's functionalisation, as inductor would (inductor itself needs a C compiler
and minutes of compiling on 2 cores: bench/bench_sampler.py --compiled measures it).
"""

import pytest
import torch
from torch._dynamo.utils import counters

from sampler import decode, kv_cache
from modeling import models
import rollout
from tests.test_one_pass import G, WARM, golden_rows, responses


@pytest.fixture(scope="module")
def warm():
    return models.load_policy(WARM)


def rows_of(model, tok, problems=3):
    """The golden rows of the first `problems` problems (G each), and sample()'s arguments for them."""
    prompts, seeds, spec = golden_rows(model, tok)
    n = problems * G
    kw = dict(max_new_tokens=spec.max_new_tokens, eos_ids=spec.eos_ids, pad_id=spec.pad_id, temperature=1.0,
              seeds=seeds[:n], batch_size=spec.rows_per_call(max(map(len, prompts[:n]))))
    return prompts[:n], kw


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_pass_gives_the_eager_tokens(warm, backend, monkeypatch):
    """Seeded rows through fewer slots than rows: the same tokens and finished flags as the eager
    step; the slots were compacted to a power of two and the cache's buffers kept their addresses.
    (The log-probs differ by the rounding of the longer masked sums: not compared.)"""
    model, tok = warm
    prompts, kw = rows_of(model, tok)
    eager = rollout.sample(model, prompts, **kw)
    kept, moved, real = [], [], kv_cache.SlotLayer.batch_select_indices

    def select(self, idx):
        kept.append(len(idx))
        before = self.k_all.data_ptr()
        real(self, idx)
        moved.append(self.k_buf.data_ptr() != before or self.k_all.data_ptr() != before)

    monkeypatch.setattr(kv_cache.SlotLayer, "batch_select_indices", select)
    compiled = rollout.sample(model, prompts, compile_decode=backend, **kw)
    assert responses(compiled) == responses(eager) and len(set(eager.lengths.tolist())) > 2
    assert torch.equal(compiled.finished, eager.finished)
    assert kept and all(n & (n - 1) == 0 for n in kept) and not any(moved)


def test_compiled_logits_are_the_eager_steps_at_the_bucketed_width(warm):
    """One step over a prefilled slot cache: CapturedStep (backend "eager") reads the width rounded
    up to a bucket, masked beyond each slot's length, and returns LeanStep's logits at that width
    exactly, and writes the same K/V into the cache."""
    model, tok = warm
    prompts, _ = rows_of(model, tok, problems=2)
    prompts = prompts[::G] + prompts[1::G]                    # two distinct lengths
    S, C = len(prompts), max(map(len, prompts)) + 16
    caches = [kv_cache.slot_cache(model, S, C) for _ in range(2)]
    for cache in caches:
        kv_cache.admit(model, cache, prompts, list(range(S)), tok.pad_token_id)
    lean, cap = decode.LeanStep(model, caches[0]), decode.CapturedStep(model, caches[1], "eager")
    pos = torch.tensor([len(p) for p in prompts])
    tok_ = torch.tensor([5] * S)
    width = int(pos.max()) + 1
    bucket = -(-C // decode.WIDTH_BUCKETS)
    wide = min(C, -(-width // bucket) * bucket)
    assert wide > width                                       # (the case: columns beyond every slot)
    with torch.no_grad():
        got = cap(tok_, pos, width)
        want = lean(tok_, pos, wide)
    assert torch.equal(got, want)
    assert torch.equal(caches[0].layers[0].k_all, caches[1].layers[0].k_all)  # the same K/V written


def test_the_compiled_step_is_traced_once_for_every_pass(warm):
    """fullgraph=True: no graph break (it would raise). A second sampler call -- a new cache, new
    buffers -- reuses the graphs the first traced: the compile time is paid once per run."""
    model, tok = warm
    prompts, kw = rows_of(model, tok, problems=2)
    rollout.sample(model, prompts, compile_decode="eager", **kw)
    graphs = counters["stats"]["unique_graphs"]
    rollout.sample(model, prompts, compile_decode="eager", **kw)
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


def test_compaction_keeps_a_power_of_two_of_slots():
    """decode.bucket_rows: the live slots rounded up to a power of two, never more than there are."""
    assert [decode.bucket_rows(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [decode.bucket_rows(n, 64) for n in (1, 3, 5, 17, 33, 64)] == [1, 4, 8, 32, 64, 64]


def fresh_copy(model):
    """A new decoding copy of the same weights (new tensors, as FSDP2's gathered or LoRA's merged copy
    made at every rollout)."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def passes(model, tok, n=10):
    """n sampler calls, each with new slot and column counts: (prompts, sample()'s arguments)."""
    prompts, kw = rows_of(model, tok, problems=6)
    for i in range(n):
        rows = 8 + 3 * i
        longer = [p + [p[-1]] * (2 * i) for p in prompts[:rows]]        # new columns (capacity) each pass
        yield longer, dict(kw, seeds=kw["seeds"][:rows], batch_size=3 + i)   # new slots each pass


def test_fresh_copies_and_new_sizes_on_ten_passes_never_end_the_run(warm, monkeypatch):
    """The issue-51 probe: a fresh decoding copy and new (slots, columns) every pass. fullgraph=True
    makes Dynamo's recompile limit an error; the sizes that change between passes are traced as sizes
    (decode._dynamic, the capacity read as a tensor's size), so the graphs settle below the limit, and
    every pass gives the eager step's tokens without falling back."""
    model, tok = warm
    torch._dynamo.reset()
    monkeypatch.setattr(decode, "_COMPILED", {})
    monkeypatch.setattr(decode, "FELL_BACK", {})
    counters.clear()
    for prompts, kw in passes(model, tok):
        eager = rollout.sample(model, prompts, **kw)
        compiled = rollout.sample(fresh_copy(model), prompts, compile_decode="eager", **kw)
        assert responses(compiled) == responses(eager)
    graphs = counters["stats"]["unique_graphs"]
    assert not decode.FELL_BACK and graphs < torch._dynamo.config.recompile_limit, graphs


def test_a_compiler_failure_falls_back_to_the_eager_step(warm, monkeypatch, capsys):
    """Past the recompile limit (here 1 graph) and under a backend that raises: the pass continues with
    the eager step, with the eager tokens, says so once, and later passes do not try again."""
    model, tok = warm
    calls = []

    def broken(gm, inputs):
        calls.append(1)
        raise RuntimeError("no C compiler")
    for backend, limit in (("eager", 1), (broken, 8)):
        torch._dynamo.reset()
        monkeypatch.setattr(decode, "_COMPILED", {})
        monkeypatch.setattr(decode, "FELL_BACK", {})
        monkeypatch.setattr(torch._dynamo.config, "recompile_limit", limit)
        for prompts, kw in passes(model, tok, n=3):
            eager = rollout.sample(model, prompts, **kw)
            compiled = rollout.sample(fresh_copy(model), prompts, compile_decode=backend, **kw)
            assert responses(compiled) == responses(eager)
        assert list(decode.FELL_BACK) == [(backend, None)]
        said = capsys.readouterr().out
        assert said.count("--compile-decode: the compiled decode step failed") == 1, said
    assert len(calls) == 1
    torch._dynamo.reset()
