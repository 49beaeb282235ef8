"""ERPO runs no reference forward unless something reads it (issue #42): --measure-policy-kl is off
by default, so a row without a Policy-KL in its loss loads no reference model; references that read
one still load it; and the monitor changes nothing but its own keys."""

import os

import pytest

import train
from rl import query_reference
from rl.run_setup import needs_reference_model
from tests.rounding import is_timing
from tests.test_golden import run_golden

# the keys only the Policy-KL monitor writes (k3 against the reference's forward: over the response
# tokens, the prompt tokens and both)
MONITOR = {"policy_kl", "response_kl", "prompt_kl", "all_kl"}


@pytest.mark.parametrize("argv, loads", [
    (["--algo", "erpo"], False),                                  # the paper's ERPO: the cache, no model
    (["--algo", "erpo", "--measure-policy-kl", "true"], True),    # Table 3's Policy-KL column of ERPO
    (["--algo", "erpo", "--qkl-ref", "live"], True),              # a Query-KL reference that reads it
    (["--algo", "grpo", "--beta", "0.01"], True),                 # a Policy-KL in the loss
])
def test_a_reference_model_only_where_something_reads_it(argv, loads):
    assert needs_reference_model(*train.parse_args(argv)) is loads


def test_every_reference_that_needs_a_model_loads_one():
    for name, ref in query_reference.REFERENCES.items():
        if ref.needs_model:
            assert needs_reference_model(*train.parse_args(["--algo", "erpo", "--qkl-ref", name])), name


def test_erpo_metrics_are_the_same_without_the_monitor(tmp_path):
    """Two steps of the golden ERPO run with and without --measure-policy-kl: the same sampled tokens
    and every metric equal (timings aside), but for the monitor's own KL keys."""
    steps = ("--steps", "2")
    plain = run_golden("erpo", os.path.join(tmp_path, "plain"), steps)
    watched = run_golden("erpo", os.path.join(tmp_path, "watched"), (*steps, "--measure-policy-kl", "true"))
    assert [m["step"] for m in plain] == [m["step"] for m in watched]
    assert any("policy_kl" in m for m in watched) and not any("policy_kl" in m for m in plain)
    for a, b in zip(plain, watched):
        keys = {k for k in b if not is_timing(k)} - MONITOR
        assert keys == {k for k in a if not is_timing(k)}, a["step"]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
