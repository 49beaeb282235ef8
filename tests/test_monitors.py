"""The instruments of issue #43 (rl/monitors.py; docs/method.md §11): per-term gradient norms and
cosines, the held-out Query-KL, the live premise meter -- each against values computed by hand,
then all of them in the metrics.jsonl of a 2-step run, which trains exactly as without them."""

import json
import math
import os

import pytest
import torch

import analysis
import losses
import train
from modeling import models
from rl import experience, monitors, scale_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def test_geometry_of_two_known_gradients():
    """pg = (3, 0 | 0, 4), query_kl = (1, 0 | -, -) (a parameter it does not reach), entropy = 0:
    norms 5, 1, 0; cos(pg, query_kl) = 3 / 5; a zero gradient has no direction (None)."""
    pg = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0]])]
    q, ent = [torch.tensor([1.0, 0.0]), None], [torch.zeros(2), torch.zeros(1, 2)]
    g = monitors.geometry(pg, {"query_kl": q, "entropy": ent})
    assert g["grad_norm/pg"] == 5.0 and g["grad_norm/query_kl"] == 1.0 and g["grad_norm/entropy"] == 0.0
    assert g["grad_cos/pg_query_kl"] == pytest.approx(0.6, abs=1e-15)
    assert g["grad_cos/pg_entropy"] is None
    opposite = monitors.geometry(pg, {"policy_kl": [-2 * x for x in pg]})
    assert opposite["grad_cos/pg_policy_kl"] == pytest.approx(-1.0, abs=1e-15)
    assert opposite["grad_norm/policy_kl"] == pytest.approx(10.0, abs=1e-14)


@pytest.mark.parametrize("name, over", [
    ("grpo", {}), ("erpo", {}), ("grpo", {"kl": "k3-ratio", "alpha": 0.02}),
    ("erpo", {"entropy_coef": 0.01, "top_entropy_quantile": 0.5}), ("drgrpo", {"entropy_coef": 0.1})])
def test_loss_terms_sum_to_rl_loss(name, over):
    """The terms the monitors differentiate are rl_loss's: their sum is its loss, in value and in
    gradient (so a new term in rl_loss that loss_terms lacks fails here)."""
    torch.manual_seed(0)
    algo = losses.make_algo(name, **over)
    B, T, P = 4, 5, 3
    logp = (torch.randn(B, T) * 0.3 - 1).requires_grad_()
    prompt = (torch.randn(B, P) * 0.3 - 2).requires_grad_()
    entropy = (torch.rand(B, T) + 0.5).requires_grad_()
    mask = (torch.rand(B, T) > 0.2).float()
    kw = dict(old_logp=logp.detach() + 0.1 * torch.randn(B, T), ref_logp=logp.detach() + 0.2 * torch.randn(B, T),
              resp_mask=mask, advantages=torch.randn(B), prompt_ref_logp=prompt.detach() + 0.2,
              weights=None if algo.weights == "none" else torch.rand(B) + 0.5, prompt_mask=torch.ones(B, P),
              num_tokens=mask.sum(), num_seqs=B, max_len=T, sampler_logp=None)
    loss, _ = losses.rl_loss(algo, logp=logp, prompt_logp=prompt, entropy=entropy, **kw)
    terms = monitors.loss_terms(algo, logp=logp, prompt_logp=prompt, entropy=entropy, **kw)
    has = {"pg", *(["policy_kl"] if algo.has_policy_kl_loss else []), *(["query_kl"] if algo.alpha else []),
           *(["entropy"] if algo.entropy_coef else [])}
    assert set(terms) == has
    total = sum(terms.values())
    assert total.item() == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
    leaves = (logp, prompt, entropy)
    got = torch.autograd.grad(total, leaves, allow_unused=True)
    want = torch.autograd.grad(loss, leaves, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or torch.allclose(g, w, atol=1e-7))


