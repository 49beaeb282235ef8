"""--kv-budget 0 on CUDA: the KV-cache positions that fit in the free GPU memory, less what the rollout
phase still allocates beside the cache, less memory_plan.KV_MARGIN of the card (sampler/kv_cache.py
kv_budget_from_memory, kv_cache.kv_budget_that_fits / rollout_reserve). No GPU here: the one CUDA query,
torch.cuda.mem_get_info, is replaced by a card of a given size and free memory.
"""

import json
import os
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config

from plumbing import memory_plan, time_check
from sampler import kv_cache
from modeling import models
import rollout
from tests.test_one_pass import WARM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
CARD = 141 * GIB                                            # an H200's


@pytest.fixture(scope="module")
def warm():
    return models.load_policy(WARM)


@pytest.fixture
def qwen7b():
    with open(os.path.join(ROOT, "configs", "models", "Qwen2.5-Math-7B.json")) as f:
        return Qwen2Config(**json.load(f))


def gpu(monkeypatch, free, card=CARD, calls=None):
    """A card of `card` bytes with `free` free; calls: a list the two CUDA queries append their names to."""
    calls = [] if calls is None else calls
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: calls.append("mem_get_info") or (free, card))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))


def test_the_budget_is_what_fits_beside_the_reserve_and_the_margin(qwen7b, monkeypatch):
    """At every free memory and reserve: never negative, never more than the card holds, leaving the
    reserve and KV_MARGIN of the card free -- and one position more would not fit."""
    per = kv_cache.kv_bytes_per_position(qwen7b, torch.bfloat16)
    assert per == 2 * 28 * 4 * 128 * 2                       # K and V, 28 layers, 4 KV heads of 128, bf16
    for free in (0, 5 * GIB, 60 * GIB, 120 * GIB, CARD, 2 * CARD):   # (2 x the card: a broken query)
        for reserve in (0, 3 * GIB, 40 * GIB, 200 * GIB):
            gpu(monkeypatch, free)
            n = kv_cache.kv_budget_from_memory(qwen7b, torch.bfloat16, reserve)
            usable = min(free, CARD) - reserve - memory_plan.KV_MARGIN * CARD
            assert n >= 0 and n * per <= CARD
            assert n * per <= max(0, usable) and (n + 1) * per > usable


def test_the_budget_grows_with_free_memory_and_gives_way_to_the_reserve(qwen7b, monkeypatch):
    per = kv_cache.kv_bytes_per_position(qwen7b, torch.bfloat16)
    budgets = []
    for free in range(20, 141, 10):
        gpu(monkeypatch, free * GIB)
        budgets.append(kv_cache.kv_budget_from_memory(qwen7b, torch.bfloat16, 8 * GIB))
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    gpu(monkeypatch, 100 * GIB)
    base = kv_cache.kv_budget_from_memory(qwen7b, torch.bfloat16, 8 * GIB)
    assert kv_cache.kv_budget_from_memory(qwen7b, torch.bfloat16, 8 * GIB + 1000 * per) == base - 1000
    assert kv_cache.kv_budget_from_memory(qwen7b, torch.float32, 8 * GIB) == base // 2  # twice the bytes


