"""Shared test settings.

One intra-op thread: the models here are tiny, and on a 2-core box two OpenMP threads per
process (plus the torchrun children of the distributed test) oversubscribe the cores, which
stalls OpenMP's spin-waits and makes small forwards tens of times slower.
"""

import torch

torch.set_num_threads(1)

# Query-KL reference caches shared across runs go to a per-session temporary folder, never ~/.cache.
import os  # noqa: E402
import tempfile  # noqa: E402

os.environ["ERPO_CACHE"] = tempfile.mkdtemp(prefix="erpo-test-cache-")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """64 problems of the tiny world's training set, so the Query-KL cache costs nothing (the
    end-to-end runs of test_train.py and test_extensions.py)."""
    d = tmp_path_factory.mktemp("data")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(64)]
    (d / "train.jsonl").write_text("".join(rows))
    return str(d / "train.jsonl")
