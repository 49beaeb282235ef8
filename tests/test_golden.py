"""Golden metrics: a 3-step ERPO run and a 3-step GRPO run must reproduce the metrics.jsonl recorded
in tests/golden/ (timings aside). They guard behaviour across refactors: regenerate them only for a
deliberate change of behaviour, and say why in the commit and the README.

What is exact and what is rounding. float32 arithmetic rounds differently on another CPU: ATen picks
AVX-512, AVX2 or scalar kernels by what the CPU has, MKL its own code path, so two x86-64 machines
with the same torch agree on a loss only to ~1e-5 relative, and the differences grow step by step.
The discrete outcomes do not move:
- exact: every sampled token (a digest of each step's response ids, `tokens`), rewards,
  accuracies, counts and lengths, the lr schedule (the `EXACT` keys below);
- rounding: every other metric (losses, KL terms, entropy, gradient norm, query weights) is compared
  with an absolute tolerance of its own, 10x the worst difference measured from the recorded value
  across the CPU kernel variants of `KERNELS` (`tests/golden/tolerances.json`). A metric that is
  neither fails the test until it is classified. `test_a_change_of_behaviour_is_caught` shows that
  these tolerances still catch --lr x 1.01, --alpha 0.02 and --beta 0.02.

    python -m tests.test_golden record       # rewrites tests/golden/{erpo,grpo}.jsonl (one thread)
    python -m tests.test_golden tolerances   # re-measures tests/golden/tolerances.json (~2 minutes)
"""

import argparse
import json
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
TOLERANCES = os.path.join(GOLDEN, "tolerances.json")
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
ALGOS = ("erpo", "grpo")

# The CPU kernel variants whose rounding the tolerances cover. This machine's own kernels; those
# an AVX2-only CPU (e.g. AMD Zen 3) picks; ATen's scalar kernels; MKL's conditional-numerical-
# reproducibility path (float32 matrix products go through MKL). Each one is just environment.
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
}
SAFETY = 10  # a float metric's tolerance is SAFETY x its worst measured difference

# Integers, ratios of integers (rows, tokens, grader outcomes), the sampled tokens' digest, the lr
# schedule: the same on every CPU, so compared exactly.
EXACT = {"step", "tokens", "reward", "train_acc", "response_len", "response_tokens", "truncated_frac",
         "new_turn_frac", "zero_var_frac", "skipped_steps", "lr", "reward_timeout", "reward_error",
         "reward_no_answer", "resample_rounds", "kept_groups"}


def is_exact(key):
    return key in EXACT or key.startswith("eval_acc")


def timing(key):  # wall-clock keys (step_time, time_gen, gen_tok_per_s, ...): never compared
    return key == "step_time" or key.startswith("time_") or key.endswith("_per_s")


def golden_argv(algo, out, data):
    """Small sizes: 64 training problems, 8 prompts x 4 responses, 48 new tokens, held-out eval
    on 8 tiny-test problems at steps 0 and 3; everything else the defaults of train.py."""
    return ["--algo", algo, "--model", WARM, "--train-data", data, "--out", str(out), "--steps", "3",
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "48", "--eval-data", "tiny-test", "--eval-limit", "8",
            "--eval-every", "3", "--save-every", "0", "--seed", "0"]


def write_subset(path, n=64):
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(n)]
    with open(path, "w") as f:
        f.write("".join(rows))
    return str(path)


# train.main in a fresh interpreter, one intra-op thread (what conftest.py sets), with each sampling
# round's response ids hashed on the way: the digest joins that step's metrics line as "tokens".
TRACED_TRAIN = """
import hashlib, json, os, sys, torch
torch.set_num_threads(1)
import train
digests, sample = {}, train.sample_and_score
def traced(run, decoder, prompt_idx, step, round_):
    g = sample(run, decoder, prompt_idx, step, round_)
    ids = (g.ro.response_ids * g.ro.response_mask).numpy()
    digests.setdefault(step + 1, []).append(hashlib.sha256(ids.tobytes()).hexdigest()[:16])
    return g
train.sample_and_score = traced
train.main(sys.argv[1:])
out = sys.argv[sys.argv.index("--out") + 1]
json.dump({str(k): "+".join(v) for k, v in digests.items()}, open(os.path.join(out, "tokens.json"), "w"))
"""


