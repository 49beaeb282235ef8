"""train.py end to end on the embedded world: short runs of every algorithm, resume, and
1-process vs 2-process (torchrun, gloo) equivalence over the same global batch."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import losses
import train
from rl import scale_step
from plumbing import extension, options
from tests.rounding import assert_rounding, is_exact

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def run(out, data, *extra, steps=2):
    argv = ["--model", WARM, "--train-data", data, "--out", str(out), "--steps", str(steps),
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "48", "--eval-data", "tiny-test", "--eval-limit", "8",
            "--eval-every", "2", "--save-every", "2", *extra]
    train.main(argv)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


KEYS = {"step", "reward", "train_acc", "query_kl", "entropy", "response_len",      # (policy_kl: where a reference loads)
        "grad_norm", "step_time", "clip_frac", "zero_var_frac", "loss_query_kl",
        "time_gen", "time_reward", "time_score", "time_update", "gen_tok_per_s", "update_tok_per_s"}


def rl_loss_statistics(algo):
    """The names of the statistics losses.rl_loss returns for `algo` called as train.py calls it,
    as metrics.jsonl names them."""
    B, T = 2, 3
    _, stats = train.losses.rl_loss(
        algo, logp=torch.zeros(B, T), old_logp=torch.zeros(B, T),
        ref_logp=torch.zeros(B, T) if algo.has_policy_kl_loss else None,
        resp_mask=torch.ones(B, T), advantages=torch.ones(B), weights=None if algo.weights == "none" else torch.ones(B),
        prompt_logp=torch.zeros(B, T), prompt_ref_logp=torch.zeros(B, T), prompt_mask=torch.ones(B, T),
        num_tokens=B * T, num_seqs=B, max_len=T)
    return {f"loss_{k}" if k in ("policy_kl", "query_kl") else k for k in stats}


def test_erpo_end_to_end_writes_metrics_and_learns(tmp_path, small_data, monkeypatch):
    before = {k: v.clone() for k, v in train.models.load_policy(WARM)[0].state_dict().items()}
    real, real_clip, opt_steps = train.losses.rl_loss, torch.nn.utils.clip_grad_norm_, [{}]

    def spy(algo, **kw):                       # each optimizer step's clip statistics, micro-batches summed
        loss, st = real(algo, **kw)
        for k in losses.SURROGATES['ppo'].stats:
            opt_steps[-1][k] = opt_steps[-1].get(k, 0.0) + st[k].item()
        return loss, st

    def next_step(*a, **kw):                   # clipping: once per optimizer step, after its backwards
        opt_steps.append({})
        return real_clip(*a, **kw)
    monkeypatch.setattr(train.losses, "rl_loss", spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", next_step)
    ms = run(tmp_path, small_data, "--algo", "erpo", "--lr", "1e-3", "--no-signal", "step",
             "--measure-policy-kl", "true", steps=4)  # 2 x 4 steps; the Policy-KL monitor on
    assert ms[0]["step"] == 0 and "eval_acc" in ms[0]           # evaluation before training
    steps = [m for m in ms if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert KEYS <= set(m), KEYS - set(m)
        assert m["query_kl"] >= 0 and m["policy_kl"] >= 0 and 0 <= m["train_acc"] <= 1
        assert 0 < m["weight_min"] <= m["weight_mean"] <= m["weight_max"] <= 2  # paper weights
    # every statistic of rl_loss reaches metrics.jsonl; the clip fractions are the second optimizer
    # step's (2 per RL step): the first is on-policy, nothing to clip
    assert all(rl_loss_statistics(train.losses.ALGOS["erpo"]) <= set(m) for m in steps)
    opt_steps.pop()                            # (opened by the last clipping)
    assert len(opt_steps) == 2 * 4 and all(v == 0 for first in opt_steps[0::2] for v in first.values())
    for m, second in zip(steps, opt_steps[1::2]):
        assert all(m[k] == pytest.approx(second[k], abs=1e-12) for k in losses.SURROGATES['ppo'].stats)
    assert max(m["clip_frac"] for m in steps) > 0 and max(m["clip_frac_high"] for m in steps) > 0
    assert_rounding("train.step1_query_kl", steps[0]["query_kl"], 0.0)  # step 1 samples from the reference itself
    assert steps[-1]["query_kl"] > 0            # ... and the queries drift once it trains
    assert "eval_acc" in steps[1] and "eval_acc" in steps[3]
    after = train.models.load_policy(os.path.join(tmp_path, "ckpt"))[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    assert cfg["algo"] == "erpo" and cfg["alpha"] is None   # the algorithm's own alpha (0.01)


# --no-signal step: both paths take every optimizer step, whatever the sampled groups' rewards; the
# step at scale (rl/scale_step.py), whose fast path the skipped forward is
SKIPPED_FORWARD_ARGS = ("--algo", "grpo", "--beta", "0.04", "--eval-every", "0", "--no-signal", "step",
                        "--sampler", "kv", "--pack", "true", "--share-prompts", "true")
SKIPPED_FORWARD_KEYS = ("reward", "query_kl", "policy_kl", "entropy", "pg_loss", "loss", "grad_norm", "clip_frac")


def skipped_and_computed(tmp, data, compute_pi_old):
    """The same 3 steps twice, sharing one Query-KL cache folder: the first optimizer step's pi_old
    taken from the update's own forward; then, after `compute_pi_old()` patches train, computed by
    a no-grad forward of its own."""
    args = (*SKIPPED_FORWARD_ARGS, "--query-cache-dir", os.path.join(tmp, "qc"))
    skipped = run(os.path.join(tmp, "skip"), data, *args, steps=3)
    compute_pi_old()
    return skipped, run(os.path.join(tmp, "full"), data, *args, steps=3)


def test_the_skipped_old_policy_forward_changes_nothing(tmp_path, small_data, monkeypatch, capsys):
    """The first optimizer step's rows take pi_old from the update's own forward (same weights)
    instead of a no-grad forward of their own: the metrics are those of computing it. Exact: the
    rewards (the same tokens are sampled). Rounding: the float metrics, since the two paths run
    different kernels (a batched forward with grad vs without); each within 10x the worst
    difference between the paths measured across CPU kernel variants (tests/golden/tolerances.json,
    `python -m tests.test_golden tolerances`). Also: the second run reuses the shared Query-KL cache."""
    def compute_pi_old():
        assert "reused" not in capsys.readouterr().out                  # the first run built the cache
        monkeypatch.setattr(scale_step, "on_policy_rows", lambda run, upd_rows: slice(0, 0))

    skipped, computed = skipped_and_computed(str(tmp_path), small_data, compute_pi_old)
    assert "query-KL reference cache: reused" in capsys.readouterr().out  # the second run reused it
    for a, b in zip(skipped, computed):
        for k in SKIPPED_FORWARD_KEYS:
            if is_exact(k):
                assert a[k] == b[k], (a["step"], k)
            else:
                assert_rounding(f"skipped_forward.{k}", a[k], b[k])
    run(tmp_path / "t", small_data, *SKIPPED_FORWARD_ARGS, "--query-cache-dir", str(tmp_path / "qc"),
        "--temperature", "0.9", steps=1)  # another temperature: another cache
    assert "reused" not in capsys.readouterr().out


def test_each_optimizer_step_is_seen_inside_one_autocast_region():
    """The RL step and the SFT loop run in one autocast region (--dtype bf16-mixed; auto on CUDA),
    where torch reuses each float32 weight's bf16 copy until the region exits: optimizer.step
    must drop those copies, or every forward after the first step would see the old weights."""
    from plumbing import distributed, optimizer

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    opt = optimizer.adamw(lin, 0.1, 0.0)
    sched = optimizer.warmup_then_constant(opt, 0)
    amp = distributed.precision("bf16-mixed", torch.device("cpu"))[1]
    with amp():
        before = lin(x)
        before.sum().backward()
        optimizer.step(opt, sched)
        inside = lin(x)
    with amp():
        fresh = lin(x)
    assert not torch.equal(before, fresh) and torch.equal(inside, fresh)


def test_bf16_mixed_on_cpu_trains(tmp_path, small_data):
    """float32 master weights, bf16 autocast: 2 optimizer steps per RL step, Query-KL from float32 SDPA."""
    ms = run(tmp_path, small_data, "--algo", "erpo", "--dtype", "bf16-mixed", "--lr", "1e-3",
             "--rollout-batch", "8", "--update-batch", "4", "--eval-every", "0", "--save-every", "0",
             "--measure-policy-kl", "true", steps=2)                    # the bf16 reference too
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:
        assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "query_kl", "policy_kl", "entropy"))
    assert_rounding("train.bf16_mixed_step1_query_kl", ms[0]["query_kl"], 0.0)   # starts at the reference,
    assert ms[1]["query_kl"] > 0                                                   # then drifts


def test_heldout_evaluation_at_several_temperatures(tmp_path, small_data):
    """Each --eval-temperatures value is logged as eval_acc@T<t>*, the first also as eval_acc*; a
    temperature's numbers are those of a run that evaluates at it alone (the same per-problem seeds)."""
    many = run(tmp_path / "many", small_data, "--eval-temperatures", "0.3", "1.0", "--eval-limit", "24", steps=0)
    alone = run(tmp_path / "alone", small_data, "--eval-temperatures", "1.0", "--eval-limit", "24", steps=0)
    (m,), (a,) = many, alone
    assert m["eval_acc"] == m["eval_acc@T0.3"] and m["eval_acc/tiny-test/L3"] == m["eval_acc@T0.3/tiny-test/L3"]
    assert {k: v for k, v in m.items() if k.startswith("eval_acc@T1")} == \
        {k.replace("eval_acc", "eval_acc@T1", 1): v for k, v in a.items() if k.startswith("eval_acc")}
    assert not any("@" in k for k in a)                                  # one temperature: the plain keys


