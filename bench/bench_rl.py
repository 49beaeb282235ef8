"""Side-by-side benchmark of one RL step: our train.py against TRL's GRPOTrainer, and our
algorithms against each other. Ratios from one invocation on one machine, never absolute times.

    python bench/bench_rl.py --vs trl        # ours (grpo) vs TRL 1.16 GRPOTrainer (pip install -r requirements-bench.txt)
    python bench/bench_rl.py                 # grpo vs erpo vs erpo --measure-policy-kl true vs grpo --share-prompts false
    python bench/bench_rl.py --vs pack       # grpo --share-prompts false: --pack true vs --pack false (and the default)

The pinned work (both sides): the embedded warm start (data/tinymath/warmstart), its training set
and prompt template ("plain"), 32 prompts x 8 responses per step, up to 96 new tokens, T = 1,
top-p 1, beta = 0.01 (Policy-KL k3 in the loss), one optimizer step per rollout (update batch =
rollout batch, micro-batches of 64 sequences), AdamW lr 2e-4, float32 on CPU, torch's default
threads, the same reward (reward.score_batch and its grading process). TRL: per_device_train_batch_size
64 x gradient_accumulation_steps 4 = 256 completions per optimizer step, num_generations 8,
loss_type "grpo", gradient checkpointing off (TRL's default is on; we run without).

Each run is a subprocess; the parent samples the memory of its whole process tree (the grader's
worker included) every 50 ms from /proc/PID/statm: the peak of the summed RSS (what `top` shows;
shared pages count once per process), and beside it the kernel's exact peak RSS of the main
process (ru_maxrss), which no sampling can miss. Step time: ours is train.py's `step_time` (one RL step:
sampling, grading, log-probs, update); TRL's is the time between consecutive optimizer steps
(on_step_end), which spans the same work. Each side runs --repeats times (default 2), alternated with
the other side(s) so that a drift of this shared machine's speed hits all alike; the median over
the steps 2..N of all its runs is printed (step 1 warms up), and each run's own median beside it.

--dtype bf16-mixed runs both sides with float32 weights and bf16 autocast (ours: --dtype bf16-mixed;
TRL: bf16=True, which accelerate turns into CPU autocast). On a CPU with native bf16 dot products
(AVX512-BF16 or AMX) the matmuls run ~2x faster than in float32; elsewhere slower.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, G, NEW, LR, BETA, MICRO = 32, 8, 96, 2e-4, 0.01, 64
OURS = ["--rollout-batch", str(PROMPTS), "--update-batch", str(PROMPTS), "--group-size", str(G),
        "--max-new-tokens", str(NEW), "--micro-batch", str(MICRO), "--lr", str(LR), "--temperature", "1.0",
        "--eval-every", "0", "--save-every", "0", "--log", "jsonl",
        *("--sampler", "kv", "--share-prompts", "true", "--pack", "true")]  # the fast paths (docs/speed.md)
VARIANTS = {  # name -> extra train.py flags
    "grpo": ["--algo", "grpo", "--beta", str(BETA)],
    "erpo": ["--algo", "erpo"],
    "erpo, Policy-KL monitor": ["--algo", "erpo", "--measure-policy-kl", "true"],
    "grpo, prompts unshared": ["--algo", "grpo", "--beta", str(BETA), "--share-prompts", "false"],
    "erpo, plain step": ["--algo", "erpo", "--sampler", "hf", "--share-prompts", "false", "--pack", "false"],
}
PACKING = {  # --vs pack: the full-row forwards packed (issue #42) or padded, beside the default (shared prompts)
    "padded (unshared)": ["--algo", "grpo", "--beta", str(BETA), "--share-prompts", "false", "--pack", "false"],
    "packed (unshared)": ["--algo", "grpo", "--beta", str(BETA), "--share-prompts", "false", "--pack", "true"],
    "grpo (shared prompts)": ["--algo", "grpo", "--beta", str(BETA)],
}
# --vs pack runs train.py under this: every training forward (score_tokens) adds the tokens of its
# padded rows, their real tokens, and what it runs (packed: PackLayout's bins) to tokens.json.
COUNTING = """
import atexit, json, os, sys
sys.path.insert(0, os.getcwd())
sys.argv = ["train.py"] + sys.argv[1:]
from modeling import logprobs
import torch
n = dict(padded=0, real=0, run=0, forwards=0, shared_real=0, update_lengths=[])
score = logprobs.score_tokens
def counted(model, packed, *a, **k):
    real = int(packed.attention_mask.sum())
    if torch.is_grad_enabled() and packed.lengths:         # an update micro-batch: its rows' lengths
        n["update_lengths"].append([list(x) for x in packed.lengths])
    n["padded"] += packed.input_ids.numel(); n["real"] += real; n["forwards"] += 1
    group = k.get("group", a[2] if len(a) > 2 else 1)
    if group > 1:                                          # shared prompts: each prompt once, then the responses
        n["run"] += packed.input_ids.shape[0] // group * packed.P + packed.attention_mask[:, packed.P:].numel()
        n["shared_real"] += int(packed.attention_mask[::group, :packed.P].sum() + packed.attention_mask[:, packed.P:].sum())
    elif packed.pack:
        lengths = packed.lengths or list(zip(packed.attention_mask[:, :packed.P].sum(1).tolist(),
                                             packed.attention_mask[:, packed.P:].sum(1).tolist()))
        b, w = logprobs.PackLayout.of(lengths, packed.P, packed.input_ids.shape[1], "cpu",
                                      max(p + r for p, r in lengths)).shape
        n["run"] += b * w
    else:
        n["run"] += packed.input_ids.numel()
    return score(model, packed, *a, **k)
