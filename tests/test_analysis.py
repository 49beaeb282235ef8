"""analysis.py: training-run plots and the train - held-out gap; the Appendix D query/response NLL
from one forward against the NLL of each part computed separately."""

import json
import math
import os

import pytest
import torch

import analysis
from modeling import models
import rollout
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def test_run_plots_and_gap(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward": 0.5, "train_acc": 0.5 + 0.01 * s, "query_kl": 0.01 * (s + 1),
             "policy_kl": 0.001 * (s + 1)} for s in range(10)]
    for r in rows[::3]:
        r["eval_acc"] = r["train_acc"] - 0.1
    rows.append({"step": 10, "reward": 0.6})  # keys missing: tolerated
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n" + '{"step": 11, "rew')
    analysis.main(["runs", str(run), "--out", str(tmp_path / "o")])
    assert (tmp_path / "o" / "kl.png").stat().st_size > 0
    assert (tmp_path / "o" / "train_eval_gap.png").stat().st_size > 0
    assert "gap = 10.00 pts" in capsys.readouterr().out
    assert analysis.train_eval_gap(rows) == pytest.approx(0.1)
    with pytest.raises(SystemExit):
        analysis.main(["runs", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_query_response_nll_matches_separate_forwards():
    """Query/response NLL from one forward equals the NLL computed on each part separately."""
    model, tok = models.load_policy(WARM)
    prompts = [tok("Mia has 3 apples.", add_special_tokens=False)["input_ids"],
               tok("12 + 5", add_special_tokens=False)["input_ids"]]  # different lengths: padding
    eos = rollout.eos_token_ids(model, tok)
    ro = rollout.sample(model, prompts, max_new_tokens=6, eos_ids=eos, pad_id=tok.pad_token_id, seeds=[1, 2])
    q, r, nq, nr = analysis.query_response_nll(model, ro)
    for i, p in enumerate(prompts):
        resp = ro.response_ids[i][ro.response_mask[i].bool()].tolist()
        ids = torch.tensor([p + resp])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        tok_lp = logp.gather(1, ids[0, 1:, None])[:, 0]
        assert nq[i] == len(p) - 1 and nr[i] == len(resp)
        assert_rounding("analysis.query_nll", q[i], -tok_lp[:len(p) - 1].mean().item())
        assert_rounding("analysis.response_nll", r[i], -tok_lp[len(p) - 1:].mean().item())
    assert analysis.pearson([1, 2, 3], [2, 4, 6.5]) > 0.99
    assert math.isnan(analysis.pearson([1, 1], [2, 3]))
