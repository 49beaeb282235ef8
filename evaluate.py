"""Evaluate checkpoints the way the paper does (docs/method.md §6).

For every model x benchmark x temperature we sample n responses per problem, grade each with
reward.py, and report
    avg@n    mean correctness over the n samples (= the unbiased pass@1),
    pass@k   unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), for each k <= n,
    maj@n    accuracy of the majority answer (vote over the grader's normalized \\boxed{} answers),
then per benchmark the means over the temperature grid and over the buckets "<=1.0" and
"1.2-1.5", and "Avg." = the unweighted mean over benchmarks (the layout of the paper's Tables 1,
2 and 6). Outputs in --out: samples.jsonl (one line per sample, appended as we go, so an
interrupted run resumes where it stopped), summary.json, results.md, accuracy_vs_temperature.png.

    python evaluate.py --model data/tinymath/warmstart runs/erpo/ckpt --benchmarks tiny \\
        --n 8 --k 1 8 --out results/tiny
    python evaluate.py --model Qwen/Qwen2.5-Math-7B --template paper --benchmarks paper \\
        --data-dir /path/to/benchmarks --n 32 --k 1 8 32 --max-new-tokens 3072 --out results/7b

A --model is an HF folder or hub id, a run folder (runs/erpo: its ckpt/), or any checkpoint of a
run, including the sharded ones of an FSDP2 run (ckpt/dcp/: the run's initial model gives the
architecture, the shards the weights; checkpoints.find_model). Prompts plus --max-new-tokens must fit
the model's positions (checked before it samples). Training-run plots and the Appendix D NLL
study are analysis.py. Sampling is seeded per sample: the seed of (salt, benchmark, problem,
temperature, sample index) is rollout.row_seed, so a resumed or re-run evaluation draws the same
samples, and all models see the same seeds.

Resuming (evaluation/eval_folder.py): --out/config.json is the folder's resume key, the settings that change
what a sample is (GENERATION_KEYS, --dtype included) and a fingerprint of each model's weight, config
and tokenizer files (every byte hashed, no model loaded); each sample names the version of its
benchmark row. A command
whose key differs from the one its folder's samples were made under (another --top-p, a checkpoint
retrained or edited at the same path, a benchmark file whose rows changed) is refused with one line;
a folder with no samples of that model takes the new key, so a command that failed before sampling
never blocks the corrected one. Bad flag values, and an --out that is no evaluation folder (a
training run's), are refused before --out is written. Ctrl-C or SIGTERM: one line, exit status
130 / 143; every finished chunk is on disk and the same command continues.
"""

import argparse
import glob
import json
import math
import os
import sys
from collections import Counter, defaultdict

from plumbing import threads

os.environ.update(threads.short_spin(os.environ))  # OpenMP's threads: a short spin, then sleep (before torch)

from tqdm import tqdm

from evaluation import heldout
import reward
from data.prompts import PromptSet, encode_prompts
from evaluation import eval_folder
from plumbing import distributed, errors, extension, interrupts, plots, run_dir
from plumbing.errors import DataError

# The paper's temperature grid (method.md §6): 0.1 ... 1.0 and 1.2 ... 1.5, 14 points.
DEFAULT_TEMPERATURES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.3, 1.4, 1.5]
# Temperature buckets reported by Tables 2 and 6, plus the mean over the whole grid (Table 1).
BUCKETS = {"all": (0.0, math.inf), "<=1.0": (0.0, 1.0), "1.2-1.5": (1.2, 1.5)}
AVG = "Avg."

# ----------------------------------------------------------------------------- metrics (pure)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    Product form (no huge binomials): C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i).
    Equals 1 when n - c < k (every k-subset holds a correct sample).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def majority_correct(extracted, correct):
    """maj@n for one problem: is the most common answer correct?

    Answers vote under the grader's normaliser (reward.normalize), so two answers the grader
    reads as the same string vote together. Samples without an answer do not vote; ties go to the
    answer seen first; the winning group is graded by its first member. 0.0 when no sample has an
    answer.
    """
    keys = [None if a is None else (reward.normalize(a) or None) for a in extracted]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0.0
    best = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == best)
    return float(correct[keys.index(winner)])


