"""GRPO vs ERPO, side by side, in under 10 minutes on 2 CPU cores: the Query-KL drift plot.

    python -m labs.drift_pair                      # both runs -> runs/drift_pair/ (figure, JSON, run folders)
    python -m labs.drift_pair --out labs/results   # the same, and REWRITES the committed figure and JSON
    python -m labs.drift_pair --replot labs/results/drift_pair.json --out /tmp/x   # the figure from a JSON

Two `train.py` runs, `--algo grpo` and `--algo erpo`, start together as subprocesses with one
intra-op thread each (the two cores, one each), from the same warm start, seed and first rollout,
on the first SUBSET problems of the tiny training set, so that the short runs pass over them many
times (the multi-epoch regime where GRPO's Query-KL drifts: study/miniature.py). Both log the same
k3 monitors on the rollout policy: `query_kl` (prompt tokens vs the initial model, method.md §3)
and `policy_kl` (response tokens vs the reference policy, method.md §8). GRPO has the Policy-KL
in its loss and nothing on the prompts; ERPO has the Query-KL in its loss instead (method.md §1).

Output: drift_pair.json (the settings and every plotted number) and drift_pair.png, drawn from the
JSON alone by `plot` (tests/test_labs.py redraws it from the committed JSON); the PNG carries the
digest of the numbers it shows (`numbers_digest`).
"""

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ("grpo", "erpo")
SUBSET = 64           # training problems: 16 prompts per RL step pass over them every 4 steps
STEPS = 80            # 20 passes; ~4 s a step on one busy core
KEYS = ("query_kl", "policy_kl", "train_acc")
TAIL = 8              # the last 10% of steps, averaged beside the last step (one step is noisy)
SETTINGS = ["--rollout-batch", "16", "--update-batch", "8", "--group-size", "8", "--max-new-tokens", "64",
            "--eval-every", "0", "--save-every", "0", "--seed", "0", "--query-cache-dir", "",
            "--measure-policy-kl", "true"]     # ERPO's Policy-KL is the figure's right panel


def train_argv(algo, data, out, steps=STEPS) -> list[str]:
    """train.py's arguments of one run of the pair (its own run folder, replaced if there)."""
    return ["--algo", algo, "--train-data", data, "--out", out, "--steps", str(steps), *SETTINGS,
            "--overwrite"]


def write_subset(folder) -> str:
    path = os.path.join(folder, "train-subset.jsonl")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(SUBSET)]
    with open(path, "w") as f:
        f.write("".join(rows))
    return path


def metric_rows(run) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f) if "step" in r and "query_kl" in r]


