"""The long run in miniature (the paper's Figs. 5-6) and the rest of its Tables 2 and 6, on the
embedded world: does GRPO degrade in a long run, and ERPO later and less?

    python -m study.long_run                  # the runs still missing (within --budget minutes), the report
    python -m study.long_run --list           # which runs are done (committed), which are missing
    python -m study.long_run --report         # only the report, from the committed run summaries
    python -m study.long_run --smoke          # the whole pipeline at toy sizes, in a temporary folder

PROTOCOL (committed before any run of this study; the numbers below are what the command does)

Why. The short study (study/miniature.py, 112 steps) found GRPO's Query-KL drifting 12x ERPO's,
but neither algorithm's held-out accuracy had turned down by its end. The paper's longest section
(240 -> 1,000 steps) says GRPO then degrades, first at a high sampling temperature, then at every
temperature, with entropy spiking, while ERPO degrades later and less and keeps its
high-temperature accuracy.

Long arm. grpo and erpo (the README's defaults otherwise: lr 2e-4, T = 1 rollouts, the warm start
data/tinymath/warmstart), seeds 0, 1, 2 (a grpo and an erpo run with one seed share their first
rollout: a pair), on the short study's training set (the first 256 tiny-train problems), for 560
RL steps: 5x the short study. The per-step work is cut ~3x to fit the budget, not the steps or the
seeds: 16 prompts x 8 responses per step (short study: 32 x 8), 2 optimizer steps of 8 prompts
each (as there: 2 of 16), at most 64 new tokens (there: 96; the tiny world's answers take ~40-50).
That is 35 passes over the training set (there: 14), the multi-epoch regime in which a policy can
fit its training questions. Logged every step: reward, train_acc, query_kl, policy_kl, entropy.
Held-out pass@1 (one sample per problem) every 40 steps (15 points, steps 0..560) on all 500
tiny-test problems, at T = 0.4 (low), 1.0 (middle) and 1.2 (high), each temperature with the same
per-problem seeds.

What counts as degradation (per run and temperature). The held-out curve p_0, p_40, ..., p_560 is
smoothed by a centred moving average over 3 points (2 at the ends), s_i; its running maximum is
M_i = max(s_0..s_i). The run has degraded at step 40i (the onset) when s_i and s_{i+1} both lie
more than DELTA below M_i; its depth is M_14 - s_14 (how far the end lies below the best, >= 0);
"no onset" when that never happens. DELTA is the smallest multiple of 0.01 whose false-alarm rate
on a flat curve is <= 5%: 15 points, each an independent Binomial(500, p) / 500 with p = 0.5 (the
noisiest accuracy), 20,000 resampled curves (`false_alarm_rate`): DELTA = 0.05, false-alarm rate
4.3% at p = 0.5 and 2.3% at p = 0.3. (The real evaluations share their problems and seeds across
steps, so their noise is positively correlated and a flat real curve trips the rule less often.)

"Later and less", paired per seed (erpo-sK against grpo-sK), at each temperature: the onset step
(no onset counts as 600, one evaluation after the end: a censored value, said so in the tables),
the depth, and the final smoothed accuracy s_14; the paired difference erpo - grpo, mean +- the
95% Student-t interval over the 3 pairs (t = 4.30), as in the short study. "ERPO keeps its
high-temperature accuracy": its s_14 at T = 1.2 against its step-0 value, per seed. "Entropy
spikes": each run's largest entropy over steps against its mean over steps 1-40. Reported whatever
they show.

Ablations (the short study's regime: its training set and sizes, 112 steps, seed 0, held-out
pass@1 every 16 steps on all of tiny-test at T = 0.4 / 1.0 / 1.2): grpo and erpo (alpha 0.01), erpo
with alpha 0.005 and 0.05 (Table 2), grpo and erpo with 16 responses per prompt (Table 2), dapo vs
dapo-erpo and rloo vs rloo-erpo (Table 6). Each is compared with grpo seed 0 and with its own
partner (erpo-g16 with grpo-g16, dapo-erpo with dapo, rloo-erpo with rloo). One seed: the
comparisons carry no seed interval; the binomial standard error of a 500-problem accuracy, ~2.2
points, says what a difference of one evaluation can be.

Budget and sessions. A run is a subprocess of `train.py` on one intra-op thread (results do not
depend on the machine's core count); --jobs of them at a time (2 on a 2-core machine). A run that
finishes writes its summary, study/results/long_run/summaries/<name>.json (every logged metric per
step and the evaluations; ~100 KB), which is committed: a later session, on a new machine,
runs only the runs still missing, and the report is rebuilt from the committed summaries alone.
`--budget` (minutes, default 100) starts a run only while its estimate still fits; a run
interrupted anyway resumes from its checkpoint (every 40 / 16 steps) in runs/long_run/.
Each summary records the commit it ran at and the digest of tests/golden/ (the golden metrics of
that code), which the report requires to be the same for every run.

Added after the long arm's results were read (exploratory, not part of the protocol above). The
protocol's entropy-spike measure is dominated by step 1 on the tiny model, whose entropy mostly
falls, so it cannot see a late rise. "Late rise": the w-step trailing mean of entropy, m_t, against
its running minimum, max_t m_t / min(m_1..m_t), for w = 10, 20 and 40 steps (all three reported:
the window was not chosen in advance).

Output: study/results/long_run/long_run.json (every number the tables and figures use),
tables.md, heldout.png (held-out pass@1 over steps, per temperature), drift.png (Query-KL,
Policy-KL, entropy over steps), ablations.png (each ablation's Query-KL and last held-out pass@1).
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from study.miniature import ci, subset  # noqa: E402  (the short study's statistics and training set)
from plumbing.errors import OneLineParser  # noqa: E402
from study import RECORDED_FAST_PATHS  # noqa: E402


def jobs_count(text) -> int:
    """--jobs: a whole number >= 1, checked by the parser (0 was a ThreadPoolExecutor traceback after
    --smoke's temporary folder was made, which it left behind)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of runs at a time, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (runs at a time), got {n}")
    return n

RESULTS = os.path.join(ROOT, "study", "results", "long_run")
SUMMARIES = "summaries"               # the committed run summaries, in RESULTS (not "runs/": .gitignore'd)
TEMPS = [0.4, 1.0, 1.2]
DELTA = 0.05                          # the degradation threshold the protocol's rule gives (a test checks)
NEVER = 600                           # the onset of a run that never degraded (censored)
RISE_WINDOWS = (10, 20, 40)           # the exploratory late-rise measure's windows (steps), all reported
STEP_KEYS = ("reward", "train_acc", "query_kl", "policy_kl", "entropy", "response_len", "loss", "grad_norm",
             "zero_var_frac", "truncated_frac")


@dataclass(frozen=True)
class Arm:
    """A regime: the train.py options every run of it shares."""
    steps: int
    eval_every: int
    train: tuple                      # train.py flags beyond the shared ones
    minutes: float                    # the budget's estimate of one run (2 jobs on 2 cores)
    eval_limit: int = 0               # held-out problems per evaluation (0 = all 500)
    rows: int = 256                   # training problems (the short study's subset)


@dataclass(frozen=True)
class RunSpec:
    name: str
    arm: str
    algo: str
    seed: int
    flags: tuple = ()                 # the run's own flags (--alpha 0.005, --group-size 16)
    minutes_factor: float = 1.0       # its time against its arm's run (measured: G = 16 1.7x, DAPO 1.4x)


ARMS = {
    "long": Arm(560, 40, ("--rollout-batch", "16", "--update-batch", "8", "--group-size", "8",
                          "--max-new-tokens", "64"), minutes=26),
    "short": Arm(112, 16, (), minutes=12),
}
SMOKE_ARMS = {
    "long": Arm(4, 2, ("--rollout-batch", "4", "--update-batch", "2", "--group-size", "4", "--max-new-tokens",
                       "24"), minutes=1, eval_limit=6, rows=16),
    "short": Arm(2, 2, ("--rollout-batch", "4", "--update-batch", "2", "--group-size", "4",
                        "--max-new-tokens", "24"), minutes=1, eval_limit=6, rows=16),
}
RUNS = [
    *[RunSpec(f"long-{a}-s{s}", "long", a, s) for s in (0, 1, 2) for a in ("grpo", "erpo")],
    RunSpec("short-grpo-s0", "short", "grpo", 0),
    RunSpec("short-erpo-s0", "short", "erpo", 0),
    RunSpec("short-erpo-a0.005-s0", "short", "erpo", 0, ("--alpha", "0.005")),
    RunSpec("short-erpo-a0.05-s0", "short", "erpo", 0, ("--alpha", "0.05")),
    RunSpec("short-grpo-g16-s0", "short", "grpo", 0, ("--group-size", "16"), 1.7),
    RunSpec("short-erpo-g16-s0", "short", "erpo", 0, ("--group-size", "16"), 1.7),
    RunSpec("short-dapo-s0", "short", "dapo", 0, (), 1.4),
    RunSpec("short-dapo-erpo-s0", "short", "dapo-erpo", 0, (), 1.4),
    RunSpec("short-rloo-s0", "short", "rloo", 0),
    RunSpec("short-rloo-erpo-s0", "short", "rloo-erpo", 0),
]
SMOKE_RUNS = [RunSpec("long-grpo-s0", "long", "grpo", 0), RunSpec("long-erpo-s0", "long", "erpo", 0),
              RunSpec("short-grpo-s0", "short", "grpo", 0), RunSpec("short-erpo-a0.05-s0", "short", "erpo", 0,
                                                                     ("--alpha", "0.05"))]
# the ablations' comparisons: (run, its partner); every ablation is also compared with short-grpo-s0
PARTNERS = {"short-erpo-g16-s0": "short-grpo-g16-s0", "short-dapo-erpo-s0": "short-dapo-s0",
            "short-rloo-erpo-s0": "short-rloo-s0"}


# ----------------------------------------------------------------------------------------------
# The degradation rule (PROTOCOL) and its false-alarm rate


def smooth(acc) -> np.ndarray:
    """Centred moving average over 3 evaluation points (2 at the ends); acc (..., points)."""
    x = np.asarray(acc, dtype=float)
    n = x.shape[-1]
    return np.stack([x[..., max(0, i - 1):min(n, i + 2)].mean(-1) for i in range(n)], -1)


def degraded_at(acc, delta=DELTA) -> np.ndarray:
    """Index of the first point i where s_i and s_{i+1} both lie more than delta below M_i, the
    running maximum of the smoothed curve s; -1 where there is none. acc (..., points)."""
    s = smooth(acc)
    m = np.maximum.accumulate(s, -1)
    gap = delta + 1e-9                   # "more than": accuracies are k/500, so exact ties are common
    below = (m[..., :-1] - s[..., :-1] > gap) & (m[..., :-1] - s[..., 1:] > gap)   # (..., points - 1)
    first = below.argmax(-1)
    return np.where(below.any(-1), first, -1)


def false_alarm_rate(p=0.5, problems=500, points=15, delta=DELTA, trials=20000, seed=0) -> float:
    """How often a flat curve (each point an independent Binomial(problems, p) / problems) is
    called degraded."""
    rng = np.random.default_rng(seed)
    return float((degraded_at(rng.binomial(problems, p, (trials, points)) / problems, delta) >= 0).mean())


def protocol_delta(problems=500, points=15, level=0.05) -> float:
    """The smallest multiple of 0.01 whose false-alarm rate at p = 0.5 is <= level."""
    for k in range(1, 30):
        if false_alarm_rate(0.5, problems, points, k / 100) <= level:
            return k / 100
    raise ValueError("no threshold below 0.3 keeps the false-alarm rate at the level")


def curve_numbers(steps, acc, delta=DELTA) -> dict:
    """Onset (a step; NEVER if none), depth, the final smoothed value and the step-0 value of one curve."""
    s = smooth(acc)
    i = int(degraded_at(acc, delta))
    return {"onset": NEVER if i < 0 else steps[i], "depth": float(s.max() - s[-1]), "final": float(s[-1]),
            "start": float(acc[0]), "best": float(s.max())}


# ----------------------------------------------------------------------------------------------
# Running (resumable): a run is done when its summary exists


def golden_digest() -> str:
    h = hashlib.sha256()
    for name in ("erpo.jsonl", "grpo.jsonl"):
        with open(os.path.join(ROOT, "tests", "golden", name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train_argv(spec: RunSpec, arm: Arm, data, out) -> list[str]:
    return ["--algo", spec.algo, "--seed", str(spec.seed), "--train-data", data, "--steps", str(arm.steps),
            "--eval-data", "tiny-test", "--eval-every", str(arm.eval_every),
            "--eval-limit", str(arm.eval_limit),
            "--eval-temperatures", *map(str, TEMPS), "--save-every", str(arm.eval_every), "--out", out,
            "--measure-policy-kl", "true", *RECORDED_FAST_PATHS, *arm.train, *spec.flags]   # policy_kl: every step


ONE_THREAD = "import sys, torch; torch.set_num_threads(1); import train; train.main(sys.argv[1:])"


def run_one(spec: RunSpec, arm: Arm, data, runs_dir, results) -> str:
    """Train (or resume) one run in a subprocess, then write its summary -> its name."""
    out = os.path.join(runs_dir, spec.name)
    resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "segments.jsonl"), "a") as f:        # the code each part of the run ran on
        f.write(json.dumps({"commit": commit(), "golden": golden_digest(), "resumed": bool(resume)}) + "\n")
    t0 = time.time()
    with open(os.path.join(out, "log.txt"), "a") as log:
        done = subprocess.run([sys.executable, "-c", ONE_THREAD, *train_argv(spec, arm, data, out), *resume],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{spec.name} failed (exit {done.returncode}); see {out}/log.txt")
    write_summary(spec, arm, out, results, time.time() - t0)
    return spec.name


def write_summary(spec, arm, out, results, seconds):
    """The run's committed record: every step's metrics, the evaluations, the code it ran on."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "segments.jsonl")) as f:
        segments = [json.loads(line) for line in f]
    steps = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if "eval_acc" in r]
    want = list(range(0, arm.steps + 1, arm.eval_every))
    if [r["step"] for r in steps] != list(range(1, arm.steps + 1)) or [r["step"] for r in evals] != want:
        raise RuntimeError(f"{spec.name}: {out}/metrics.jsonl is not a whole run of {arm.steps} steps "
                           f"evaluated at {want}")
    if len({g["golden"] for g in segments}) > 1:
        raise RuntimeError(f"{spec.name}: its parts ran on code with different golden metrics: {segments}")
    summary = {"name": spec.name, "arm": spec.arm, "algo": spec.algo, "seed": spec.seed,
               "flags": list(spec.flags),
               "argv": train_argv(spec, arm, f"train{arm.rows}.jsonl", spec.name),
               "commit": "+".join(dict.fromkeys(g["commit"] for g in segments)),
               "golden": segments[0]["golden"],
               "segments": segments, "seconds": round(seconds, 1),
               "steps": [r["step"] for r in steps], **{k: [r.get(k) for r in steps] for k in STEP_KEYS},
               "eval_steps": [r["step"] for r in evals],
               "eval": {f"{t:g}": [r[f"eval_acc@T{t:g}"] for r in evals] for t in TEMPS}}
    os.makedirs(os.path.join(results, SUMMARIES), exist_ok=True)
    path = os.path.join(results, SUMMARIES, f"{spec.name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(path + ".tmp", path)


def missing(runs, results) -> list[RunSpec]:
    return [r for r in runs if not os.path.exists(os.path.join(results, SUMMARIES, f"{r.name}.json"))]


def run_missing(runs, arms, runs_dir, results, jobs, budget_min):
    """The missing runs, long arm first, `jobs` at a time; a run starts only while its estimate
    still fits in the budget."""
    todo, t0 = missing(runs, results), time.time()
    if not todo:
        return
    os.makedirs(runs_dir, exist_ok=True)
    data = {name: subset(runs_dir, arm.rows) for name, arm in arms.items()}   # before the threads
    bar = tqdm(total=len(todo), desc="long-run study")
    failed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        running = set()
        while todo or running:
            while todo and len(running) < jobs:
                spec = todo[0]
                need = arms[spec.arm].minutes * spec.minutes_factor
                if (time.time() - t0) / 60 + need > budget_min:
                    bar.write(f"budget: {spec.name} (~{need:.0f} min) would not end within {budget_min} min")
                    todo = []
                    break
                running.add(pool.submit(run_one, todo.pop(0), arms[spec.arm], data[spec.arm], runs_dir,
                                        results))
            if not running:
                break
            finished, running = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
            for f in finished:
                try:
                    bar.write(f"done: {f.result()}")
                except RuntimeError as e:                   # the others go on; reported at the end
                    failed.append(str(e))
                    bar.write(f"failed: {e}")
                bar.update()
    bar.close()
    if failed:
        raise RuntimeError("; ".join(failed))


# ----------------------------------------------------------------------------------------------
# The report: from the run summaries alone


def load_summaries(results) -> dict:
    folder = os.path.join(results, SUMMARIES)
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                s = json.load(f)
            out[s["name"]] = s
    digests = {s["golden"] for s in out.values()}
    if len(digests) > 1:
        raise SystemExit(f"error: the run summaries come from code with different golden metrics "
                         f"{sorted(digests)}: "
                         "rerun the older ones (delete their summaries) so every run is of the same code")
    return out


def tail_mean(values, frac=0.1):
    """Mean over the last 10% of steps (None: nothing logged)."""
    v = finite(values)
    return float(np.mean(v[-max(1, int(len(v) * frac)):])) if v else None


def run_numbers(s) -> dict:
    """The scalars of one run: per temperature the curve's final / change from step 0 / last
    evaluation, and for the long arm (the curve DELTA was set for) its onset and depth; the drift
    monitors over the last 10% of steps; the entropy spike and late rise. None where a run logged nothing."""
    out = {}
    for t, acc in s["eval"].items():
        c = curve_numbers(s["eval_steps"], acc)
        keep = ("final", "start", "best") + (("onset", "depth") if s["arm"] == "long" else ())
        out.update({f"{k}@{t}": c[k] for k in keep})
        out[f"change@{t}"] = c["final"] - c["start"]
        out[f"last@{t}"] = acc[-1]
    for k in ("query_kl", "policy_kl", "entropy"):
        out[f"{k}_tail"] = tail_mean(s[k])
    entropy = finite(s["entropy"])
    early = finite(e for step, e in zip(s["steps"], s["entropy"]) if step <= 40)
    spiked = entropy and early and np.mean(early) > 0
    out["entropy_spike"] = max(entropy) / float(np.mean(early)) if spiked else None
    for w in RISE_WINDOWS:
        out[f"entropy_rise{w}"] = late_rise(entropy, w)
    return out


def late_rise(values, window):
    """max_t m_t / min(m_1..m_t) of the trailing `window`-step mean m (exploratory: see the
    docstring); None when the run is shorter than the window."""
    if len(values) < window:
        return None
    m = np.convolve(np.asarray(values, dtype=float), np.ones(window) / window, "valid")
    low = np.minimum.accumulate(m)
    return float((m / low).max()) if (low > 0).all() else None


def finite(values) -> list:
    return [x for x in values if x is not None and np.isfinite(x)]


def long_arm(summaries, numbers) -> dict:
    """The long arm: each algorithm's scalars over its seeds, erpo - grpo per seed, the curves."""
    seeds = {a: sorted(s["seed"] for s in summaries.values() if s["arm"] == "long" and s["algo"] == a)
             for a in ("grpo", "erpo")}
    seeds = {a: v for a, v in seeds.items() if v}
    keys = list(next(iter(numbers.values()))) if numbers else []
    algos = {a: {k: interval([numbers[f"long-{a}-s{s}"][k] for s in ss]) for k in keys}
             for a, ss in seeds.items()}
    pairs = sorted(set(seeds.get("grpo", [])) & set(seeds.get("erpo", [])))

    def minus(k, s):
        e, g = numbers[f"long-erpo-s{s}"][k], numbers[f"long-grpo-s{s}"][k]
        return None if e is None or g is None else e - g
    paired = {k: interval([minus(k, s) for s in pairs]) for k in keys} if pairs else {}
    curves = {}
    for a, ss in seeds.items():
        runs = [summaries[f"long-{a}-s{s}"] for s in ss]
        curves[a] = {"steps": runs[0]["steps"], "eval_steps": runs[0]["eval_steps"],
                     **{k: [r[k] for r in runs] for k in ("query_kl", "policy_kl", "entropy")},
                     "eval": {t: [r["eval"][t] for r in runs] for t in map(str_t, TEMPS)}}
    return {"algos": algos, "paired_erpo_minus_grpo": paired, "curves": curves, "seeds": seeds,
            "pairs": pairs}


def ablations(summaries, numbers) -> dict:
    """The short-regime runs: their scalars, and the last evaluation's difference from grpo-s0 and
    from the run's partner (PARTNERS), per temperature."""
    short = {n: numbers[n] for n in summaries if summaries[n]["arm"] == "short"}

    def minus(name, other):
        if other not in short or other == name:
            return None
        return {t: short[name][f"last@{t}"] - short[other][f"last@{t}"] for t in map(str_t, TEMPS)}
    return {n: {**v, "vs_grpo": minus(n, "short-grpo-s0"), "vs_partner": minus(n, PARTNERS.get(n))}
            for n, v in short.items()}


def aggregate(summaries) -> dict:
    numbers = {name: run_numbers(s) for name, s in summaries.items()}
    return {"protocol": {"delta": DELTA, "never": NEVER, "temps": TEMPS,
                         "false_alarm": {f"{p:g}": false_alarm_rate(p) for p in (0.3, 0.5)}},
            "runs": {n: {"commit": s["commit"], "golden": s["golden"], "seconds": s["seconds"], **numbers[n]}
                     for n, s in summaries.items()},
            **long_arm(summaries, {n: v for n, v in numbers.items() if summaries[n]["arm"] == "long"}),
            "ablations": ablations(summaries, numbers)}


def str_t(t) -> str:
    return f"{t:g}"


def interval(values) -> dict:
    """ci() of the values a run has (None: not logged), keeping every value for the per-seed rows."""
    have = [v for v in values if v is not None]
    if not have:
        return {"mean": None, "half": None, "n": 0, "values": values}
    return {**ci(have), "values": values}


def cell(c, scale=1.0, digits=1):
    if c is None or c["mean"] is None:
        return "—"
    if c["half"] is None:
        return f"{c['mean'] * scale:.{digits}f}"
    return f"{c['mean'] * scale:.{digits}f} ± {c['half'] * scale:.{digits}f}"


def long_rows():
    """(label, scalar key, scale, digits) of the long arm's tables."""
    rows = []
    for t in map(str_t, TEMPS):
        rows += [(f"onset of degradation, T={t} (step; {NEVER} = none)", f"onset@{t}", 1, 0),
                 (f"depth: best - end, T={t} (points)", f"depth@{t}", 100, 1),
                 (f"pass@1 at the end (smoothed), T={t} (%)", f"final@{t}", 100, 1),
                 (f"change from step 0, T={t} (points)", f"change@{t}", 100, 1)]
    return rows + [("Query-KL, last 10% of steps (x1e-3)", "query_kl_tail", 1e3, 2),
                   ("Policy-KL k3, last 10% of steps (x1e-3)", "policy_kl_tail", 1e3, 1),
                   ("entropy, last 10% of steps", "entropy_tail", 1, 3),
                   ("entropy: max / mean of steps 1-40", "entropy_spike", 1, 2),
                   *[(f"entropy: late rise, {w}-step mean / its running min (exploratory)",
                      f"entropy_rise{w}", 1, 2) for w in RISE_WINDOWS]]


def long_tables(study) -> list[str]:
    algos, seeds = list(study["algos"]), study["seeds"]
    if not algos:
        return []
    lines = ["Long arm (560 steps), mean ± 95% CI over seeds:", "",
             "| measure | " + " | ".join(f"{a} (n={len(seeds[a])})" for a in algos)
             + f" | ERPO - GRPO, paired (n={len(study['pairs'])}) |", "|---" * (len(algos) + 2) + "|"]
    for label, key, scale, d in long_rows():
        if key.startswith("onset@"):                     # censored: counted, not averaged
            cells = [onsets(study["algos"][a][key]["values"]) for a in algos]
            pair = later(study["paired_erpo_minus_grpo"].get(key))
            label = label.replace("(step; 600 = none)", "(runs with one)")
        else:
            cells = [cell(study["algos"][a][key], scale, d) for a in algos]
            pair = cell(study["paired_erpo_minus_grpo"].get(key), scale, d)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {pair} |")
    lines += ["", "Per seed:", "", "| measure | " + " | ".join(f"{a}, seeds {' / '.join(map(str, seeds[a]))}"
                                                             for a in algos) + " |",
              "|---" * (len(algos) + 1) + "|"]
    for label, key, scale, d in long_rows():
        per_seed = [" / ".join("—" if v is None else f"{v * scale:.{d}f}"
                               for v in study["algos"][a][key]["values"]) for a in algos]
        lines.append(f"| {label} | " + " | ".join(per_seed) + " |")
    return lines


def onsets(values) -> str:
    """'1 of 3 (step 280)': how many runs degraded, and when."""
    hit = [v for v in values if v is not None and v < NEVER]
    return f"{len(hit)} of {len(values)}" + (f" (step {', '.join(str(int(v)) for v in hit)})" if hit else "")


def later(c) -> str:
    """The paired onset column: in how many pairs ERPO's onset came later / earlier than GRPO's."""
    if c is None or not c["values"]:
        return "—"
    d = [v for v in c["values"] if v is not None]
    return (f"later in {sum(v > 0 for v in d)}, earlier in {sum(v < 0 for v in d)}, "
            f"same in {sum(v == 0 for v in d)}")


def ablation_table(study) -> list[str]:
    ab, temps = study["ablations"], list(map(str_t, TEMPS))
    if not ab:
        return []
    at = " / ".join(temps)
    lines = ["Ablations (112 steps, seed 0): held-out pass@1 (%) at the last evaluation (all 500 "
             "tiny-test problems; binomial SE ~2.2 points), and its difference (points) from grpo-s0 and "
             "from the run's partner:", "",
             "| run | " + " | ".join(f"T={t}" for t in temps) + " | Query-KL last 10% (x1e-3) | "
             f"entropy last 10% | vs grpo, T={at} | vs partner, T={at} |", "|---" * (len(temps) + 5) + "|"]

    def diff(d):
        return "—" if d is None else " / ".join(f"{100 * d[t]:+.1f}" for t in temps)
    def num(x, scale, fmt):
        return "—" if x is None else format(x * scale, fmt)
    for name, v in ab.items():
        acc = " | ".join(f"{100 * v[f'last@{t}']:.1f}" for t in temps)
        lines.append(f"| {name.removeprefix('short-')} | {acc} | {num(v['query_kl_tail'], 1e3, '.2f')} | "
                     f"{num(v['entropy_tail'], 1, '.3f')} | {diff(v['vs_grpo'])} | {diff(v['vs_partner'])} |")
    return lines


def tables(study) -> str:
    """The markdown tables of docs/studies.md's long-run section, from long_run.json alone."""
    long, ab = long_tables(study), ablation_table(study)
    return "\n".join(long + ([""] if long and ab else []) + ab) + "\n"


def figures(study, folder) -> list[str]:
    from plumbing.plots import _plt
    plt, paths, curves = _plt(), [], study["curves"]
    if not curves:
        return paths
    fig, axes = plt.subplots(1, len(TEMPS), figsize=(5 * len(TEMPS), 3.8), sharey=True)
    for ax, t in zip(axes, map(str_t, TEMPS)):
        for a, c in curves.items():
            runs = np.array(c["eval"][t]) * 100
            line, = ax.plot(c["eval_steps"], runs.mean(0), label=f"{a} (mean of {len(runs)})")
            for r in runs:
                ax.plot(c["eval_steps"], r, color=line.get_color(), alpha=0.25, lw=0.8)
        ax.set_title(f"held-out pass@1, T={t}"), ax.set_xlabel("RL step")
    axes[0].set_ylabel("tiny-test pass@1 (%)"), axes[0].legend(fontsize=8)
    paths.append(os.path.join(folder, "heldout.png"))
    fig.tight_layout(), fig.savefig(paths[-1], dpi=100), plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, k in zip(axes, ("query_kl", "policy_kl", "entropy")):
        for a, c in curves.items():
            runs = np.array([[np.nan if x is None else x for x in r] for r in c[k]])
            if np.isfinite(runs).any():                                # (a monitor a run did not log: none)
                have = np.isfinite(runs).any(0)                          # steps some seed logged
                ax.plot(np.array(c["steps"])[have], np.nanmean(runs[:, have], 0), label=a)
        ax.set_title(f"{k} (mean over seeds)"), ax.set_xlabel("RL step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    paths.append(os.path.join(folder, "drift.png"))
    fig.tight_layout(), fig.savefig(paths[-1], dpi=100), plt.close(fig)
    return paths


def ablation_figure(study, folder) -> list[str]:
    """The ablations at a glance: each run's Query-KL (log scale) and its last held-out pass@1 per
    temperature, runs without ERPO grey and with ERPO blue, next to their partners."""
    from plumbing.plots import _plt
    ab = study["ablations"]
    known = [r.name for r in RUNS if r.arm == "short" and r.name in ab]       # RUNS' order: partners side by side
    names = known + sorted(set(ab) - set(known))
    if not names:
        return []
    plt, x = _plt(), np.arange(len(names))
    erpo = ["erpo" in n for n in names]
    colors = ["tab:blue" if e else "tab:gray" for e in erpo]
    fig, (kl, acc) = plt.subplots(1, 2, figsize=(14, 4.2))
    qkl = [np.nan if ab[n]["query_kl_tail"] is None else ab[n]["query_kl_tail"] * 1e3 for n in names]
    kl.bar(x, qkl, color=colors)
    kl.set_yscale("log"), kl.set_ylabel("Query-KL, last 10% of steps (x1e-3)")
    for marker, t in zip("o^s", map(str_t, TEMPS)):
        acc.scatter(x, [100 * ab[n][f"last@{t}"] for n in names], c=colors, marker=marker, label=f"T={t}")
    acc.set_ylabel("held-out pass@1 at the last evaluation (%)"), acc.legend(fontsize=8)
    for ax in (kl, acc):
        ax.set_xticks(x, [n.removeprefix("short-") for n in names], rotation=45, ha="right", fontsize=8)
    fig.suptitle("ablations (112 steps, seed 0): grey without ERPO, blue with")
    path = os.path.join(folder, "ablations.png")
    fig.tight_layout(), fig.savefig(path, dpi=100), plt.close(fig)
    return [path]


def report(results) -> dict:
    study = aggregate(load_summaries(results))
    with open(os.path.join(results, "long_run.json"), "w") as f:
        json.dump(study, f, indent=1)
    with open(os.path.join(results, "tables.md"), "w") as f:
        f.write(tables(study))
    paths = figures(study, results) + ablation_figure(study, results)
    print(tables(study))
    print(f"wrote {results}/long_run.json, tables.md" + "".join(f", {os.path.basename(p)}" for p in paths))
    return study


def main(argv=None):
    ap = OneLineParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "long_run"),
                    help="the run folders (resumable)")
    ap.add_argument("--results", default=RESULTS,
                    help="the run summaries (summaries/), long_run.json, tables, figures")
    ap.add_argument("--jobs", type=jobs_count, default=2, help="runs at a time, one CPU thread each")
    ap.add_argument("--budget", type=float, default=100.0, help="minutes: start a run only while it fits")
    ap.add_argument("--report", action="store_true", help="only the report, from the run summaries there are")
    ap.add_argument("--list", action="store_true", help="which runs are done and which are missing")
    ap.add_argument("--smoke", action="store_true", help="toy sizes in a temporary folder (a minute)")
    a = ap.parse_args(argv)
    arms, runs = (SMOKE_ARMS, SMOKE_RUNS) if a.smoke else (ARMS, RUNS)
    if not a.smoke:
        return run_study(a, runs, arms)
    tmp = tempfile.mkdtemp(prefix="long-run-smoke-")
    a.runs_dir, a.results = os.path.join(tmp, "runs"), os.path.join(tmp, "results")
    try:
        return run_study(a, runs, arms)
    finally:                                                             # a failed smoke leaves no folder
        shutil.rmtree(tmp, ignore_errors=True)


def run_study(a, runs, arms):
    """main's work once its folders are set: --list, or the missing runs and the report."""
    os.makedirs(a.results, exist_ok=True)
    if a.list:
        todo = {r.name for r in missing(runs, a.results)}
        for r in runs:
            print(f"{'missing' if r.name in todo else 'done   '}  {r.name}")
        return None
    if not a.report:
        try:
            run_missing(runs, arms, a.runs_dir, a.results, a.jobs, a.budget)
        except RuntimeError as e:                                        # a run failed: its log says why
            raise SystemExit(f"error: {e}") from None
    return report(a.results)


if __name__ == "__main__":
    main()