def problem_metrics(correct, extracted, ks):
    """Metrics of one problem from its samples (lists of equal length n)."""
    n, c = len(correct), int(sum(bool(x) for x in correct))
    out = {"avg": c / n, "maj": majority_correct(extracted, correct)}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = pass_at_k(n, c, k)
    return out


def temp_key(t):
    return round(float(t), 6)


def bucket_of(t):
    return [b for b, (lo, hi) in BUCKETS.items() if lo - 1e-9 <= t <= hi + 1e-9]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _mean_dicts(ds):
    """Key-wise mean of metric dicts (a key missing from some dicts is averaged over the rest)."""
    keys = []
    for d in ds:
        keys += [k for k in d if k not in keys]
    return {k: _mean([d.get(k) for d in ds]) for k in keys}


def _group_records(records, n, models, benchmarks, temperatures):
    """-> {(model, bench, T): {problem id: {sample: record}}}, keeping only what is asked for."""
    temps = None if temperatures is None else {temp_key(t) for t in temperatures}
    groups = defaultdict(dict)
    for r in records:
        t = temp_key(r["temperature"])
        if (models is not None and r["model"] not in models) or \
           (benchmarks is not None and r["benchmark"] not in benchmarks) or \
           (temps is not None and t not in temps) or (n is not None and r["sample"] >= n):
            continue
        groups[(r["model"], r["benchmark"], t)].setdefault(r["id"], {})[r["sample"]] = r
    return groups


def _add_means(results):
    """In place: "Avg." over benchmarks per temperature (unweighted: each benchmark counts once),
    then every benchmark's (and Avg.'s) means over the temperature buckets."""
    for benches in results.values():
        names = [b for b in benches if b != AVG]
        all_t = sorted({t for b in names for t in benches[b]["by_temperature"]}, key=float)
        benches[AVG]["by_temperature"] = {
            t: _mean_dicts([benches[b]["by_temperature"][t] for b in names
                            if t in benches[b]["by_temperature"]]) for t in all_t}
        for b in names + [AVG]:
            by_t = benches[b]["by_temperature"]
            benches[b]["mean"] = {
                bucket: _mean_dicts([v for t, v in by_t.items() if bucket in bucket_of(float(t))])
                for bucket in BUCKETS}


def _level_accuracy(groups):
    """Accuracy by difficulty level (rows that carry one, e.g. the tiny world and MATH500), over
    all kept samples and temperatures: {model: {bench: {level: mean correctness}}}."""
    by_level = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (model, bench, _), problems in groups.items():
        for samples in problems.values():
            for r in samples.values():
                if r.get("level") is not None:
                    by_level[model][bench][str(r["level"])].append(float(r["correct"]))
    return {m: {b: {lv: sum(v) / len(v) for lv, v in sorted(d.items())} for b, d in bs.items()}
            for m, bs in by_level.items()}


def summarize(records, ks=(1,), n=None, models=None, benchmarks=None, temperatures=None):
    """Per-sample records -> nested metrics (the numbers behind results.md).

    records: dicts with model, benchmark, id, temperature, sample, correct, extracted.
    n: use samples 0..n-1 of each problem (default: all). ks: pass@k values (k <= n kept).
    models / benchmarks / temperatures: keep only these (default: whatever the records hold).
    Returns {"n", "ks", "models", "benchmarks", "temperatures", "results", "levels"} where
    results[model][benchmark or "Avg."] = {"by_temperature": {"0.1": {metric: value}},
                                           "mean": {"all" | "<=1.0" | "1.2-1.5": {metric: value}}}
    Metric names: avg@n, pass@1, pass@k..., maj@n, and num_problems.
    """
    groups = _group_records(records, n, models, benchmarks, temperatures)
    if n is None:
        n = max((len(s) for g in groups.values() for s in g.values()), default=0)
    ks = sorted({1, *[k for k in ks if 1 <= k <= n]}) if n else [1]
    results = defaultdict(lambda: defaultdict(lambda: {"by_temperature": {}}))
    for (model, bench, t), problems in sorted(groups.items()):
        per_problem = []
        for samples in problems.values():
            rs = [samples[i] for i in sorted(samples)]
            per_problem.append(problem_metrics([r["correct"] for r in rs],
                                               [r.get("extracted") for r in rs], ks))
        m = _mean_dicts(per_problem)
        results[model][bench]["by_temperature"][f"{t:g}"] = {
            f"avg@{n}": m["avg"], **{f"pass@{k}": m.get(f"pass@{k}") for k in ks},
            f"maj@{n}": m["maj"], "num_problems": len(per_problem)}
    _add_means(results)
    present_benches = []
    for m in results.values():
        present_benches += [b for b in m if b != AVG and b not in present_benches]
    return {"n": n, "ks": ks,
            "models": [m for m in (models or list(results)) if m in results],
            "benchmarks": [b for b in (benchmarks or present_benches) if b in present_benches],
            "temperatures": sorted({float(t) for m in results.values() for b in m.values()
                                    for t in b["by_temperature"]}),
            "results": json.loads(json.dumps(results)),  # plain dicts
            "levels": _level_accuracy(groups)}


