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
