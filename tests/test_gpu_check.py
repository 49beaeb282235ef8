"""bench/gpu_check.py's results file and budget on a CPU (no GPU): the items' host side runs at toy
widths, the time model's phases print as "model / measured / ratio" lines with "measured: n/a (no GPU)",
and one JSON file holds the items, the measurements, the constants --plan-constants reads and the
phases. (tests/test_scale.py runs every item.)"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check  # noqa: E402

PHASES = ("decode", "prefill", "score", "update", "step")


def test_a_cpu_run_writes_one_json_of_its_items_and_the_model_s_phases(tmp_path, capsys):
    path = tmp_path / "results.json"
    assert gpu_check.main(["--preset", "tiny", "--device", "cpu", "--items", "kv", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert [(r["item"], r["status"]) for r in doc["items"]] == [("kv-cache", "PASS")]
    assert doc["device"] == "cpu" and doc["minutes"] == 5.0 and doc["gpu"] == "h100"
    assert set(doc["phases"]) == set(PHASES) and doc["hours"]["measured"] is None
    for p in PHASES:
        ph = doc["phases"][p]
        assert ph["model_s"] > 0 and ph["measured_s"] is None and ph["ratio"] is None
        line = next(ln for ln in out.splitlines() if ln.startswith(f"phase {p} "))
        assert f"model {ph['model_s']:8.2f} s / measured: n/a (no GPU) / ratio: n/a" in line
    assert doc["phases"]["step"]["model_s"] == sum(doc["phases"][p]["model_s"] for p in PHASES[:-1])
    assert doc["constants"] == dict.fromkeys(("decode_bw_fraction", "update_mfu", "launch_us", "exposed_comm"))
    assert out.splitlines()[-1].startswith("gpu_check: 1 PASS, 0 FAIL, 0 SKIP")


def test_no_item_starts_past_the_budget(tmp_path, capsys):
    """--minutes 0: every item SKIPs with the budget's reason; the phases and the JSON still come."""
    path = tmp_path / "results.json"
    assert gpu_check.main(["--preset", "tiny", "--device", "cpu", "--items", "kv,mfu", "--minutes", "0",
                           "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert [(r["item"], r["status"]) for r in doc["items"]] == [("update-mfu", "SKIP"), ("kv-cache", "SKIP")]
    assert all("the --minutes budget" in r["text"] for r in doc["items"]) and doc["phases"]["step"]["model_s"] > 0
    assert "measured: n/a (no GPU)" in capsys.readouterr().out
