"""The paper's three claims, tested in miniature on the embedded world: seeds, 95% confidence
intervals, and a multi-epoch regime like the paper's.

    python -m study.miniature              # every run that is missing (resumable), then the report
    python -m study.miniature --report     # only the report: from the runs there are, else from the
                                           # committed study/results/study.json (a fresh clone)
    python -m study.miniature --smoke      # the same pipeline at toy sizes, in a temporary folder

PROTOCOL (written before the study was run; the numbers below are what the command does)

Regime. The paper trains 240 steps x 512 prompts over 8,523 problems: ~14 passes over its training
set, where a policy can fit its training questions. Here: a fixed subset of the first 256 tiny
training problems, 32 prompts x 8 responses per RL step, 112 steps = 14 passes (14 x 8 steps),
2 optimizer steps of 16 prompts per RL step, the README main command's other defaults (lr 2e-4,
T = 1.0, up to 96 new tokens, the warm start data/tinymath/warmstart).

Runs. grpo and erpo with seeds 0-2 (3 each; the seed sets the prompt order and every sampled row,
so grpo and erpo runs with one seed share their first rollout and form a pair); the paper's
ablations grpo-star (GRPO + query weights) and qkl (GRPO + Query-KL, no weights) with seed 0.
About 9 minutes a run on 2 CPU cores: 8 runs and the warm start's evaluation, ~75 minutes.

Measurements.
1. Drift (Fig. 1, Table 3): query_kl, policy_kl (k3 monitors on the rollout policy, logged by
   every run whatever its loss) and entropy, averaged over the last 10% of steps (101-112), and
   their curves.
2. Temperature robustness (Tables 1-2): after training, pass@1 (one sample per problem) at
   T in {0.1, 0.4, 0.7, 1.0, 1.2, 1.5} on the first 150 problems of tiny-test, tiny-hard and
   tiny-ood, averaged over the three sets; the buckets T <= 1.0 and T in {1.2, 1.5}.
   Final held-out accuracy: pass@1 at T = 1.0 on EVERY problem of each set (500 / 300 / 300).
3. Train-eval gap (Tables 4-5): every 16 steps, pass@1 at T = 1.0 on the first 200 problems of the
   training subset and of tiny-test (same sampler, seeds and protocol); the gap is their difference.

Statistics. Per algorithm: mean over seeds +- the 95% Student-t half-width t(0.975, n-1) * sd /
sqrt(n) (n = 3: t = 4.30, so the interval is +-2.48 standard deviations of the seeds: only a
difference several times the seed-to-seed spread can show; one seed: no interval), and every
seed's value. Paired: erpo - grpo per seed, mean +- the same t interval over the 3 pairs. A difference "counts" when that paired interval excludes 0;
anything else is reported as not distinguishable at this size.

Output: study/results/study.json (every number the tables and figures use), tables.md,
drift.png, temperature.png, gap.png. docs/studies.md's study section is built from study.json
(tests/test_study.py checks it).
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile

from tqdm import tqdm
from study import RECORDED_FAST_PATHS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TEMPS = [0.1, 0.4, 0.7, 1.0, 1.2, 1.5]
SETS = ["tiny-test", "tiny-hard", "tiny-ood"]
SIZES = {
    "full": dict(train_rows=256, steps=112, eval_every=16, eval_limit=200, sweep_limit=150, final_limit=0,
                 temps=TEMPS, seeds={"grpo": [0, 1, 2], "erpo": [0, 1, 2], "grpo-star": [0], "qkl": [0]},
                 train=[]),
    "smoke": dict(train_rows=16, steps=2, eval_every=2, eval_limit=4, sweep_limit=3, final_limit=4,
                  temps=[0.7, 1.2], seeds={"grpo": [0, 1], "erpo": [0, 1]},
                  train=["--rollout-batch", "4", "--update-batch", "2", "--group-size", "4", "--micro-batch", "8",
                         "--max-new-tokens", "24"]),
}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


# ----------------------------------------------------------------------------------------------
# Running (resumable: a run folder with its final evaluation is done; a started one resumes)


def subset(out, rows):
    path = os.path.join(out, f"train{rows}.jsonl")
    if not os.path.exists(path):
        with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
            lines = [next(f) for _ in range(rows)]
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)
    return path


def train_run(out, algo, seed, size, data):
    import train

    run = os.path.join(out, f"{algo}-s{seed}")
    done = False
    if os.path.exists(os.path.join(run, "metrics.jsonl")):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            done = any(json.loads(line).get("step") == size["steps"] for line in f)
    if not done:
        resume = ["--resume"] if os.path.exists(os.path.join(run, "config.json")) else []
        train.main(["--algo", algo, "--seed", str(seed), "--train-data", data, "--steps", str(size["steps"]),
                    "--eval-data", "tiny-test", data, "--eval-every", str(size["eval_every"]),
                    "--eval-limit", str(size["eval_limit"]), "--save-every", str(size["eval_every"]),
                    "--out", run, "--measure-policy-kl", "true", *RECORDED_FAST_PATHS, *size["train"], *resume])
    return run


def final_eval(run, model, label, size):
    """pass@1 at T = 1 on every problem of each set, and over the temperature grid on the first
    sweep_limit problems (evaluate.py: per-sample seeds, resumable)."""
    import evaluate

    common = ["--model", model, "--labels", label, "--benchmarks", *SETS, "--n", "1", "--k", "1",
              "--max-new-tokens", "96", "--no-progress"]
    for name, temps, limit in (("final", [1.0], size["final_limit"]), ("sweep", size["temps"], size["sweep_limit"])):
        if not os.path.exists(os.path.join(run, name, "summary.json")):
            evaluate.main(common + ["--temperatures", *map(str, temps), "--out", os.path.join(run, name)]
                          + (["--limit", str(limit)] if limit else []))


def run_all(out, size):
    os.makedirs(out, exist_ok=True)
    data = subset(out, size["train_rows"])
    todo = [(a, s) for a, seeds in size["seeds"].items() for s in seeds]
    warm = os.path.join(out, "warmstart")
    final_eval(warm, os.path.join(ROOT, "data", "tinymath", "warmstart"), "warmstart", size)
    for algo, seed in tqdm(todo, desc="study runs"):
        run = train_run(out, algo, seed, size, data)
        final_eval(run, os.path.join(run, "ckpt"), f"{algo}-s{seed}", size)


# ----------------------------------------------------------------------------------------------
# The report: numbers per run -> mean +- CI over seeds, paired differences, tables, figures


def ci(values):
    """{"mean", "half" (95% Student-t half-width; None for one value), "n", "values"}."""
    n, m = len(values), statistics.fmean(values)
    half = T_975[n - 1] * statistics.stdev(values) / math.sqrt(n) if n > 1 else None
    return {"mean": m, "half": half, "n": n, "values": values}


def pass1(summary, bench, temp):
    res = summary["results"]
    model = next(iter(res))
    return res[model][bench]["by_temperature"][f"{temp:g}"]["pass@1"]


def run_numbers(run, size):
    """Everything the report uses from one run folder (a training run, or the warm start's evals)."""
    out = eval_numbers(run, size)
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return out
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r["step"] > 0]
    tail = steps[-max(1, len(steps) // 10):]                             # the last 10% of steps
    evals = [r for r in rows if any(k.startswith("eval_acc/") for k in r)]
    train_key = f"train{size['train_rows']}.jsonl"
    train_acc = [next(v for k, v in r.items() if k.startswith("eval_acc/") and k.endswith(train_key)) for r in evals]
    held = [r["eval_acc/tiny-test"] for r in evals]
    out.update(steps=[r["step"] for r in steps], curves={k: [r.get(k) for r in steps] for k in DRIFT},
               gap_steps=[r["step"] for r in evals], train_acc=train_acc, heldout_acc=held,
               gap_final=train_acc[-1] - held[-1], **{f"{k}_tail": statistics.fmean(r[k] for r in tail) for k in DRIFT})
    return out


DRIFT = ("query_kl", "policy_kl", "entropy")


def eval_numbers(run, size):
    """pass@1 at T = 1 on every problem (per set, and their mean), by temperature (mean of the
    three sets), and the two temperature buckets."""
    with open(os.path.join(run, "final", "summary.json")) as f:
        final = json.load(f)
    with open(os.path.join(run, "sweep", "summary.json")) as f:
        sweep = json.load(f)
    fin = {b: pass1(final, b, 1.0) for b in SETS}
    fin["avg"] = statistics.fmean(fin[b] for b in SETS)
    by_t = {f"{t:g}": statistics.fmean(pass1(sweep, b, t) for b in SETS) for t in size["temps"]}
    low, high = [v for t, v in by_t.items() if float(t) <= 1.0], [v for t, v in by_t.items() if float(t) > 1.0]
    return {"final": fin, "sweep": by_t, "sweep_low": statistics.fmean(low), "sweep_high": statistics.fmean(high)}


# What the tables report: (name, how to read it from run_numbers, unit scale)
SCALARS = {
    "query_kl_tail": lambda r: r["query_kl_tail"], "policy_kl_tail": lambda r: r["policy_kl_tail"],
    "entropy_tail": lambda r: r["entropy_tail"],
    **{f"final_{b}": (lambda r, b=b: r["final"][b]) for b in SETS + ["avg"]},
    "sweep_low": lambda r: r["sweep_low"], "sweep_high": lambda r: r["sweep_high"],
    "gap_final": lambda r: r["gap_final"], "train_acc_final": lambda r: r["train_acc"][-1],
    "heldout_acc_final": lambda r: r["heldout_acc"][-1],
}


def aggregate(out, size) -> dict:
    runs = {f"{a}-s{s}": run_numbers(os.path.join(out, f"{a}-s{s}"), size)
            for a, seeds in size["seeds"].items() for s in seeds}
    algos = {a: {k: ci([f(runs[f"{a}-s{s}"]) for s in seeds]) for k, f in SCALARS.items()}
             for a, seeds in size["seeds"].items()}
    pairs = sorted(set(size["seeds"]["grpo"]) & set(size["seeds"]["erpo"]))
    paired = {k: ci([f(runs[f"erpo-s{s}"]) - f(runs[f"grpo-s{s}"]) for s in pairs]) for k, f in SCALARS.items()}
    sweep = {a: {t: ci([runs[f"{a}-s{s}"]["sweep"][t] for s in seeds]) for t in runs[f"{a}-s{seeds[0]}"]["sweep"]}
             for a, seeds in size["seeds"].items()}
    curves = {a: {k: [ci([runs[f"{a}-s{s}"]["curves"][k][i] for s in seeds]) for i in range(size["steps"])]
                  for k in DRIFT} for a, seeds in size["seeds"].items()}
    gaps = {a: {k: [ci([runs[f"{a}-s{s}"][k][i] for s in seeds]) for i in range(len(runs[f"{a}-s{seeds[0]}"][k]))]
                for k in ("train_acc", "heldout_acc")} for a, seeds in size["seeds"].items()}
    return {"protocol": {k: v for k, v in size.items() if k != "train"}, "warmstart": run_numbers(os.path.join(out, "warmstart"), size),
            "runs": {k: {x: v for x, v in r.items() if x != "curves"} for k, r in runs.items()},
            "algos": algos, "paired_erpo_minus_grpo": paired, "sweep": sweep, "curves": curves, "gap_curves": gaps,
            "gap_steps": runs[next(iter(runs))]["gap_steps"]}


def fmt(c, scale=1.0, digits=1):
    """mean +- half-width (or just the mean for one seed)."""
    if c["half"] is None:
        return f"{c['mean'] * scale:.{digits}f}"
    return f"{c['mean'] * scale:.{digits}f} ± {c['half'] * scale:.{digits}f}"


def seeds_of(c, scale=1.0, digits=1):
    return " / ".join(f"{v * scale:.{digits}f}" for v in c["values"])


ROWS = [  # (table row label, scalar key, scale, digits)
    ("Query-KL, last 10% of steps (x1e-3)", "query_kl_tail", 1e3, 2),
    ("Policy-KL k3, last 10% of steps (x1e-3)", "policy_kl_tail", 1e3, 1),
    ("entropy, last 10% of steps", "entropy_tail", 1.0, 3),
    ("held-out pass@1 T=1, tiny-test (all 500)", "final_tiny-test", 100, 1),
    ("held-out pass@1 T=1, tiny-hard (all 300)", "final_tiny-hard", 100, 1),
    ("held-out pass@1 T=1, tiny-ood (all 300)", "final_tiny-ood", 100, 1),
    ("held-out pass@1 T=1, mean of the 3 sets", "final_avg", 100, 1),
    ("sweep pass@1, T <= 1.0 (150/set)", "sweep_low", 100, 1),
    ("sweep pass@1, T 1.2-1.5 (150/set)", "sweep_high", 100, 1),
    ("train-subset pass@1 at the end (200)", "train_acc_final", 100, 1),
    ("tiny-test pass@1 at the end (200)", "heldout_acc_final", 100, 1),
    ("train - held-out gap at the end (points)", "gap_final", 100, 1),
]


def tables(study) -> str:
    """The markdown tables of docs/studies.md's study section, from study.json alone."""
    algos = list(study["algos"])
    head = "| measure | " + " | ".join(f"{a} (n={study['algos'][a]['final_avg']['n']})" for a in algos) + \
        " | ERPO - GRPO, paired |"
    lines = ["Mean ± 95% CI over seeds:", "", head, "|---" * (len(algos) + 2) + "|"]
    for label, key, scale, d in ROWS:
        cells = [fmt(study["algos"][a][key], scale, d) for a in algos]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {fmt(study['paired_erpo_minus_grpo'][key], scale, d)} |")
    lines += ["", "Per seed (seed 0 / 1 / ...):", "", "| measure | " + " | ".join(algos) + " |", "|---" * (len(algos) + 1) + "|"]
    for label, key, scale, d in ROWS:
        lines.append(f"| {label} | " + " | ".join(seeds_of(study["algos"][a][key], scale, d) for a in algos) + " |")
    temps = list(study["sweep"][algos[0]])
    lines += ["", "pass@1 by temperature (mean of tiny-test, tiny-hard, tiny-ood; 150 problems each), mean ± 95% CI:", "",
              "| T | warm start | " + " | ".join(algos) + " |", "|---" * (len(algos) + 2) + "|"]
    for t in temps:
        lines.append(f"| {t} | {100 * study['warmstart']['sweep'][t]:.1f} | "
                     + " | ".join(fmt(study["sweep"][a][t], 100, 1) for a in algos) + " |")
    return "\n".join(lines) + "\n"


def figures(study, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, k in zip(axes, DRIFT):
        for a, cur in study["curves"].items():
            m = [c["mean"] for c in cur[k]]
            x = range(1, len(m) + 1)
            ax.plot(x, m, label=a)
            if cur[k][0]["half"] is not None:
                ax.fill_between(x, [c["mean"] - c["half"] for c in cur[k]], [c["mean"] + c["half"] for c in cur[k]], alpha=0.2)
        ax.set_title(f"{k} (mean, 95% CI band over seeds)"), ax.set_xlabel("RL step"), ax.legend()
    paths.append(os.path.join(out_dir, "drift.png"))
    fig.tight_layout(), fig.savefig(paths[-1], dpi=110), plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    ts = list(study["sweep"][next(iter(study["sweep"]))])
    ax.plot([float(t) for t in ts], [100 * study["warmstart"]["sweep"][t] for t in ts], "k--", label="warm start")
    for a, by_t in study["sweep"].items():
        ax.errorbar([float(t) for t in ts], [100 * by_t[t]["mean"] for t in ts],
                    yerr=[100 * (by_t[t]["half"] or 0) for t in ts], capsize=3, label=a)
    ax.set_xlabel("temperature"), ax.set_ylabel("pass@1 (%)"), ax.legend()
    paths.append(os.path.join(out_dir, "temperature.png"))
    fig.tight_layout(), fig.savefig(paths[-1], dpi=110), plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for a, g in study["gap_curves"].items():
        line, = ax.plot(study["gap_steps"], [100 * c["mean"] for c in g["train_acc"]], label=f"{a} train subset")
        ax.plot(study["gap_steps"], [100 * c["mean"] for c in g["heldout_acc"]], "--", color=line.get_color(), label=f"{a} tiny-test")
    ax.set_xlabel("RL step"), ax.set_ylabel("pass@1 at T=1 (%)"), ax.legend(fontsize=7)
    paths.append(os.path.join(out_dir, "gap.png"))
    fig.tight_layout(), fig.savefig(paths[-1], dpi=110), plt.close(fig)
    return paths


def report(out, size, results):
    """study.json, tables.md and the figures in `results`: aggregated from the runs in `out` when they
    are all there; else (a fresh clone: runs/ is not committed) rebuilt from `results`/study.json."""
    os.makedirs(results, exist_ok=True)
    have = all(os.path.exists(os.path.join(out, f"{a}-s{s}", "final", "summary.json"))
               for a, seeds in size["seeds"].items() for s in seeds)
    if have:
        study = aggregate(out, size)
        with open(os.path.join(results, "study.json"), "w") as f:
            json.dump(study, f, indent=1)
    else:
        print(f"the runs are not in {out}: the tables and figures from {results}/study.json")
        with open(os.path.join(results, "study.json")) as f:
            study = json.load(f)
    with open(os.path.join(results, "tables.md"), "w") as f:
        f.write(tables(study))
    paths = figures(study, results)
    print(tables(study))
    print(f"wrote {results}/{'study.json, ' if have else ''}tables.md, " + ", ".join(map(os.path.basename, paths)))
    return study


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "study"), help="the runs (resumable)")
    ap.add_argument("--results", default=os.path.join(ROOT, "study", "results"), help="study.json, tables, figures")
    ap.add_argument("--report", action="store_true", help="only aggregate the runs there are")
    ap.add_argument("--smoke", action="store_true", help="toy sizes in a temporary folder (seconds)")
    a = ap.parse_args(argv)
    size = SIZES["smoke" if a.smoke else "full"]
    if a.smoke:
        tmp = tempfile.mkdtemp(prefix="study-smoke-")
        a.out, a.results = os.path.join(tmp, "runs"), os.path.join(tmp, "results")
    if not a.report:
        run_all(a.out, size)
    study = report(a.out, size, a.results)
    if a.smoke:
        shutil.rmtree(tmp)
    return study


if __name__ == "__main__":
    main()