def test_resume_continues_from_the_saved_step(tmp_path, small_data):
    full = run(tmp_path / "full", small_data, "--algo", "grpo", steps=4)
    run(tmp_path / "cut", small_data, "--algo", "grpo", steps=2)           # "killed" after step 2
    resumed = run(tmp_path / "cut", small_data, "--algo", "grpo", "--resume", steps=4)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]                # no step lost or repeated
    for a, b in zip(full, resumed):
        for k in ("reward", "train_acc", "query_kl", "policy_kl", "grad_norm", "eval_acc"):
            if k in a:
                if is_exact(k):                                           # the same tokens, the same grades
                    assert b[k] == a[k], (a["step"], k)
                else:
                    assert_rounding(f"train.resume.{k}", b[k], a[k])


def test_passk_options_are_checked_when_parsed(capsys, tmp_path):
    """--adv passk: --passk-k is its own option (inert for another --adv), k <= --group-size, 0/1
    rewards (--reward acc); all refused with one line before anything runs."""
    out = ["--out", str(tmp_path / "x")]
    args, algo = train.parse_args(["--adv", "passk", "--passk-k", "2", "--group-size", "4", *out])
    assert algo.adv == "passk" and args.passk_k == 2
    for bad, said in ((["--adv", "passk", "--passk-k", "5", "--group-size", "4"], "passk_k must be in [1, G = 4]"),
                      (["--adv", "passk", "--reward", "acc+format"], "needs 0/1 rewards"),
                      (["--passk-k", "2"], "--passk-k 2 cannot act"),
                      (["--adv", "passk", "--algo", "dapo"], "success rewards")):
        with pytest.raises(SystemExit):
            train.parse_args([*bad, *out])
        assert said in capsys.readouterr().err