# ----------------------------------------------------------------------------- tables


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}"


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_table(summary, path=None):
    """results.md: Table-1 layout (models x benchmarks, mean over temperatures) for each metric,
    then Table-2 layout (pass@1 per temperature and bucket means) for each benchmark and Avg."""
    n, res = summary["n"], summary["results"]
    models, benches = summary["models"], summary["benchmarks"] + [AVG]
    label = plots.short_labels(models)
    temps = [f"{t:g}" for t in summary["temperatures"]]
    metrics = [f"avg@{n}"] + [f"pass@{k}" for k in summary["ks"]] + [f"maj@{n}"]
    out = [f"# Results\n\nn = {n} samples per problem; temperatures {', '.join(temps)}. "
           f"Values in %. pass@k is the unbiased estimator; pass@1 = avg@{n}.\n"]
    for metric in metrics:
        rows = [[label[m]] + [_pct(res[m].get(b, {}).get("mean", {}).get("all", {}).get(metric))
                              for b in benches] for m in models]
        table = _md_table(["model"] + benches, rows)
        out.append(f"## {metric}, mean over temperatures\n\n{table}")
    for b in benches:
        rows = []
        for m in models:
            cell = res[m].get(b, {})
            by_t, mean = cell.get("by_temperature", {}), cell.get("mean", {})
            rows.append([label[m]] + [_pct(by_t.get(t, {}).get("pass@1")) for t in temps] +
                        [_pct(mean.get(k, {}).get("pass@1")) for k in ("<=1.0", "1.2-1.5", "all")])
        header = ["model"] + [f"T={t}" for t in temps] + ["mean <=1.0", "mean 1.2-1.5", "mean all"]
        out.append(f"## {b}: pass@1 by temperature\n\n" + _md_table(header, rows))
    for m, bs in summary.get("levels", {}).items():
        for b, d in bs.items():
            out.append(f"## {b}: accuracy by level ({label.get(m, m)}, all temperatures)\n\n" +
                       _md_table(["level"] + list(d), [["acc"] + [_pct(v) for v in d.values()]]))
    text = "\n\n".join(out) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


# ------------------------------------------------------------------- the sweep, with resume


def record_key(r):
    return (r["model"], r["benchmark"], str(r["id"]), temp_key(r["temperature"]), r["sample"])


def missing_samples(problems, done, model, benchmark, temperature, n):
    """{problem id: [sample indices not yet in `done`]} for problems with something left to do."""
    t = temp_key(temperature)
    todo = {}
    for p in problems:
        left = [i for i in range(n) if (model, benchmark, p["id"], t, i) not in done]
        if left:
            todo[p["id"]] = left
    return todo


def planned_samples(benches, temperatures, n, model_keys, done=frozenset()) -> int:
    """How many samples a sweep draws: every model x benchmark x temperature x problem x sample not
    yet in `done` (record keys). With nothing done: models x sets' problems x n x temperatures."""
    return sum(len(v) for key in model_keys for b, rows in benches.items() for t in temperatures
               for v in missing_samples(rows, done, key, b, t, n).values())