logprobs.score_tokens = counted
out = sys.argv[sys.argv.index("--out") + 1]
atexit.register(lambda: json.dump(n, open(os.path.join(out, "tokens.json"), "w")))
import runpy
runpy.run_path("train.py", run_name="__main__")
"""


# ----------------------------------------------------------------------------------------------
# Memory of a process tree, sampled from /proc


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _rss_kib(pid):
    """Resident set of one process in KiB, or 0 if it is gone. From statm: a counter read, no
    page-table walk (smaps_rollup's walk holds the process's mmap lock: sampling it every 50 ms
    slowed the allocation-heavy update of the measured process by up to 1.6x)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, IndexError, ValueError):
        return 0


class TreeMemory(threading.Thread):
    """Peak summed RSS (GiB) of a process and its descendants, sampled every 50 ms."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak_rss, self.procs, self.stop = pid, 0, 1, False

    def run(self):
        while not self.stop:
            pids = _tree(self.pid)
            self.peak_rss = max(self.peak_rss, sum(_rss_kib(p) for p in pids))
            self.procs = max(self.procs, len(pids))
            time.sleep(0.05)


def run_measured(cmd, env=None):
    """Run cmd; return (peak summed RSS of its process tree, the kernel's exact peak RSS of the
    process itself (ru_maxrss), both GiB; most processes seen at once). Exits on failure."""
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        mem = TreeMemory(p.pid)
        mem.start()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        mem.stop = True
        mem.join()
        if p.returncode:
            err.seek(0)
            sys.exit(f"error: {' '.join(cmd[:4])} ... failed (exit {p.returncode}):\n{err.read()[-3000:]}")
    return mem.peak_rss / 2**20, usage.ru_maxrss / 2**20, mem.procs


# ----------------------------------------------------------------------------------------------
# The two sides


def ours(flags, steps, out, dtype="float32", count_tokens=False):
    entry = ["-c", COUNTING] if count_tokens else [os.path.join(ROOT, "train.py")]
    cmd = [sys.executable, *entry, *OURS, *flags, "--dtype", dtype, "--steps", str(steps), "--out", out]
    rss, main_rss, procs = run_measured(cmd)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    phases = {k: statistics.median(m[k] for m in lines[1:]) for k in lines[-1] if k.startswith("time_")}
    tokens = None
    if count_tokens:
        with open(os.path.join(out, "tokens.json")) as f:
            tokens = json.load(f)
    return dict(step_s=[m["step_time"] for m in lines], rss=rss, main_rss=main_rss, procs=procs, phases=phases,
                update_tok_s=statistics.median(m["update_tok_per_s"] for m in lines[1:]), tokens=tokens)


def trl(steps, out, dtype="float32"):
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", "--steps", str(steps), "--out", out, "--dtype", dtype]
    rss, main_rss, procs = run_measured(cmd)
    with open(os.path.join(out, "trl_steps.json")) as f:
        return dict(step_s=json.load(f), rss=rss, main_rss=main_rss, procs=procs, phases={})


def trl_worker(steps, out, dtype):
    """Runs in the subprocess: TRL's GRPOTrainer on the pinned work; writes its step times."""
    sys.path.insert(0, ROOT)
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from modeling import models
    import reward
    from data.prompts import build_prompt

    model, tok = models.load_policy(os.path.join(ROOT, "data", "tinymath", "warmstart"), dtype=torch.float32)
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    data = Dataset.from_list([{"prompt": build_prompt(tok, r["problem"], "plain"), "answer": r["answer"]} for r in rows])

    def accuracy(prompts, completions, answer, **_):   # the same grader as train.py
        return reward.score_batch(list(completions), list(answer))[0]

    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=out, use_cpu=True, bf16=dtype == "bf16-mixed", learning_rate=LR, beta=BETA, loss_type="grpo",
                     per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * G // MICRO,
                     num_generations=G, max_completion_length=NEW, temperature=1.0, top_p=1.0,
                     gradient_checkpointing=False, max_steps=steps, logging_steps=1, save_strategy="no",
                     report_to=[], seed=0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01)
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    with open(os.path.join(out, "trl_steps.json"), "w") as f:
        json.dump([b - a for a, b in zip([start] + ends[:-1], ends)], f)


