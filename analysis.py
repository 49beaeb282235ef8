"""Look at what training did: KL and accuracy curves of runs, and the paper's Appendix D study.

    python analysis.py runs runs/grpo runs/erpo --out results/tiny        # Fig. 1/4, Tables 4-5
    python analysis.py compare runs/grpo runs/erpo --last 10              # one table, B - A
    python analysis.py nll --model data/tinymath/warmstart --benchmarks tiny-test \\
        --max-new-tokens 96 --out results/nll                             # Appendix D

`runs` plots Query-KL vs Policy-KL over steps (kl.png) and training vs held-out accuracy
(train_eval_gap.png, with 95% Wilson intervals) from each run's metrics.jsonl, and prints the mean
train - held-out gap; and the instruments (rl/monitors.py), where logged: each loss term's gradient
norm and its cosine with the policy gradient (grad_norms.png, grad_cos.png), held-out vs trained
prompts' Query-KL at evaluations (query_kl_heldout.png), the premise meter (premise.png).
`compare` prints one table of runs side by side: the last held-out accuracy per set with its 95%
Wilson interval, train accuracy, Query-KL, Policy-KL and entropy averaged over the last --last
steps, the steps, and each run minus the first (B - A); then a verdict line (each B - A in held-out
accuracy against its 95% interval). Percentages to 0.1 point, other numbers to 3 significant
digits. Both commands warn, in one line naming the file and line, of a metrics.jsonl line that is
not a JSON object (left out); log-scaled plots draw values <= 0 on the bottom edge and say so.
`nll` samples one response per problem and relates the query's mean per-token NLL to the
response's (one forward over [prompt | response]): their Pearson correlation is the paper's
motivation for query weights (method.md §4).
"""

import argparse
import json
import math
import os
import sys

from plumbing import threads

os.environ.update(threads.short_spin(os.environ))  # OpenMP's threads: a short spin, then sleep (before torch)

import torch
from tqdm import tqdm

from evaluation import heldout
from modeling import logprobs
import rollout
from data import benchmarks
from plumbing import errors, extension, interrupts, plots, run_dir

# ----------------------------------------------------------------------------- training runs