def test_premise_r_is_pearson_over_prompts_of_their_rows_mean():
    """premise_r = Pearson r over prompts of (prompt mean per-token NLL, mean over the prompt's
    valid rows of each response's mean per-token NLL); an invalid row (DAPO filler) is left out,
    a prompt without one too."""
    torch.manual_seed(1)
    G, n = 3, 5
    B, P, R = G * n, 4, 6
    ref = -torch.rand(n, P).repeat_interleave(G, 0) * 3
    old = -torch.rand(B, R) * 2
    valid = torch.ones(B)
    valid[[1, 12, 13, 14]] = 0                                       # prompt 4: no valid row
    pmask = (torch.rand(B, P) > 0.3).float()
    pmask = pmask.view(n, G, P)[:, :1].expand(n, G, P).reshape(B, P) * valid[:, None]
    rmask = (torch.rand(B, R) > 0.3).float() * valid[:, None]
    xs, ys = [], []
    for p in range(n - 1):
        rows = [i for i in range(p * G, p * G + G) if valid[i]]
        i = rows[0]
        xs.append(-(ref[i].double() * pmask[i]).sum().item() / pmask[i].sum().item())
        ys.append(sum(-(old[j].double() * rmask[j]).sum().item() / rmask[j].sum().item()
                      for j in rows) / len(rows))
    s = {k: float(v) for k, v in experience.premise_sums(ref * pmask, pmask, old, rmask, valid, G).items()}
    assert s["premise_n"] == n - 1
    assert experience.premise_r(s) == pytest.approx(analysis.pearson(xs, ys), abs=1e-12)
    assert experience.premise_r({**s, "premise_n": 1.0}) is None