def test_adaptive_entropy_coefficient_by_hand():
    """Skywork-OR1: c += delta below the target, -= above, clipped to [0, cap]."""
    from rl import controllers
    rule = controllers.adaptive_coef
    assert rule(0.0, 0.1, 0.2, 0.005, 0.05) == 0.005
    assert rule(0.01, 0.3, 0.2, 0.005, 0.05) == pytest.approx(0.005)
    assert rule(0.002, 0.3, 0.2, 0.005, 0.05) == 0.0                      # not below 0
    assert rule(0.049, 0.1, 0.2, 0.005, 0.05) == 0.05                     # not above the cap
    assert rule(0.01, 0.2, 0.2, 0.005, 0.05) == 0.01                      # at the target: stays
    c = controllers.AdaptiveEntropy({"entropy_target": 0.2, "entropy_coef_delta": 0.01, "entropy_coef_max": 0.015},
                               losses.make_algo("grpo", entropy_coef=0.001))
    assert c.value() == 0.001 and c.knob == "entropy_coef"
    for entropy, want in ((0.1, 0.011), (0.1, 0.015), (0.5, 0.005)):
        c.after_step({"entropy": entropy})
        assert c.value() == pytest.approx(want)
    fresh = controllers.AdaptiveEntropy({"entropy_target": 0.2, "entropy_coef_delta": 0.01, "entropy_coef_max": 0.05},
                                   losses.make_algo("grpo"))
    fresh.load_state_dict(c.state_dict())
    assert fresh.value() == c.value()
    assert not controllers.AdaptiveEntropy.is_on({"entropy_target": 0.0})