# ----------------------------------------------------------------------------------------------


def median_after_first(xs):
    return statistics.median(xs[1:]) if len(xs) > 1 else xs[0]


def merged(runs):
    """Repeats of one side -> one result: the steps after each run's first, pooled (their median is
    the side's step time), the peak memory over all runs, the per-phase medians over the runs."""
    steps = [t for r in runs for t in (r["step_s"][1:] if len(r["step_s"]) > 1 else r["step_s"])]
    out = dict(step_s=[float("nan")] + steps, rss=max(r["rss"] for r in runs), main_rss=max(r["main_rss"] for r in runs),
               procs=max(r["procs"] for r in runs), runs=[median_after_first(r["step_s"]) for r in runs],
               phases={k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]})
    if runs[0].get("update_tok_s"):
        out["update_tok_s"] = statistics.median(r["update_tok_s"] for r in runs)
    if runs[0].get("tokens"):
        out["tokens"] = {k: sum(r["tokens"][k] for r in runs) for k in runs[0]["tokens"] if k != "update_lengths"}
        out["update_lengths"] = [x for r in runs for x in r["tokens"]["update_lengths"]]
    return out


def alternated(sides, repeats, tmp):
    """Run each side `repeats` times, alternating (A B A B ...), so a drift in the shared machine's
    speed hits every side alike; -> {name: merged result}."""
    runs = {name: [] for name in sides}
    for k in range(repeats):
        for name, fn in sides.items():
            print(f"running {name} ({k + 1}/{repeats}) ...", flush=True)
            folder = "".join(c if c.isalnum() else "_" for c in name)          # one per side and run
            runs[name].append(fn(os.path.join(tmp, f"{folder}_{len(runs[name])}")))
    return {name: merged(rs) for name, rs in runs.items()}


