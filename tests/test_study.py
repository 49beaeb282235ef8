"""study/miniature.py: its statistics, and the whole pipeline (runs -> evaluations -> study.json,
tables, figures) at toy sizes."""

import math
import os

import pytest

from study import miniature as M


def test_ci_is_the_student_t_interval():
    c = M.ci([1.0, 2.0, 3.0])
    assert c["mean"] == 2.0 and c["n"] == 3
    assert c["half"] == pytest.approx(4.303 * 1.0 / math.sqrt(3))   # sd of 1, 2, 3 is 1
    assert M.ci([0.5])["half"] is None                              # one seed: no interval
    assert M.fmt(c, 100, 1) == "200.0 ± 248.4"


def test_smoke_study_runs_resumably_end_to_end(tmp_path):
    size = M.SIZES["smoke"]
    out = str(tmp_path / "runs")
    M.run_all(out, size)
    mtimes = {f: os.path.getmtime(os.path.join(out, f, "metrics.jsonl")) for f in ("grpo-s0", "erpo-s1")}
    M.run_all(out, size)                                           # a rerun finds everything done
    assert all(os.path.getmtime(os.path.join(out, f, "metrics.jsonl")) == t for f, t in mtimes.items())
    study = M.report(out, size, str(tmp_path / "results"))
    for f in ("study.json", "tables.md", "drift.png", "temperature.png", "gap.png"):
        assert (tmp_path / "results" / f).exists()
    runs, paired = study["runs"], study["paired_erpo_minus_grpo"]
    want = [runs[f"erpo-s{s}"]["final"]["avg"] - runs[f"grpo-s{s}"]["final"]["avg"] for s in (0, 1)]
    assert paired["final_avg"]["values"] == pytest.approx(want)
    assert study["algos"]["grpo"]["query_kl_tail"]["values"] == [runs[f"grpo-s{s}"]["query_kl_tail"] for s in (0, 1)]
    assert len(study["curves"]["erpo"]["query_kl"]) == size["steps"]
    assert (tmp_path / "results" / "tables.md").read_text() == M.tables(study)


def test_the_readme_study_tables_are_built_from_the_committed_json():
    """Every line of the tables M.tables() makes from study/results/study.json is in docs/studies.md, and
    tables.md next to it is that same text."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "study", "results", "study.json")) as f:
        study = json.load(f)
    text = M.tables(study)
    with open(os.path.join(root, "docs", "studies.md")) as f:
        readme = f.read()
    missing = [line for line in text.splitlines() if line and line not in readme]
    assert not missing, missing[:5]
    with open(os.path.join(root, "study", "results", "tables.md")) as f:
        assert f.read() == text


def test_report_in_a_fresh_clone_rebuilds_from_the_committed_json(tmp_path):
    """No runs (runs/ is not committed): --report rebuilds tables.md and the figures from study.json."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(os.path.join(root, "study", "results", "study.json"), results / "study.json")
    M.main(["--report", "--out", str(tmp_path / "no-runs"), "--results", str(results)])
    with open(os.path.join(root, "study", "results", "tables.md")) as f:
        assert (results / "tables.md").read_text() == f.read()
    assert all((results / f).exists() for f in ("drift.png", "temperature.png", "gap.png"))
