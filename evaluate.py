"""Evaluate checkpoints the way the paper does (ERPO.md §6), and plot training runs.

For every model x benchmark x temperature we sample n responses per problem, grade each with
reward.py, and report
    avg@n    mean correctness over the n samples (= the unbiased pass@1),
    pass@k   unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), for each k <= n,
    maj@n    accuracy of the majority answer (vote over normalized \\boxed{} answers),
then per benchmark the means over the temperature grid and over the buckets "<=1.0" and
"1.2-1.5", and "Avg." = the unweighted mean over benchmarks (the layout of the paper's Tables 1,
2 and 6). Outputs in --out: samples.jsonl (one line per sample, appended as we go, so an
interrupted run resumes where it stopped), summary.json, results.md, accuracy_vs_temperature.png.

    python evaluate.py --model data/tinymath/warmstart runs/erpo/final --benchmarks tiny \\
        --n 8 --k 1 8 --out results/tiny
    python evaluate.py --model Qwen/Qwen2.5-Math-7B --template paper --benchmarks paper \\
        --data-dir /path/to/benchmarks --n 32 --k 1 8 32 --max-new-tokens 3072 --out results/7b
    python evaluate.py --from-run runs/grpo runs/erpo --out results/runs    # KL + train-eval gap
    python evaluate.py --model runs/grpo/final --benchmarks tiny-train --limit 512 \\
        --nll-analysis --out results/nll                                  # Appendix D

Sampling is seeded per sample: the seed of (benchmark, problem, temperature, sample index) is a
hash, so a resumed or re-run evaluation draws the same samples, and all models see the same seeds.
"""

import argparse
import hashlib
import json
import math
import os
import re
import sys
from collections import Counter, defaultdict

from tqdm import tqdm

from data.benchmarks import benchmark_label, expand_benchmarks, load_benchmark, normalize_answer
from data.prompts import TEMPLATES, build_prompt

# The paper's temperature grid (ERPO.md §6): 0.1 ... 1.0 and 1.2 ... 1.5, 14 points.
DEFAULT_TEMPERATURES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.3, 1.4, 1.5]
# Temperature buckets reported by Tables 2 and 6, plus the mean over the whole grid (Table 1).
BUCKETS = {"all": (0.0, math.inf), "<=1.0": (0.0, 1.0), "1.2-1.5": (1.2, 1.5)}
AVG = "Avg."
SAMPLES_FILE = "samples.jsonl"
# Settings that change what a sample is: a resumed run must use the same ones.
GENERATION_KEYS = ["template", "max_new_tokens", "top_p", "seed", "sampler"]

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


def normalize_extracted(answer):
    """Extracted answer -> a voting key for maj@n: "27.0", "027", " 27 " all vote together."""
    if answer is None:
        return None
    s = normalize_answer(answer)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", " "):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    return normalize_answer(s) or None


def majority_correct(extracted, correct):
    """maj@n for one problem: is the most common (normalized) answer correct?

    Samples without an answer do not vote; ties go to the answer seen first; the winning group is
    graded by its first member (equal keys grade alike). 0.0 when no sample has an answer.
    """
    keys = [normalize_extracted(a) for a in extracted]
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