def test_an_adaptive_entropy_coefficient_moves_and_resumes(tmp_path, small_data, capsys):
    """--entropy-target (Skywork-OR1's adaptive entropy control, rl/controllers.py): the entropy is
    below the target, so the coefficient rises by --entropy-coef-delta each step up to
    --entropy-coef-max; it is logged, saved in the checkpoint and restored by --resume (the resumed
    run's coefficients are the uninterrupted run's). Its options are inert without it."""
    flags = ("--algo", "grpo", "--eval-every", "0", "--no-signal", "step", "--entropy-target", "100",
             "--entropy-coef-delta", "0.01", "--entropy-coef-max", "0.015")
    full = run(tmp_path / "full", small_data, *flags, steps=3)
    assert [m["entropy_coef"] for m in full] == [0.0, 0.01, 0.015]
    assert "entropy_bonus" not in full[0] and full[1]["entropy_bonus"] > 0
    run(tmp_path / "cut", small_data, *flags, steps=2)                    # saved after step 2
    extra = torch.load(tmp_path / "cut" / "ckpt" / "state.pt", weights_only=False)["extra"]
    assert extra["controllers"] == {"adaptive-entropy": {"coef": 0.015}}
    resumed = run(tmp_path / "cut", small_data, *flags, "--resume", steps=3)
    assert [m["entropy_coef"] for m in resumed] == [0.0, 0.01, 0.015]
    assert [m["reward"] for m in resumed] == [m["reward"] for m in full]  # the same tokens sampled
    for bad in (["--entropy-coef-delta", "0.01"], ["--algo", "sft", "--entropy-target", "0.2"]):
        with pytest.raises(SystemExit):
            train.parse_args([*bad, "--out", str(tmp_path / "x")])
    assert "cannot act" in capsys.readouterr().err


@pytest.mark.parametrize("algo", [a for a in losses.ALGOS if a not in ("erpo", "grpo")])
def test_every_algorithm_trains(tmp_path, small_data, algo):
    """Each row's whole loss runs: --no-signal step takes both optimizer steps whatever the 8 sampled
    groups' rewards (the default's skipping: tests/test_no_signal.py)."""
    ms = run(tmp_path, small_data, "--algo", algo, "--eval-every", "0", "--no-signal", "step", steps=1)
    m = ms[-1]
    assert m["step"] == 1 and KEYS <= set(m)
    spec = losses.ALGOS[algo]
    assert ("policy_kl" in m) == (spec.kl is not None)     # a reference model only where the loss reads it
    assert ("weight_mean" in m) == (spec.weights != "none")
    if spec.dynamic_sampling:
        assert "kept_groups" in m and "resample_rounds" in m


