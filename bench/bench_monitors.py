"""What the per-term gradient monitors cost (rl/monitors.py, issue #43): one RL step's time with the
monitors every step, at train.py's default cadence (--monitor-every's default) and off, side by side
on the tiny world. Ratios from one invocation on one machine, never absolute times.

    python bench/bench_monitors.py                     # erpo, 10 steps per run, each config once
    python bench/bench_monitors.py --full              # at train.py's default sizes (slow on a CPU)
    python bench/bench_monitors.py --algo grpo --steps 20 --repeats 2

Each run is a subprocess of train.py (the embedded warm start, the first 256 problems of its training
set, the sizes of SMALL or train.py's defaults, no evaluation, no checkpoint); the configurations
alternate, so a drift of this shared machine's speed hits all alike. Printed per configuration: the MEAN step_time over steps 2..N (a
median would hide the one monitored step in N; step 1 warms up) and its ratio to "off"; then the
monitors' own phase (time_monitors, the extra forward and one backward per loss term, on one
micro-batch) per monitored step, and what it adds per step at each cadence as a fraction of the
"off" step time: the estimate that step-time noise does not blur. The issue's bar: the default
cadence costs <= 5%.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# the tests' sizes (8 prompts x 4 responses, 48 new tokens, micro-batches of 16 rows: the monitors'
# one micro-batch is half of the step's rows, so their share is larger than at train.py's defaults)
SMALL = ["--rollout-batch", "8", "--update-batch", "8", "--group-size", "4", "--max-new-tokens", "48",
         "--micro-batch", "16"]
FIXED = ["--eval-every", "0", "--save-every", "0", "--log", "jsonl"]


def default_cadence() -> int:
    import train
    return next(row[1] for row in train.OPTIONS if row[0] == "monitor_every")


def training_subset(tmp, n=256) -> str:
    """The first n problems of the tiny world's training set: its Query-KL cache is built in seconds,
    not the minutes of all 8,500 (the steps sample from it alike)."""
    path = os.path.join(tmp, "train.jsonl")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f, open(path, "w") as out:
        out.writelines(line for _, line in zip(range(n), f))
    return path


def one_run(algo, extra, steps, out, sizes, data) -> list[dict]:
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--algo", algo, "--steps", str(steps), "--out", out,
            "--train-data", data, "--overwrite", *sizes, *FIXED, *extra]
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("step", 0) > 0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--algo", default="erpo")
    p.add_argument("--steps", type=int, default=10, help="RL steps per run (>= 2; step 1 is not timed)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--full", action="store_true", help="train.py's default sizes (32 prompts x 8 responses, "
                   "96 new tokens, micro-batches of 64 rows) instead of the tests' (minutes per step on 2 cores)")
    args = p.parse_args(argv)
    sizes = [] if args.full else SMALL
    n = default_cadence()
    configs = {"off": ["--monitor-every", "0"], f"default (every {n})": [], "every step": ["--monitor-every", "1"]}
    times = {name: [] for name in configs}
    phase = []
    with tempfile.TemporaryDirectory() as tmp:
        data = training_subset(tmp)
        for rep in range(args.repeats):
            for i, (name, extra) in enumerate(configs.items()):
                rows = one_run(args.algo, extra, args.steps, os.path.join(tmp, f"{rep}-{i}"),
                               sizes, data)
                times[name] += [r["step_time"] for r in rows if r["step"] > 1]
                phase += [r["time_monitors"] for r in rows if "time_monitors" in r and r["step"] > 1]
    off = statistics.mean(times["off"])
    shown = " ".join(sizes) or "train.py's defaults"
    print(f"{args.algo}, {args.steps} steps x {args.repeats} run(s) per config; sizes: {shown}")
    print(f"{'config':22s} {'mean step_time':>15s} {'vs off':>8s}")
    for name, ts in times.items():
        m = statistics.mean(ts)
        print(f"{name:22s} {m:14.2f}s {m / off:8.3f}")
    if phase:
        per = statistics.mean(phase)
        print(f"monitors' phase: {per:.3f} s per monitored step = {100 * per / off:.1f}% of an 'off' step; "
              f"at the default cadence (every {n}) {100 * per / off / max(n, 1):.2f}% per step")


if __name__ == "__main__":
    main()