def run_golden(algo, tmp, extra=(), env=None):
    """The golden run of `algo` (plus `extra` flags) under `env` (a KERNELS entry): its metrics
    lines, each RL step's with its "tokens" digest."""
    os.makedirs(tmp, exist_ok=True)
    data = write_subset(os.path.join(tmp, "train64.jsonl"))
    out = os.path.join(tmp, algo + "".join(extra).replace("-", "_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
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


def load_tolerances():
    with open(TOLERANCES) as f:
        return json.load(f)


def mismatches(want, got, atol):
    """What differs between the golden lines `want` and a run's lines `got`: exact keys that are not
    equal, float keys further apart than their tolerance `atol[key]` (atol None: floats not
    compared), keys missing or unclassified."""
    if [m["step"] for m in got] != [m["step"] for m in want]:
        return [f"steps {[m['step'] for m in got]} != {[m['step'] for m in want]}"]
    bad = []
    for a, b in zip(want, got):
        for k, v in a.items():
            where = f"step {a['step']} {k}"
            if timing(k):
                continue
            if k not in b:
                bad.append(f"{where}: missing")
            elif is_exact(k):
                if b[k] != v:
                    bad.append(f"{where}: {b[k]!r} != {v!r} (exact)")
            elif atol is None:
                continue
            elif k not in atol:
                bad.append(f"{where}: no tolerance; classify it in EXACT or re-measure tolerances.json")
            elif not abs(b[k] - v) <= atol[k]:  # `not <=`: a NaN is a mismatch
                bad.append(f"{where}: {b[k]!r} vs {v!r}, |diff| {abs(b[k] - v):.3g} > tolerance {atol[k]:.3g}")
    return bad


@pytest.mark.parametrize("algo", ALGOS)
def test_golden_metrics(tmp_path, algo):
    """The recorded run, reproduced: exact keys equal, float keys within their rounding tolerance."""
    _, want = load_golden(algo)
    bad = mismatches(want, run_golden(algo, str(tmp_path)), load_tolerances()["golden"][algo])
    assert not bad, "\n".join(bad)


# A deliberate change of behaviour, each an algorithm and extra flags: the lr by 1%, ERPO's
# Query-KL coefficient alpha (0.01) and GRPO's Policy-KL coefficient beta (0.01) doubled.
CHANGES = [("erpo", ("--lr", "2.02e-4")), ("erpo", ("--alpha", "0.02")), ("grpo", ("--beta", "0.02"))]


@pytest.mark.parametrize("algo,extra", CHANGES, ids=[" ".join(e) for _, e in CHANGES])
def test_a_change_of_behaviour_is_caught(tmp_path, algo, extra):
    """The golden comparison fails for a small change of behaviour, and does so on the float
    metrics alone (a tolerance loose enough to pass such a change would be no guard)."""
    _, want = load_golden(algo)
    got = run_golden(algo, str(tmp_path), extra)
    atol = load_tolerances()["golden"][algo]
    exact = mismatches(want, got, None)
    rounding_only = [m for m in mismatches(want, got, atol) if m not in exact]
    excess = max(abs(b[k] - v) / atol[k] for a, b in zip(want, got) for k, v in a.items()
                 if not (timing(k) or is_exact(k)) and atol[k] > 0)
    print(f"{algo} {' '.join(extra)}: {len(rounding_only)} float metrics beyond tolerance, up to {excess:.0f}x it; "
          f"e.g. {rounding_only[:2]}")
    assert rounding_only


# ----------------------------------------------------------------------------------------------
# Measuring the tolerances: `python -m tests.test_golden tolerances`

# The two code paths of tests/test_train.py::test_the_skipped_old_policy_forward_changes_nothing
# (pi_old taken from the update's forward vs computed by a forward of its own), in one interpreter.
TWO_PATHS = """
import json, shutil, tempfile, torch
torch.set_num_threads(1)
import train
from tests.test_golden import is_exact, write_subset
from tests.test_train import SKIPPED_FORWARD_KEYS, skipped_and_computed
tmp = tempfile.mkdtemp()
skipped, computed = skipped_and_computed(tmp, write_subset(tmp + "/train64.jsonl"), lambda: setattr(
    train, "on_policy_rows", lambda run, upd_rows: slice(0, 0)))
assert all(a[k] == b[k] for a, b in zip(skipped, computed) for k in SKIPPED_FORWARD_KEYS if is_exact(k))
keys = [k for k in SKIPPED_FORWARD_KEYS if not is_exact(k)]
print(json.dumps([{k: max(abs(a[k] - b[k]) for a, b in zip(skipped, computed)) for k in keys},
                  {k: max(abs(a[k]) for a in skipped) for k in keys}]))
shutil.rmtree(tmp)
"""


def worst_differences(algo, tmp):
    """{kernel variant: {float key: max over steps of |run - golden|}}, after checking that every
    exact key matches the golden under each variant (else no tolerance could make the test portable)."""
    _, want = load_golden(algo)
    out = {}
    for name, env in KERNELS.items():
        got = run_golden(algo, os.path.join(tmp, name), env=env)
        exact = mismatches(want, got, None)
        assert not exact, f"{algo} under {name}: an exact key moved: {exact}"
        out[name] = {}
        for a, b in zip(want, got):
            for k, v in a.items():
                if not (timing(k) or is_exact(k)):
                    out[name][k] = max(out[name].get(k, 0.0), abs(b[k] - v))
        print(f"  {algo:5s} {name:15s} " + ", ".join(f"{k} {d:.2g}" for k, d in sorted(out[name].items())))
    return out


def two_path_differences():
    """For the skipped-forward test's float keys: {kernel variant: {key: max over steps of
    |skipped - computed|}}, and {key: its largest |value|}."""
    out, scale = {}, {}
    for name, env in KERNELS.items():
        r = subprocess.run([sys.executable, "-c", TWO_PATHS], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", **env), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        diff, size = json.loads(r.stdout.strip().splitlines()[-1])
        out[name] = diff
        scale = {k: max(v, scale.get(k, 0.0)) for k, v in size.items()}
        print(f"  two paths {name:15s} " + ", ".join(f"{k} {d:.2g}" for k, d in sorted(diff.items())))
    return out, scale


def tolerance(worst_by_kernel, scale):
    """SAFETY x the worst difference over kernel variants; where every variant agreed bit for bit,
    SAFETY float32 ulps of the metric's largest value `scale` (the least another CPU could round
    apart; 0 for a metric that is 0 throughout)."""
    worst = max(worst_by_kernel)
    return SAFETY * worst if worst > 0 else SAFETY * abs(scale) * 2.0 ** -23


def measure_tolerances():
    import tempfile

    result = {"how": "python -m tests.test_golden tolerances: the golden runs (and the two code paths of the "
                     f"skipped-forward test) under each of {list(KERNELS)}; tolerance = {SAFETY} x the worst "
                     "difference over variants and steps (where none: 10 float32 ulps of the value)",
              "kernels": KERNELS, "commit": _commit()[0], "dirty_worktree": _commit()[1], "machine": _machine(),
              "golden": {}, "worst": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ALGOS:
            diffs = worst_differences(algo, tmp)
            _, want = load_golden(algo)
            keys = sorted(diffs["native"])
            scale = {k: max(abs(m[k]) for m in want if k in m) for k in keys}
            result["worst"][algo] = diffs
            result["golden"][algo] = {k: tolerance([d[k] for d in diffs.values()], scale[k]) for k in keys}
    diffs, scale = two_path_differences()
    result["worst"]["skipped_forward"] = diffs
    result["skipped_forward"] = {k: tolerance([d[k] for d in diffs.values()], scale[k]) for k in scale}
    with open(TOLERANCES, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(TOLERANCES, ROOT)}")


def _commit():
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
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
    return {"cpu": cpu, "torch": torch.__version__, "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def record_golden():
    import tempfile

    commit, dirty = _commit()
    os.makedirs(GOLDEN, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ALGOS:
            ms = run_golden(algo, tmp)
            header = {"golden": algo, "commit": commit, "dirty_worktree": dirty,
                      "argv": [a.replace(ROOT + os.sep, "") for a in
                                golden_argv(algo, "<tmp>", "<first 64 rows of data/tinymath/train.jsonl>")]}
            with open(os.path.join(GOLDEN, f"{algo}.jsonl"), "w") as f:
                for m in [header, *ms]:
                    f.write(json.dumps(m) + "\n")
            print(f"wrote tests/golden/{algo}.jsonl: {len(ms)} metric lines from {commit[:7]}")
    print("now re-measure the tolerances: python -m tests.test_golden tolerances")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Record the golden metrics, or measure their rounding tolerances.")
    ap.add_argument("what", choices=["record", "tolerances"],
                    help="record: rerun and rewrite tests/golden/{erpo,grpo}.jsonl (a deliberate change of "
                         "behaviour only); tolerances: re-measure tests/golden/tolerances.json")
    a = ap.parse_args(argv)
    record_golden() if a.what == "record" else measure_tolerances()


if __name__ == "__main__":
    main()