def test_a_surrogate_registered_from_outside_trains(tmp_path, small_data):
    """A new policy-gradient surrogate is a function and a row of losses.SURROGATES: registered
    here with the one public call (extension.register, no monkeypatching), --surrogate picks it (the flag's choices are the table), its loss is the one trained, its
    statistic is logged, and the knobs it does not read are inert (an error on the command line)."""
    calls = []

    def vanilla_pg(logp, old_logp, advantages, mask, algo):   # REINFORCE with the ratio, unclipped
        calls.append(logp.shape)
        ratio = torch.exp(logp - old_logp)
        return losses.Surrogate(-advantages[:, None] * ratio, ratio.detach(), {"big_ratio": ratio > 2})
    extension.register(losses.SURROGATES, "vanilla", losses.SurrogateRow(vanilla_pg, frozenset(), ("big_ratio",)))
    try:
        ms = run(tmp_path, small_data, "--algo", "grpo", "--surrogate", "vanilla", "--eval-every", "0",
                 "--no-signal", "step", steps=1)
        assert calls and ms[-1]["step"] == 1 and ms[-1]["big_ratio"] == 0 and math.isfinite(ms[-1]["loss"])
        assert "clip_frac" not in ms[-1]                       # PPO's statistics are PPO's
        with pytest.raises(SystemExit):                        # it reads no clip range: --eps-high is inert
            train.parse_args(["--surrogate", "vanilla", "--eps-high", "0.28", "--out", str(tmp_path / "y")])
    finally:
        extension.unregister(losses.SURROGATES, "vanilla")
    with pytest.raises(SystemExit):                            # unregistered: an argparse error
        train.main(["--surrogate", "nope", "--out", str(tmp_path / "x")])


def test_group_size_16_and_code_weights(tmp_path, small_data):
    ms = run(tmp_path, small_data, "--algo", "erpo", "--group-size", "16", "--weights", "code",
             "--eval-every", "0", steps=1)
    assert ms[-1]["weight_min"] > 0


def test_derived_sizes_and_bad_input(capsys, tmp_path, small_data):
    with pytest.raises(SystemExit, match="multiple of --update-batch"):
        train.main(["--train-data", small_data, "--out", str(tmp_path), "--rollout-batch", "6",
                    "--update-batch", "4"])
    with pytest.raises(SystemExit):
        train.main(["--algo", "nope"])


def test_loss_knobs_are_flags_and_inert_ones_are_errors(capsys, tmp_path):
    """Every losses.Algo field is a flag; one that cannot act on the algorithm is an argparse
    error (exit 2), given on the command line or set by a config file for its own algorithm (one
    rule wherever a value comes from, issue #50)."""
    for argv, inert in ((["--algo", "erpo", "--kl", "k2"], "--kl"),
                        (["--algo", "grpo", "--weight-clip", "0.5", "1.5"], "--weight-clip"),
                        (["--algo", "grpo", "--qkl-estimator", "k2"], "--qkl-estimator"),
                        (["--algo", "erpo", "--overlong-cache", "8"], "--overlong-cache")):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{inert} cannot act on --algo {argv[1]}" in err, err
    _, algo = train.parse_args(["--algo", "erpo", "--kl", "k2", "--beta", "0.02"])  # ERPO + Policy-KL
    assert algo.kl == "k2" and algo.beta == 0.02 and algo.has_policy_kl_loss
    _, algo = train.parse_args(["--algo", "erpo", "--weight-clip", "0.5", "1.5"])
    assert algo.weight_clip == (0.5, 1.5)
    _, algo = train.parse_args(["--algo", "dapo", "--overlong-cache", "8", "--dual-clip", "0"])
    assert algo.overlong_cache == 8 and algo.dual_clip is None
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"algo": "erpo", "kl": "k2", "beta": 0.02, "weight_clip": [0.5, 1.5], "steps": 3}))
    args, algo = train.parse_args(["--config", str(cfg), "--algo", "erpo"])
    assert args.steps == 3 and algo.kl == "k2" and algo.beta == 0.02 and algo.weight_clip == (0.5, 1.5)
    cfg.write_text(json.dumps({"algo": "erpo", "kl": "k2", "steps": 3}))      # k2 without beta: inert
    with pytest.raises(SystemExit):
        train.parse_args(["--config", str(cfg)])
    assert f"--config {cfg}: kl cannot act on --algo erpo as configured" in capsys.readouterr().err
    cfg.write_text('{"steps": 3,}')
    with pytest.raises(SystemExit):
        train.parse_args(["--config", str(cfg)])
    assert "c.json:1: not valid JSON" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a config's loss knobs
# They apply only to the algorithm the config names ("algo"); run with another, those that would
# change its loss are refused in one line that names them and the fixes (each of which parses).

CONFIGS = sorted(os.path.join(ROOT, "configs", f) for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".json"))


