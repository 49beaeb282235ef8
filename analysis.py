"""Look at what training did: KL and accuracy curves of runs, and the paper's Appendix D study.

    python analysis.py runs runs/grpo runs/erpo --out results/tiny        # Fig. 1/4, Tables 4-5
    python analysis.py nll --model data/tinymath/warmstart --benchmarks tiny-test \\
        --max-new-tokens 96 --out results/nll                             # Appendix D

`runs` plots Query-KL vs Policy-KL over steps (kl.png) and training vs held-out accuracy
(train_eval_gap.png) from each run's metrics.jsonl, and prints the mean train - held-out gap.
`nll` samples one response per problem and relates the query's mean per-token NLL to the
response's (one forward over [prompt | response]): their Pearson correlation is the paper's
motivation for query weights (method.md §4).
"""

import argparse
import json
import math
import os
import sys

import torch
from tqdm import tqdm

from evaluation import heldout
from modeling import logprobs
import rollout
from plumbing import errors, interrupts, plots, run_dir

# ----------------------------------------------------------------------------- training runs


def read_metrics(run):
    """Rows of a training run's metrics.jsonl (RUN_DIR or the file itself)."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl in {run}")
    return run_dir.read_jsonl(path)


def train_eval_gap(rows):
    """Tables 4-5: mean of (train_acc - eval_acc) over the steps that logged both, or None."""
    gaps = [r["train_acc"] - r["eval_acc"] for r in rows
            if r.get("train_acc") is not None and r.get("eval_acc") is not None]
    return sum(gaps) / len(gaps) if gaps else None


def analyze_runs(runs, out_dir):
    label = plots.short_labels([os.path.normpath(r) for r in runs])
    data = {label[os.path.normpath(r)]: read_metrics(r) for r in runs}
    os.makedirs(out_dir, exist_ok=True)
    paths = [p for p in (plots.kl_over_steps(data, os.path.join(out_dir, "kl.png")),
                         plots.train_vs_heldout(data, os.path.join(out_dir, "train_eval_gap.png"))) if p]
    for name, rows in data.items():
        gap = train_eval_gap(rows)
        print(f"{name}: mean train - held-out accuracy gap = "
              f"{'-' if gap is None else f'{100 * gap:.2f} pts'}")
    print("wrote " + (", ".join(paths) if paths else "no plots (no KL or accuracy keys logged)"))
    return paths


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
    lines, groups = [], {}
    for key in dict.fromkeys(p["model"] for p in pairs):
        for bench in benches:
            sel = [p for p in pairs if p["model"] == key and p["benchmark"] == bench]
            xs, ys = [p["query_nll"] for p in sel], [p["response_nll"] for p in sel]
            rho = pearson(xs, ys)
            lines.append(f"{key} on {bench}: Pearson r(query NLL, response NLL) = {rho:.3f} "
                         f"over {len(sel)} problems")
            groups[f"{plots.short_labels([key])[key]} / {bench} (r={rho:.2f})"] = (xs, ys)
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
    n = sub.add_parser("nll", help="Appendix D: query NLL vs response NLL per problem")
    heldout.add_sampling_args(n, benchmarks=["tiny-test"], out="results/nll")
    n.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)
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


def fail(msg):
    """Bad input: one line on stderr and exit status 2, no traceback, no usage dump."""
    print(f"analysis.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.cmd == "runs":
            return analyze_runs(args.runs, args.out)
        kept = "nothing written (the results are written at the end); rerun the command"
        with interrupts.exit_when_interrupted(lambda: kept, "analysis.py"):
            return analyze_nll(args)
    except (OSError, ValueError) as e:  # a missing run folder, benchmark file or model: one line
        fail(heldout.first_line(e))


if __name__ == "__main__":
    main()
