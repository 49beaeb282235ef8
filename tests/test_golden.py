"""Golden metrics: a 3-step ERPO run and a 3-step GRPO run must reproduce, number for number, the
metrics.jsonl recorded in tests/golden/ (timings aside). They guard behaviour across refactors:
regenerate them only for a deliberate change of behaviour, and say why in the commit and the README.

    python -m tests.test_golden        # rewrites tests/golden/{erpo,grpo}.jsonl (one thread, CPU)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
def timing(k):  # wall-clock keys (step_time, time_gen, gen_tok_per_s, ...): never compared
    return k == "step_time" or k.startswith("time_") or k.endswith("_per_s")
ALGOS = ("erpo", "grpo")


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


def run_golden(algo, tmp):
    """Run train.py in a fresh interpreter with one intra-op thread (what conftest.py sets), so
    the numbers do not depend on the caller's thread settings or on state left by other tests."""
    data = write_subset(os.path.join(tmp, "train64.jsonl"))
    out = os.path.join(tmp, algo)
    code = ("import sys, torch; torch.set_num_threads(1); import train; "
            "train.main(sys.argv[1:])")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code, *golden_argv(algo, out, data)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def load_golden(algo):
    with open(os.path.join(GOLDEN, f"{algo}.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]  # a header (where the numbers come from), then the metrics


@pytest.mark.parametrize("algo", ALGOS)
def test_golden_metrics(tmp_path, algo):
    _, want = load_golden(algo)
    got = run_golden(algo, str(tmp_path))
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(want, got):
        for k, v in a.items():
            if timing(k):
                continue
            assert k in b, (algo, a["step"], k)
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (algo, a["step"], k, v, b[k])
            else:
                assert b[k] == v, (algo, a["step"], k, v, b[k])


if __name__ == "__main__":
    import tempfile

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
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
