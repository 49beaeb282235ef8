"""study/headline.py: the README's headline table from run summaries (seeds and kernel variants)."""

import pytest

from study import headline as H


def summary(algo, seed, kernels, test, qkl):
    return {"name": H.Run(algo, seed, kernels).name, "algo": algo, "seed": seed, "kernels": kernels,
            "step0": {"tiny-test": 0.3}, "final": {"tiny-test": test}, "query_kl_tail": qkl,
            "golden": "g", "commit": "c", "cpu": "CPU", "torch": "2.13"}


def test_the_table_shows_the_seed_interval_and_the_kernel_range():
    runs = [summary("grpo", s, "native", 0.50 + 0.01 * s, 0.010) for s in H.SEEDS] + \
        [summary("erpo", s, "native", 0.55, 0.003 + 0.001 * s) for s in H.SEEDS] + \
        [summary(a, 0, k, t, 0.02) for k, t in (("avx2", 0.48), ("aten-default", 0.53)) for a in ("grpo", "erpo")]
    study = H.aggregate({s["name"]: s for s in runs})
    g = study["algos"]["grpo"]
    assert g["seeds"]["final/tiny-test"]["values"] == [0.50, 0.51, 0.52] and g["n_kernels"] == 3
    assert g["seeds"]["final/tiny-test"]["half"] == pytest.approx(4.303 * 0.01 / 3 ** 0.5, rel=1e-3)
    assert g["kernels"]["final/tiny-test"] == [0.48, 0.53] and g["kernels"]["query_kl_tail"] == [0.01, 0.02]
    rows = H.table(study).splitlines()
    assert rows[2] == "| tiny-test (step 50) % | 51.0 ± 2.5 [50.0 / 51.0 / 52.0] | 48.0–53.0 | 55.0 ± 0.0 " \
                      "[55.0 / 55.0 / 55.0] | 48.0–55.0 |"
    with pytest.raises(SystemExit):
        H.aggregate({**{s["name"]: s for s in runs}, "x": {**runs[0], "name": "x", "golden": "other"}})


def test_the_committed_pairs_shared_their_step1_samples():
    """Each committed GRPO/ERPO pair (a seed on this machine's kernels, or seed 0 under another kernel
    variant) sampled the same step-1 tokens (equal digests of the sampled tokens): the pair's
    difference starts from one batch, so the sampled data's share of the seed spread cancels."""
    runs = H.load_summaries(H.RESULTS)
    assert {r.name for r in H.RUNS} <= set(runs), sorted(set(r.name for r in H.RUNS) - set(runs))
    for g in (r for r in H.RUNS if r.algo == "grpo"):
        grpo, erpo = runs[g.name], runs[H.Run("erpo", g.seed, g.kernels).name]
        assert grpo["sample_digest"] and grpo["sample_digest"] == erpo["sample_digest"], g.name
    assert set(H.aggregate(runs)["paired"]["shared_step1_samples"].values()) == {True}
