"""The lab (labs/, docs/teaching.md): its grading tests fail on the stubs and pass on the repo's
functions, and catch the classic mistakes; the notebook script runs and its second optimizer step
clips; the drift pair's committed figure is drawn from its committed JSON, which the teacher's page
quotes; the pair's train.py arguments still parse."""

import json
import re
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import torch

from labs import drift_pair, grade, repo_functions
from tests.loss_cases import PPO_CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "labs", "results")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _grade(impl, tmp_path) -> list[dict]:
    """labs/grade.py in a fresh pytest -> one {name, outcome, message} per test."""
    xml = tmp_path / f"{impl}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "labs/grade.py",
                    "--impl", impl, f"--junitxml={xml}"], cwd=ROOT, env=ENV, capture_output=True, timeout=300)
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        out.append({"name": case.get("name"), "outcome": bad[0].tag if bad else "passed",
                    "message": bad[0].get("message", "") if bad else ""})
    return out


def test_the_grading_fails_on_the_stubs_and_passes_on_the_repos_functions(tmp_path):
    stubs, repo = _grade("exercises", tmp_path), _grade("repo", tmp_path)
    assert len(stubs) == len(repo) >= 20 and [c["name"] for c in stubs] == [c["name"] for c in repo]
    assert all(c["outcome"] == "passed" for c in repo), [c for c in repo if c["outcome"] != "passed"]
    assert all(c["outcome"] == "failure" and "NotImplementedError" in c["message"] for c in stubs), \
        [c for c in stubs if c["outcome"] != "failure" or "NotImplementedError" not in c["message"]]


FUNCTIONS = ("group_advantages", "k3", "query_kl", "query_weights", "ppo_loss", "grpo_prompt_weight")


def _mutant(**changes):
    """The repo's functions with some replaced by a wrong version."""
    return SimpleNamespace(**{**{k: getattr(repo_functions, k) for k in FUNCTIONS}, **changes})


def _biased_std(rewards, G, eps=1e-6):
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)).view(-1)


def _no_exact_zero(rewards, G, eps=1e-6):
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def _summed_query_kl(logp, ref, mask):
    return repo_functions.query_kl(logp, ref, mask) * mask.sum(-1)


def _unclipped_weights(nll, mean_nll=None, clip=None):
    return repo_functions.query_weights(nll, mean_nll)


def _weights_with_gradient(nll, mean_nll=None, clip=None):
    return (nll.mean() if mean_nll is None else mean_nll) / nll


def _population_std_weight(p, G, eps=1e-6):
    return 0.0 if p in (0, 1) else 1 / ((p * (1 - p)) ** 0.5 + eps)


def _weight_without_zero(p, G, eps=1e-6):
    return 1 / ((G / (G - 1) * p * (1 - p)) ** 0.5 + eps)