def summarize(records, ks=(1,), n=None, models=None, benchmarks=None, temperatures=None):
    """Per-sample records -> nested metrics (the numbers behind results.md).

    records: dicts with model, benchmark, id, temperature, sample, correct, extracted.
    n: use samples 0..n-1 of each problem (default: all). ks: pass@k values (k <= n kept).
    models / benchmarks / temperatures: keep only these (default: whatever the records hold).
    Returns {"n", "ks", "models", "benchmarks", "temperatures", "results"} where
    results[model][benchmark or "Avg."] = {"by_temperature": {"0.1": {metric: value}},
                                           "mean": {"all" | "<=1.0" | "1.2-1.5": {metric: value}}}
    Metric names: avg@n, pass@1, pass@k..., maj@n, and num_problems.
    """
    temps = None if temperatures is None else {temp_key(t) for t in temperatures}
    groups = defaultdict(dict)  # (model, bench, T) -> {problem id: {sample: record}}
    for r in records:
        t = temp_key(r["temperature"])
        if (models is not None and r["model"] not in models) or \
           (benchmarks is not None and r["benchmark"] not in benchmarks) or \
           (temps is not None and t not in temps) or (n is not None and r["sample"] >= n):
            continue
        groups[(r["model"], r["benchmark"], t)].setdefault(r["id"], {})[r["sample"]] = r
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
        row = {f"avg@{n}": m["avg"], **{f"pass@{k}": m.get(f"pass@{k}") for k in ks},
               f"maj@{n}": m["maj"], "num_problems": len(per_problem)}
        results[model][bench]["by_temperature"][f"{t:g}"] = row

    for model, benches in results.items():
        names = [b for b in benches if b != AVG]
        # Avg. over benchmarks, per temperature (unweighted: each benchmark counts once).
        all_t = sorted({t for b in names for t in benches[b]["by_temperature"]}, key=float)
        benches[AVG]["by_temperature"] = {
            t: _mean_dicts([benches[b]["by_temperature"][t] for b in names
                            if t in benches[b]["by_temperature"]]) for t in all_t}
        for b in names + [AVG]:
            by_t = benches[b]["by_temperature"]
            benches[b]["mean"] = {
                bucket: _mean_dicts([v for t, v in by_t.items() if bucket in bucket_of(float(t))])
                for bucket in BUCKETS}
    # Accuracy by difficulty level (rows that carry one, e.g. the tiny world and MATH500), over
    # all kept samples and temperatures: {model: {bench: {level: mean correctness}}}.
    by_level = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (model, bench, _), problems in groups.items():
        for samples in problems.values():
            for r in samples.values():
                if r.get("level") is not None:
                    by_level[model][bench][str(r["level"])].append(float(r["correct"]))
    levels = {m: {b: {lv: sum(v) / len(v) for lv, v in sorted(d.items())} for b, d in bs.items()}
              for m, bs in by_level.items()}
    present_models = list(results)
    present_benches = []
    for m in results.values():
        present_benches += [b for b in m if b != AVG and b not in present_benches]
    present_temps = sorted({float(t) for m in results.values() for b in m.values()
                            for t in b["by_temperature"]})
    return {"n": n, "ks": ks,
            "models": [m for m in (models or present_models) if m in results],
            "benchmarks": [b for b in (benchmarks or present_benches) if b in present_benches],
            "temperatures": present_temps,
            "results": json.loads(json.dumps(results)),  # plain dicts
            "levels": levels}


# ----------------------------------------------------------------------------- tables and plots


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}"


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def short_labels(models):
    """Display names: drop the path prefix all models share (runs/grpo/final -> grpo/final)."""
    if len(models) < 2:
        return {m: m for m in models}
    parts = [os.path.normpath(m).split(os.sep) for m in models]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    return {m: os.sep.join(p[common:]) for m, p in zip(models, parts)}


