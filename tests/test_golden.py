"""Golden metrics: a 3-step ERPO run and a 3-step GRPO run must reproduce the metrics.jsonl recorded
in tests/golden/ (timings aside). They guard behaviour across refactors: regenerate them only for a
deliberate change of behaviour, and say why in the commit and the README.

What is exact and what is rounding (tests/rounding.py says why): exact are every sampled token (a
digest of each step's response ids, `tokens`), rewards, accuracies, counts, lengths and the lr
schedule; every other recorded metric (losses, KL terms, entropy, gradient norm, query weights) must
lie within its own absolute tolerance, 10x the worst difference from the recorded value measured
across CPU kernel variants (tests/golden/tolerances.json). A recorded metric that is in neither
class fails the test until it is classified; a metric the code logs but the recording lacks is not
compared. `test_a_change_of_behaviour_is_caught` shows the tolerances still catch --lr x 1.01,
--alpha 0.02 and --beta 0.02.

The same measurement gives every other test that compares two code paths its tolerances
(`assert_rounding`: the tests of tests/rounding.py's CROSS_PATH_TESTS, run under each variant). A
re-measurement keeps, per metric, the larger of the committed tolerance and the new one: a CPU kind
that rounds closer must not shrink what another kind needed (`measurements` says where each came from).

    python -m tests.test_golden record --reason "..."  # rewrites tests/golden/{erpo,grpo}.jsonl
    python -m tests.test_golden tolerances   # re-measures tests/golden/tolerances.json (~15 minutes)
"""

import argparse
import ast
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

from tests.rounding import (CROSS_PATH_TESTS, KERNELS, RECORD, runnable_kernels, SAFETY, TOLERANCES, is_exact, is_timing,
                            kernel_env, load_tolerances, tolerance)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
ALGOS = ("erpo", "grpo")


def golden_argv(algo, out, data):
    """Small sizes: 64 training problems, 8 prompts x 4 responses, 48 new tokens, held-out eval
    on 8 tiny-test problems at steps 0 and 3; everything else the defaults of train.py. Its own
    Query-KL cache (--query-cache-dir ''): a shared one, built under other CPU kernels, would hide
    how these round the reference's prompt log-probs, and so the query weights."""
    return ["--algo", algo, "--model", WARM, "--train-data", data, "--out", str(out), "--steps", "3",
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "48", "--eval-data", "tiny-test", "--eval-limit", "8",
            "--eval-every", "3", "--save-every", "0", "--seed", "0", "--query-cache-dir", ""]


def write_subset(path, n=64):
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(n)]
    with open(path, "w") as f:
        f.write("".join(rows))
    return str(path)


# train.main in a fresh interpreter, one intra-op thread (what conftest.py sets), with each sampling
# round's response ids (shape, then values) hashed on the way: the digest joins that step's line.
TRACED_TRAIN = """
import hashlib, json, os, sys, torch
torch.set_num_threads(1)
import train
digests, sample = {}, train.experience.sample_and_score
def traced(run, decoder, prompt_idx, step, round_):
    g = sample(run, decoder, prompt_idx, step, round_)
    ids = (g.ro.response_ids * g.ro.response_mask).numpy()
    h = hashlib.sha256(str(ids.shape).encode() + ids.tobytes())
    digests.setdefault(step + 1, []).append(h.hexdigest()[:16])
    return g
train.experience.sample_and_score = traced
train.main(sys.argv[1:])
with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], "tokens.json"), "w") as f:
    json.dump({str(k): "+".join(v) for k, v in digests.items()}, f)
"""


