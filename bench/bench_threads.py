"""The tiny world's step under thread settings, on free cores and beside one busy process.

The default thread settings against the others, beside one busy process standing for another run,
a test suite or a browser. Ratios from one invocation on one machine, the settings alternated so
that a drift of the machine hits all alike.

    python bench/bench_threads.py                  # 4 RL steps a run, 2 runs a setting and load
    python bench/bench_threads.py --steps 3 --repeats 1

Why it matters: OpenMP's worker threads spin between parallel regions (libgomp: 300,000 turns by
default), and a tiny model's step is thousands of short regions. With a core taken by another
process, the spinning thread holds the core the working one waits for: the step takes several times
as long (issue #50: a main job of 40.6 minutes instead of 5.2 on a busy 2-core machine). train.py,
evaluate.py and analysis.py set GOMP_SPINCOUNT=3000 unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
set: the threads spin briefly, then sleep. Each setting here is named by its environment; the
median step time (steps 2..N of all its runs) and its ratio to the default on free cores.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {  # name -> environment (the default: train.py's own, GOMP_SPINCOUNT=3000)
    "default (spin 3000, 2 threads)": {},
    "libgomp's spin (300000, 2 threads)": {"GOMP_SPINCOUNT": "300000"},
    "passive (no spin, 2 threads)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
BUSY = "while True: pass"


def step_times(env: dict, steps: int, out: str) -> list[float]:
    """One tiny-world ERPO run of `steps` steps under `env` -> its steps' step_time, steps 2..N."""
    argv = [sys.executable, "train.py", "--algo", "erpo", "--alpha", "0.01", "--steps", str(steps),
            "--eval-every", "0", "--save-every", "0", "--out", out, "--overwrite", "--query-cache-dir", ""]
    full = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    full = {**full, "OMP_NUM_THREADS": "2", **env}
    r = subprocess.run(argv, cwd=ROOT, env=full, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"train.py failed under {env}: {r.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [m["step_time"] for m in rows if "step_time" in m][1:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps a run (the first is not timed)")
    p.add_argument("--repeats", type=int, default=2, help="runs a setting and load, alternated")
    a = p.parse_args(argv)
    if a.steps < 2 or a.repeats < 1:
        p.error("--steps must be >= 2 (the first step is not timed) and --repeats >= 1")
    times = {(load, name): [] for load in ("free", "busy") for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for load in ("free", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", BUSY]) if load == "busy" else None
            try:
                for _ in range(a.repeats):
                    for name, env in SETTINGS.items():
                        times[load, name] += step_times(env, a.steps, os.path.join(tmp, "run"))
                        print(f"  {load:4s} {name}: {statistics.median(times[load, name]):.2f} s", flush=True)
            finally:
                if busy:
                    busy.kill()
    base = statistics.median(times["free", "default (spin 3000, 2 threads)"])
    print(f"\nmedian RL step (steps 2..{a.steps}, {a.repeats} run(s) each), vs the default on free cores:")
    print("| setting | free cores | beside one busy process |\n|---|---:|---:|")
    for name in SETTINGS:
        free, busy = (statistics.median(times[load, name]) for load in ("free", "busy"))
        print(f"| {name} | {free:.2f} s ({free / base:.2f}x) | {busy:.2f} s ({busy / base:.2f}x) |")


if __name__ == "__main__":
    main()
