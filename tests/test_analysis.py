"""analysis.py: training-run plots and the train - held-out gap; `compare`'s table of two runs on
hand-written metrics; the `next:` lines a run ends with, their sample counts against evaluate.py's
own; the Appendix D query/response NLL from one forward against the NLL of each part computed
separately."""

import json
import math
import os
import shlex

import pytest
import torch

import analysis
import evaluate
from evaluation import heldout
from modeling import models
import rollout
from plumbing import plots, run_dir, run_summary
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def test_run_plots_and_gap(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward": 0.5, "train_acc": 0.5 + 0.01 * s, "query_kl": 0.01 * (s + 1),
             "policy_kl": 0.001 * (s + 1)} for s in range(10)]
    for r in rows[::3]:
        r["eval_acc"] = r["train_acc"] - 0.1
    rows.append({"step": 10, "reward": 0.6})  # keys missing: tolerated
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n" + '{"step": 11, "rew')
    analysis.main(["runs", str(run), "--out", str(tmp_path / "o")])
    assert (tmp_path / "o" / "kl.png").stat().st_size > 0
    assert (tmp_path / "o" / "train_eval_gap.png").stat().st_size > 0
    assert "gap = 10.00 pts" in capsys.readouterr().out
    assert analysis.train_eval_gap(rows) == pytest.approx(0.1)
    with pytest.raises(SystemExit):
        analysis.main(["runs", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "no metrics.jsonl" in capsys.readouterr().err


def write_run(folder, rows, **config):
    folder.mkdir(parents=True)
    cfg = {"task": "math", "eval_limit": 200, "eval_temperatures": [1.0], **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_wilson_interval_by_hand():
    # p = 0.5, n = 200: centre 0.5, half = 1.96 sqrt(0.25/200 + 1.96^2/160000) / (1 + 1.96^2/200)
    lo, hi = plots.wilson(0.5, 200)
    half = 1.96 * math.sqrt(0.25 / 200 + 1.96 ** 2 / 160000) / (1 + 1.96 ** 2 / 200)
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half))
    assert (lo, hi) == pytest.approx((0.4314, 0.5686), abs=1e-4)      # 100 of 200, as tabulated
    assert plots.wilson(0.0, 10)[0] == 0.0 and plots.wilson(0.4, None) == (0.4, 0.4)


def test_compare_two_runs_by_hand(tmp_path, capsys):
    """Two hand-made runs of 20 steps: the table's numbers, worked out by hand."""
    def rows(qkl, acc_test, acc_hard):
        out = [{"step": 0, "eval_acc": 0.3, "eval_acc/tiny-test": 0.3, "eval_acc/tiny-hard": 0.1,
                "eval_acc/tiny-test/L3": 0.5}]
        for s in range(1, 21):
            out.append({"step": s, "train_acc": 0.01 * s, "query_kl": qkl * s, "policy_kl": 0.02,
                        "entropy": 0.04})
        out[-1].update({"eval_acc": acc_test, "eval_acc/tiny-test": acc_test, "eval_acc/tiny-hard": acc_hard})
        return out
    a = write_run(tmp_path / "runs" / "grpo", rows(0.001, 0.5, 0.25), eval_data=["tiny-test", "tiny-hard"])
    b = write_run(tmp_path / "runs" / "erpo", rows(0.0005, 0.55, 0.20), eval_data=["tiny-test", "tiny-hard"])
    analysis.main(["compare", a, b, "--last", "5"])
    table = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in
             capsys.readouterr().out.splitlines()[2:]}
    # eval_limit 200 of tiny-test's 500 and tiny-hard's 300 problems: n = 200 for both
    lo, hi = plots.wilson(0.5, 200)
    assert table["held-out tiny-test %, last eval [95% interval]"][0] == \
        f"50.0 [{100 * lo:.1f}, {100 * hi:.1f}] of 200 (step 20)"
    assert table["held-out tiny-test %, last eval [95% interval]"][2].startswith("+5.0 [")
    assert table["held-out tiny-hard %, last eval [95% interval]"][2].startswith("-5.0 [")
    # steps 16-20: train_acc 0.16 .. 0.20, mean 0.18; Query-KL 0.001 * 18 = 0.018 vs 0.009
    assert table["train accuracy %, mean of the last 5 steps"][:2] == ["18.0 (steps 16-20)", "18.0 (steps 16-20)"]
    assert table["Query-KL, mean of the last 5 steps"][:2] == ["0.018 (steps 16-20)", "0.009 (steps 16-20)"]
    assert table["Query-KL, mean of the last 5 steps"][2].rstrip(" |") == "-0.009"
    assert table["Policy-KL, mean of the last 5 steps"][2].rstrip(" |") == "+0"
    assert table["steps"][0] == "20"
    # the verdict: each difference against its interval (+5 and -5 points over 200 problems: noise)
    verdict = [k for k in table if k.startswith("verdict: ")]
    assert verdict == ["verdict: erpo - grpo on tiny-test: +5.0 points [{}, {}], no difference shown at 95%; "
                       "erpo - grpo on tiny-hard: -5.0 points [{}, {}], no difference shown at 95%".format(
                           *(f"{100 * x:+.1f}" for x in (*analysis.newcombe(0.5, 200, 0.55, 200),
                                                         *analysis.newcombe(0.25, 200, 0.20, 200))))]
    assert analysis.newcombe(0.5, 200, 0.5, 200)[0] == pytest.approx(-(0.5 - lo) * math.sqrt(2))
    # one-line errors: a missing folder, a folder without metrics.jsonl, an empty metrics.jsonl
    (tmp_path / "bare").mkdir()
    empty = write_run(tmp_path / "empty", [])
    for bad, why in ((str(tmp_path / "nope"), "no such folder"), (str(tmp_path / "bare"), "no metrics.jsonl"),
                     (empty, "no step logged yet")):
        with pytest.raises(SystemExit) as e:
            analysis.main(["compare", a, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        analysis.main(["compare", a])
    assert "two or more run folders" in capsys.readouterr().err


def test_next_lines_count_what_evaluate_would_sample(tmp_path):
    """The `next:` evaluate.py commands a run ends with: each says how many samples it draws, and
    evaluate.py's own count for exactly those flags (parsed by its parser, its benchmarks loaded as it
    loads them) is that number; the paper-protocol note names evaluate.py's defaults."""
    sets = ["tiny-test", "tiny-ood", "tiny-hard"]
    out = write_run(tmp_path / "run", [{"step": 0, "eval_acc": 0.3, "eval_acc/tiny-test": 0.3},
                                       {"step": 1, "query_kl": 0.0, "entropy": 0.1}], eval_data=sets)
    os.makedirs(os.path.join(out, "ckpt"))
    open(os.path.join(out, "ckpt", "state.pt"), "w").close()
    text = run_summary.summary(out, 60, sets, "plain")
    cmds = [line.split("#") for line in text.splitlines() if line.strip().startswith("python evaluate.py")]
    assert len(cmds) == 2 and "quick" in cmds[0][1] and "sized like the run" in cmds[1][1]
    counts = []
    for cmd, note in cmds:
        args = evaluate.parse_args(shlex.split(cmd)[2:])
        benches = evaluate.load_benchmarks(args.benchmarks, args.limit, args.data_dir, args.task)
        keys = heldout.model_keys(args)
        counts.append(evaluate.planned_samples(benches, args.temperatures, args.n, keys))
        assert f"{counts[-1]:,} samples" in note
    assert counts == [3 * 200 * 1 * 1, 3 * 200 * 8 * 3]
    assert f"  # with a run to compare: python analysis.py compare <another run folder> {out}" in text
    # the paper's protocol: evaluate.py's defaults, 492,800 samples on the tiny world (docs/evaluation.md)
    args = evaluate.parse_args(["--model", os.path.join(out, "ckpt"), "--out", str(tmp_path / "e")])
    assert (args.n, len(args.temperatures)) == (run_summary.PAPER_N, run_summary.PAPER_TEMPERATURES)
    benches = evaluate.load_benchmarks(args.benchmarks, None, None)
    full = evaluate.planned_samples(benches, args.temperatures, args.n, ["m"])
    assert full == 492_800
    assert f"{run_summary.PAPER_N} samples x {run_summary.PAPER_TEMPERATURES} temperatures" in text
    with open(os.path.join(ROOT, "docs", "evaluation.md")) as f:
        assert "492,800" in f.read()


def test_the_next_compare_line_works_as_pasted(tmp_path, capsys):
    """`next:`'s comparison names a run beside this one (runs/grpo beside runs/erpo) and then works
    as pasted; with none, it is a comment whose placeholder is plainly one (`compare OTHER_RUN`
    failed as pasted)."""
    rows = [{"step": 0, "eval_acc": 0.3, "eval_acc/tiny-test": 0.3}, {"step": 1, "query_kl": 0.0, "entropy": 0.1}]
    erpo = write_run(tmp_path / "runs" / "erpo", rows)
    line = run_summary.compare_command(erpo)
    assert line.strip().startswith("# with a run to compare: python analysis.py compare <another run folder> ")
    (tmp_path / "runs" / "notes").mkdir()                               # a folder of the user's: not a run
    grpo = write_run(tmp_path / "runs" / "grpo", rows)
    line = run_summary.compare_command(erpo)
    cmd = line.split("#")[0].split()
    assert cmd == ["python", "analysis.py", "compare", grpo, erpo]
    analysis.main(cmd[2:])
    assert "verdict: erpo - grpo" in capsys.readouterr().out


def test_query_response_nll_matches_separate_forwards():
    """Query/response NLL from one forward equals the NLL computed on each part separately."""
    model, tok = models.load_policy(WARM)
    prompts = [tok("Mia has 3 apples.", add_special_tokens=False)["input_ids"],
               tok("12 + 5", add_special_tokens=False)["input_ids"]]  # different lengths: padding
    eos = rollout.eos_token_ids(model, tok)
    ro = rollout.sample(model, prompts, max_new_tokens=6, eos_ids=eos, pad_id=tok.pad_token_id, seeds=[1, 2])
    q, r, nq, nr = analysis.query_response_nll(model, ro)
    for i, p in enumerate(prompts):
        resp = ro.response_ids[i][ro.response_mask[i].bool()].tolist()
        ids = torch.tensor([p + resp])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        tok_lp = logp.gather(1, ids[0, 1:, None])[:, 0]
        assert nq[i] == len(p) - 1 and nr[i] == len(resp)
        assert_rounding("analysis.query_nll", q[i], -tok_lp[:len(p) - 1].mean().item())
        assert_rounding("analysis.response_nll", r[i], -tok_lp[len(p) - 1:].mean().item())
    assert analysis.pearson([1, 2, 3], [2, 4, 6.5]) > 0.99
    assert math.isnan(analysis.pearson([1, 1], [2, 3]))


def test_compare_verdict_says_which_run_is_higher(tmp_path, capsys):
    """A difference whose interval excludes 0 is named; runs without evaluations say so."""
    rows = [{"step": 1, "eval_acc/tiny-test": 0.3}], [{"step": 1, "eval_acc/tiny-test": 0.6}]
    a, b = (write_run(tmp_path / n, r, eval_data=["tiny-test"]) for n, r in zip("ab", rows))
    assert analysis.compare_table([a, b]).splitlines()[-1].endswith("], b higher at 95%")
    bare = [write_run(tmp_path / n, [{"step": 1, "query_kl": 0.1}]) for n in ("c", "d")]
    assert "no held-out set evaluated in both runs" in analysis.compare_table(bare).splitlines()[-1]


def test_runs_and_compare_warn_of_malformed_lines(tmp_path, capsys):
    """A metrics.jsonl line that is not a JSON object is left out with one warning naming the file
    and its line, not dropped without a word (issue #50: a run shown at step 3 that reached 4)."""
    good = [{"step": s, "query_kl": 0.01 * s, "train_acc": 0.5} for s in range(1, 5)]
    a = write_run(tmp_path / "a", good)
    b = write_run(tmp_path / "b", good)
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    lines[2], lines[3] = '{"step": 3, "query', "[4]"
    (tmp_path / "b" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    analysis.main(["compare", a, b])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"analysis.py: warning: {os.path.join(b, 'metrics.jsonl')}:3: not a JSON object, left out "
                   "(and 1 more: line 4)"]
    analysis.main(["runs", b, "--out", str(tmp_path / "plots")])
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert len(run_dir.read_jsonl(os.path.join(b, "metrics.jsonl"))) == 3     # no warn: as before, [4] kept


def test_log_plots_draw_zeros_on_the_bottom_edge(tmp_path):
    """Log-scaled plots: a value <= 0 (step 0's KL, a term the loss lacks) is a triangle on the
    bottom edge, not dropped, and the y label says so; a run whose values are all 0 still shows."""
    plt = plots._plt()
    fig, ax = plt.subplots()
    assert plots.plot_log(ax, [0, 1, 2], [0.0, 1e-3, 2e-3], "-", "C0", "a") == 1
    assert plots.plot_log(ax, [0, 1], [0.0, 0.0], "-", "C1", "b (alpha = 0)") == 2
    assert "<= 0" in plots.log_ylabel(ax, "KL", 3) and plots.log_ylabel(ax, "KL", 0) == "KL (log)"
    assert [line.get_label() for line in ax.lines] == ["a", "_child1", "b (alpha = 0) (all <= 0)"]
    assert list(ax.lines[1].get_xdata()) == [0] and list(ax.lines[2].get_xdata()) == [0, 1]
    plt.close(fig)
    rows = {"a": [{"step": s, "grad_norm/pg": 1.0, "grad_norm/query_kl": 0.0} for s in (1, 2)]}
    path = analysis.monitor_plots(rows, str(tmp_path))[0]
    assert path and os.path.getsize(path) > 0