def read_metrics(run, need_rows=False):
    """Rows of a training run's metrics.jsonl (RUN_DIR or the file itself), each line that is not a
    JSON object said in one warning (file and line); `need_rows`: an empty file is an error too."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl in {run}" + ("" if os.path.exists(run) else " (no such folder)"))
    rows = run_dir.read_jsonl(path, warn=warn)
    if need_rows and not any("step" in r for r in rows):
        raise ValueError(f"{path} has no step logged yet (an empty run)")
    return rows


def heldout_problems(run) -> dict:
    """{held-out set: problems per evaluation} of a run, from its config.json (--eval-data,
    --eval-limit, --task): the set's size up to the limit; a hub benchmark (not read here) or a set
    that no longer loads counts --eval-limit problems, or is left out (no interval) without one."""
    cfg = run_dir.read_config(run if os.path.isdir(run) else os.path.dirname(run)) or {}
    limit, out = cfg.get("eval_limit") or None, {}
    for name in cfg.get("eval_data", []):
        key = benchmarks.canonical_name(name)
        try:
            if key in benchmarks.HUB or key in benchmarks.HUB_FILES:
                raise ValueError("a hub benchmark")
            rows = next(iter(heldout.load_sets([name], limit, None, cfg.get("task", "math")).values()))
            out[name] = len(rows)
        except (OSError, ValueError):
            if limit:
                out[name] = limit
    return out


def train_eval_gap(rows):
    """Tables 4-5: mean of (train_acc - eval_acc) over the steps that logged both, or None."""
    gaps = [r["train_acc"] - r["eval_acc"] for r in rows
            if r.get("train_acc") is not None and r.get("eval_acc") is not None]
    return sum(gaps) / len(gaps) if gaps else None


def analyze_runs(runs, out_dir):
    label = plots.short_labels([os.path.normpath(r) for r in runs])
    data = {label[os.path.normpath(r)]: read_metrics(r) for r in runs}
    first_set = {label[os.path.normpath(r)]: next(iter(heldout_problems(r).values()), None) for r in runs}
    os.makedirs(out_dir, exist_ok=True)
    paths = [p for p in (plots.kl_over_steps(data, os.path.join(out_dir, "kl.png")),
                         plots.train_vs_heldout(data, os.path.join(out_dir, "train_eval_gap.png"),
                                                {k: v for k, v in first_set.items() if v}),
                         *monitor_plots(data, out_dir)) if p]
    for name, rows in data.items():
        gap = train_eval_gap(rows)
        print(f"{name}: mean train - held-out accuracy gap = "
              f"{'-' if gap is None else f'{100 * gap:.2f} pts'}")
    print("wrote " + (", ".join(paths) if paths else "no plots (no KL or accuracy keys logged)"))
    return paths


# The instruments of issue #43 (rl/monitors.py; method.md §11): one figure each, None where no run logged them
GRAD_TERMS = ("policy_kl", "query_kl", "entropy")


def _step_figure(runs, path, title, ylabel, curves, log=False):
    """One figure over steps: for each run (colour) each (key, style, label) of `curves` it logged;
    `log`: log scale, the values <= 0 on its bottom edge (plots.plot_log), the y label says so."""
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    low = 0
    for i, (name, rows) in enumerate(runs.items()):
        for key, style, what in curves:
            x, y = plots.series(rows, key)
            if x and log:
                low += plots.plot_log(ax, x, y, style, f"C{i}", f"{name} {what}", ms=3)
            elif x:
                ax.plot(x, y, style, color=f"C{i}", ms=3, label=f"{name} {what}" if what else "_nolegend_")
    out = None
    if ax.lines:
        if log:
            ylabel = plots.log_ylabel(ax, ylabel, low)
        else:
            ax.axhline(0, color="grey", lw=0.5)
        out = plots._save_step_plot(fig, ax, ylabel, path, title)
    plt.close(fig)
    return out


def monitor_plots(runs: dict, out_dir) -> list:
    """grad_norms.png (each loss term's gradient norm, log scale), grad_cos.png (the cosine of the
    policy gradient with each regulariser's), query_kl_heldout.png (Query-KL of held-out prompts vs
    prompts the run trained on, at each evaluation: their gap is the memorisation curve; a run from
    before issue #50 logged the training set's first rows instead, drawn as such), premise.png (premise_r)."""
    styles = dict(zip(("pg", *GRAD_TERMS), ("-", "--", ":", "-.")))
    return [
        _step_figure(runs, os.path.join(out_dir, "grad_norms.png"), "Gradient norm of each loss term "
                     "(as it enters the loss; one micro-batch)", "gradient norm",
                     [(f"grad_norm/{t}", styles[t] + "o", t) for t in styles], log=True),
        _step_figure(runs, os.path.join(out_dir, "grad_cos.png"), "Cosine of the policy gradient with each "
                     "regulariser's", "cosine",
                     [(f"grad_cos/pg_{t}", styles[t] + "o", t) for t in GRAD_TERMS]),
        _step_figure(runs, os.path.join(out_dir, "query_kl_heldout.png"), "Query-KL at evaluations: held-out "
                     "(solid) vs prompts the run trained on (dashed)", "Query-KL",
                     [("eval_query_kl", "-o", "held-out"),
                      ("eval_query_kl_trained", "--s", "trained prompts"),
                      ("eval_query_kl_train", ":x", "first training rows (older runs)")], log=True),
        _step_figure(runs, os.path.join(out_dir, "premise.png"), "Premise meter: r(prompt NLL under pi_0, "
                     "response NLL under pi_old) per step, with its 95% interval", "Pearson r",
                     [("premise_r", "-", "r"), ("premise_r_lo", ":", "95% interval"),
                      ("premise_r_hi", ":", None)])]


# ----------------------------------------------------------------------------- two runs, one table

MONITORS = (("train_acc", "train accuracy %", 100), ("query_kl", "Query-KL", 1),
            ("policy_kl", "Policy-KL", 1), ("entropy", "entropy", 1))


def last_steps_mean(rows, key, last):
    """(mean of `key` over the steps last_step - last + 1 .. last_step that logged it, (first, last
    step averaged)), or (None, None)."""
    steps = [r["step"] for r in rows if "step" in r]
    top = max(steps, default=0)
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("step", 0) > top - last
           and r.get("step", 0) > 0]
    if not pts:
        return None, None
    return sum(v for _, v in pts) / len(pts), (min(s for s, _ in pts), max(s for s, _ in pts))


