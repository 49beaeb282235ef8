"""Shared test settings.

One intra-op thread: the models here are tiny, and on a 2-core box two OpenMP threads per
process (plus the torchrun children of the distributed test) oversubscribe the cores, which
stalls OpenMP's spin-waits and makes small forwards tens of times slower.

`--order`: the order the tests run in (issue #40: no test may depend on another having run, or not,
before it). `default` is the files' order (CI's); `reverse` runs every module, and every test in it,
backwards; `shuffle:SEED` (or `shuffle`, which draws a seed and prints it in the header) shuffles
the modules and, within each, its tests, so each module-scoped fixture is still built once:
`python -m pytest -q tests --order shuffle:3`.
"""

import torch

torch.set_num_threads(1)

# Query-KL reference caches shared across runs go to a per-session temporary folder, never ~/.cache.
import os  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402

os.environ["ERPO_CACHE"] = tempfile.mkdtemp(prefix="erpo-test-cache-")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _order(value: str) -> str:
    if value in ("default", "reverse"):
        return value
    kind, _, seed = value.partition(":")
    if kind == "shuffle" and (not seed or seed.isdigit()):
        return f"shuffle:{seed or random.randrange(10**6)}"
    raise pytest.UsageError(f"--order {value}: expected default, reverse, shuffle or shuffle:SEED "
                            "(SEED an integer)")


def pytest_addoption(parser):
    parser.addoption("--order", default="default", help="the order tests run in: default (the files'), "
                     "reverse, shuffle or shuffle:SEED (modules shuffled, then the tests within each)")


def pytest_configure(config):
    config.option.order = _order(config.option.order)


def pytest_report_header(config):
    return f"test order: {config.option.order}" if config.option.order != "default" else None


@pytest.hookimpl(trylast=True)               # after pytest's own reordering: this order is the one that runs
def pytest_collection_modifyitems(config, items):
    order = config.option.order
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        rng = random.Random(int(order.split(":")[1]))
        modules = {}
        for item in items:                   # (dicts keep the first-seen order of the modules)
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        groups = list(modules.values())
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
        items[:] = [item for group in groups for item in group]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """64 problems of the tiny world's training set, so the Query-KL cache costs nothing (the
    end-to-end runs of test_train.py and test_extensions.py)."""
    d = tmp_path_factory.mktemp("data")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(64)]
    (d / "train.jsonl").write_text("".join(rows))
    return str(d / "train.jsonl")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another model with the warm start's tokenizer (its weights perturbed): as a stronger model or
    an earlier checkpoint would be, a model folder whose prompt log-probs are not the policy's
    (--qkl-ref model's tests in test_references.py and test_extensions.py)."""
    from modeling import models

    model, tok = models.load_policy(os.path.join(ROOT, "data", "tinymath", "warmstart"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("other") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
