"""The --dry-run's time model (plumbing/time_model.py): its terms against hand values for the
paper's 7B config, so a change of a formula or an assumption shows here."""

import os

import pytest

import train
from plumbing import memory_plan, time_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paper(*extra):
    a, algo = train.parse_args(["--config", os.path.join(ROOT, "configs", "paper_qwen7b.json"), *extra])
    return a, algo


def test_decode_is_one_pass_of_the_rows_through_the_slots():
    """512 rows per GPU, 128 slots (524288 KV positions / (1024 + 3072)): every row to the limit is
    4 x 3072 steps; at half the limit the slots stay full for 512 x 1536 / 128 steps, then the last
    rows finish (1536 more)."""
    a, _ = paper()
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    assert memory_plan.kv_rows(a, 8) == 128
    (term,) = time_model.decode_terms(arch, a, 8, gpu, (3072, 1536))
    assert "12,288 / 7,680 decode steps of 512 rows in 128 slots" in term.note
    weights = 2 * (arch.params() - arch.vocab * arch.hidden)                  # the input embedding is a lookup
    kv = 128 * (1024 + 3072) * arch.kv_bytes_per_position()                 # up to the longest slot
    assert term.seconds[0] == pytest.approx(12288 * (weights + kv) / 3.35e12)


def test_compute_terms_by_hand():
    a, _ = paper()
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    N, flops = arch.params(), 989e12
    prefill, score, update = time_model.compute_terms(arch, a, 8, gpu, True, (3072, 1536), old_rows=0.75)
    assert prefill.seconds[0] == pytest.approx(2 * N * 64 * 1024 / (flops * 0.5))
    tokens = 512 * (1024 + 3072)
    assert score.seconds[0] == pytest.approx(1.75 * 2 * N * tokens / (flops * 0.4))
    micro = -(-tokens // memory_plan.micro_batch_tokens(a))
    comm = 3 * 2 * N * 7 / 8 / (450e9 * 0.7)
    assert update.seconds[0] == pytest.approx(8 * N * tokens / (flops * 0.4) + micro * comm)   # grad ckpt


def test_the_report_names_its_assumptions_and_sums_its_terms():
    a, algo = paper("--steps", "10")
    text = time_model.report(a, 8, True, "h200", old_rows=0.75)
    lines = text.splitlines()
    assert lines[0].startswith("time model of one RL step on 8 x H200") and "not a measurement" in lines[0]
    secs = {ln.split()[0]: float(ln.split()[1]) for ln in lines[1:]}
    assert set(secs) == {"decode", "prefill", "score", "update", "step"}
    assert secs["step"] == pytest.approx(sum(v for k, v in secs.items() if k != "step"), abs=0.3)
    assert "4.8 TB/s" in text and "40% MFU" in text and "x 10 steps" in text


def test_the_disk_a_run_needs():
    """Two checkpoints of 12 bytes per parameter at most (checkpoints.make_room), the bf16 export,
    and for a run over several nodes the shared --out it needs."""
    a, _ = paper()
    n = memory_plan.arch_for(a.model).params()
    line = time_model.disk_report(a, 8)
    assert f"a checkpoint is {12 * n / 1e9:.1f} GB" in line and f"{24 * n / 1e9:.1f} GB" in line
    assert f"{2 * n / 1e9:.1f} GB for the final bf16 export" in line and "node" not in line
    assert "file system every node sees" in time_model.disk_report(a, 16)