def run(out, data, *extra):
    train.main(["--algo", "erpo", "--model", WARM, "--train-data", data, "--out", str(out), "--steps", "2",
                "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
                "--max-new-tokens", "32", "--eval-data", "tiny-test", "--eval-limit", "6", "--eval-every", "1",
                "--save-every", "0", "--no-signal", "step", "--entropy-coef", "0.01", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def prompt_logp(model, ids) -> torch.Tensor:
    """log p(x_t | x_<t), t = 2..T, of one prompt alone (no padding, no batch): by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_a_two_step_run_logs_the_instruments_at_their_hand_values(tmp_path, small_data, monkeypatch):
    seen, at_eval = {}, []
    real_metrics, real_measure = experience.step_metrics, monitors.HeldoutQueryKL.measure

    def spy_metrics(run, step, c, ro, batch, qref, upd):             # step 1's rows, as the step has them
        seen.setdefault(step, (ro, batch.valid.clone(), run.args.group_size))
        return real_metrics(run, step, c, ro, batch, qref, upd)

    def spy_measure(self, run, *a):                                  # the weights each evaluation scores
        at_eval.append(({k: v.clone() for k, v in run.policy.state_dict().items()}, self))
        return real_measure(self, run, *a)
    monkeypatch.setattr(experience, "step_metrics", spy_metrics)
    monkeypatch.setattr(monitors.HeldoutQueryKL, "measure", spy_measure)
    rows = run(tmp_path / "on", small_data, "--monitor-every", "1")
    steps = {r["step"]: r for r in rows}
    for k in ("grad_norm/pg", "grad_norm/query_kl", "grad_norm/entropy", "grad_cos/pg_query_kl",
              "grad_cos/pg_entropy", "premise_r", "eval_query_kl", "eval_query_kl/tiny-test",
              "eval_query_kl_trained"):
        assert all(k in steps[s] for s in (1, 2)), k
    assert steps[0]["eval_query_kl"] == 0.0                          # the same forward as the cache's
    assert "eval_query_kl_trained" not in steps[0]                   # nothing trained yet

    # held-out Query-KL after one step, by hand: each held-out prompt alone, k3 per token against the
    # initial policy, mean over its tokens, then over the prompts
    initial = models.load_policy(WARM)[0].eval()
    after = models.load_policy(WARM)[0].eval()
    weights, held = at_eval[1]
    after.load_state_dict(weights)
    train_ids = {tuple(x) for x in train.tasks.prompt_set(small_data, models.load_tokenizer(WARM), "plain",
                                                          "math", training=True).ids}
    assert not train_ids & {tuple(x) for x in held.ids}              # not the training cache's prompts
    k3 = []
    for ids in held.ids:
        d = prompt_logp(initial, ids).double() - prompt_logp(after, ids).double()   # log r, r = pi_0 / pi
        k3.append((d.exp() - d - 1).mean().item())
    assert steps[1]["eval_query_kl"] == pytest.approx(sum(k3) / len(k3), rel=2e-3)
    assert steps[1]["eval_query_kl"] > 0

    # the premise meter at step 1 = analysis.py nll's r on the same rows (pi_old = pi_0 then),
    # each prompt's response NLL the mean over its G rows
    ro, valid, G = seen[0]
    q, r, _, _ = analysis.query_response_nll(initial, ro)
    xs, ys = [], []
    for p in range(len(q) // G):
        mine = [i for i in range(p * G, p * G + G) if valid[i]]
        if mine:
            xs.append(q[mine[0]])
            ys.append(sum(r[i] for i in mine) / len(mine))
    assert steps[1]["premise_r"] == pytest.approx(analysis.pearson(xs, ys), abs=1e-4)

    # the monitors measure; the run trains exactly as without them
    monkeypatch.setattr(experience, "step_metrics", real_metrics)
    off = {r["step"]: r for r in run(tmp_path / "off", small_data, "--monitor-every", "0")}
    assert not any(k.startswith("grad_cos/") for r in off.values() for k in r)
    for s in (1, 2):
        for k in ("loss", "grad_norm", "pg_loss", "loss_query_kl", "reward", "response_tokens"):
            assert steps[s][k] == off[s][k], (s, k)


def test_the_sample_digest_sees_the_tokens_not_the_padding():
    import rollout
    ids, mask = torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    ro = rollout.Rollout.__new__(rollout.Rollout)
    ro.response_ids, ro.response_mask = ids, mask
    same = rollout.Rollout.__new__(rollout.Rollout)
    same.response_ids, same.response_mask = torch.tensor([[5, 6, 9], [7, 9, 9]]), mask   # other padding
    other = rollout.Rollout.__new__(rollout.Rollout)
    other.response_ids, other.response_mask = torch.tensor([[5, 6, 0], [8, 0, 0]]), mask
    assert experience.sample_digest(ro) == experience.sample_digest(same) != experience.sample_digest(other)


def test_headline_pairs_erpo_and_grpo_by_seed():
    """study.headline's paired report (issue #43): ERPO - GRPO per seed, its Student-t interval over
    the pairs, and whether each pair shared its step-1 samples (equal digests)."""
    from study import headline as H

    def summary(algo, seed, test, digest):
        return {"name": H.Run(algo, seed, "native").name, "algo": algo, "seed": seed, "kernels": "native",
                "step0": {}, "final": {"tiny-test": test}, "golden": "g", "commit": "c", "cpu": "CPU",
                "torch": "2", "sample_digest": digest}
    runs = [summary("grpo", s, 0.50 + 0.02 * s, f"d{s}") for s in H.SEEDS] + \
        [summary("erpo", s, 0.52 + 0.02 * s + 0.01 * (s == 2), f"d{s}" if s else "x") for s in H.SEEDS]
    p = H.aggregate({r["name"]: r for r in runs})["paired"]
    d = p["diff"]["final/tiny-test"]
    assert d["values"] == pytest.approx([0.02, 0.02, 0.03])
    assert d["mean"] == pytest.approx(0.07 / 3)
    assert d["half"] == pytest.approx(4.303 * 0.01 / math.sqrt(3) / 3 ** 0.5, rel=1e-3)   # sd of diffs / sqrt 3
    assert p["shared_step1_samples"] == {"0": False, "1": True, "2": True}
    assert "seed 0: DIFFER" in H.paired_table(H.aggregate({r["name"]: r for r in runs}))


def test_the_measured_micro_batch_has_a_policy_gradient():
    """The per-term gradients are measured on the first micro-batch, among the update batches that
    take a step, with a nonzero advantage (else pg's gradient is 0 and no cosine exists)."""
    from modeling.logprobs import MicroBatch

    def mb(*rows):
        return MicroBatch(torch.tensor(rows), 2, 2)
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0])
    skipped = scale_step.UpdatePlan([mb(5, 6)], 4.0, 2.0, num_signal=0.0)      # no signal: takes no step
    stepping = scale_step.UpdatePlan([mb(2, 3), mb(4, 5)], 4.0, 2.0, num_signal=1.0)
    plan = scale_step.StepPlan([], [], [], [skipped, stepping], 1)
    assert monitors.measured_micro_batch(plan, adv, "skip").rows.tolist() == [4, 5]
    assert monitors.measured_micro_batch(plan, adv, "step").rows.tolist() == [5, 6]   # (then it steps)
    none = scale_step.StepPlan([], [], [], [stepping], 1)
    assert monitors.measured_micro_batch(none, torch.zeros(8), "skip").rows.tolist() == [2, 3]


def test_a_gradient_under_the_noise_floor_has_no_direction():
    """A term's gradient under NOISE_FLOOR * |coef| * ||g_pg|| is rounding: its norm is logged, its
    cosine is None; just above the floor the cosine is the exact one. No coefficient, no floor."""
    pg = [torch.tensor([3.0, 4.0])]                                                   # ||g_pg|| = 5
    floor = monitors.NOISE_FLOOR * 0.5 * 5
    under, over = [torch.tensor([0.0, 0.9 * floor])], [torch.tensor([0.0, 1.1 * floor])]
    g = monitors.geometry(pg, {"query_kl": under}, {"query_kl": 0.5})
    assert g["grad_norm/query_kl"] == pytest.approx(0.9 * floor) and g["grad_cos/pg_query_kl"] is None
    g = monitors.geometry(pg, {"query_kl": over}, {"query_kl": 0.5})
    assert g["grad_cos/pg_query_kl"] == pytest.approx(0.8)
    assert monitors.geometry(pg, {"query_kl": under})["grad_cos/pg_query_kl"] == pytest.approx(0.8)
    assert monitors.absent_terms(g) == {"grad_norm/policy_kl": 0.0, "grad_cos/pg_policy_kl": None,
                                        "grad_norm/entropy": 0.0, "grad_cos/pg_entropy": None}


def one_ulp_off(monkeypatch):
    """The Query-KL cache one float32 ulp off the forward's log-probs (toward 0), as another kernel or
    layout leaves it: at step 1 the Query-KL gradient is then rounding noise, not exactly 0."""
    from rl import query_reference as qr
    real = qr.cache_for_run

    def nudged(*a, **k):
        c = real(*a, **k)
        return qr.QueryCache.from_logp([torch.nextafter(t, torch.zeros_like(t)) for t in c.logp], c.meta)
    monkeypatch.setattr(qr, "cache_for_run", nudged)


def gradient_rows(out, data, alpha):
    train.main(["--algo", "erpo", "--alpha", str(alpha), "--model", WARM, "--train-data", data, "--out",
                str(out), "--steps", "3", "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4",
                "--micro-batch", "4", "--max-new-tokens", "64", "--eval-every", "0", "--save-every", "0",
                "--no-signal", "step", "--monitor-every", "1"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "grad_norm/pg" in r}


def test_query_kl_cosine_is_null_at_step_1_and_measured_once_the_policy_moved(tmp_path, small_data,
                                                                             monkeypatch):
    """Issue #50: at step 1 (cache reference, pi = pi_0) the Query-KL gradient is rounding (here one
    ulp of the cache: ~1e-7 of ||g_pg|| per unit of alpha, the issue's 0.0019 cosine); its norm is
    logged, its cosine null. Once the policy has moved (steps 2, 3) it is far above the floor and
    the cosine is measured. At alpha = 0 the term is logged as 0 with no cosine."""
    one_ulp_off(monkeypatch)
    steps = gradient_rows(tmp_path / "a1", small_data, 1.0)
    assert steps[1]["grad_norm/pg"] > 0 and 0 < steps[1]["grad_norm/query_kl"] < monitors.NOISE_FLOOR * \
        steps[1]["grad_norm/pg"]
    assert steps[1]["grad_cos/pg_query_kl"] is None
    for s in (2, 3):
        assert steps[s]["grad_norm/query_kl"] > 100 * monitors.NOISE_FLOOR * steps[s]["grad_norm/pg"], s
        assert steps[s]["grad_cos/pg_query_kl"] is not None, s
    off = gradient_rows(tmp_path / "a0", small_data, 0.0)
    assert all(r["grad_norm/query_kl"] == 0.0 and r["grad_cos/pg_query_kl"] is None for r in off.values())
    assert all("grad_norm/query_kl" in r and "grad_norm/policy_kl" in r for r in off.values())


def test_trained_prompts_are_the_first_sampled(monkeypatch):
    """trained_prompts: the first n distinct indices of the steps' samples in order, fixed once n
    are reached, all of them before; none before a step."""
    order = [experience.step_indices(50, k, 8, 3) for k in range(4)]
    seen = list(dict.fromkeys(i for o in order for i in o))
    assert monitors.trained_prompts(50, 0, 8, 3, 10) == []
    assert monitors.trained_prompts(50, 1, 8, 3, 10) == order[0]                  # 8 of 10: fewer before
    assert monitors.trained_prompts(50, 2, 8, 3, 10) == seen[:10] == monitors.trained_prompts(50, 4, 8, 3, 10)
    assert monitors.trained_prompts(50, 4, 8, 3, 100) == seen                      # every one sampled


def test_the_memorisation_metric_scores_prompts_the_run_has_sampled(tmp_path, small_data, monkeypatch):
    """Issue #50: eval_query_kl_trained's prompts, at each evaluation after step s, are a subset of the
    prompts steps 1..s sampled (experience.step_indices), as many as the held-out set has once there are
    that many; the training set's first rows, which the old eval_query_kl_train scored, are not."""
    from plumbing import run_dir
    seen = []
    real = monitors.HeldoutQueryKL.trained_sample

    def spy(self, run, steps):
        seen.append((steps, real(self, run, steps), len(self.data_ids), next(iter(self.sets.values()))))
        return seen[-1][1]
    monkeypatch.setattr(monitors.HeldoutQueryKL, "trained_sample", spy)
    out = tmp_path / "run"
    rows = {r["step"]: r for r in run(out, small_data, "--monitor-every", "0", "--steps", "3",
                                      "--eval-limit", "12")}
    seed = run_dir.read_config(str(out))["seed"]
    assert [s for s, *_ in seen] == [1, 2, 3] and all("eval_query_kl_trained" in rows[s] for s in (1, 2, 3))
    for steps, idx, n_data, n in seen:
        sampled = {i for k in range(steps) for i in experience.step_indices(n_data, k, 8, seed)}
        assert set(idx) <= sampled and len(idx) == min(n, len(sampled)) == len(set(idx)), steps
    assert seen[1][1] == seen[2][1] and len(seen[1][1]) == 12                       # fixed once 12 are sampled
    assert set(seen[2][1]) != set(range(12))


def test_the_premise_meters_interval_covers_the_mean_of_its_steps(tmp_path, small_data):
    """premise_r is one r over one step's prompts: its 95% interval (Fisher's z over the step's n
    prompts) holds the step's r, is the textbook one at a hand value, and over a seeded 8-step run
    the intervals cover the mean of the per-step values (a single step says little: method.md §11)."""
    lo_hi = experience.premise_interval(0.2, 32)
    half = 1.959964 / math.sqrt(29)
    assert lo_hi == pytest.approx({"premise_r_lo": math.tanh(math.atanh(0.2) - half),
                                   "premise_r_hi": math.tanh(math.atanh(0.2) + half)})
    assert experience.premise_interval(None, 32) == experience.premise_interval(0.5, 3) == \
        {"premise_r_lo": None, "premise_r_hi": None}
    ms = [m for m in run(tmp_path / "run", small_data, "--steps", "8") if m["step"]]
    rs = [m["premise_r"] for m in ms if m["premise_r"] is not None]
    assert len(rs) >= 6
    mean = sum(rs) / len(rs)
    for m in ms:
        if m["premise_r"] is not None:
            assert m["premise_r_lo"] <= m["premise_r"] <= m["premise_r_hi"]
    covered = [m["premise_r_lo"] <= mean <= m["premise_r_hi"] for m in ms if m["premise_r"] is not None]
    assert sum(covered) >= len(covered) - 1, (mean, [(m["premise_r_lo"], m["premise_r_hi"]) for m in ms])