def forward_backward(lengths_list, reps=5):
    """The update's forward + backward alone on micro-batches of the lengths a run recorded
    (random tokens), packed and padded alternated `reps` times in this process: the medians (s)."""
    import torch
    from dataclasses import replace

    sys.path.insert(0, ROOT)
    from modeling import logprobs, models

    model, _ = models.load_policy(os.path.join(ROOT, "data", "tinymath", "warmstart"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in lengths_list:
        P, R = max(p for p, _ in lengths), max(r for _, r in lengths)
        ids, mask = torch.zeros(len(lengths), P + R, dtype=torch.long), torch.zeros(len(lengths), P + R, dtype=torch.long)
        for i, (p, r) in enumerate(lengths):
            ids[i, P - p:P + r] = torch.randint(3, model.config.vocab_size, (p + r,), generator=g)
            mask[i, P - p:P + r] = 1
        batches.append(logprobs.Packed(ids, mask, mask[:, 1:P] * mask[:, :P - 1], P, [tuple(x) for x in lengths]))
    times = {True: [], False: []}
    for _ in range(reps):
        for pack in (False, True):
            t0 = time.perf_counter()
            for b in batches:
                s = logprobs.score_tokens(model, replace(b, pack=pack), 1.0)
                (s.response.sum() + s.prompt.sum()).backward()
            times[pack].append(time.perf_counter() - t0)
    return statistics.median(times[False]), statistics.median(times[True])


def matmul_gflops():
    """float32 matmul throughput of this machine at the tiny model's shapes (4096 x 128 @ 128 x 384)
    and at 2048^2: the ceiling the update's compute runs against."""
    import torch

    out = []
    for m, k, n, reps in ((4096, 128, 384, 200), (2048, 2048, 2048, 5)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        out.append(2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9)
    return out


def compute_rate(results):
    """The update's throughput in row tokens (prompt + response of every row, as logged in
    update_tok_per_s) next to this machine's matmul peak. With shared prompts (the default) the
    model computes each group's prompt once, so 6 x parameters x row tokens would overstate its
    FLOPs: what matters is the step time above."""
    small, big = matmul_gflops()
    for name, r in results.items():
        if r.get("update_tok_s"):
            print(f"{name:22s} update {r['update_tok_s']:.0f} row tokens/s")
    print(f"float32 matmul on this machine: {small:.0f} GFLOP/s at 4096x128x384, {big:.0f} GFLOP/s at 2048^3")


def report(results, base):
    b = results[base]
    print(f"{'':22s} {'median step':>12s} {'vs ' + base:>10s} {'peak RSS':>9s} {'(main)':>9s} {'procs':>5s}  per run")
    for name, r in results.items():
        t = median_after_first(r["step_s"])
        print(f"{name:22s} {t:10.2f} s {median_after_first(b['step_s']) / t:9.2f}x "
              f"{r['rss']:7.2f} G {r['main_rss']:7.2f} G {r['procs']:5d}  " + " ".join(f"{x:.2f}" for x in r["runs"]))
    for name, r in results.items():
        if r["phases"]:
            print(f"{name:22s} " + "  ".join(f"{k[5:]} {v:.2f}s" for k, v in r["phases"].items()))
    for name, r in results.items():
        if r.get("tokens"):
            t = r["tokens"]
            print(f"{name:22s} training forwards: padded rows {t['padded'] / t['real']:.3f}x the real tokens, "
                  f"run {t['run'] / t['real']:.3f}x ({t['forwards']} forwards)"
                  + (f"; each prompt once, unpadded: {t['shared_real'] / t['real']:.3f}x" if t["shared_real"] else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--vs", choices=["trl", "pack"], help="trl: our GRPO step vs TRL's GRPOTrainer; pack: "
                    "--share-prompts false with --pack true vs false (and the default), with token counts")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", choices=["float32", "bf16-mixed"], default="float32",
                    help="both sides: float32, or float32 weights with bf16 autocast (ours --dtype bf16-mixed, "
                         "TRL bf16=True)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, alternated; their steps pooled")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.steps, args.out, args.dtype)
    tmp = args.out or tempfile.mkdtemp(prefix="bench_rl_")
    if args.vs == "trl":
        try:
            import trl as _  # noqa: F401
        except ImportError:
            sys.exit("error: TRL is not installed (pip install -r requirements-bench.txt)")
        results = alternated({"ours (grpo)": lambda o: ours(VARIANTS["grpo"], args.steps, o, args.dtype),
                              "TRL GRPOTrainer": lambda o: trl(args.steps, o, args.dtype)}, args.repeats, tmp)
        report(results, "TRL GRPOTrainer")
    elif args.vs == "pack":
        results = alternated({name: (lambda o, f=flags: ours(f, args.steps, o, args.dtype, count_tokens=True))
                              for name, flags in PACKING.items()}, args.repeats, tmp)
        report(results, "padded (unshared)")
        lengths = results["packed (unshared)"]["update_lengths"][:4]
        padded, packed = forward_backward(lengths)
        print(f"update forward + backward alone, {len(lengths)} micro-batches of {sum(map(len, lengths))} rows, "
              f"medians of 5 alternated: padded {padded:.2f} s, packed {packed:.2f} s ({padded / packed:.2f}x faster)")
    else:
        results = alternated({name: (lambda o, f=flags: ours(f, args.steps, o, args.dtype)) for name, flags in VARIANTS.items()},
                             args.repeats, tmp)
        report(results, "grpo")
    compute_rate(results)
    print(f"runs in {tmp}")


if __name__ == "__main__":
    main()