def parse_error(capsys, argv):
    """train.parse_args on argv that must be refused -> its one error line."""
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def suggested(line, lead) -> list[str]:
    """The flags a refusal suggests after `lead`, e.g. "to keep them give them on the command line"."""
    m = re.search(re.escape(lead) + r" \((--[^)]*)\)", line)
    return m.group(1).split() if m else []


def resolved_knobs(config_path, algo, capsys, extra=()):
    """-> (the losses.Algo a run resolves, None) or (None, the refusal line)."""
    try:
        return train.parse_args(["--config", config_path, "--algo", algo, *extra])[1], None
    except SystemExit:
        return None, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("algo", list(losses.ALGOS))
@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_a_configs_loss_knobs_apply_only_to_its_own_algorithm(capsys, config, algo):
    with open(config) as f:
        cfg = json.load(f)
    knobs = {k: v for k, v in cfg.items() if k in {name for name, *_ in options.algo_knobs()}}
    resolved, line = resolved_knobs(config, algo, capsys)
    if cfg.get("algo") == algo:                          # the config's own: every knob applies
        assert resolved == losses.make_algo(algo, **knobs)
        return
    row = losses.ALGOS[algo]
    inherited = {k for k, v in knobs.items() if not options.is_rows_own(algo, k, v)}
    if resolved is not None:                             # nothing inherited that could act: the row's own
        assert resolved == row
        return
    named = re.findall(r"(\w+) (\S+(?: \S+)?) \(" + re.escape(algo) + r": ", line)
    assert named and {k for k, _ in named} <= inherited, line
    for k, _ in named:
        assert f"{k} {options.knob_text(k, knobs[k])} ({algo}: {options.knob_text(k, getattr(row, k))})" in line
    drop = suggested(line, f"to drop them give {algo}'s")
    keep = suggested(line, "to keep them give them on the command line")
    assert drop and keep, line
    assert resolved_knobs(config, algo, capsys, drop)[0] == row          # the suggested fixes parse
    kept = resolved_knobs(config, algo, capsys, keep)[0]
    assert kept is not None
    assert all(getattr(kept, k) == getattr(losses.make_algo(algo, **{k: knobs[k]}), k)
               for k, _ in named if f"--{k.replace('_', '-')}" in keep)


def write_config(tmp_path, **values):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_grpos_knobs_in_a_config_run_as_erpo_are_refused_and_each_fix_works(capsys, tmp_path):
    """The fuzz sweep's case: a config spelling out GRPO's loss trains GRPO under the name erpo."""
    cfg = write_config(tmp_path, kl="k3", beta=0.01, alpha=0, weights="none", steps=3)
    line = parse_error(capsys, ["--config", cfg, "--algo", "erpo"])
    assert (f"error: --config {cfg} sets loss knobs of another algorithm (it names no algorithm, this run is "
            "--algo erpo): alpha 0 (erpo: 0.01), beta 0.01 (erpo: 0), kl k3 (erpo: none), weights none "
            "(erpo: paper); ") in line, line
    assert f'or add "algo": "erpo" to {cfg}' in line
    _, kept = train.parse_args(["--config", cfg, "--algo", "erpo", *suggested(line, "to keep them give them "
                                                                               "on the command line")])
    assert kept == losses.ALGOS["grpo"]                  # what the config spells out, said on the command line
    args, dropped = train.parse_args(["--config", cfg, "--algo", "erpo", *suggested(line, "to drop them give "
                                                                                        "erpo's")])
    assert dropped == losses.ALGOS["erpo"] and args.steps == 3
    _, own = train.parse_args(["--config", write_config(tmp_path, algo="erpo", kl="k3", beta=0.01, alpha=0,
                                                        weights="none")])
    assert own == losses.ALGOS["grpo"]                   # "algo" in the config: its knobs are its own