def evaluate_model(model, tokenizer, model_key, benches, temperatures, n, out_file, done, *,
                   template, max_new_tokens, top_p=1.0, batch_size=64, seed=0, sampler="kv",
                   timeout=1.0, progress=True):
    """Sample + grade everything missing for one model; append each record to `out_file`.

    benches: {benchmark label: normalized rows}. done: set of record keys already on disk
    (updated in place). Work is done a few problems at a time (about batch_size samples), and
    every finished chunk is flushed, so a kill loses at most one chunk.
    """
    plan = [(b, t, missing_samples(rows, done, model_key, b, t, n))
            for b, rows in benches.items() for t in temperatures]
    total = sum(len(v) for _, _, todo in plan for v in todo.values())
    with tqdm(total=total, desc=os.path.basename(os.path.normpath(model_key)), unit="sample",
              disable=not progress or total == 0) as bar:     # (closed on Ctrl-C too, before its one line)
        for bench, t, todo in plan:
            rows = {p["id"]: p for p in benches[bench] if p["id"] in todo}
            ids = list(rows)
            per_chunk = max(1, (batch_size or 64) // n)
            bar.set_postfix(bench=bench, T=f"{t:g}")
            for s in range(0, len(ids), per_chunk):
                chunk = [rows[i] for i in ids[s:s + per_chunk]]
                samples, _ = heldout.generate_samples(
                    model, tokenizer, chunk, t, todo, benchmark=bench, template=template,
                    max_new_tokens=max_new_tokens, top_p=top_p, batch_size=batch_size, seed=seed,
                    sampler=sampler)
                correct, extracted = heldout.grade([x["completion"] for x in samples],   # by each row's task
                                                   [rows[x["id"]] for x in samples], timeout)
                for x, c, e in zip(samples, correct, extracted):
                    rec = {"model": model_key, "benchmark": bench, "id": x["id"], "temperature": t,
                           "sample": x["sample"], "completion": x["completion"], "extracted": e,
                           "answer": rows[x["id"]]["answer"], "correct": bool(c),
                           "row": eval_folder.row_digest(rows[x["id"]]),
                           "level": rows[x["id"]].get("level"),
                           "num_tokens": x["num_tokens"], "finished": x["finished"]}
                    out_file.write(json.dumps(rec) + "\n")
                    done.add(record_key(rec))
                out_file.flush()
                bar.update(len(samples))


def merge_shards(out_dir):
    """Append the per-rank files of a torchrun sweep (samples.rank<r>.jsonl) to samples.jsonl,
    skipping records already there, then delete them. Idempotent: a kill halfway leaves nothing
    that a rerun would count twice (records are keyed; read_jsonl skips a half-written line)."""
    path = os.path.join(out_dir, eval_folder.SAMPLES_FILE)
    shards = sorted(glob.glob(os.path.join(out_dir, "samples.rank*.jsonl")))
    if not shards:
        return
    run_dir.drop_partial_line(path)
    done = {record_key(r) for r in run_dir.read_jsonl(path)}
    with open(path, "a") as f:
        for shard in shards:
            for r in run_dir.read_jsonl(shard):
                if record_key(r) not in done:
                    f.write(json.dumps(r) + "\n")
                    done.add(record_key(r))
        f.flush()
        os.fsync(f.fileno())
    for shard in shards:
        os.remove(shard)


def run_sweep(args, benches, d: distributed.Dist):
    """The main evaluation: sample/grade what is missing, then summary.json, results.md, png.
    Under torchrun each rank takes every world-th problem of each benchmark and appends to its
    own samples.rank<r>.jsonl; rank 0 merges them into samples.jsonl. Per-sample seeds make the
    records the same as one process's."""
    path = os.path.join(args.out, eval_folder.SAMPLES_FILE)
    if d.main:
        merge_shards(args.out)            # left by a killed multi-process run
        run_dir.drop_partial_line(path)
    distributed.barrier()
    done = {record_key(r) for r in run_dir.read_jsonl(path)}
    keys = heldout.model_keys(args)
    mine = os.path.join(args.out, f"samples.rank{d.rank}.jsonl") if d.world > 1 else path
    share = {b: rows[d.rank::d.world] for b, rows in benches.items()}
    with open(mine, "a") as f:
        for model_path, key in zip(args.model, keys):
            todo = planned_samples(share, args.temperatures, args.n, [key], done)
            if todo == 0:
                distributed.print0(f"{key}: all samples already in {path}")
                continue
            print(f"{key}: {todo} samples to generate" + (f" on rank {d.rank}" if d.world > 1 else ""))
            model, tokenizer = load_model(model_path, d.device,
                                          eval_folder.sampling_dtype(args.dtype, d.device))
            check_fits(model, tokenizer, benches, args)
            evaluate_model(model.eval(), tokenizer, key, share, args.temperatures, args.n, f, done,
                           template=args.template, max_new_tokens=args.max_new_tokens,
                           top_p=args.top_p, batch_size=args.batch_size, seed=args.seed,
                           sampler=args.sampler, timeout=args.grade_timeout,
                           progress=not args.no_progress and d.main)
            del model
    distributed.barrier()
    return write_results(args, benches) if d.main else None


def load_model(path, device, dtype):
    """heldout.load_model, its ValueError (files that looked like a model but do not load) one line."""
    try:
        return heldout.load_model(path, device, dtype)
    except ValueError as e:
        fail(e)


def check_fits(model, tokenizer, benches, args):
    """Before a model samples: every prompt of every benchmark (all of them, on every rank, so all
    ranks stop together) plus --max-new-tokens within the model's positions."""
    sets = {b: PromptSet(rows, encode_prompts(tokenizer, rows, args.template)) for b, rows in benches.items()}
    try:
        heldout.check_fits(model, sets, args.max_new_tokens, what="benchmark")
    except DataError as e:
        fail(str(e))


def write_results(args, benches):
    """summary.json, results.md and the plot, over the problems this command asks for: the samples
    of others (past a smaller --limit, or deleted from the benchmark's file) stay on disk, out of
    the tables."""
    merge_shards(args.out)
    path = os.path.join(args.out, eval_folder.SAMPLES_FILE)
    asked = {(b, str(r["id"])) for b, rows in benches.items() for r in rows}
    records = [r for r in run_dir.read_jsonl(path) if (r["benchmark"], str(r["id"])) in asked]
    summary = summarize(records, ks=args.k, n=args.n, models=heldout.model_keys(args),
                        benchmarks=list(benches), temperatures=args.temperatures)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(write_table(summary, os.path.join(args.out, "results.md")))
    plots.accuracy_vs_temperature(summary, os.path.join(args.out, "accuracy_vs_temperature.png"), avg_key=AVG)
    print(f"wrote {args.out}/: {eval_folder.SAMPLES_FILE}, summary.json, results.md, "
          "accuracy_vs_temperature.png")
    return summary


def all_sampled(args, benches) -> bool:
    """Is every sample this command asks for on disk already (samples.jsonl or rank files)?"""
    done = {record_key(r) for path in eval_folder.sample_files(args.out) for r in run_dir.read_jsonl(path)}
    return not any(missing_samples(rows, done, key, bench, t, args.n)
                   for key in heldout.model_keys(args) for bench, rows in benches.items()
                   for t in args.temperatures)


# ----------------------------------------------------------------------------- command line


def write_first(out, settings, fingerprints) -> str | None:
    """--out and its config.json, before any sample; a write that fails (a full disk): what it
    made goes again (no empty folder left) -> why, else None."""
    parent = run_dir._existing_parent(out)
    had = os.path.exists(os.path.join(out, "config.json"))
    try:
        os.makedirs(out, exist_ok=True)
        eval_folder.write_config(out, settings, fingerprints)
    except OSError as e:
        for leftover in ("config.json.tmp", *(() if had else ("config.json",))):
            if os.path.isfile(os.path.join(out, leftover)):
                os.remove(os.path.join(out, leftover))
        run_dir.remove_empty_folders(out, parent)
        return f"cannot write {out}/config.json ({e.strerror or e})"
    return None


def fail(msg):
    """Bad input: one line on stderr and exit status 2, no traceback, no usage dump."""
    print(f"evaluate.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def build_parser():
    p = errors.OneLineParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    heldout.add_sampling_args(p, benchmarks=["tiny"], out="results/eval",
                              out_help="output folder (resumes if it exists)",
                              model_help="HF model folder(s) or hub ids, run folders, or checkpoints of a "
                                         "run (an FSDP2 run's sharded ckpt/ too)")
    add = p.add_argument
    add("--temperatures", nargs="+", type=float, default=DEFAULT_TEMPERATURES)
    add("--n", "--num-samples", dest="n", type=int, default=32,
        help="samples per problem and temperature (under torchrun write --num-samples: torchrun takes --n "
             "as its own)")
    add("--k", nargs="+", type=int, default=None,
        help="pass@k values (default: 1, powers of 2 up to n, and n)")
    add("--nccl-timeout", type=float, default=120.0,
        help="under torchrun: minutes a rank waits at a collective before the job is aborted (NCCL's own 10 "
             "would fire while ranks wait for one that loads a model or grades)")
    return p


def parse_args(argv=None):
    """Parse and check the command line (bad input -> one line, not a traceback), before anything
    is loaded or written: a value outside its meaning never reaches --out."""
    extension.load_named(sys.argv[1:] if argv is None else argv)      # a task of one's own: a --task
    args = build_parser().parse_args(argv)
    try:
        heldout.check_sampling_args(args)
    except ValueError as e:
        fail(e)
    if args.n < 1:
        fail(f"--n must be >= 1, got {args.n}")
    if not (math.isfinite(args.nccl_timeout) and args.nccl_timeout > 0):
        fail(f"--nccl-timeout must be a finite number of minutes > 0, got {args.nccl_timeout}")
    if args.k is None:  # 1, 2, 4, ... up to n, and n itself
        args.k = sorted({args.n} | {2 ** i for i in range(args.n.bit_length()) if 2 ** i <= args.n})
    bad = [k for k in args.k if not 1 <= k <= args.n]
    if bad:
        fail(f"--k values must be in 1..n={args.n}, got {bad}")
    bad = [t for t in args.temperatures if not (math.isfinite(t) and t >= 0)]
    if bad:
        fail(f"--temperatures must be finite and >= 0, got {bad}")
    args.temperatures = sorted({temp_key(t) for t in args.temperatures})
    why = eval_folder.not_an_eval_folder(args.out)              # (a training run's folder: refused)
    if why:
        fail(why)
    if args.max_new_tokens is None:
        args.max_new_tokens = heldout.default_max_new_tokens(args.template)
    return args


def load_benchmarks(names, limit, data_dir, task="math") -> dict:
    """{label: normalized rows} of --benchmarks (heldout.load_sets); a bad one: one line."""
    try:
        return heldout.load_sets(names, limit, data_dir, task)
    except ValueError as e:
        fail(str(e))


def check_models(args) -> list:
    """Each --model's checkpoints.ModelSource, once every one is known to be a model (or a checkpoint
    of one) whose tokenizer loads: a bad one is one line before anything is written."""
    try:
        return [heldout.model_source(m) for m in args.model]
    except ValueError as e:
        fail(e)


def main(argv=None):
    """One process, or `torchrun --nproc_per_node=N evaluate.py ...` (the problems split across
    ranks, one merged samples.jsonl and summary). Ctrl-C or SIGTERM: one line, status 130 / 143,
    and the same command continues."""
    args = parse_args(argv)
    with interrupts.exit_when_interrupted(lambda: eval_folder.kept_samples(args.out), "evaluate.py"):
        benches = load_benchmarks(args.benchmarks, args.limit, args.data_dir, args.task)
        sources = check_models(args)
        d = distributed.setup(args.device, timeout_min=args.nccl_timeout)
        settings = eval_folder.sample_settings(args, d.device)
        fingerprints = {key: eval_folder.weights_fingerprint(src)
                        for key, src in zip(heldout.model_keys(args), sources)}
        finished = all_sampled(args, benches)                       # then only the tables are rewritten:
        auto = {"dtype"} if finished and args.dtype == "auto" else set()    # on any machine, whatever
        try:                                                        # its device's dtype
            # every rank: all stop together
            eval_folder.check_config(args.out, settings, fingerprints, ignore=auto,
                                     sources=dict(zip(heldout.model_keys(args), sources)))
            eval_folder.check_rows(args.out, benches)
        except ValueError as e:
            fail(e)
        why = write_first(args.out, settings, fingerprints) if d.main and not finished else None
        why = distributed.all_gather_list([why])[0]                 # every rank stops together
        if why:
            fail(why)
        summary = run_sweep(args, benches, d)
        distributed.teardown()
    return summary


if __name__ == "__main__":
    main()