def final_heldout(rows, name):
    """(accuracy, step) of the last evaluation of held-out set `name`, or (None, None)."""
    pts = [(r[f"eval_acc/{name}"], r["step"]) for r in rows if r.get(f"eval_acc/{name}") is not None]
    return pts[-1] if pts else (None, None)


def newcombe(p1, n1, p2, n2):
    """95% interval of p2 - p1 from the two Wilson intervals (Newcombe's hybrid score method, for
    independent samples: the same problems in both runs make it conservative)."""
    (l1, u1), (l2, u2) = plots.wilson(p1, n1), plots.wilson(p2, n2)
    d = p2 - p1
    return d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)


def compare_table(runs, last=10) -> str:
    """One markdown table: a column per run, then each later run minus the first (B - A); under it
    the verdict line. One precision: percentages (accuracies and their differences) to 0.1 point,
    every other number to 3 significant digits."""
    label = plots.short_labels([os.path.normpath(r) for r in runs])
    names = [label[os.path.normpath(r)] for r in runs]
    data = [read_metrics(r, need_rows=True) for r in runs]
    sizes = [heldout_problems(r) for r in runs]
    sets = list(dict.fromkeys(k[len("eval_acc/"):] for rows in data for r in rows for k in r
                              if k.startswith("eval_acc/") and "/L" not in k[len("eval_acc/"):]))
    head = names + [f"{b} - {names[0]}" for b in names[1:]]
    table = [accuracy_row(name, data, sizes) for name in sets]
    for key, what, scale in MONITORS:
        got = [last_steps_mean(rows, key, last) for rows in data]
        cells = ["-" if m is None else f"{_num(scale * m, pct=scale == 100)} (steps {a}-{b})" for m, (a, b) in
                 [(m, span or (None, None)) for m, span in got]]
        cells += ["-" if m is None or got[0][0] is None else
                  _num(scale * (m - got[0][0]), sign=True, pct=scale == 100) for m, _ in got[1:]]
        table.append([f"{what}, mean of the last {last} steps"] + cells)
    steps = [max((r["step"] for r in rows if "step" in r), default=0) for rows in data]
    table.append(["steps"] + [str(s) for s in steps] + [f"{s - steps[0]:+d}" for s in steps[1:]])
    lines = ["| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table] +
                     [verdict(names, data, sizes, sets)])


def heldout_differences(name, data, sizes):
    """[(B - A, its 95% Newcombe interval or None, A's and B's steps)] of held-out set `name`'s last
    accuracy, one per later run (None where either run has none)."""
    vals, ns = [final_heldout(rows, name) for rows in data], [sz.get(name) for sz in sizes]
    (p0, s0), n0 = vals[0], ns[0]
    return [None if p is None or p0 is None else
            (p - p0, newcombe(p0, n0, p, n) if n and n0 else None, (s0, st))
            for (p, st), n in zip(vals[1:], ns[1:])]


def accuracy_row(name, data, sizes) -> list:
    """The table's row of held-out set `name`: each run's last accuracy, then each B - A."""
    cells = [_acc_cell(p, sz.get(name), st) for (p, st), sz in
             zip((final_heldout(rows, name) for rows in data), sizes)]
    for d in heldout_differences(name, data, sizes):
        cells.append("-" if d is None else _num(100 * d[0], sign=True, pct=True) + (
            "" if d[1] is None else " [{}, {}]".format(*(_num(100 * x, sign=True, pct=True) for x in d[1]))))
    return [f"held-out {name} %, last eval [95% interval]"] + cells