def test_config_knobs_that_cannot_act_are_dropped_and_pairs_that_can_are_refused(capsys, tmp_path):
    # k2 cannot act on erpo (beta 0), with the config's values or the row's: the row's stands
    args, algo = train.parse_args(["--config", write_config(tmp_path, kl="k2", steps=3), "--algo", "erpo"])
    assert algo == losses.ALGOS["erpo"] and args.kl is None and args.steps == 3   # config.json: the row's
    # no Policy-KL for grpo, said twice: each is inert given the other, the pair is not
    cfg = write_config(tmp_path, kl="none", beta=0)
    line = parse_error(capsys, ["--config", cfg, "--algo", "grpo"])
    assert "beta 0 (grpo: 0.01), kl none (grpo: k3)" in line
    keep = suggested(line, "to keep them give them on the command line")
    assert len(keep) == 2                                 # one of the two is enough (both: refused as inert)
    _, algo = train.parse_args(["--config", cfg, "--algo", "grpo", *keep])
    assert not algo.has_policy_kl_loss
    # an acting knob in a config without "algo", run with the default algorithm
    line = parse_error(capsys, ["--config", write_config(tmp_path, weight_clip=[0.5, 1.5])])
    assert "weight_clip 0.5 1.5 (erpo: 0 2)" in line and "--weight-clip 0.5 1.5" in line


def test_a_knob_on_the_command_line_at_the_rows_own_value_is_accepted(capsys):
    for argv in (["--algo", "grpo", "--alpha", "0"], ["--algo", "erpo", "--kl", "none"],
                 ["--algo", "erpo", "--kl", "none", "--beta", "0"], ["--algo", "drgrpo", "--dual-clip", "0"]):
        _, algo = train.parse_args(argv)
        assert algo == losses.ALGOS[argv[1]], argv
    assert "--kl cannot act on --algo erpo" in parse_error(capsys, ["--algo", "erpo", "--kl", "k3"])


def test_qkl_ref_that_cannot_act_is_an_error(capsys):
    line = parse_error(capsys, ["--algo", "grpo", "--qkl-ref", "live"])
    assert "--qkl-ref live cannot act on --algo grpo as configured: alpha=0" in line
    for argv in (["--algo", "grpo", "--qkl-ref", "cache"], ["--algo", "erpo", "--qkl-ref", "live"],
                 ["--algo", "grpo", "--alpha", "0.01", "--qkl-ref", "live"]):
        assert train.parse_args(argv)[0].qkl_ref == argv[-1]


