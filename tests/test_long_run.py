"""study/long_run.py: its degradation rule and the false-alarm rate its protocol states, and the
whole pipeline (runs -> summaries -> long_run.json, tables, figures) at toy sizes."""

import json
import os
import re

import numpy as np
import pytest

from study import long_run as L


def test_the_protocol_threshold_and_false_alarm_rates_are_what_the_code_computes():
    assert L.protocol_delta() == L.DELTA
    rates = re.search(r"false-alarm rate\s+(\S+)% at p = 0.5 and (\S+)% at p = 0.3", L.__doc__)
    assert rates, "the protocol states the false-alarm rates at p = 0.5 and 0.3"
    assert float(rates.group(1)) == round(100 * L.false_alarm_rate(0.5), 1)
    assert float(rates.group(2)) == round(100 * L.false_alarm_rate(0.3), 1)


def test_degradation_rule_on_hand_made_curves():
    steps = list(range(0, 600, 40))                                      # 15 evaluation points
    flat = [0.5] * 15
    assert L.degraded_at(flat) == -1
    rise_then_fall = [0.40, 0.45, 0.50, 0.55, 0.55, 0.55, 0.55, 0.55, 0.45, 0.40, 0.40, 0.40, 0.40, 0.40, 0.40]
    s = L.smooth(rise_then_fall)
    assert s[7] == pytest.approx((0.55 + 0.55 + 0.45) / 3) and s[0] == pytest.approx(0.425)
    # s_8 = 0.4667 and s_9 = 0.4167 both lie more than 0.05 below the running max 0.55 (s_7 = 0.5167 does not)
    assert L.degraded_at(rise_then_fall) == 8
    c = L.curve_numbers(steps, rise_then_fall)
    assert c["onset"] == 320 and c["depth"] == pytest.approx(0.55 - 0.40) and c["final"] == pytest.approx(0.40)
    one_dip = list(flat)
    one_dip[6] = 0.44                                                    # one low evaluation: 2 points of s dip 0.02
    assert L.degraded_at(one_dip) == -1 and L.curve_numbers(steps, one_dip)["onset"] == L.NEVER
    last_point_only = flat[:-1] + [0.2]                                  # a drop at the very end needs a 2nd point
    assert L.degraded_at(last_point_only) == 13                          # s_13, s_14 = 0.4, 0.35: both below
    one_low_then_high = list(flat)
    one_low_then_high[6], one_low_then_high[7] = 0.3, 0.65             # s_5..s_8 = .433 .483 .483 .55: only
    assert L.degraded_at(one_low_then_high) == -1                        # one point 0.05 below: no onset
    tie = [0.55] * 3 + [0.50] * 12                                       # exactly DELTA below: not "more than"
    assert L.degraded_at(tie) == -1
    batch = np.array([flat, rise_then_fall])
    assert L.degraded_at(batch).tolist() == [-1, 8]


def test_entropy_late_rise_on_hand_values():
    falls_then_rises = [4.0, 3.0, 2.0, 2.0, 3.0]
    assert L.late_rise(falls_then_rises, 1) == pytest.approx(3.0 / 2.0)      # 3 against the minimum 2 before it
    assert L.late_rise(falls_then_rises, 2) == pytest.approx(2.5 / 2.0)      # means 3.5 2.5 2 2.5
    assert L.late_rise([4.0, 3.0, 2.0, 1.0], 2) == 1.0                       # only falls: never above its minimum
    assert L.late_rise(falls_then_rises, 6) is None                          # shorter than the window


def test_smoke_pipeline_resumes_and_reports_from_the_summaries(tmp_path):
    runs_dir, results = str(tmp_path / "runs"), str(tmp_path / "results")
    L.run_missing(L.SMOKE_RUNS, L.SMOKE_ARMS, runs_dir, results, jobs=2, budget_min=60)
    assert L.missing(L.SMOKE_RUNS, results) == []
    first = {r.name: os.path.getmtime(os.path.join(results, L.SUMMARIES, f"{r.name}.json")) for r in L.SMOKE_RUNS}
    L.run_missing(L.SMOKE_RUNS, L.SMOKE_ARMS, runs_dir, results, jobs=2, budget_min=60)   # nothing to do
    assert {n: os.path.getmtime(os.path.join(results, L.SUMMARIES, f"{n}.json")) for n in first} == first
    study = L.report(results)
    for f in ("long_run.json", "tables.md", "heldout.png", "drift.png", "ablations.png"):
        assert (tmp_path / "results" / f).exists()
    with open(os.path.join(results, L.SUMMARIES, "long-erpo-s0.json")) as f:
        s = json.load(f)
    assert s["eval_steps"] == [0, 2, 4] and set(s["eval"]) == {"0.4", "1", "1.2"}
    assert len(s["query_kl"]) == L.SMOKE_ARMS["long"].steps and s["golden"] == L.golden_digest()
    paired = study["paired_erpo_minus_grpo"]["query_kl_tail"]["values"]
    assert paired == pytest.approx([study["runs"]["long-erpo-s0"]["query_kl_tail"]
                                    - study["runs"]["long-grpo-s0"]["query_kl_tail"]])
    ab = study["ablations"]["short-erpo-a0.05-s0"]
    assert ab["vs_grpo"]["1"] == pytest.approx(ab["last@1"] - study["ablations"]["short-grpo-s0"]["last@1"])
    assert (tmp_path / "results" / "tables.md").read_text() == L.tables(study)