def write_table(summary, path=None):
    """results.md: Table-1 layout (models x benchmarks, mean over temperatures) for each metric,
    then Table-2 layout (pass@1 per temperature and bucket means) for each benchmark and Avg."""
    n, res = summary["n"], summary["results"]
    models, benches = summary["models"], summary["benchmarks"] + [AVG]
    label = short_labels(models)
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


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_accuracy_vs_temperature(summary, path, metric=None):
    """Figs 5-6: accuracy vs sampling temperature, one panel per benchmark, one line per model."""
    plt = _plt()
    metric = metric or f"avg@{summary['n']}"
    benches = summary["benchmarks"] + ([AVG] if len(summary["benchmarks"]) > 1 else [])
    label = short_labels(summary["models"])
    cols = min(3, len(benches))
    rows = math.ceil(len(benches) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, b in zip(axes.flat, benches):
        for m in summary["models"]:
            by_t = summary["results"][m].get(b, {}).get("by_temperature", {})
            ts = sorted(by_t, key=float)
            ax.plot([float(t) for t in ts], [100 * by_t[t][metric] for t in ts], marker="o",
                    ms=3, label=label[m])
        ax.set_title(b)
        ax.set_xlabel("temperature")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(benches):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- sampling and grading


def sample_seed(benchmark, problem_id, temperature, index, salt=0):
    """62-bit seed of one sample: depends only on what the sample is, never on batching/order."""
    key = f"{salt}|{benchmark}|{problem_id}|{temp_key(temperature):g}|{index}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 2


def grade(completions, answers, timeout=1.0):
    """-> (correct: list[bool], extracted: list[str|None]) using reward.py (accuracy only)."""
    import reward  # lazy: the metrics and --from-run plots need neither torch nor a grader

    scores, _ = reward.score_batch(completions, answers, format_reward=False, timeout=timeout)
    return [s > 0.5 for s in scores], [reward.extract_boxed(c) for c in completions]


def encode_prompts(tokenizer, problems, template):
    """One token-id list per problem: the chat-templated prompt (data/prompts.py)."""
    return [tokenizer(build_prompt(tokenizer, p["problem"], template),
                      add_special_tokens=False)["input_ids"] for p in problems]


def generate_samples(model, tokenizer, problems, temperature, sample_indices, *, benchmark,
                     template, max_new_tokens, top_p=1.0, batch_size=None, seed=0, sampler="kv"):
    """Sample the responses (problem, i) for i in sample_indices[problem id]; no grading.

    Returns one dict per sample: id, sample, completion, num_tokens, finished, plus the Rollout
    (rows in the same order) for callers that need token ids (the NLL analysis).
    """
    import rollout

    eos = rollout.eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompt_ids = encode_prompts(tokenizer, problems, template)
    rows, prompts, seeds = [], [], []
    for p, ids in zip(problems, prompt_ids):
        for i in sample_indices[p["id"]]:
            rows.append((p["id"], i))
            prompts.append(ids)
            seeds.append(sample_seed(benchmark, p["id"], temperature, i, seed))
    ro = rollout.sample(model, prompts, max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=pad,
                        temperature=temperature, top_p=top_p, seeds=seeds, sampler=sampler,
                        batch_size=batch_size)
    ids, mask = ro.response_ids.tolist(), ro.response_mask.tolist()
    out = []
    for (pid, i), r_ids, r_mask, fin in zip(rows, ids, mask, ro.finished.tolist()):
        toks = [t for t, m in zip(r_ids, r_mask) if m]
        out.append({"id": pid, "sample": i, "completion": tokenizer.decode(
            toks, skip_special_tokens=True), "num_tokens": len(toks), "finished": bool(fin)})
    return out, ro


# ------------------------------------------------------------------- the sweep, with resume


def load_records(path):
    """Per-sample records from a JSONL file; a half-written last line (a kill) is dropped."""
    records = []
    if not os.path.isfile(path):
        return records
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def drop_partial_line(path):
    """Cut a half-written last line (the run was killed mid-write) so appends start clean."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


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
    bar = tqdm(total=total, desc=os.path.basename(os.path.normpath(model_key)), unit="sample",
               disable=not progress or total == 0)
    for bench, t, todo in plan:
        rows = {p["id"]: p for p in benches[bench] if p["id"] in todo}
        ids = list(rows)
        per_chunk = max(1, (batch_size or 64) // n)
        bar.set_postfix(bench=bench, T=f"{t:g}")
        for s in range(0, len(ids), per_chunk):
            chunk = [rows[i] for i in ids[s:s + per_chunk]]
            samples, _ = generate_samples(
                model, tokenizer, chunk, t, todo, benchmark=bench, template=template,
                max_new_tokens=max_new_tokens, top_p=top_p, batch_size=batch_size, seed=seed,
                sampler=sampler)
            correct, extracted = grade([x["completion"] for x in samples],
                                       [rows[x["id"]]["answer"] for x in samples], timeout)
            for x, c, e in zip(samples, correct, extracted):
                rec = {"model": model_key, "benchmark": bench, "id": x["id"], "temperature": t,
                       "sample": x["sample"], "completion": x["completion"], "extracted": e,
                       "answer": rows[x["id"]]["answer"], "correct": bool(c),
                       "level": rows[x["id"]].get("level"),
                       "num_tokens": x["num_tokens"], "finished": x["finished"]}
                out_file.write(json.dumps(rec) + "\n")
                done.add(record_key(rec))
            out_file.flush()
            bar.update(len(samples))
    bar.close()


def check_config(out_dir, args):
    """Refuse to resume into a folder sampled with different generation settings."""
    path = os.path.join(out_dir, "config.json")
    now = {k: getattr(args, k) for k in GENERATION_KEYS}
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        diff = {k: (before.get(k), now[k]) for k in GENERATION_KEYS if before.get(k) != now[k]}
        if diff:
            raise ValueError(f"{out_dir} holds samples made with other settings "
                             f"(old, new): {diff}; use another --out")
    with open(path, "w") as f:
        json.dump(now, f, indent=1)


def run_sweep(args, benches):
    """The main evaluation: sample/grade what is missing, then summary.json, results.md, png."""
    path = os.path.join(args.out, SAMPLES_FILE)
    drop_partial_line(path)
    records = load_records(path)
    done = {record_key(r) for r in records}
    keys = model_keys(args)
    with open(path, "a") as f:
        for model_path, key in zip(args.model, keys):
            todo = sum(len(v) for b, rows in benches.items() for t in args.temperatures
                       for v in missing_samples(rows, done, key, b, t, args.n).values())
            if todo == 0:
                print(f"{key}: all samples already in {path}")
                continue
            print(f"{key}: {todo} samples to generate")
            model, tokenizer = load_model(model_path, args)
            evaluate_model(model, tokenizer, key, benches, args.temperatures, args.n, f, done,
                           template=args.template, max_new_tokens=args.max_new_tokens,
                           top_p=args.top_p, batch_size=args.batch_size, seed=args.seed,
                           sampler=args.sampler, timeout=args.grade_timeout,
                           progress=not args.no_progress)
            del model
    summary = summarize(load_records(path), ks=args.k, n=args.n, models=keys,
                        benchmarks=list(benches), temperatures=args.temperatures)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(write_table(summary, os.path.join(args.out, "results.md")))
    plot_accuracy_vs_temperature(summary, os.path.join(args.out, "accuracy_vs_temperature.png"))
    print(f"wrote {args.out}/: {SAMPLES_FILE}, summary.json, results.md, "
          f"accuracy_vs_temperature.png")
    return summary


# ------------------------------------------------------- Appendix D: query vs response NLL


def query_response_nll(model, ro):
    """Mean per-token NLL of each prompt (tokens after the first) and of each response.

    One token_logprobs forward over [prompt | response] (temperature 1: the model's own
    likelihood). logp[:, j] scores token j+1, so with P prompt columns (left-padded):
    query tokens j+1 in 1..P-1 -> logp[:, :P-1], counted where both j and j+1 are real prompt
    tokens (skips the first real token, which has no prediction);
    response token P+i -> logp[:, P-1+i].
    """
    import torch
    import rollout

    ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)  # (B, P+R)
    mask = torch.cat([ro.prompt_mask, ro.response_mask], 1)
    with torch.no_grad():
        logp, _ = rollout.token_logprobs(model, ids, mask)  # (B, P+R-1)
    logp = logp.float()
    P = ro.prompt_ids.shape[1]
    pm = ro.prompt_mask.to(logp.device).bool()
    q_mask = pm[:, 1:] & pm[:, :-1]  # (B, P-1)
    r_mask = ro.response_mask.to(logp.device).bool()  # (B, R)
    zero = torch.zeros((), device=logp.device)
    q = -torch.where(q_mask, logp[:, :P - 1], zero).sum(1) / q_mask.sum(1).clamp(min=1)
    r = -torch.where(r_mask, logp[:, P - 1:], zero).sum(1) / r_mask.sum(1).clamp(min=1)
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


def run_nll_analysis(args, benches):
    """Per problem one response at --nll-temperature; save (query NLL, response NLL) pairs,
    print the Pearson correlation, and scatter-plot them (the paper's Appendix D)."""
    path = os.path.join(args.out, "nll_pairs.jsonl")
    pairs = []
    for model_path, key in zip(args.model, model_keys(args)):
        model, tokenizer = load_model(model_path, args)
        for bench, rows in benches.items():
            bs = args.batch_size or 64
            for s in tqdm(range(0, len(rows), bs), desc=f"nll {bench}",
                          disable=args.no_progress):
                chunk = rows[s:s + bs]
                samples, ro = generate_samples(
                    model, tokenizer, chunk, args.nll_temperature, {p["id"]: [0] for p in chunk},
                    benchmark=bench, template=args.template, max_new_tokens=args.max_new_tokens,
                    top_p=args.top_p, batch_size=args.batch_size, seed=args.seed,
                    sampler=args.sampler)
                q, r, nq, nr = query_response_nll(model, ro)
                correct, _ = grade([x["completion"] for x in samples],
                                   [p["answer"] for p in chunk], args.grade_timeout)
                for p, x, qi, ri, a, b, c in zip(chunk, samples, q, r, nq, nr, correct):
                    pairs.append({"model": key, "benchmark": bench, "id": p["id"],
                                  "query_nll": qi, "response_nll": ri, "query_tokens": a,
                                  "response_tokens": b, "correct": bool(c)})
        del model
    with open(path, "w") as f:
        for p in pairs:
            f.write(json.dumps(p) + "\n")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 4))
    lines = []
    for key in dict.fromkeys(p["model"] for p in pairs):
        for bench in benches:
            sel = [p for p in pairs if p["model"] == key and p["benchmark"] == bench]
            xs, ys = [p["query_nll"] for p in sel], [p["response_nll"] for p in sel]
            rho = pearson(xs, ys)
            lines.append(f"{key} on {bench}: Pearson r(query NLL, response NLL) = {rho:.3f} "
                         f"over {len(sel)} problems")
            ax.scatter(xs, ys, s=6, alpha=0.5, label=f"{short_labels([key])[key]} / {bench} "
                                                     f"(r={rho:.2f})")
    ax.set_xlabel("query NLL (mean per token)")
    ax.set_ylabel("response NLL (mean per token)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "nll_scatter.png"), dpi=120)
    plt.close(fig)
    print("\n".join(lines))
    with open(os.path.join(args.out, "nll_correlation.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return pairs


# ----------------------------------------------------------------------------- training-run plots


def read_metrics(run):
    """Rows of a training run's metrics.jsonl (RUN_DIR or the file itself)."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise ValueError(f"no metrics.jsonl in {run}")
    return load_records(path)


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if "step" in r and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def train_eval_gap(rows):
    """Tables 4-5: mean of (train_acc - eval_acc) over the steps that logged both, or None."""
    gaps = [r["train_acc"] - r["eval_acc"] for r in rows
            if r.get("train_acc") is not None and r.get("eval_acc") is not None]
    return sum(gaps) / len(gaps) if gaps else None


def _save_step_plot(fig, ax, ylabel, path):
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_runs(runs, out_dir):
    """Fig 1/4: Query-KL vs Policy-KL over steps; plus train vs held-out accuracy per run."""
    plt = _plt()
    data = {r: read_metrics(r) for r in runs}
    label = short_labels([os.path.normpath(r) for r in runs])
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (run, rows) in enumerate(data.items()):
        color = f"C{i}"
        for key, style, name in (("query_kl", "-", "Query-KL"), ("policy_kl", "--", "Policy-KL")):
            x, y = _series(rows, key)
            if x:
                ax.plot(x, y, style, color=color, label=f"{label[os.path.normpath(run)]} {name}")
    if ax.lines:
        # log scale: the KLs of different runs and kinds differ by orders of magnitude; the exact
        # zeros of step 1 (policy == reference) are left out rather than breaking the axis
        ax.set_yscale("log", nonpositive="mask")
        paths.append(_save_step_plot(fig, ax, "KL", os.path.join(out_dir, "kl.png")))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    lines = []
    for i, (run, rows) in enumerate(data.items()):
        name = label[os.path.normpath(run)]
        x, y = _series(rows, "train_acc")
        if x:
            ax.plot(x, y, "-", color=f"C{i}", alpha=0.6, label=f"{name} train")
        x, y = _series(rows, "eval_acc")
        if x:
            ax.plot(x, y, "o--", color=f"C{i}", ms=4, label=f"{name} held-out")
        gap = train_eval_gap(rows)
        lines.append(f"{name}: mean train - held-out accuracy gap = "
                     f"{'-' if gap is None else f'{100 * gap:.2f} pts'}")
    if ax.lines:
        paths.append(_save_step_plot(fig, ax, "accuracy", os.path.join(out_dir, "train_eval_gap.png")))
    plt.close(fig)
    print("\n".join(lines))
    print("wrote " + (", ".join(paths) if paths else "no plots (no KL or accuracy keys logged)"))
    return paths


# ----------------------------------------------------------------------------- command line


def model_keys(args):
    """The name each model is stored under in samples.jsonl (--labels, else the path as given)."""
    return args.labels or [os.path.normpath(m) for m in args.model]


def load_model(path, args):
    import rollout

    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = None if args.dtype == "auto" else args.dtype
    model, tokenizer = rollout.load_policy(path, device=device, dtype=dtype)
    model.eval()
    return model, tokenizer


def _looks_like_hub_id(path):
    """org/name with no local meaning: let load_policy try the hub (on machines that have it)."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path)) and not path.startswith(".") \
        and not os.path.exists(path.split("/")[0])


def fail(msg):
    """Bad input: one line on stderr and exit status 2, no traceback, no usage dump."""
    print(f"evaluate.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=[], help="HF model folder(s) (or hub ids)")
    p.add_argument("--labels", nargs="+", help="names for the models in tables (default: paths)")
    p.add_argument("--benchmarks", nargs="+", default=["tiny"],
                   help="names (tiny, tiny-test, paper, aime24, math500, ...) or .jsonl paths")
    p.add_argument("--data-dir", default=None, help="local copies of the hub benchmarks "
                   "(aime2024.jsonl, math500.jsonl, ...); default $ERPO_DATA_DIR")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--temperatures", nargs="+", type=float, default=DEFAULT_TEMPERATURES)
    p.add_argument("--n", type=int, default=32, help="samples per problem and temperature")
    p.add_argument("--k", nargs="+", type=int, default=None,
                   help="pass@k values (default: 1, powers of 2 up to n, and n)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 3072 for --template paper, 256 for plain (the tiny world)")
    p.add_argument("--template", choices=sorted(TEMPLATES), default="plain",
                   help="prompt template; must match the one the model was trained with")
    p.add_argument("--batch-size", type=int, default=64, help="sequences decoded at once")
    p.add_argument("--sampler", choices=["kv", "hf"], default="kv")
    p.add_argument("--seed", type=int, default=0, help="salt of the per-sample seeds")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--grade-timeout", type=float, default=1.0, help="seconds per graded answer")
    p.add_argument("--out", default="results/eval", help="output folder (resumes if it exists)")
    p.add_argument("--from-run", nargs="+", default=[], metavar="RUN_DIR",
                   help="plot Query-KL/Policy-KL and train vs held-out accuracy of training runs")
    p.add_argument("--nll-analysis", action="store_true",
                   help="Appendix D: query NLL vs response NLL per problem (instead of the sweep)")
    p.add_argument("--nll-temperature", type=float, default=1.0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    # Bad input -> one line, not a traceback.
    if not args.model and not args.from_run:
        fail("nothing to do: give --model (and --benchmarks) and/or --from-run")
    for m in args.model:
        if not os.path.exists(m) and not _looks_like_hub_id(m):
            fail(f"model path not found: {m}")
    if args.labels and len(args.labels) != len(args.model):
        fail(f"--labels needs one name per --model ({len(args.model)}), got {len(args.labels)}")
    for r in args.from_run:
        if not os.path.isfile(os.path.join(r, "metrics.jsonl")) and not os.path.isfile(r):
            fail(f"no metrics.jsonl in run folder {r}")
    if args.n < 1:
        fail("--n must be >= 1")
    if args.k is None:  # 1, 2, 4, ... up to n, and n itself
        args.k = sorted({args.n} | {2 ** i for i in range(args.n.bit_length()) if 2 ** i <= args.n})
    bad = [k for k in args.k if not 1 <= k <= args.n]
    if bad:
        fail(f"--k values must be in 1..n={args.n}, got {bad}")
    if any(t < 0 for t in args.temperatures):
        fail("temperatures must be >= 0")
    args.temperatures = sorted({temp_key(t) for t in args.temperatures})
    if args.max_new_tokens is None:
        args.max_new_tokens = 3072 if args.template == "paper" else 256
    args.benchmarks = expand_benchmarks(args.benchmarks)
    args.benches = {}
    if args.model:
        for name in args.benchmarks:
            try:
                rows = load_benchmark(name, limit=args.limit, data_dir=args.data_dir)
            except ValueError as e:
                fail(str(e))
            label = benchmark_label(name)
            if label in args.benches:
                fail(f"two benchmarks are both called {label!r}; rename one of the files")
            args.benches[label] = rows
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.from_run:
        plot_runs(args.from_run, args.out)
    if not args.model:
        return None
    if args.nll_analysis:
        return run_nll_analysis(args, args.benches)
    try:
        check_config(args.out, args)
    except ValueError as e:
        fail(e)
    return run_sweep(args, args.benches)


if __name__ == "__main__":
    main()