def _torchrun(nproc, out, data, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master-port",
           str(29500 + nproc + os.getpid() % 1000), os.path.join(ROOT, "train.py"),
           "--model", WARM, "--train-data", data, "--out", str(out), "--steps", "2", "--algo", "erpo",
           "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
           "--gen-batch", "8", "--max-new-tokens", "48", "--eval-data", "tiny-test",
           "--eval-limit", "9", "--eval-every", "2", "--save-every", "0", "--lr", "1e-3", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_processes_equal_one_over_the_same_global_batch(tmp_path, small_data):
    """DDP and FSDP2 (+ activation checkpointing, a sharded reference) on 2 ranks (gloo) reproduce
    one process: same rollouts (per-row seeds), same update (global loss denominators), same
    metrics (each float within its measured tolerance), Query-KL 0 up to rounding at step 1. 9 eval
    problems: one rank gets fewer."""
    one = _torchrun(1, tmp_path / "one", small_data)
    assert_rounding("train.torchrun_step1_query_kl", one[1]["query_kl"], 0.0)  # the cache: the training forward
    for name, extra in (("ddp", ()), ("fsdp", ("--fsdp", "true", "--grad-ckpt", "true"))):
        two = _torchrun(2, tmp_path / name, small_data, *extra)
        assert len(one) == len(two) == 3
        assert_rounding("train.torchrun_step1_query_kl", two[1]["query_kl"], 0.0)
        for a, b in zip(one, two):
            for k, v in a.items():
                if k in ("step_time", "lr") or k.startswith("time_") or k.endswith("_per_s") or not isinstance(v, float):
                    continue
                if is_exact(k):
                    assert b[k] == v, (name, a["step"], k)
                else:
                    assert_rounding(f"train.{name}_vs_one_process.{k}", b[k], v)


def test_sft_is_deterministic_and_every_prefix_is_a_run(tmp_path):
    """The warm start is regenerated by one command: the same command gives the same weights,
    and (constant LR after warm-up) step k of a longer run equals a run of k steps."""
    from safetensors.torch import load_file

    with open(os.path.join(ROOT, "data", "tinymath", "test.jsonl")) as f:
        rows = [next(f) for _ in range(32)]  # any rows with problem + solution will do
    (tmp_path / "sft.jsonl").write_text("".join(rows))
    base = ["--algo", "sft", "--model", WARM, "--sft-data", str(tmp_path / "sft.jsonl"),
            "--sft-batch", "8", "--micro-batch", "4", "--sft-warmup", "2", "--eval-data", "tiny-test",
            "--eval-limit", "4"]
    train.main(base + ["--out", str(tmp_path / "a"), "--sft-steps", "2", "--export", str(tmp_path / "a2")])
    train.main(base + ["--out", str(tmp_path / "b"), "--sft-steps", "4", "--save-every", "2",
                       "--export", str(tmp_path / "b4")])
    a2 = load_file(str(tmp_path / "a2" / "model.safetensors"))
    b2 = load_file(str(tmp_path / "b" / "sft-00002" / "model.safetensors"))
    b4 = load_file(str(tmp_path / "b4" / "model.safetensors"))
    warm = load_file(os.path.join(WARM, "model.safetensors"))
    assert all(torch.equal(a2[k], b2[k]) for k in a2)
    assert any(not torch.equal(a2[k], b4[k]) for k in a2)
    assert any(not torch.equal(a2[k], warm[k]) for k in a2)
    losses_ = [json.loads(line)["sft_loss"] for line in open(tmp_path / "b" / "metrics.jsonl") if "sft_loss" in line]
    assert len(losses_) == 4 and all(x > 0 for x in losses_)


def test_microbatch_plan_by_rows_tokens_and_count():
    from plumbing import batching

    lens = [5, 40, 12, 40, 7, 30, 1, 22]
    plan = batching.microbatch_plan(lens, size=3)
    assert sorted(i for mb in plan for i in mb) == list(range(8))        # every row once
    assert [len(mb) for mb in plan] == [3, 3, 2]
    assert [[lens[i] for i in mb] for mb in plan] == [[40, 40, 30], [22, 12, 7], [5, 1]]  # longest first
    plan = batching.microbatch_plan(lens, size=8, max_tokens=80)
    assert all(len(mb) * max(lens[i] for i in mb) <= 80 for mb in plan)
    assert batching.microbatch_plan([100, 3], size=8, max_tokens=50) == [[0], [1]]  # too long: alone
    even = batching.microbatch_plan(lens, size=8, count=5)                # FSDP2: as many as the busiest rank
    assert len(even) == 5 and sorted(i for mb in even for i in mb) == list(range(8))
    with pytest.raises(ValueError):
        batching.microbatch_plan([1, 2], size=8, count=3)
    # Groups of 2 rows sharing a prompt stay whole and in order; ordered by their longest row.
    grouped = batching.microbatch_plan(lens, size=4, group=2)
    assert grouped == [[0, 1, 2, 3], [4, 5, 6, 7]]                        # groups of longest 40, 40, then 30, 22
    assert batching.microbatch_plan(lens, size=8, max_tokens=100, group=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_sft_with_eval_every_0_evaluates_nothing(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train.sft, "heldout_at_temperatures", lambda *a, **k: calls.append(1) or {})
    with open(os.path.join(ROOT, "data", "tinymath", "test.jsonl")) as f:
        (tmp_path / "sft.jsonl").write_text("".join(next(f) for _ in range(8)))
    train.main(["--algo", "sft", "--model", WARM, "--sft-data", str(tmp_path / "sft.jsonl"), "--sft-batch", "4",
                "--sft-steps", "2", "--save-every", "1", "--eval-every", "0", "--out", str(tmp_path / "o")])
    assert not calls and (tmp_path / "o" / "sft-00002").is_dir()


@pytest.mark.parametrize("script", ["train.py", "evaluate.py", "analysis.py"])
def test_a_bad_flag_is_one_line(script):
    """Not the ~50-line usage block first: one line naming the flag (under torchrun every rank would
    print it, before torchrun's own report of the failed worker)."""
    needed = {"evaluate.py": ["--model", "m"], "analysis.py": ["runs", "r"]}.get(script, [])
    r = subprocess.run([sys.executable, script, *needed, "--bogus"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"{script}: error: unrecognized arguments: --bogus"], r.stderr