def test_a_run_without_its_summary_resumes_and_gets_the_same_one(tmp_path):
    runs_dir, results = str(tmp_path / "runs"), str(tmp_path / "results")
    one = [L.SMOKE_RUNS[0]]
    L.run_missing(one, L.SMOKE_ARMS, runs_dir, results, jobs=1, budget_min=60)
    path = os.path.join(results, L.SUMMARIES, f"{one[0].name}.json")
    with open(path) as f:
        first = json.load(f)
    os.remove(path)                                                      # e.g. a session ended before the commit
    L.run_missing(one, L.SMOKE_ARMS, runs_dir, results, jobs=1, budget_min=60)   # --resume: nothing left to train
    with open(path) as f:
        again = json.load(f)
    assert [seg["resumed"] for seg in again["segments"]] == [False, True]
    skip = {"segments", "seconds"}
    assert {k: v for k, v in again.items() if k not in skip} == {k: v for k, v in first.items() if k not in skip}


def test_the_report_of_a_partial_study(tmp_path):
    """Seeds missing on either side, an ablation without its partner or grpo-s0, unlogged monitors."""
    steps, evals = list(range(1, 81)), list(range(0, 81, 40))

    def summary(name, arm, algo, seed, entropy=0.5):
        return {"name": name, "arm": arm, "algo": algo, "seed": seed, "commit": "c", "golden": "g", "seconds": 1,
                "steps": steps, "query_kl": [1e-3] * 80, "policy_kl": [None] * 80,
                "entropy": [entropy] * 79 + [None], "eval_steps": evals,
                "eval": {t: [0.5, 0.6, 0.4 + seed / 100] for t in ("0.4", "1", "1.2")}}
    runs = [summary("long-grpo-s0", "long", "grpo", 0), summary("long-grpo-s2", "long", "grpo", 2, 0.7),
            summary("long-erpo-s2", "long", "erpo", 2), summary("short-erpo-g16-s0", "short", "erpo", 0)]
    os.makedirs(tmp_path / L.SUMMARIES)
    for r in runs:
        (tmp_path / L.SUMMARIES / f"{r['name']}.json").write_text(json.dumps(r))
    study = L.report(str(tmp_path))
    assert study["seeds"] == {"grpo": [0, 2], "erpo": [2]} and study["pairs"] == [2]
    assert study["algos"]["grpo"]["entropy_tail"]["values"] == pytest.approx([0.5, 0.7])
    assert study["paired_erpo_minus_grpo"]["entropy_tail"]["values"] == pytest.approx([-0.2])
    assert study["algos"]["grpo"]["policy_kl_tail"]["mean"] is None
    assert study["ablations"]["short-erpo-g16-s0"]["vs_grpo"] is None
    text = L.tables(study)
    assert "| grpo, seeds 0 / 2 | erpo, seeds 2 |" in text and "paired (n=1)" in text
    assert "| Policy-KL k3, last 10% of steps (x1e-3) | — | — | — |" in text
    assert "| erpo-g16-s0 | 60.0 | 60.0 | 60.0 | 1.00 | 0.500 | — | — |" not in text   # its last eval is 0.40
    assert "| erpo-g16-s0 | 40.0 | 40.0 | 40.0 | 1.00 | 0.500 | — | — |" in text


def test_a_budget_too_small_starts_nothing(tmp_path, capsys):
    results = str(tmp_path / "results")
    L.run_missing(L.SMOKE_RUNS, L.SMOKE_ARMS, str(tmp_path / "runs"), results, jobs=1, budget_min=0.5)
    assert len(L.missing(L.SMOKE_RUNS, results)) == len(L.SMOKE_RUNS)
    assert "would not end within 0.5 min" in capsys.readouterr().out


def test_the_readme_long_run_tables_are_built_from_the_committed_json():
    """Every line of the tables L.tables() makes from study/results/long_run/long_run.json is in
    docs/studies.md, tables.md next to it is that same text, and the JSON is what the committed run
    summaries give."""
    with open(os.path.join(L.RESULTS, "long_run.json")) as f:
        study = json.load(f)
    text = L.tables(study)
    with open(os.path.join(L.ROOT, "docs", "studies.md")) as f:
        readme = f.read()
    missing = [line for line in text.splitlines() if line and line not in readme]
    assert not missing, missing[:5]
    with open(os.path.join(L.RESULTS, "tables.md")) as f:
        assert f.read() == text
    again = json.loads(json.dumps(L.aggregate(L.load_summaries(L.RESULTS))))
    assert L.tables(again) == text
