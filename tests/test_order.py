"""Tests independent of their order (issue #40): `--order` of tests/conftest.py, and the state that
leaked from one test into another.

The leak: tests/test_menu.py's runs (--micro-batch 64) shared the tiny world's Query-KL cache in the
session's ERPO_CACHE folder; a later run of the same prompts at --micro-batch 8 (the query-cache test
of tests/test_checkpoints.py) reused it, and rebuilding that run's cache at --micro-batch 8 did not
give it back bit for bit: the prompts per forward set the padding, hence the last bits. The shared
cache's meta now records them (query_reference.cache_meta's `batch`)."""

import os
import subprocess
import sys

import torch

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def test_a_shared_query_cache_is_reused_only_at_the_micro_batch_it_was_built_with(tmp_path, small_data):
    """A run at --micro-batch 8 after one at 64 with the same shared folder has the cache it builds
    alone (the sequence test_menu.py, test_checkpoints.py's query-cache test, in three --steps 0 runs)."""
    def cache(name, micro_batch, shared):
        train.main(["--model", WARM, "--train-data", small_data, "--out", str(tmp_path / name),
                    "--steps", "0", "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4",
                    "--micro-batch", str(micro_batch), "--eval-every", "0", "--save-every", "0",
                    "--query-cache-dir", shared])
        return torch.load(tmp_path / name / "query_cache.pt")
    shared = str(tmp_path / "shared")
    first = cache("first", 64, shared)
    after, alone = cache("after", 8, shared), cache("alone", 8, "")
    assert all(torch.equal(x, y) for x, y in zip(after["logp"], alone["logp"]))
    assert first["meta"]["batch"] == 64 and after["meta"] == alone["meta"]
    again = cache("again", 64, shared)                                   # the same micro-batch: reused
    assert all(torch.equal(x, y) for x, y in zip(again["logp"], first["logp"]))


def collected(*args) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "tests/test_countdown.py", "tests/test_reward.py", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_order_reverses_or_shuffles_modules_and_the_tests_within_them():
    default, shuffled = collected(), collected("--order", "shuffle:3")
    assert collected("--order", "reverse") == default[::-1]
    assert sorted(shuffled) == sorted(default) and shuffled != default and shuffled != default[::-1]
    modules = [t.split("::")[0] for t in shuffled]
    assert sum(i == 0 or m != modules[i - 1] for i, m in enumerate(modules)) == 2    # each one contiguous
    assert collected("--order", "shuffle:3") == shuffled
