"""The sampler's one pass per rank (sampler/kv_cache.py), on the tiny warm-start model (data/tinymath/warmstart).

The tokens pinned: seeded rows, G copies of prompts long and short, decoded with a --kv-budget that
holds fewer rows than the call has, must give the tokens recorded in tests/golden/sampler_tokens.json,
and each row decoded alone (batch 1) the same tokens. Recorded before the sampler became one pass
per rank (#32), by the chunked loop: however the rows are scheduled, a seeded row's tokens depend
only on its seed and the model. Then: one pass with the cache under the budget, refills and
compaction against HF generate, and the host reads of the loop counted.

    python -m tests.test_one_pass record   # rewrites tests/golden/sampler_tokens.json
"""

import json
import os

import pytest
import torch

from sampler import decode
from sampler import kv_cache
from modeling import models
import rollout
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
GOLDEN = os.path.join(ROOT, "tests", "golden", "sampler_tokens.json")
PROBLEMS = [  # short and long prompts, so slots hold rows of different prompt lengths
    "How many?",
    "Mia has 23 apples. How many apples does Mia have now?",
    "Leo owns 36 buttons. Leo gives 19 buttons to Zoe. The number of buttons that Leo has becomes 4 times "
    "as large. How many buttons does Leo have in the end?",
    "Tom owns 46 coins. How many coins does Tom have now?",
    "Omar owns 24 cookies. Omar gives 8 cookies to Ana. Omar finds 7 more cookies. Omar gives 15 cookies "
    "to Ana. The number of cookies that Omar has becomes 3 times as large. How many cookies does Omar have now?",
    "Zoe has 4 boxes of 12 pens each.",
]
G, NEW, SLOTS = 4, 48, 5
SETTINGS = {"t1": dict(temperature=1.0, top_p=1.0), "t07_p09": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def warm():
    return models.load_policy(WARM)


def golden_rows(model, tok):
    """The rows of the golden: each problem's prompt G times (consecutive, as GRPO's groups), one
    seed per row, and the spec that decodes them with room for SLOTS rows in the KV cache."""
    from data.prompts import build_prompt

    prompts = [tok(build_prompt(tok, p, "plain"), add_special_tokens=False).input_ids
               for p in PROBLEMS for _ in range(G)]
    seeds = [rollout.row_seed(32, i) for i in range(len(prompts))]
    spec = rollout.SampleSpec(NEW, rollout.eos_token_ids(model, tok), tok.pad_token_id, "kv", None,
                              kv_budget=SLOTS * (max(map(len, prompts)) + NEW))
    return prompts, seeds, spec


def responses(ro) -> list[list[int]]:
    return [ro.response_ids[i, :n].tolist() for i, n in enumerate(ro.lengths.tolist())]


def sample_golden(model, tok, setting):
    prompts, seeds, spec = golden_rows(model, tok)
    ro = rollout.sample_with(model, prompts, spec, seeds=seeds, **SETTINGS[setting])
    return {"tokens": responses(ro), "finished": ro.finished.tolist()}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_seeded_rows_give_the_recorded_tokens(warm, setting):
    model, tok = warm
    with open(GOLDEN) as f:
        want = json.load(f)[setting]
    got = sample_golden(model, tok, setting)
    assert got == want
    lengths = [len(t) for t in want["tokens"]]
    assert len(set(lengths)) > 3 and min(lengths) <= NEW // 2 and any(not f for f in want["finished"])  # long-tailed
    prompts, seeds, spec = golden_rows(model, tok)
    kw = dict(max_new_tokens=NEW, eos_ids=spec.eos_ids, pad_id=spec.pad_id, **SETTINGS[setting])
    for i in range(len(prompts)):  # batch 1: nothing shared with another row
        alone = rollout.sample(model, [prompts[i]], seeds=[seeds[i]], **kw)
        assert responses(alone)[0] == want["tokens"][i], i


def test_a_kv_budget_gives_one_pass_over_fewer_slots_and_changes_no_sample(warm, monkeypatch):
    """The paper's geometry in miniature: a --kv-budget that holds 3 of the call's 12 rows. One
    decoding pass (not 4 chunks), a cache of 3 slots x (longest prompt + max_new_tokens) <= the
    budget, refilled as rows end, and the same samples as decoding all 12 rows at once."""
    model, tok = warm
    prompts = [tok(f"Mia has {n} apples.", add_special_tokens=False).input_ids for n in range(10, 22)]
    P = max(map(len, prompts))
    budget = 3 * (P + 40) + 5
    spec = rollout.SampleSpec(40, rollout.eos_token_ids(model, tok), tok.pad_token_id, "kv", 256, None,
                              kv_budget=budget)
    assert spec.rows_per_call(P) == 3
    passes, caches, admitted = [], [], []
    real_pass, real_cache, real_admit = kv_cache.decode_pass, kv_cache.slot_cache, kv_cache.admit

    def spy_cache(model, n, capacity):
        caches.append(n * capacity)
        return real_cache(model, n, capacity)

    monkeypatch.setattr(kv_cache, "decode_pass", lambda *a, **k: passes.append(k["slots"]) or real_pass(*a, **k))
    monkeypatch.setattr(kv_cache, "slot_cache", spy_cache)
    monkeypatch.setattr(kv_cache, "admit", lambda m, c, ps, free, pad: admitted.append(len(free)) or
                        real_admit(m, c, ps, free, pad))
    a = rollout.sample_with(model, prompts, spec, temperature=1.0, seeds=list(range(12)))
    assert passes == [3] and caches == [3 * (P + 40)] and caches[0] <= budget
    assert len(admitted) > 2 and sum(admitted) == 12                # refilled as rows ended
    b = rollout.sample(model, prompts, max_new_tokens=40, eos_ids=spec.eos_ids, pad_id=tok.pad_token_id,
                       seeds=list(range(12)))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert len(set(a.lengths.tolist())) > 2


def test_refilled_and_compacted_slots_match_hf_generate(warm, monkeypatch):
    """Greedy decoding through the slot cache -- written in place, finished slots refilled with
    queued rows, then compacted once nothing is queued -- gives HF generate's tokens on ragged
    prompts (float32, CPU)."""
    from data.prompts import build_prompt

    model, tok = warm
    problems = ["Mia has 23 apples.", "Mia has 23 apples. Mia gives 5 apples to Tom. Tom eats 2 apples. Mia buys "
                "7 apples. How many apples does Mia have now?", "How many?", "Leo owns 36 buttons. Leo gives 19 "
                "buttons to Zoe. How many buttons does Leo have now?", "Zoe has 4 boxes of 12 pens each."] * 2
    prompts = [tok(build_prompt(tok, p, "plain"), add_special_tokens=False).input_ids for p in problems]
    eos = rollout.eos_token_ids(model, tok)
    buffers, compactions = set(), []
    real_admit, real_select = kv_cache.admit, kv_cache.SlotLayer.batch_select_indices

    def admit(m, cache, ps, free, pad):
        buffers.add(cache.layers[0].k_buf.data_ptr())
        return real_admit(m, cache, ps, free, pad)

    monkeypatch.setattr(kv_cache, "admit", admit)
    monkeypatch.setattr(kv_cache.SlotLayer, "batch_select_indices",
                        lambda self, idx: compactions.append(len(idx)) or real_select(self, idx))
    kv = rollout.sample(model, prompts, max_new_tokens=64, eos_ids=eos, pad_id=tok.pad_token_id, temperature=0,
                        batch_size=4)
    hf = rollout.sample(model, prompts, max_new_tokens=64, eos_ids=eos, pad_id=tok.pad_token_id, temperature=0,
                        sampler="hf")
    assert len(buffers) == 1 and compactions                       # refills in place; a compacted tail
    lens = kv.lengths
    assert len(set(lens.tolist())) > 2
    assert torch.equal(kv.response_ids, hf.response_ids[:, :kv.response_ids.shape[1]])
    assert torch.equal(lens, hf.lengths) and torch.equal(kv.finished, hf.finished)
    assert_rounding("one_pass.compacted_kv_vs_hf_logprobs", kv.logprobs, hf.logprobs[:, :kv.response_ids.shape[1]])


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")


def test_the_loop_reads_the_device_once_per_check(warm, monkeypatch):
    """Which slots are done is read once every kv_cache.CHECK_EVERY decode steps (kv_cache.host_read);
    nothing else in the pass reads a tensor's value back -- the decode steps, token choices and
    their bookkeeping -- except the refills' prefill forwards, which run at a check."""
    model, tok = warm
    prompts, seeds, spec = golden_rows(model, tok)
    reads, steps, checks, counting = [], [], [], []
    for name in READS:  # any read of a tensor's value, counted while the pass runs, outside a check
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name, **k:
                            (counting and counting[-1] and reads.append(_n)) or _real(self, *a, **k))

    def counted(fn, on, tally=None):
        def run(*a, **k):
            counting.append(on)
            if tally is not None:
                tally.append(1)
            try:
                return fn(*a, **k)
            finally:
                counting.pop()
        return run

    monkeypatch.setattr(kv_cache, "decode_pass", counted(kv_cache.decode_pass, True))
    monkeypatch.setattr(kv_cache, "host_read", counted(kv_cache.host_read, False, checks))
    monkeypatch.setattr(kv_cache, "admit", counted(kv_cache.admit, False))
    monkeypatch.setattr(decode.LeanStep, "__call__", counted(decode.LeanStep.__call__, True, steps))
    ro = rollout.sample_with(model, prompts, spec, seeds=seeds, temperature=1.0)
    assert reads == []
    assert len(steps) > 3 * kv_cache.CHECK_EVERY and 1 <= len(checks) <= len(steps) // kv_cache.CHECK_EVERY + 1
    assert responses(ro) == sample_golden(model, tok, "t1")["tokens"]   # (the spies changed nothing)


def record():
    torch.set_num_threads(1)
    model, tok = models.load_policy(WARM)
    out = {s: sample_golden(model, tok, s) for s in sorted(SETTINGS)}
    with open(GOLDEN, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {GOLDEN}:", {s: len(v["tokens"]) for s, v in out.items()}, "rows")


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Record the sampler's golden tokens (tests/golden/sampler_tokens.json).")
    ap.add_argument("what", choices=["record"], help="rewrite the golden from the current sampler (on purpose only)")
    ap.parse_args(argv)
    record()


if __name__ == "__main__":
    main()