def verdict(names, data, sizes, sets) -> str:
    """One line: for each later run and held-out set, B - A in points and whether its 95% interval
    excludes 0 (above / below) or not (no difference shown)."""
    said = []
    for name in sets:
        for b, d in zip(names[1:], heldout_differences(name, data, sizes)):
            if d is None:
                continue
            diff, ci, (s0, s1) = d
            span = "" if ci is None else " [{}, {}]".format(*(_num(100 * x, sign=True, pct=True) for x in ci))
            word = ("no interval (problem count unknown)" if ci is None else f"{b} higher at 95%" if ci[0] > 0
                    else f"{b} lower at 95%" if ci[1] < 0 else "no difference shown at 95%")
            when = "" if s0 == s1 else f", evaluated at steps {s0} vs {s1}"
            said.append(f"{b} - {names[0]} on {name}: {_num(100 * diff, sign=True, pct=True)} points{span}, "
                        f"{word}{when}")
    return "verdict: " + ("; ".join(said) if said else
                          "no held-out set evaluated in both runs (turn evaluations on: --eval-every)")


def _acc_cell(p, n, step):
    if p is None:
        return "-"
    lo, hi = plots.wilson(p, n)
    return _num(100 * p, pct=True) + (f" [{_num(100 * lo, pct=True)}, {_num(100 * hi, pct=True)}] of {n}"
                                      if n else "") + f" (step {step})"


def _num(x, sign=False, pct=False):
    """The table's one precision: a percentage to 0.1 point, anything else to 3 significant digits."""
    return format(x, ("+" if sign else "") + (".1f" if pct else ".3g"))


# ----------------------------------------------------------------------------- Appendix D


def query_response_nll(model, ro: rollout.Rollout):
    """Mean per-token NLL of each prompt (tokens after the first) and of each response, from one
    forward over [prompt | response] at temperature 1 (the model's own likelihood).
    -> (query NLLs, response NLLs, query token counts, response token counts), lists of B."""
    packed = ro.packed()
    with torch.no_grad():
        s = logprobs.score_tokens(model, packed, 1.0)
    q_mask, r_mask = packed.prompt_tok_mask.bool(), ro.response_mask.bool()
    q = -torch.where(q_mask, s.prompt, 0.0).sum(1) / q_mask.sum(1).clamp(min=1)
    r = -torch.where(r_mask, s.response, 0.0).sum(1) / r_mask.sum(1).clamp(min=1)
    return q.tolist(), r.tolist(), q_mask.sum(1).tolist(), r_mask.sum(1).tolist()


def pearson(xs, ys):
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def pearson_interval(r, n, z=1.96):
    """95% interval of a Pearson r over n pairs (Fisher's z: atanh(r) +- z / sqrt(n - 3)); nan for
    n < 4 or an undefined r."""
    if n < 4 or not math.isfinite(r) or abs(r) >= 1:
        return float("nan"), float("nan")
    f, half = math.atanh(r), z / math.sqrt(n - 3)
    return math.tanh(f - half), math.tanh(f + half)


def nll_pairs(model, tokenizer, key, bench, rows, args):
    """One response per problem of one benchmark -> records of (query NLL, response NLL)."""
    out, bs = [], args.batch_size
    for s in tqdm(range(0, len(rows), bs), desc=f"nll {bench}", disable=args.no_progress):
        chunk = rows[s:s + bs]
        samples, ro = heldout.generate_samples(
            model, tokenizer, chunk, args.temperature, {p["id"]: [0] for p in chunk}, benchmark=bench,
            template=args.template, max_new_tokens=args.max_new_tokens, top_p=args.top_p, batch_size=bs,
            seed=args.seed, sampler=args.sampler)
        q, r, nq, nr = query_response_nll(model, ro)
        correct, _ = heldout.grade([x["completion"] for x in samples], chunk, args.grade_timeout)
        for p, qi, ri, a, b, c in zip(chunk, q, r, nq, nr, correct):
            out.append({"model": key, "benchmark": bench, "id": p["id"], "query_nll": qi, "response_nll": ri,
                        "query_tokens": a, "response_tokens": b, "correct": bool(c)})
    return out