def test_the_reserve_is_what_the_rollout_phase_allocates(warm, monkeypatch):
    """rollout_reserve: Adam's state is what AdamW allocates at its first step (and nothing once it
    has); under bf16 autocast, the bf16 copies of the nn.Linear weights (tied lm_head once). With the
    reserve and the pass's own (its prefill, the logits of its slots) the budget is
    memory_plan.kv_positions_that_fit of their sum -- the plan's rule."""
    model, _ = warm
    model = type(model)(model.config)                                  # a copy to train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = kv_cache.rollout_reserve(model, opt, bf16=True)
    linear = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert before["autocast casts"] == 2 * linear and before["decoding copy"] == 0
    assert kv_cache.rollout_reserve(model, opt, bf16=False)["autocast casts"] == 0

    gpu(monkeypatch, 100 * GIB)
    per = kv_cache.kv_bytes_per_position(model.config, torch.bfloat16)
    budget = kv_cache.kv_budget_that_fits(model, opt, True, 256, 96)
    own = kv_cache.decode_reserve(model.config, 2, 256)
    assert budget == memory_plan.kv_positions_that_fit(100 * GIB, CARD, sum(before.values()) + sum(own.values()),
                                                       per)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert state == before["adam"] and kv_cache.rollout_reserve(model, opt, bf16=True)["adam"] == 0
    after = kv_cache.kv_budget_that_fits(model, opt, True, 256, 96)
    assert after - budget in (state // per, state // per + 1)           # (floors of two quotients)


def test_a_lora_run_reserves_its_merged_decoding_copy(warm):
    """LoRA: the sampler decodes lora.merged's copy of the base (bf16 under bf16), made at each
    rollout: its bytes are reserved; the adapters' Adam state only."""
    pytest.importorskip("peft")
    from modeling import lora

    model, _ = warm
    policy = lora.wrap(type(model)(model.config), 4, 8)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    got = kv_cache.rollout_reserve(policy.get_base_model(), opt, bf16=True)
    merged = lora.merged(policy, torch.bfloat16)
    assert got["decoding copy"] == sum(p.numel() * p.element_size() for p in merged.parameters())
    assert got["adam"] == 2 * 4 * lora.trainable(policy)[0] and got["autocast casts"] == 0


def test_the_cpu_has_no_cap(warm):
    model, tok = warm
    assert rollout.SampleSpec.make(model, tok, 96, "kv", 256, 0, bf16=False).kv_budget == 0


def test_each_pass_sizes_the_budget_from_the_memory_free_then(warm, monkeypatch):
    """--kv-budget 0 on CUDA: every one pass (sample_by_spec) re-derives the budget from the memory free
    when it starts, beside the decoding copy already made -- not the set-up's figure, which reserved
    Adam's state that arrives later and cannot see fragmentation or what an evaluation holds. The rows
    it decodes at once follow: less free memory, fewer slots. A fixed --kv-budget stays as given."""
    model, tok = warm
    got = []
    monkeypatch.setattr(rollout, "sample", lambda *a, batch_size, **kw: got.append(batch_size))
    spec = rollout.SampleSpec(96, [0], 0, "kv", 256, torch.bfloat16, kv_budget=10 ** 6, kv_fits=True)
    edge, MIB = int(memory_plan.KV_MARGIN * CARD), 2 ** 20               # (a slot: 128 positions, 128 KiB)
    prompts = [[1] * 32] * 300
    for free in (100 * GIB, edge + 40 * MIB, edge + 20 * MIB):
        gpu(monkeypatch, free)
        rollout.sample_by_spec(model, prompts, spec, 1.0, None, 1.0)
        want = kv_cache.kv_budget_that_fits(model, None, True, 256, 96)   # (the decoder: no optimizer)
        assert got[-1] == min(256, max(1, want // (32 + 96)))
    assert got[0] == 256 and 1 <= got[2] < got[1] < 256
    fixed = replace(spec, kv_budget=128 * 40, kv_fits=False)
    rollout.sample_by_spec(model, prompts, fixed, 1.0, None, 1.0)
    assert got[-1] == 40


def test_the_budget_is_sized_after_the_allocator_s_cache_is_released(qwen7b, monkeypatch):
    """mem_get_info counts the caching allocator's free blocks as used: the cache is released first,
    once per sizing, and the sizing is kept for the step's metrics line (time_check.BUDGET)."""
    calls = []
    gpu(monkeypatch, 100 * GIB, calls=calls)
    monkeypatch.setattr(time_check, "BUDGET", {})
    n = kv_cache.kv_budget_from_memory(qwen7b, torch.bfloat16, 8 * GIB)
    assert calls == ["empty_cache", "mem_get_info"]
    per = kv_cache.kv_bytes_per_position(qwen7b, torch.bfloat16)
    assert time_check.BUDGET == {"positions": n, "gib": n * per / GIB, "free_gib": 100.0}


def test_each_rollout_logs_its_slots_and_kv_budget(warm, monkeypatch):
    """The one pass records what its rank got; the step's hook (time_check.FirstSteps, every device)
    puts the step's first pass on its line -- slots, columns, KV GiB, the --kv-budget 0 sizing -- and
    a line without a pass since the last gets none."""
    import argparse
    import train
    from tests.test_decode_capture import rows_of

    model, tok = warm
    monkeypatch.setattr(time_check, "BUDGET", {"positions": 1234, "gib": 0.5, "free_gib": 70.0})
    a = train.parse_args(["--steps", "5"])[0]
    hook = time_check.FirstSteps(a, argparse.Namespace(world=1, device=torch.device("cpu")), False, 0.5, 0)
    prompts, kw = rows_of(model, tok, problems=2)
    for slots in (3, 5):
        rollout.sample(model, prompts, **dict(kw, batch_size=slots))
        rollout.sample(model, prompts[:2], **dict(kw, batch_size=2, seeds=kw["seeds"][:2]))  # (an evaluation)
        line = hook({"step": slots})
        C = max(map(len, prompts)) + kw["max_new_tokens"]
        per = kv_cache.kv_bytes_per_position(model.config, kv_cache.kv_dtype(model))
        assert line["sampler/slots"] == slots and line["sampler/columns"] == C and line["sampler/passes"] == 2
        assert line["sampler/rows"] == len(prompts) and line["sampler/decode_steps"] > 0
        assert line["sampler/kv_gib"] == pytest.approx(slots * C * per / GIB)
        assert line["sampler/kv_budget"] == 1234 and line["sampler/kv_budget_free_gib"] == 70.0
    assert hook({"step": 6}) == {"step": 6}
