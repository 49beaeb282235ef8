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

    python -m tests.test_golden record --reason "..."  # rewrites tests/golden/{erpo,grpo}.jsonl
    python -m tests.test_golden tolerances   # re-measures tests/golden/tolerances.json (~2 minutes)
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

from tests.rounding import (KERNELS, SAFETY, TOLERANCES, is_exact, is_timing, kernel_env, load_tolerances,
                            tolerance)

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


# ----------------------------------------------------------------------------------------------
# Measuring the tolerances: `python -m tests.test_golden tolerances`

# The two code paths of tests/test_train.py::test_the_skipped_old_policy_forward_changes_nothing
# (pi_old taken from the update's forward vs computed by a forward of its own), in one interpreter:
# [{key: max over steps of |skipped - computed|}, {key: largest |value|}] for its float keys.
TWO_PATHS = """
import json, shutil, tempfile, torch
torch.set_num_threads(1)
import train
from tests.rounding import is_exact
from tests.test_golden import write_subset
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


def golden_differences(algo, tmp):
    """{kernel variant: {float key: max over steps of |run - golden|}}, after checking that every
    exact key matches the golden under each variant (else no tolerance could make the test portable)."""
    _, want = load_golden(algo)
    out = {}
    for name in KERNELS:
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


def two_path_differences():
    """For the skipped-forward test's float keys: {kernel variant: {key: max over steps of
    |skipped - computed|}}, and {key: its largest |value|}."""
    out, scale = {}, {}
    for name in KERNELS:
        r = subprocess.run([sys.executable, "-c", TWO_PATHS], cwd=ROOT, capture_output=True, text=True,
                           env=dict(kernel_env(name), OMP_NUM_THREADS="1"), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        diff, size = json.loads(r.stdout.strip().splitlines()[-1])
        out[name] = diff
        scale = {k: max(v, scale.get(k, 0.0)) for k, v in size.items()}
        print(f"  two paths {name:15s} " + ", ".join(f"{k} {d:.2g}" for k, d in sorted(diff.items())))
    return out, scale


def measure_tolerances():
    commit, dirty = _commit()
    result = {"how": "python -m tests.test_golden tolerances: the golden runs (and the two code paths of the "
                     f"skipped-forward test) under each of {list(KERNELS)}; tolerance = {SAFETY} x the worst "
                     f"difference over variants and steps (where they all agree: {SAFETY} x 2^-23 x the "
                     "largest value)",
              "kernels": KERNELS, "commit": commit, "dirty_worktree": dirty, "machine": _machine(),
              "golden": {}, "worst": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ALGOS:
            diffs = golden_differences(algo, tmp)
            _, want = load_golden(algo)
            scale = {k: max(abs(m[k]) for m in want if k in m) for k in diffs["native"]}
            result["worst"][algo] = diffs
            result["golden"][algo] = {k: tolerance([d[k] for d in diffs.values()], scale[k])
                                      for k in sorted(scale)}
    diffs, scale = two_path_differences()
    result["worst"]["skipped_forward"] = diffs
    result["skipped_forward"] = {k: tolerance([d[k] for d in diffs.values()], scale[k]) for k in scale}
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
    a = ap.parse_args(argv)
    if a.what == "record" and not a.reason:
        ap.error("record needs --reason: golden metrics are regenerated only on purpose, saying why")
    record_golden(a.reason) if a.what == "record" else measure_tolerances()


if __name__ == "__main__":
    main()