def analyze_nll(args):
    """nll_pairs.jsonl, the Pearson correlation per model x benchmark, and a scatter plot. Every
    --model (an HF folder or hub id, a run folder, a checkpoint: heldout.load_model) is checked,
    a local one's tokenizer included, before the first is loaded; --out is written only at the end."""
    benches = heldout.load_sets(args.benchmarks, args.limit, args.data_dir, args.task)
    for path in args.model:
        heldout.model_source(path)
    pairs = []
    for path, key in zip(args.model, heldout.model_keys(args)):
        model, tokenizer = heldout.load_model(path, device=args.device, dtype=args.dtype)
        for bench, rows in benches.items():
            pairs += nll_pairs(model.eval(), tokenizer, key, bench, rows, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "nll_pairs.jsonl"), "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    lines, groups = [], {}   # r's 95% interval: Fisher's z
    for key in dict.fromkeys(p["model"] for p in pairs):
        for bench in benches:
            sel = [p for p in pairs if p["model"] == key and p["benchmark"] == bench]
            xs, ys = [p["query_nll"] for p in sel], [p["response_nll"] for p in sel]
            rho = pearson(xs, ys)
            lo, hi = pearson_interval(rho, len(sel))
            lines.append(f"{key} on {bench}: Pearson r(query NLL, response NLL) = {rho:.3f} "
                         f"[95%: {lo:.3f}, {hi:.3f}] over {len(sel)} problems")
            name = f"{plots.short_labels([key])[key]} / {bench}"
            groups[f"{name} (r={rho:.2f} [{lo:.2f}, {hi:.2f}])"] = (xs, ys)
    plots.nll_scatter(groups, os.path.join(args.out, "nll_scatter.png"))
    print("\n".join(lines))
    with open(os.path.join(args.out, "nll_correlation.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return pairs


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = errors.OneLineParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("runs", help="KL and train vs held-out accuracy plots of training runs")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", default="results/runs")
    c = sub.add_parser("compare", help="one table of runs side by side, each minus the first (B - A)")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="two or more run folders; the first is A")
    c.add_argument("--last", type=int, default=10, help="monitors: mean over the last N steps (default 10)")
    n = sub.add_parser("nll", help="Appendix D: query NLL vs response NLL per problem")
    heldout.add_sampling_args(n, benchmarks=["tiny-test"], out="results/nll")
    n.add_argument("--temperature", type=float, default=1.0)
    extension.load_named(sys.argv[1:] if argv is None else argv)       # nll: a task of one's own
    args = p.parse_args(argv)
    if args.cmd == "compare" and (len(args.runs) < 2 or args.last < 1):
        fail("compare needs two or more run folders" if len(args.runs) < 2 else
             f"--last must be >= 1, got {args.last}")
    if args.cmd == "nll":
        try:
            check_nll_args(args)
        except ValueError as e:
            fail(e)
    return args


def check_nll_args(args):
    """`nll`'s flag values (evaluate.py's shared checks, and --temperature), before anything is
    loaded or written; fills in the --max-new-tokens default."""
    heldout.check_sampling_args(args)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be finite and >= 0, got {args.temperature}")
    if args.max_new_tokens is None:
        args.max_new_tokens = heldout.default_max_new_tokens(args.template)


def warn(msg):
    """Something left out of what is shown (a malformed metrics.jsonl line): one line on stderr."""
    print(f"analysis.py: warning: {msg}", file=sys.stderr)


def fail(msg):
    """Bad input: one line on stderr and exit status 2, no traceback, no usage dump."""
    print(f"analysis.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.cmd == "runs":
            return analyze_runs(args.runs, args.out)
        if args.cmd == "compare":
            text = compare_table(args.runs, args.last)
            print(text)
            return text
        kept = "nothing written (the results are written at the end); rerun the command"
        with interrupts.exit_when_interrupted(lambda: kept, "analysis.py"):
            return analyze_nll(args)
    except (OSError, ValueError) as e:  # a missing run folder, benchmark file or model: one line
        fail(heldout.first_line(e))


if __name__ == "__main__":
    main()
