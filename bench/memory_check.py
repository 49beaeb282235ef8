"""Planned vs measured memory of an RL step, per phase, on a CPU with real tensors (12 configurations).

    python bench/memory_check.py                       # all 12, 2-3 minutes; writes bench/results/memory_check.json
    python bench/memory_check.py --only 1proc-fp32     # some of them (names: --list)

Each configuration runs memory_measure.measure_memory (the step's real code under memory_measure.PhasePeaks)
on a random 20M-parameter Qwen2 (configs/models/memcheck-20m.json: 32K vocabulary) with 1,008-token
prompts and 16 new tokens, and prints the plan of memory_plan.phases next to the measurement:
one process, 2-process DDP and 2-process FSDP2 (gloo, torchrun), with and without --grad-ckpt, in
float32 and bf16-mixed. tests/test_memory.py runs a subset and asserts plan within 15%.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from plumbing import memory_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "memory_check.json")
# The step: 2 prompts x G = 2 responses, 1,024-token rows, micro-batches of one row (one group
# where prompts are shared), sampler calls of 2 rows.
STEP = ["--model", "memcheck-20m", "--max-prompt-len", "1008", "--max-new-tokens", "16", "--group-size", "2",
        "--rollout-batch", "2", "--update-batch", "2", "--micro-batch", "1", "--gen-batch", "2", "--algo", "erpo",
        "--measure-policy-kl", "true"]    # the reference model's terms measured too
CONFIGS = {f"{procs}-{dtype}{'-ckpt' if ckpt else ''}": (procs, dtype, ckpt)
           for procs in ("1proc", "ddp", "fsdp") for dtype in ("fp32", "bf16") for ckpt in (False, True)}
TOLERANCE = 0.15


def train_argv(name):
    procs, dtype, ckpt = CONFIGS[name]
    return STEP + ["--dtype", "float32" if dtype == "fp32" else "bf16-mixed", "--fsdp", str(procs == "fsdp").lower(),
                   "--grad-ckpt", str(ckpt).lower(), *FAST]


# The step at scale, as the GPU configs run it (rl/run_setup.FAST_PATHS): what the plan models
FAST = ["--sampler", "kv", "--pack", "true", "--share-prompts", "true"]


def measure_here(name) -> dict:
    """This process's measurement (run under torchrun for the 2-process configurations)."""
    import torch

    import train
    from plumbing import distributed
    from rl import memory_measure

    torch.manual_seed(0)
    a, algo = train.parse_args(train_argv(name))
    d = distributed.setup("cpu", fsdp=a.fsdp)
    m = memory_measure.measure_memory(a, algo, d.world, fake=False, max_micro_batches=10 ** 6)
    planned = memory_plan.phases(memory_plan.arch_for(a.model), a, d.world, needs_ref=True, device="cpu")
    distributed.teardown()
    return {"name": name, "world": d.world, "measured": m.peaks, "planned": planned}


def free_port() -> int:
    """A port no one listens on now: a fixed one collides with another suite or check running beside."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name) -> dict:
    """A configuration in a fresh process (torchrun for DDP/FSDP2): nothing of another one stays alive."""
    procs = CONFIGS[name][0]
    launch = [sys.executable] if procs == "1proc" else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                                       "--master-port", str(free_port())]
    r = subprocess.run(launch + [os.path.abspath(__file__), "--worker", name], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("{")), None)
    if r.returncode or line is None:
        raise SystemExit(f"error: {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(line)


def worst_ratio(result) -> float:
    """The plan's furthest distance from the measurement over the phases, as |plan / measured - 1|."""
    return max(abs(result["planned"][ph] / result["measured"][ph] - 1) for ph in result["measured"])


def show(result) -> str:
    MiB = 2 ** 20
    cells = "  ".join(f"{ph} {result['planned'][ph] / MiB:6.0f}/{result['measured'][ph] / MiB:6.0f}" for ph in result["measured"])
    return f"{result['name']:16s} plan/measured MiB: {cells}  worst {worst_ratio(result) * 100:4.1f}%"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="these configurations only")
    ap.add_argument("--list", action="store_true", help="print the configuration names")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.list:
        return print("\n".join(CONFIGS))
    if a.worker:
        result = measure_here(a.worker)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return
    results = []
    for name in a.only or CONFIGS:
        results.append(measure(name))
        print(show(results[-1]), flush=True)
    bad = [r["name"] for r in results if worst_ratio(r) > TOLERANCE]
    print(f"{len(results) - len(bad)} of {len(results)} configurations within {TOLERANCE:.0%} in every phase" + (f"; not: {bad}" if bad else ""))
    if not a.only:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump({"command": "python bench/memory_check.py", "tolerance": TOLERANCE, "results": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
