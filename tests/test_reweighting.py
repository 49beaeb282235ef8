"""labs/reweighting.py (docs/teaching.md, part D): each estimator's effective per-prompt weight, read
off losses.group_advantages, equals its hand value; the committed JSON is what the command computes
today, and the teacher's page quotes its table and shows its figure."""

import json
import math
import os

import pytest
import torch

import losses
from labs import reweighting as rw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "labs", "results")
EPS = 1e-6


def test_hand_values_at_p_one_quarter_with_four_responses():
    """p = 1/4, G = 4: GRPO's std is Bessel's (losses.py), sigma^2 = 4/3 * 3/16 = 1/4, so 1/(1/2 + eps),
    not the population std's 1/sqrt(3/16) = 2.31; RLOO 4/3; MaxRL 1/p = 4; Dr.GRPO 1; DAPO keeps the
    group (GRPO's); ERPO GRPO's times w = clip(30 / 20, 0, 2) = 1.5."""
    grpo = 1 / (0.5 + EPS)
    assert rw.effective_weight("grpo", 1, 4) == pytest.approx(grpo, rel=1e-6)
    assert rw.effective_weight("grpo", 1, 4) != pytest.approx(1 / math.sqrt(3 / 16), rel=1e-3)
    assert rw.effective_weight("drgrpo", 1, 4) == pytest.approx(1.0, rel=1e-6)
    assert rw.effective_weight("rloo", 1, 4) == pytest.approx(4 / 3, rel=1e-6)
    assert rw.effective_weight("maxrl", 1, 4) == pytest.approx(1 / (0.25 + EPS), rel=1e-6)
    assert rw.effective_weight("dapo", 1, 4) == pytest.approx(grpo, rel=1e-6)
    assert rw.effective_weight("erpo", 1, 4, nll=20.0, mean_nll=30.0) == pytest.approx(1.5 * grpo, rel=1e-6)


@pytest.mark.parametrize("kind", rw.ESTIMATORS)
def test_no_signal_groups_weigh_zero(kind):
    for k in (0, 4):
        assert rw.effective_weight(kind, k, 4, nll=20.0) == 0.0, f"{kind}, {k} of 4"


def test_erpo_weights_from_hand_nlls_and_the_clip():
    """w = s_bar / s clipped to [0, 2]: s = 10, 20, 30, 60 with s_bar = 30 -> 2 (3 clipped), 1.5, 1, 0.5."""
    for nll, w in ((10.0, 2.0), (20.0, 1.5), (30.0, 1.0), (60.0, 0.5)):
        assert rw.query_weight(nll, 30.0) == pytest.approx(w, rel=1e-6)
        assert rw.effective_weight("erpo", 3, 8, nll=nll, mean_nll=30.0) == \
            pytest.approx(w * rw.effective_weight("grpo", 3, 8), rel=1e-6)
    with pytest.raises(ValueError, match="NLL"):
        rw.effective_weight("erpo", 3, 8)


def test_the_formulas_over_every_k_of_eight():
    """The module docstring's table, on every interior success count of G = 8."""
    G = 8
    for k in range(1, G):
        p = k / G
        sigma = math.sqrt(G / (G - 1) * p * (1 - p))
        assert rw.effective_weight("grpo", k, G) == pytest.approx(1 / (sigma + EPS), rel=1e-6)
        assert rw.effective_weight("drgrpo", k, G) == pytest.approx(1.0, rel=1e-6)
        assert rw.effective_weight("rloo", k, G) == pytest.approx(G / (G - 1), rel=1e-6)
        assert rw.effective_weight("maxrl", k, G) == pytest.approx(1 / (p + EPS), rel=1e-6)


def test_read_weight_refuses_non_proportional_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert rw.read_weight(r, 3 * (r - 0.5)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="proportional"):
        rw.read_weight(r, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="all-equal"):
        rw.read_weight(torch.ones(4), torch.tensor([0.1, 0.0, 0.0, 0.0]))


def test_the_batch_estimators_are_not_per_prompt():
    """batch-std and reinforce++ (losses.BATCH_ADVANTAGES) depend on the other prompts of the batch:
    ESTIMATORS leaves them out on purpose."""
    assert not set(losses.BATCH_ADVANTAGES) & set(rw.ESTIMATORS)
    assert set(rw.ESTIMATORS) - {"dapo", "erpo"} <= set(losses.ADVANTAGES)


def test_the_committed_json_is_todays_record_and_the_page_quotes_it(tmp_path):
    with open(os.path.join(RESULTS, "reweighting.json")) as f:
        committed = json.load(f)
    assert committed == json.loads(json.dumps(rw.record()))
    with open(os.path.join(ROOT, "docs", "teaching.md"), encoding="utf-8") as f:
        page = f.read()
    for line in rw.table(committed).splitlines():
        assert line in page, line
    assert "](../labs/results/reweighting.png)" in page
    png = rw.plot(committed, tmp_path / "redrawn.png")
    assert os.path.getsize(png) < 200_000