def _no_dual_clip(logp, old, A, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    return repo_functions.ppo_loss(logp, old, A, eps_low, eps_high, None)


def _clip_without_min(logp, old, A, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    r = torch.exp(logp - old)
    return -A.unsqueeze(-1) * r.clamp(1 - eps_low, 1 + eps_high), (r - 1).abs() > 0.2


MISTAKES = [   # (the mistake, the implementation that makes it, grading tests that must catch it)
    ("log r = logp - ref_logp", _mutant(k3=lambda logp, ref: repo_functions.k3(ref, logp)),
     ["test_k3_hand_values", "test_k3_expectation_is_kl_theta_ref_on_the_exact_toy",
      "test_k3_as_a_loss_follows_the_gradient_of_the_other_direction"]),
    ("k3 without gradient", _mutant(k3=lambda logp, ref: repo_functions.k3(logp.detach(), ref)),
     ["test_k3_as_a_loss_follows_the_gradient_of_the_other_direction"]),
    ("std without Bessel's correction", _mutant(group_advantages=_biased_std),
     ["test_group_advantages_hand_values"]),
    ("no exact 0 for all-equal groups", _mutant(group_advantages=_no_exact_zero),
     ["test_group_advantages_all_equal_groups_are_exactly_zero"]),
    ("Query-KL summed over the prompt", _mutant(query_kl=_summed_query_kl),
     ["test_query_kl_hand_values", "test_query_kl_masks_and_zero"]),
    ("weights not clipped", _mutant(query_weights=_unclipped_weights), ["test_query_weights_hand_values"]),
    ("weights with gradient", _mutant(query_weights=_weights_with_gradient),
     ["test_query_weights_carry_no_gradient_and_refuse_log_likelihoods"]),
    ("no dual-clip", _mutant(ppo_loss=_no_dual_clip), ["test_ppo_loss_cases"]),
    ("GRPO's weight with the population std", _mutant(grpo_prompt_weight=_population_std_weight),
     ["test_grpo_prompt_weight_hand_values", "test_grpo_prompt_weight_times_centred_rewards_is_the_advantage"]),
    ("GRPO's weight 1/eps at p = 0 or 1", _mutant(grpo_prompt_weight=_weight_without_zero),
     ["test_grpo_prompt_weight_hand_values"]),
    ("clip without PPO's min", _mutant(ppo_loss=_clip_without_min), ["test_ppo_loss_cases"]),
]


@pytest.mark.parametrize("mistake, impl, tests", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_the_grading_catches_the_classic_mistakes(mistake, impl, tests):
    for name in tests:
        fn = getattr(grade, name)
        cases = [(c,) for c in PPO_CASES] if name == "test_ppo_loss_cases" else [()]
        caught = 0
        for args in cases:
            try:
                fn(impl, *args)
            except AssertionError:
                caught += 1
        assert caught, f"{name} passes an implementation with the mistake: {mistake}"


def test_the_notebook_runs_and_its_second_optimizer_step_clips(tmp_path):
    path = os.path.join(ROOT, "labs", "notebook.py")
    assert open(path).read().count("# %%") >= 10                         # cells, as Jupytext reads them
    summary = tmp_path / "summary.json"
    env = dict(ENV, LAB_NOTEBOOK_SUMMARY=str(summary))
    p = subprocess.run([sys.executable, path], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["ratio_max_abs_dev"][0] == 0 and s["clip_frac"][0] == 0     # step 1: on-policy, r = 1 exactly
    assert s["clip_frac"][1] > 0 and s["clipped_tokens"][1] > 0          # step 2: off-policy, PPO clips
    assert s["query_kl"][0] == s["policy_kl"][0] == 0                    # the policy starts at the reference
    assert 0 < s["query_kl"][1] < s["query_kl"][2] and s["policy_kl"][1] > 0
    assert "clipped tokens of" in p.stdout and "A < 0, r < 0.8" in p.stdout


def test_the_drift_pair_figure_is_drawn_from_its_json(tmp_path):
    PIL = pytest.importorskip("PIL.Image")
    import numpy as np

    with open(os.path.join(RESULTS, "drift_pair.json")) as f:
        rec = json.load(f)
    png = os.path.join(RESULTS, "drift_pair.png")
    assert PIL.open(png).info.get("Description") == "numbers sha256 " + drift_pair.numbers_digest(rec)
    redrawn = np.asarray(PIL.open(drift_pair.plot(rec, tmp_path / "redrawn.png")).convert("L"), dtype=float)
    committed = np.asarray(PIL.open(png).convert("L"), dtype=float)
    assert redrawn.shape == committed.shape
    assert np.abs(redrawn - committed).mean() < 2.0                       # of 255: fonts may differ a little
    for algo, c in rec["curves"].items():                                 # the summary is the curves'
        assert c["step"] == list(range(1, rec["steps"] + 1))
        for k in ("query_kl", "policy_kl"):
            assert rec["summary"][algo]["last_" + k] == c[k][-1]
            tail = c[k][-rec["tail_steps"]:]
            assert rec["summary"][algo]["tail_" + k] == pytest.approx(sum(tail) / len(tail))
    grpo, erpo = rec["summary"]["grpo"], rec["summary"]["erpo"]
    assert rec["grpo_query_kl_above_erpo"] == {"last": grpo["last_query_kl"] > erpo["last_query_kl"],
                                               "tail": grpo["tail_query_kl"] > erpo["tail_query_kl"]}


def test_the_teachers_page_quotes_the_committed_pair():
    with open(os.path.join(RESULTS, "drift_pair.json")) as f:
        rec = json.load(f)
    with open(os.path.join(ROOT, "docs", "teaching.md"), encoding="utf-8") as f:
        page = f.read()
    for line in drift_pair.report(rec).splitlines():                       # the command's closing lines
        assert line in page, line
    assert "](../labs/results/drift_pair.png)" in page


def test_the_pairs_train_arguments_parse(small_data, tmp_path):
    import train

    for algo in drift_pair.ALGOS:
        args, algo_row = train.parse_args(drift_pair.train_argv(algo, small_data, str(tmp_path / algo)))
        assert args.algo == algo and algo_row == train.losses.ALGOS[algo] and args.steps == drift_pair.STEPS


def _slug(heading):
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_teachers_page_links_resolve():
    """Every relative link of docs/teaching.md names a file that exists and, with #anchor, one of its
    headings (method.md and walkthrough.md change: a renamed section must not leave a dead link)."""
    page = os.path.join(ROOT, "docs", "teaching.md")
    links = re.findall(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)", open(page, encoding="utf-8").read())
    assert len(links) >= 10
    for target, anchor in links:
        path = os.path.normpath(os.path.join(os.path.dirname(page), target))
        assert os.path.exists(path), target
        if anchor:
            with open(path, encoding="utf-8") as f:
                headings = {_slug(m) for m in re.findall(r"^#+\s+(.*)$", f.read(), re.M)}
            assert anchor in headings, f"{target}#{anchor}"
