"""bench/gpu_check.py's results file and budget on a CPU (no GPU): the items' host side runs at toy
widths, the time model's phases print as "model / measured / ratio" lines with "measured: n/a (no GPU)",
and one JSON file holds the items, the measurements (decode-grid's points, kv-budget's slots,
update-fit's per-layer fit), the constants --plan-constants reads and the phases; measured constants
replay the step through time_model.step_terms. (tests/test_scale.py runs every item.)"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check  # noqa: E402
from plumbing import memory_plan, time_model  # noqa: E402

CONSTANTS = ("decode_bw_fraction", "update_mfu", "launch_us", "exposed_comm")


def test_a_cpu_run_writes_one_json_of_its_items_and_the_model_s_phases(tmp_path, capsys):
    path = tmp_path / "results.json"
    items = "matmul,decode-grid,kv-budget,update-fit,kv"
    assert gpu_check.main(["--preset", "tiny", "--device", "cpu", "--items", items, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert [(r["item"], r["status"]) for r in doc["items"]] == [
        ("fp32-matmul", "SKIP"), ("decode-grid", "PASS"), ("kv-budget", "SKIP"), ("update-fit", "PASS"),
        ("kv-cache", "PASS")]
    assert doc["device"] == "cpu" and doc["minutes"] == 5.0 and doc["gpu"] == "h100"
    phases = [p for p in doc["phases"] if p != "step"]
    assert {"decode", "prefill", "score", "update"} <= set(phases) and doc["hours"]["measured"] is None
    for p in (*phases, "step"):
        ph = doc["phases"][p]
        assert ph["model_s"] > 0 and ph["measured_s"] is None and ph["ratio"] is None
        line = next(ln for ln in out.splitlines() if ln.startswith(f"phase {p} "))
        assert f"model {ph['model_s']:8.2f} s / measured: n/a (no GPU) / ratio: n/a" in line
    assert doc["phases"]["step"]["model_s"] == pytest.approx(sum(doc["phases"][p]["model_s"] for p in phases))
    assert doc["constants"] == dict.fromkeys(CONSTANTS)          # a CPU measures none of them
    m = doc["measured"]
    grid = m["decode_grid"]                                       # 3 slot counts x 3 column counts
    assert len(grid["points"]) == 9 and len({p["slots"] for p in grid["points"]}) == 3
    for p in grid["points"]:
        assert p["device_ms"] is None and p["wall_ms"] > 0 and p["enqueue_ms"] > 0
        read_ms = p["bound_ms"] / time_model.CENTRAL["decode_bw_fraction"]    # the model: the slower bound
        assert p["model_ms"] >= max(p["launch_ms"], read_ms) > 0
    assert grid["model_kernels"] == time_model.KERNELS_PER_LAYER * grid["layers"] and grid["ops_per_step"] > 0
    fit = m["update_fit"]                                         # time = a + b x layers through both depths
    for L, t in zip(fit["layers"], fit["update_s"]):
        assert fit["a_s"] + fit["b_s_per_layer"] * L == pytest.approx(t)
    assert fit["update_full_s"] == pytest.approx(fit["a_s"] + fit["b_s_per_layer"] * fit["full_layers"])
    assert fit["mfu"] is None and fit["forward_mfu"] is None and fit["forward_full_s"] is not None
    assert fit["grad_ckpt"] is False and fit["model_update_s"] == pytest.approx(3 * fit["model_forward_s"])
    kv = m["kv_budget"]                                           # the plan's figure; measured n/a
    assert kv["plan_slots"] > 0 and kv["plan_positions"] > 0 and kv["slots"] is None
    assert "n/a (no GPU)" in next(r["text"] for r in doc["items"] if r["item"] == "kv-budget")
    assert out.splitlines()[-1].startswith("gpu_check: 3 PASS, 0 FAIL, 2 SKIP")


def test_measured_constants_replay_the_time_model_s_step():
    """What phase_lines prints for a GPU's measurements: time_model.step_terms on the same plan with
    CENTRAL updated by the measured constants and --kv-budget at the measured positions."""
    p = gpu_check.paper_plan("h100")
    measured = {"decode_grid": {"on_gpu": True, "preset": "7b", "model_kernels": 1204, "points": [
                    dict(bound_ms=5.0, device_ms=8.0, enqueue_ms=4.0), dict(bound_ms=9.0, device_ms=12.0,
                                                                            enqueue_ms=4.4),
                    dict(bound_ms=1.0, device_ms=6.0, enqueue_ms=5.5)]},        # host-bound: no bandwidth
                "update_fit": {"on_gpu": True, "preset": "7b", "mfu": 0.42}}
    k = gpu_check.measured_constants(measured)
    assert k == {"decode_bw_fraction": 0.75, "update_mfu": 0.42, "launch_us": pytest.approx(4400 / 1204),
                 "exposed_comm": None}
    got = gpu_check.replayed_phases(p, k, kv_budget=500_000)
    plan = memory_plan._with(p.a, kv_budget=500_000)
    terms = time_model.step_terms(p.arch, plan, 8, time_model.GPUS["h100"], p.needs_ref, p.old_rows, p.resp,
                                  p.prompt, k={**time_model.CENTRAL, **{n: v for n, v in k.items() if v}})
    want = {t.name: t.seconds[0] for t in terms}
    for phase in ("decode", "prefill", "score", "update"):
        assert got[phase]["measured_s"] == pytest.approx(want[phase])
        assert got[phase]["ratio"] == pytest.approx(want[phase] / got[phase]["model_s"])
    assert got["step"]["measured_s"] == pytest.approx(sum(want.values()))
    mfu = time_model.CENTRAL["update_mfu"]
    assert got["score"]["measured_s"] == pytest.approx(got["score"]["model_s"] * mfu / 0.42)
    model = time_model.step_terms(p.arch, p.a, 8, time_model.GPUS["h100"], p.needs_ref, p.old_rows, p.resp,
                                  p.prompt)
    assert {ph: v["model_s"] for ph, v in got.items() if ph != "step"} == {t.name: t.seconds[0]
                                                                          for t in model}
    nothing = gpu_check.replayed_phases(p, dict.fromkeys(CONSTANTS))             # nothing measured: n/a
    assert all(v["measured_s"] is None for v in nothing.values())
    only_mfu = gpu_check.replayed_phases(p, {**dict.fromkeys(CONSTANTS), "update_mfu": 0.42})
    assert only_mfu["decode"]["measured_s"] is None and only_mfu["update"]["measured_s"] is not None


def test_no_item_starts_past_the_budget(tmp_path, capsys):
    """--minutes 0: every item SKIPs with the budget's reason; the phases and the JSON still come."""
    path = tmp_path / "results.json"
    assert gpu_check.main(["--preset", "tiny", "--device", "cpu", "--items", "kv,update-fit",
                           "--minutes", "0", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert [(r["item"], r["status"]) for r in doc["items"]] == [("update-fit", "SKIP"), ("kv-cache", "SKIP")]
    assert all("the --minutes budget" in r["text"] for r in doc["items"])
    assert doc["phases"]["step"]["model_s"] > 0
    assert "measured: n/a (no GPU)" in capsys.readouterr().out