def run_golden(algo, tmp, extra=(), kernels=None):
    """The golden run of `algo` (plus `extra` flags): its metrics lines, each RL step's with its
    "tokens" digest. kernels: a name of rounding.KERNELS (default: what the caller's environment
    picks)."""
    os.makedirs(tmp, exist_ok=True)
    data = write_subset(os.path.join(tmp, "train64.jsonl"))
    out = os.path.join(tmp, algo + "".join(extra).replace("-", "_"))
    env = dict(os.environ if kernels is None else kernel_env(kernels), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", TRACED_TRAIN, *golden_argv(algo, out, data), *extra], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "tokens.json")) as f:
        tokens = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [{**m, "tokens": tokens[str(m["step"])]} if str(m["step"]) in tokens else m for m in lines]


def load_golden(algo):
    with open(os.path.join(GOLDEN, f"{algo}.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]  # a header (where the numbers come from), then the metrics


@dataclass
class Mismatch:
    step: int | None                    # None: the runs' steps differ
    key: str
    exact: bool                         # an exact key (or a missing / unclassified one)
    what: str

    def __str__(self):
        return f"step {self.step} {self.key}: {self.what}"


def mismatches(want, got, atol) -> list[Mismatch]:
    """What differs between the golden lines `want` and a run's lines `got`: exact keys that are not
    equal, float keys further apart than their tolerance `atol[key]` (atol None: floats not
    compared), keys missing or unclassified."""
    if [m["step"] for m in got] != [m["step"] for m in want]:
        return [Mismatch(None, "step", True, f"{[m['step'] for m in got]} != {[m['step'] for m in want]}")]
    bad = []
    for a, b in zip(want, got):
        for k, v in a.items():
            if is_timing(k):
                continue
            if k not in b:
                bad.append(Mismatch(a["step"], k, True, "missing"))
            elif is_exact(k):
                if b[k] != v:
                    bad.append(Mismatch(a["step"], k, True, f"{b[k]!r} != {v!r} (exact)"))
            elif atol is None:
                continue
            elif k not in atol:
                bad.append(Mismatch(a["step"], k, True, "no tolerance: classify it in tests/rounding.py's "
                                                        "EXACT or re-measure tolerances.json"))
            elif not abs(b[k] - v) <= atol[k]:  # `not <=`: a NaN is a mismatch
                bad.append(Mismatch(a["step"], k, False, f"{b[k]!r} vs {v!r}, |diff| {abs(b[k] - v):.3g} > "
                                                         f"tolerance {atol[k]:.3g}"))
    return bad


@pytest.mark.parametrize("algo", ALGOS)
def test_golden_metrics(tmp_path, algo):
    """The recorded run, reproduced: exact keys equal, float keys within their rounding tolerance."""
    _, want = load_golden(algo)
    bad = mismatches(want, run_golden(algo, str(tmp_path)), load_tolerances()["golden"][algo])
    assert not bad, "\n".join(map(str, bad))


# The fast paths the GPU configs turn on (rl/run_setup.FAST_PATHS): the one-pass KV sampler, packed and
# shared-prompt forwards (the step at scale, rl/scale_step.py). The golden runs were recorded with them
# on (they were the defaults then), so this also keeps the step at scale as it was.
FAST = ("--sampler", "kv", "--pack", "true", "--share-prompts", "true")


@pytest.mark.parametrize("algo", ALGOS)
def test_the_fast_paths_reproduce_the_golden_run(tmp_path, algo):
    """The plain step (the default) and the step at scale sample the same tokens, rewards and counts;
    their losses, KLs and norms agree within the golden rounding tolerances."""
    _, want = load_golden(algo)
    bad = mismatches(want, run_golden(algo, str(tmp_path), FAST), load_tolerances()["golden"][algo])
    assert not bad, "\n".join(map(str, bad))


# A deliberate change of behaviour, each an algorithm and extra flags: the lr by 1%, ERPO's
# Query-KL coefficient alpha (0.01) and GRPO's Policy-KL coefficient beta (0.01) doubled.
CHANGES = [("erpo", ("--lr", "2.02e-4")), ("erpo", ("--alpha", "0.02")), ("grpo", ("--beta", "0.02"))]


@pytest.mark.parametrize("algo,extra", CHANGES, ids=[" ".join(e) for _, e in CHANGES])
def test_a_change_of_behaviour_is_caught(tmp_path, algo, extra):
    """The golden comparison fails for a small change of behaviour on the float metrics alone, at
    steps that still sampled the recorded tokens (once the tokens differ, anything would catch it):
    a tolerance loose enough to let such a change pass would be no guard."""
    _, want = load_golden(algo)
    got = run_golden(algo, str(tmp_path), extra)
    atol = load_tolerances()["golden"][algo]
    same_tokens = {a["step"] for a, b in zip(want, got) if a.get("tokens") == b.get("tokens")}
    caught = [m for m in mismatches(want, got, atol) if not m.exact and m.step in same_tokens]
    excess = max((abs(b[k] - v) / atol[k] for a, b in zip(want, got) if a["step"] in same_tokens
                  for k, v in a.items() if not (is_timing(k) or is_exact(k)) and atol[k] > 0), default=0.0)
    print(f"{algo} {' '.join(extra)}: steps {sorted(same_tokens)} sample the recorded tokens; there "
          f"{len(caught)} float metrics lie beyond tolerance, the furthest {excess:.1f}x it")
    assert caught


def calls(fn):
    """The names a function calls directly (f(...), not obj.f(...))."""
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def rounding_comparisons():
    """Every test function of tests/test_*.py that calls assert_rounding, itself or through the
    module's own helpers (same_metrics, ...), as a pytest node id."""
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(ROOT, "tests", name)) as f:
                fns = [fn for fn in ast.parse(f.read()).body if isinstance(fn, ast.FunctionDef)]
            compare = {"assert_rounding"}
            while len(compare) < len(more := compare | {fn.name for fn in fns if calls(fn) & compare}):
                compare = more
            found += [f"tests/{name}::{fn.name}" for fn in fns if fn.name.startswith("test") and calls(fn) & compare]
    return found


def test_every_cross_path_comparison_is_measured():
    """The measurement runs exactly the tests that compare two code paths with assert_rounding (one
    left out would have no tolerance, or a stale one), and every tolerance it wrote is still used."""
    assert sorted(CROSS_PATH_TESTS) == sorted(rounding_comparisons())
    paths = load_tolerances()["paths"]
    assert {t for v in paths.values() for t in v["from"]} <= set(CROSS_PATH_TESTS)


def test_a_tolerance_never_shrinks():
    """Re-measured on a CPU kind that rounds closer, a metric keeps the tolerance an earlier one
    needed (and which measurement set it); a larger new one replaces it."""
    tol, by = larger_tolerances({"a": 2e-6, "b": 1e-7, "gone": 1.0}, {"a": 0, "b": 0, "gone": 0},
                                {"a": 1e-6, "b": 3e-7, "new": 5e-8}, 1)
    assert tol == {"a": 2e-6, "b": 3e-7, "new": 5e-8} and by == {"a": 0, "b": 1, "new": 1}


# ----------------------------------------------------------------------------------------------
# Measuring the tolerances: `python -m tests.test_golden tolerances`

def golden_differences(algo, tmp):
    """{kernel variant: {float key: max over steps of |run - golden|}}, after checking that every
    exact key matches the golden under each variant (else no tolerance could make the test portable)."""
    _, want = load_golden(algo)
    out = {}
    for name in runnable_kernels():
        got = run_golden(algo, os.path.join(tmp, name), kernels=name)
        exact = mismatches(want, got, None)
        assert not exact, f"{algo} under {name}: an exact key moved: {list(map(str, exact))}"
        out[name] = {}
        for a, b in zip(want, got):
            for k, v in a.items():
                if not (is_timing(k) or is_exact(k)):
                    out[name][k] = max(out[name].get(k, 0.0), abs(b[k] - v))
        print(f"  {algo:5s} {name:15s} " + ", ".join(f"{k} {d:.2g}" for k, d in sorted(out[name].items())))
    return out


def cross_path_differences(tmp, tests):
    """The cross-path `tests` (node ids of CROSS_PATH_TESTS) under each kernel variant, with RECORD
    set: {variant: {name: worst difference}}, {name: largest |value|}, {name: the tests it came from}."""
    out, scale, source = {}, {}, {}
    for name in runnable_kernels():
        record = os.path.join(tmp, f"paths-{name}.jsonl")
        env = dict(kernel_env(name), OMP_NUM_THREADS="1", **{RECORD: record})
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        assert r.returncode == 0, f"under {name}:\n{r.stdout[-3000:]}"
        out[name] = {}
        with open(record) as f:
            for row in map(json.loads, f):
                k = row["name"]
                out[name][k] = max(out[name].get(k, 0.0), row["diff"])
                scale[k] = max(scale.get(k, 0.0), row["scale"])
                source[k] = sorted({*source.get(k, []), row["test"]})
        print(f"  paths {name:15s} " + ", ".join(f"{k} {d:.2g}" for k, d in sorted(out[name].items())))
    missing = {k for d in out.values() for k in scale if k not in d}
    assert not missing, f"compared under some kernel variants only: {sorted(missing)}"
    return out, scale, source


def larger_tolerances(old, old_set_by, new, new_set_by):
    """Per key of `new`, the larger of the committed tolerance old[k] (from measurement old_set_by[k])
    and the new one: a tolerance that another CPU kind needed never shrinks when this one measures
    less. -> ({key: tolerance}, {key: index of the measurement it came from})."""
    tol, by = {}, {}
    for k, v in new.items():
        keep = k in old and old[k] >= v
        tol[k], by[k] = (old[k], old_set_by[k]) if keep else (v, new_set_by)
    return tol, by


def measure_tolerances(tests=None):
    """Re-measure tolerances.json on this machine: per float metric and per cross-path comparison,
    the larger of the committed tolerance and SAFETY x the worst difference under KERNELS. tests:
    only these of CROSS_PATH_TESTS, no golden runs (a comparison just added); the rest stays as committed."""
    commit, dirty = _commit()
    old = load_tolerances()
    what = "the golden runs and every cross-path test" if tests is None else f"the cross-path tests {tests}"
    measurements = [*old["measurements"], {"machine": _machine(), "kernels": runnable_kernels(), "commit": commit,
                                           "dirty_worktree": dirty, "what": what}]
    now = len(measurements) - 1
    result = {"how": "python -m tests.test_golden tolerances: the golden runs, and the tests of tests/rounding.py's "
                     f"CROSS_PATH_TESTS (each assert_rounding), under each of {list(KERNELS)} this CPU runs; tolerance = "
                     f"{SAFETY} x the worst difference over variants and steps (where they all agree: {SAFETY} x "
                     "2^-23 x the largest value), or the committed one where larger (measured on another "
                     "machine: *_set_by and paths' set_by index `measurements`)",
              "measurements": measurements, "golden": {}, "golden_set_by": {}, "paths": {}, "worst": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ALGOS if tests is None else ():
            diffs = golden_differences(algo, tmp)
            _, want = load_golden(algo)
            scale = {k: max(abs(m[k]) for m in want if k in m) for k in diffs["native"]}
            result["worst"][algo] = diffs
            new = {k: tolerance([d[k] for d in diffs.values()], scale[k]) for k in sorted(scale)}
            result["golden"][algo], result["golden_set_by"][algo] = larger_tolerances(
                old["golden"].get(algo, {}), old["golden_set_by"].get(algo, {}), new, now)
        diffs, scale, source = cross_path_differences(tmp, CROSS_PATH_TESTS if tests is None else tests)
    if tests is not None:                                  # the golden tolerances as committed
        for key in ("golden", "golden_set_by"):
            result[key] = old[key]
        result["worst"] = {algo: old["worst"][algo] for algo in ALGOS}
    kept = {k: v for k, v in old["paths"].items() if tests is not None and not set(v["from"]) & set(tests)}
    result["worst"]["paths"] = {var: {**{k: w for k, w in old["worst"].get("paths", {}).get(var, {}).items()
                                         if k in kept}, **diffs[var]} for var in runnable_kernels()}
    new = {k: tolerance([d[k] for d in diffs.values()], scale[k]) for k in sorted(scale)}
    committed = old["paths"]
    tol, by = larger_tolerances({k: v["atol"] for k, v in committed.items()},
                                {k: v["set_by"] for k, v in committed.items()}, new, now)
    result["paths"] = dict(sorted({**kept, **{k: {"atol": tol[k], "set_by": by[k], "from": source[k],
                                                   "scale": scale[k]} for k in tol}}.items()))
    with open(TOLERANCES, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(TOLERANCES, ROOT)}")


def _commit():
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    return commit, dirty


def _machine():
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return {"cpu": cpu, "torch": torch.__version__,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def record_golden(reason):
    """Rewrite tests/golden/{erpo,grpo}.jsonl from a run of the current code; `reason` (why the
    behaviour changed on purpose) goes into each header."""
    commit, dirty = _commit()
    os.makedirs(GOLDEN, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ALGOS:
            ms = run_golden(algo, tmp)
            header = {"golden": algo, "commit": commit, "dirty_worktree": dirty, "reason": reason,
                      "argv": [a.replace(ROOT + os.sep, "") for a in
                                golden_argv(algo, "<tmp>", "<first 64 rows of data/tinymath/train.jsonl>")]}
            with open(os.path.join(GOLDEN, f"{algo}.jsonl"), "w") as f:
                for m in [header, *ms]:
                    f.write(json.dumps(m) + "\n")
            print(f"wrote tests/golden/{algo}.jsonl: {len(ms)} metric lines from {commit[:7]}")
    print("now re-measure the tolerances: python -m tests.test_golden tolerances")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Record the golden metrics, or measure their rounding tolerances.")
    ap.add_argument("what", choices=["record", "tolerances"],
                    help="record: rerun and rewrite tests/golden/{erpo,grpo}.jsonl (a deliberate change of "
                         "behaviour only); tolerances: re-measure tests/golden/tolerances.json")
    ap.add_argument("--reason", help="record: why the behaviour changed (kept in each golden file's header)")
    ap.add_argument("--tests", nargs="+", metavar="NODEID",
                    help="tolerances: re-measure only these cross-path tests of tests/rounding.py's "
                         "CROSS_PATH_TESTS (no golden runs); every other tolerance stays as committed")
    a = ap.parse_args(argv)
    if a.what == "record" and not a.reason:
        ap.error("record needs --reason: golden metrics are regenerated only on purpose, saying why")
    if a.tests and not set(a.tests) <= set(CROSS_PATH_TESTS):
        ap.error(f"--tests: not in CROSS_PATH_TESTS: {sorted(set(a.tests) - set(CROSS_PATH_TESTS))}")
    record_golden(a.reason) if a.what == "record" else measure_tolerances(a.tests)


if __name__ == "__main__":
    main()
