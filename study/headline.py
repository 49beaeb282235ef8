"""The README's headline numbers, with where they hold: the main command and its GRPO twin over
three seeds, and one seed under four CPU kernel variants.

    python -m study.headline                  # the runs still missing (a few at a time), the report
    python -m study.headline --report         # only the report, from the committed run summaries
    python -m study.headline --smoke          # the whole pipeline at toy sizes, in a temporary folder

What runs. `train.py --algo erpo` (the README's main command: 50 RL steps of 32 prompts x 8
responses, its defaults otherwise) and `--algo grpo`, seeds 0, 1 and 2, on this machine's own
float32 kernels; and seed 0 of both again under each of the other four kernel variants
tests/rounding.py uses to measure how far rounding moves a result (avx2 kernels, AVX-512 without
AMX, ATen's default kernels, MKL's conditional-numerical-reproducibility mode). A CPU of another
kind rounds like one of them, not like this one: the kernel spread says how far a figure moves on
another machine, the seed spread how far it moves with the sampled data. Each run is a `train.py`
subprocess on one intra-op thread (the numbers do not depend on the core count), --jobs at a time.

What is reported, per algorithm: held-out pass@1 at step 50 (`eval_acc/<set>` of metrics.jsonl: one
sample at T = 1.0 on the first 200 problems of each set) and the step-0 value, Query-KL, Policy-KL
and entropy averaged over steps 46-50 (the last tenth); as the mean over the three seeds +- the 95% Student-t
half-width (t = 4.30 for 3 seeds) with each seed's value, and the min-max over the five kernel
variants of seed 0; and ERPO - GRPO paired by seed (the pairs share their step-1 samples), with
its Student-t interval over the three differences (paired.md). Each run's summary
(study/results/headline/summaries/<name>.json: its
numbers, the commit, the golden digest of that code, the CPU and torch it ran on) is committed;
the report is rebuilt from them alone, and the README's table comes from its JSON (a test).
"""

import concurrent.futures
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from study.long_run import cell, commit, golden_digest, interval, jobs_count  # noqa: E402
from plumbing.errors import OneLineParser  # noqa: E402
from tests.rounding import KERNELS, kernel_env  # noqa: E402
from study import RECORDED_FAST_PATHS  # noqa: E402

RESULTS = os.path.join(ROOT, "study", "results", "headline")
SETS = ("tiny-test", "tiny-ood", "tiny-hard")
MONITORS = ("query_kl", "policy_kl", "entropy")
SEEDS = (0, 1, 2)
ONE_THREAD = "import sys, torch; torch.set_num_threads(1); import train; train.main(sys.argv[1:])"


@dataclass(frozen=True)
class Run:
    algo: str
    seed: int
    kernels: str                        # a name of tests/rounding.KERNELS

    @property
    def name(self):
        return f"{self.algo}-s{self.seed}" + ("" if self.kernels == "native" else f"-{self.kernels}")


RUNS = [Run(a, s, "native") for s in SEEDS for a in ("erpo", "grpo")] + \
    [Run(a, 0, k) for k in KERNELS if k != "native" for a in ("erpo", "grpo")]
SIZES = {"full": [], "smoke": ["--steps", "2", "--rollout-batch", "8", "--update-batch", "4", "--group-size",
                               "4", "--max-new-tokens", "16", "--eval-every", "2", "--eval-limit", "4"]}


def cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def summarize(run: Run, out, seconds, size, started_at) -> dict:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [m for m in lines if m["step"] > 0 and "reward" in m]
    last = max(m["step"] for m in lines)
    tail = [m for m in steps if m["step"] > last - max(1, last // 10)]            # the last tenth: 46-50
    acc = {m["step"]: {s: m[f"eval_acc/{s}"] for s in SETS if f"eval_acc/{s}" in m} for m in lines}
    import torch
    return {"name": run.name, "algo": run.algo, "seed": run.seed, "kernels": run.kernels, "size": size,
            "step0": acc.get(0, {}), "final": acc.get(last, {}), "last_step": last,
            **{f"{k}_tail": sum(m[k] for m in tail) / len(tail) for k in MONITORS if all(k in m for m in tail)},
            "sample_digest": next((m.get("sample_digest") for m in lines if m["step"] == 1), None),
            "seconds": round(seconds), "commit": started_at, "golden": golden_digest(),
            "cpu": cpu(), "torch": torch.__version__}


def run_one(run: Run, runs_dir, results, size) -> str:
    out, t0, started_at = os.path.join(runs_dir, run.name), time.time(), commit()   # the code it ran
    # its own Query-KL cache: a shared one, built under other kernels, would hide how these round the
    # reference's prompt log-probs (tests/test_golden.py does the same)
    argv = ["--algo", run.algo, "--seed", str(run.seed), "--out", out, "--overwrite", "--query-cache-dir", "",
            "--measure-policy-kl", "true", *RECORDED_FAST_PATHS, *SIZES[size]]   # Policy-KL: a column
    env = {**kernel_env(run.kernels), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", ONE_THREAD, *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise RuntimeError(f"{run.name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    summary = summarize(run, out, time.time() - t0, size, started_at)
    os.makedirs(os.path.join(results, "summaries"), exist_ok=True)
    with open(os.path.join(results, "summaries", f"{run.name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return run.name


def run_missing(runs_dir, results, jobs, size):
    done = {n[:-5] for n in os.listdir(os.path.join(results, "summaries"))} \
        if os.path.isdir(os.path.join(results, "summaries")) else set()
    todo = [r for r in RUNS if r.name not in done]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool, tqdm(total=len(todo), desc="headline") as bar:
        for f in concurrent.futures.as_completed([pool.submit(run_one, r, runs_dir, results, size) for r in todo]):
            bar.write(f"done: {f.result()}")
            bar.update()


def numbers(s) -> dict:
    return {**{f"step0/{k}": v for k, v in s["step0"].items()}, **{f"final/{k}": v for k, v in s["final"].items()},
            **{k: s[k] for k in (f"{m}_tail" for m in MONITORS) if k in s}}


def aggregate(summaries) -> dict:
    if len({s["golden"] for s in summaries.values()}) > 1:
        raise SystemExit("error: the headline summaries come from code with different golden metrics: rerun "
                         "the older ones (delete their summaries)")
    out = {"machine": sorted({f"{s['cpu']}, torch {s['torch']}" for s in summaries.values()}),
           "commits": sorted({s["commit"] for s in summaries.values()}), "algos": {}}
    for algo in ("grpo", "erpo"):
        seeds = [summaries[f"{algo}-s{s}"] for s in SEEDS if f"{algo}-s{s}" in summaries]
        variants = [summaries[n] for n in (f"{algo}-s0", *(f"{algo}-s0-{k}" for k in KERNELS if k != "native"))
                    if n in summaries]
        keys = list(numbers(seeds[0])) if seeds else []
        out["algos"][algo] = {
            "seeds": {k: interval([numbers(s).get(k) for s in seeds]) for k in keys},
            "kernels": {k: [min(v), max(v)] for k in keys
                        if (v := [numbers(s)[k] for s in variants if k in numbers(s)])},
            "n_seeds": len(seeds), "n_kernels": len(variants)}
    out["paired"] = paired(summaries)
    return out


def paired(summaries) -> dict:
    """ERPO - GRPO per seed (native kernels), each metric's mean +- the 95% Student-t half-width over
    the seed pairs (a paired interval: what the seed moves in both runs alike cancels); and per seed
    whether the pair shared its step-1 samples (equal sample_digest; None: a summary without one)."""
    pairs = [(summaries[f"grpo-s{s}"], summaries[f"erpo-s{s}"]) for s in SEEDS
             if f"grpo-s{s}" in summaries and f"erpo-s{s}" in summaries]
    keys = [k for k in (numbers(pairs[0][0]) if pairs else {}) if all(k in numbers(e) for _, e in pairs)]
    shared = {str(g["seed"]): (None if g.get("sample_digest") is None or e.get("sample_digest") is None
                               else g["sample_digest"] == e["sample_digest"]) for g, e in pairs}
    return {"diff": {k: interval([numbers(e)[k] - numbers(g).get(k) for g, e in pairs
                                  if numbers(g).get(k) is not None]) for k in keys},
            "shared_step1_samples": shared, "n_pairs": len(pairs)}


def paired_table(study) -> str:
    """ERPO - GRPO, paired by seed: mean +- 95% interval [each seed's difference], and the pairs'
    step-1 samples (shared / differ / unknown)."""
    p = study["paired"]
    word = {True: "shared", False: "DIFFER", None: "unknown (no digest)"}
    lines = [f"| ERPO − GRPO, paired by seed ({p['n_pairs']} pairs) | mean ± 95% [per seed] |", "|---|---|"]
    for label, key, scale, digits in ROWS:
        c = p["diff"].get(key)
        if c:
            unit = " ×10⁻³" if scale == 1000 else (" pts" if scale == 100 else "")
            each = " / ".join(f"{v * scale:+.{digits}f}" for v in c["values"])
            lines.append(f"| {label}{unit} | {cell(c, scale, digits)} [{each}] |")
    lines.append("| step-1 samples | " + ", ".join(f"seed {s}: {word[v]}"
                                                   for s, v in p["shared_step1_samples"].items()) + " |")
    return "\n".join(lines) + "\n"


ROWS = [*((f"{s} (step 50)", f"final/{s}", 100, 1) for s in SETS),
        ("Query-KL (steps 46–50)", "query_kl_tail", 1000, 2), ("Policy-KL, k3 (steps 46–50)", "policy_kl_tail", 1000, 1),
        ("entropy (steps 46–50)", "entropy_tail", 1, 3)]


def table(study) -> str:
    """The README's table: each metric's mean ± 95% interval over seeds [each seed], and its range over
    the kernel variants of seed 0."""
    a = study["algos"]
    lines = ["| | GRPO: 3 seeds | GRPO: kernels, seed 0 | ERPO: 3 seeds | ERPO: kernels, seed 0 |",
             "|---|---|---|---|---|"]
    for label, key, scale, digits in ROWS:
        unit = " ×10⁻³" if scale == 1000 else (" %" if scale == 100 else "")
        cells = []
        for algo in ("grpo", "erpo"):
            c, k = a[algo]["seeds"].get(key), a[algo]["kernels"].get(key)
            seeds = " / ".join(f"{v * scale:.{digits}f}" for v in c["values"]) if c else ""
            cells += [f"{cell(c, scale, digits)} [{seeds}]" if c else "—",
                      f"{k[0] * scale:.{digits}f}–{k[1] * scale:.{digits}f}" if k else "—"]
        lines.append(f"| {label}{unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_summaries(results) -> dict:
    folder, out = os.path.join(results, "summaries"), {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            s = json.load(f)
        out[s["name"]] = s
    return out


def report(results) -> dict:
    study = aggregate(load_summaries(results))
    with open(os.path.join(results, "headline.json"), "w") as f:
        json.dump(study, f, indent=1)
        f.write("\n")
    with open(os.path.join(results, "table.md"), "w") as f:
        f.write(table(study))
    with open(os.path.join(results, "paired.md"), "w") as f:
        f.write(paired_table(study))
    print(table(study) + "\n" + paired_table(study) + f"machine: {'; '.join(study['machine'])}")
    return study


def main(argv=None):
    ap = OneLineParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--report", action="store_true", help="only the report, from the committed summaries")
    ap.add_argument("--smoke", action="store_true", help="toy sizes in a temporary folder (the pipeline only)")
    ap.add_argument("--jobs", type=jobs_count, default=2, help="runs at a time (one intra-op thread each)")
    ap.add_argument("--runs", default=os.path.join(ROOT, "runs", "headline"), help="the run folders")
    a = ap.parse_args(argv)
    results, tmp = RESULTS, None
    if a.smoke:
        tmp = tempfile.mkdtemp(prefix="headline-smoke-")
        results, a.runs = os.path.join(tmp, "results"), os.path.join(tmp, "runs")
    try:
        if not a.report:
            run_missing(a.runs, results, a.jobs, "smoke" if a.smoke else "full")
        return report(results)
    finally:                                                             # a failed smoke leaves no folder
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