def run_pair(runs, steps) -> tuple[float, float]:
    """Both train.py runs at once, one thread each, their output in runs/<algo>.log -> (wall seconds,
    CPU seconds of the two: on 2 otherwise idle cores the wall time is about half of it)."""
    os.makedirs(runs, exist_ok=True)
    data = write_subset(runs)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0, cpu0, procs = time.time(), _children_cpu(), {}
    for algo in ALGOS:
        log = open(os.path.join(runs, f"{algo}.log"), "w")
        argv = train_argv(algo, data, os.path.join(runs, algo), steps)
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), *argv]
        procs[algo] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    try:
        shown = t0
        while any(p.poll() is None for p, _ in procs.values()):
            time.sleep(1)
            if time.time() - shown >= 30:
                shown = time.time()
                done = ", ".join(f"{a} {len(metric_rows(os.path.join(runs, a)))}/{steps}" for a in ALGOS)
                print(f"  {shown - t0:5.0f} s: steps done {done}", flush=True)
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait()
            log.close()
    for algo, (p, _) in procs.items():
        if p.returncode != 0:
            raise SystemExit(f"error: train.py --algo {algo} exited with {p.returncode}: see "
                             f"{os.path.join(runs, algo + '.log')}")
    return time.time() - t0, _children_cpu() - cpu0


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def record(runs, steps, wall_s, cpu_s) -> dict:
    """The JSON: settings, per-step curves of both runs, last-step and tail values, the verdict."""
    curves = {}
    for algo in ALGOS:
        rows = metric_rows(os.path.join(runs, algo))
        curves[algo] = {"step": [r["step"] for r in rows], **{k: [r.get(k) for r in rows] for k in KEYS}}
    tail = max(1, min(TAIL, steps // 10 or 1))
    summary = {algo: {"last_" + k: c[k][-1] for k in ("query_kl", "policy_kl")} |
               {f"tail_{k}": sum(c[k][-tail:]) / tail for k in ("query_kl", "policy_kl")}
               for algo, c in curves.items()}
    g, e = summary["grpo"], summary["erpo"]
    return {"command": "python -m labs.drift_pair", "train_py": SETTINGS, "subset": SUBSET, "steps": steps,
            "tail_steps": tail, "threads_per_run": 1, "wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1),
            "curves": curves,
            "summary": summary, "grpo_query_kl_above_erpo": {"last": g["last_query_kl"] > e["last_query_kl"],
                                                             "tail": g["tail_query_kl"] > e["tail_query_kl"]}}


def numbers_digest(rec) -> str:
    """sha256 of the plotted numbers (the curves), as the PNG's metadata carries it."""
    return hashlib.sha256(json.dumps(rec["curves"], sort_keys=True).encode()).hexdigest()


def plot(rec, path):
    """The figure, from the JSON record alone: Query-KL (left) and Policy-KL (right) per RL step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in zip(axes, ("query_kl", "policy_kl"),
                              ("Query-KL (prompt tokens vs initial model)", "Policy-KL (response tokens)")):
        for i, algo in enumerate(ALGOS):
            c = rec["curves"][algo]
            ax.plot(c["step"], [1e3 * v for v in c[key]], color=f"C{i}", lw=1.2, label=algo)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"{key} (×10⁻³, k3 per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(f"GRPO vs ERPO: {rec['steps']} steps on {rec['subset']} tiny problems "
                 f"(python -m labs.drift_pair)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Description": "numbers sha256 " + numbers_digest(rec)})
    plt.close(fig)
    return path


def report(rec) -> str:
    """The lines the command prints at the end (the teacher's page quotes them)."""
    g, e = rec["summary"]["grpo"], rec["summary"]["erpo"]
    when = {"last_": f"step {rec['steps']}", "tail_": f"mean of steps {rec['steps'] - rec['tail_steps'] + 1}-"
                                                       f"{rec['steps']}"}
    lines = [f"{'':30} {'grpo':>10} {'erpo':>10}"]
    for k in ("query_kl", "policy_kl"):
        for prefix, label in when.items():
            lines.append(f"{k + ', ' + label:30} {g[prefix + k]:10.3e} {e[prefix + k]:10.3e}")
    above = rec["grpo_query_kl_above_erpo"]
    lines.append(f"GRPO's query_kl above ERPO's: at the last step {'yes' if above['last'] else 'NO'}, "
                 f"over the last {rec['tail_steps']} steps {'yes' if above['tail'] else 'NO'}")
    return "\n".join(lines)


def write(rec, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "drift_pair.json"), "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    return plot(rec, os.path.join(out, "drift_pair.png"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "drift_pair"),
                   help="folder of drift_pair.json and drift_pair.png (default runs/drift_pair; labs/results "
                        "holds the committed ones)")
    p.add_argument("--runs", default=os.path.join("runs", "drift_pair"),
                   help="folder of the two run folders and their logs (replaced if there)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"RL steps of each run (default {STEPS})")
    p.add_argument("--replot", metavar="JSON", help="only draw the figure of this drift_pair.json into --out")
    a = p.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            rec = json.load(f)
        os.makedirs(a.out, exist_ok=True)
        print(f"wrote {plot(rec, os.path.join(a.out, 'drift_pair.png'))}")
        return print(report(rec))
    if a.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    print(f"grpo and erpo, {a.steps} steps each, one thread each, in parallel (logs: {a.runs}/<algo>.log)")
    wall, cpu = run_pair(a.runs, a.steps)
    rec = record(a.runs, a.steps, wall, cpu)
    print(f"both done in {wall / 60:.1f} min ({cpu / 60:.1f} CPU min); wrote {write(rec, a.out)} and "
          "drift_pair.json")
    print(report(rec))


if __name__ == "__main__":
    main()
