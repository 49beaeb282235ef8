"""Issue #50's data-loss and validation findings, each refused in one line before anything is
written: --export pointing at a run folder (plumbing/run_dir.export_overlap), a reference model
inside the run --overwrite removes (run_dir.read_refusal), a start of the adaptive
entropy coefficient above its bound (rl/controllers.py), --jobs 0 in the study commands; one rule
for an option from a flag, a --config file or an extension row (plumbing/options.py), extension rows
checked when loaded (plumbing/extension.py), empty values, pass@G, --plan-lengths files and absurd
lengths (plumbing/lengths_file.py, time_model.py)."""

import json
import os
import subprocess
import sys

import pytest

import losses
from plumbing import extension, lengths_file, options, run_dir, time_model
from rl import controllers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def a_run(folder, step=3):
    """A run folder as train.py leaves one: its config.json and metrics."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"algo": "erpo", "out": folder}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": step}) + "\n")
    return folder


def test_export_into_a_run_folder_is_refused(tmp_path):
    """The run's own --out, another run's folder, a run's own files (hf/, ckpt/...): refused, naming the
    folder; a folder of its own inside --out, a model folder written before, a new folder: fine."""
    run, new = a_run(str(tmp_path / "runs" / "erpo")), str(tmp_path / "runs" / "new")
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    for out, export, says in ((run, run, "is --out"), (new, new, "is --out"),
                              (new, run, "is the run folder"), (new, run + "/hf", "is hf/ of the run folder"),
                              (new, run + "/ckpt/x", "is inside ckpt/ of the run folder")):
        why = run_dir.export_overlap(export, out)
        assert why and says in why and "choose a folder outside it" in why, (export, why)
    for out, export in ((run, run + "/final"), (new, str(model)), (new, str(tmp_path / "models" / "n"))):
        assert run_dir.export_overlap(export, out) is None, export
    why = run_dir.refusal(run, resume=True, overwrite=False, export=run)
    assert why.startswith(f"--export {run} is --out")
    assert sorted(os.listdir(run)) == ["config.json", "metrics.jsonl"]                 # asked, nothing written


def test_a_reference_inside_the_run_that_overwrite_removes_is_refused(tmp_path):
    """--overwrite --qkl-ref-model <out>/ckpt removed the old run, that checkpoint included, and only
    then read the reference: refusal(reads=...) says so first; without --overwrite, or a model
    elsewhere (or a folder of the user's own in --out), it is fine."""
    run = a_run(str(tmp_path / "run"))
    os.makedirs(os.path.join(run, "ckpt"))
    os.makedirs(os.path.join(run, "mine"))
    reads = {"--qkl-ref-model": os.path.join(run, "ckpt")}
    why = run_dir.refusal(run, resume=False, overwrite=True, reads=reads)
    assert why.startswith(f"--qkl-ref-model {run}/ckpt is in the run that --overwrite would remove")
    assert run_dir.refusal(run, resume=True, overwrite=False, reads=reads) is None
    for other in (str(tmp_path), os.path.join(run, "mine"), None):
        assert run_dir.refusal(run, resume=False, overwrite=True, reads={"--qkl-ref-model": other}) is None


def test_an_entropy_coefficient_above_its_bound_is_refused_not_clipped():
    """--entropy-coef 0.1 --entropy-target 0.5 ran at 0.05 (the default --entropy-coef-max) while the
    printed settings said 0.1: now one line naming both flags, at parse time (refusal) and when made."""
    class Args:
        entropy_target, entropy_coef_delta, entropy_coef_max = 0.5, 0.005, 0.05
    algo = losses.make_algo("grpo", entropy_coef=0.1)
    why = controllers.refusal(Args, algo)
    assert "--entropy-coef 0.1 is above --entropy-coef-max 0.05" in why and "\n" not in why
    with pytest.raises(SystemExit, match="--entropy-coef-max 0.1 or more"):
        controllers.AdaptiveEntropy({"entropy_target": 0.5, "entropy_coef_delta": 0.005,
                                     "entropy_coef_max": 0.05}, algo)
    assert controllers.refusal(Args, losses.make_algo("grpo", entropy_coef=0.05)) is None   # at the bound
    Args.entropy_target = 0.0                                                # off: nothing to check
    assert controllers.refusal(Args, algo) is None


@pytest.mark.parametrize("study", ["headline", "long_run"])
def test_study_jobs_0_is_one_line_and_leaves_no_folder(tmp_path, study):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", f"study.{study}", "--jobs", "0", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"{study}.py: error: argument --jobs: must be >= 1 (runs at a time), got 0"]
    assert os.listdir(tmp_path) == []


def refused_at_parse(capsys, *argv) -> str:
    """train.py's one error line for argv (nothing loaded: the parser refuses)."""
    import train
    with pytest.raises(SystemExit) as e:
        train.parse_args(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("key, value, says", [
    ("lora_alpha", 32, "lora_alpha 32.0 cannot act without --lora-rank"),
    ("qkl_ref_decay", 0.5, "qkl_ref_decay 0.5 cannot act on --algo erpo as configured: it is an option of "
                           "another Query-KL reference than --qkl-ref cache"),
    ("entropy_coef_delta", 0.01, "entropy_coef_delta 0.01 cannot act on --algo erpo as configured: it is an "
                                 "option of 'adaptive-entropy'")])
def test_an_inert_key_in_a_config_is_refused_as_its_flag_is(tmp_path, capsys, key, value, says):
    """The flag was refused, the same key in a --config accepted (and did nothing): one rule now. Its
    default, or the key where it acts, is fine."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({key: value}))
    line = refused_at_parse(capsys, "--config", str(path))
    assert f"--config {path}: {says}" in line and line.endswith("or remove the key")
    flag = f"--{key.replace('_', '-')}"
    assert says.split(" cannot act")[1] in refused_at_parse(capsys, flag, str(value))   # the flag: the same
    import train
    path.write_text(json.dumps({key: train.parse_args([])[0].__dict__[key]}))          # its default: fine
    train.parse_args(["--config", str(path)])
    where = {"lora_alpha": ["--lora-rank", "4"], "qkl_ref_decay": ["--qkl-ref", "ema"],
             "entropy_coef_delta": ["--entropy-target", "0.5"]}[key]
    path.write_text(json.dumps({key: value}))
    train.parse_args(["--config", str(path), *where])


def test_empty_values_are_refused():
    """--out '' trained into runs/<algo>; --eval-data without a value evaluated nothing; a list that
    may be empty (--extensions: none) and a str whose '' means something (--query-cache-dir) are not
    refused."""
    assert "would train into runs/<algo>" in options.empty_value("out", "", None)
    assert "would evaluate nothing" in options.empty_value("eval_data", [], ["tiny-test"])
    assert "names nothing" in options.empty_value("export", "", None)
    for name, value, default in (("extensions", [], []), ("query_cache_dir", "", "~/.cache"), ("out", "x", None)):
        assert options.empty_value(name, value, default) is None


def test_pass_at_g_is_refused_up_front(capsys):
    """pass@k at k = G gives every group 0 (no variance): every step would end in the no-signal message,
    which blames equal rewards."""
    line = refused_at_parse(capsys, "--adv", "passk", "--passk-k", "8", "--group-size", "8")
    assert "--adv passk --passk-k 8 at --group-size 8: every group's advantages are 0" in line
    algo = losses.make_algo("grpo", adv="passk")
    assert options.never_a_signal(algo, 8, {"passk_k": 8})
    assert not options.never_a_signal(algo, 8, {"passk_k": 7})
    assert not options.never_a_signal(losses.make_algo("grpo"), 8, {})


def test_extension_rows_are_checked_when_loaded(capsys):
    """A row lacking what its table reads, or with a malformed option: refused by register, naming
    the row; an option named like train.py's (lr) or declared by two rows with other meanings:
    refused by the parser, however the modules were imported."""
    import train                                                     # (the tables declared)
    row = losses.AdvantageRow(losses.grpo_advantages, "grpo, mine")
    with pytest.raises(ValueError, match="extension row 'x' of --adv: it has no fn"):
        extension.register(losses.ADVANTAGES, "x", object())
    with pytest.raises(ValueError, match=r"its option \('My-K', 1, 'h'\) needs a lowercase name"):
        extension.register(losses.ADVANTAGES, "x", losses.AdvantageRow(row.fn, "x", OPTIONS=(("My-K", 1, "h"),)))
    assert extension.malformed("controllers", type("Rule", (), {"is_on": staticmethod(bool)})) == \
        "it has no value (value())"
    try:
        extension.register(losses.ADVANTAGES, "lr-row", losses.AdvantageRow(row.fn, "x", OPTIONS=(("lr", 1.0, "h"),)))
        line = refused_at_parse(capsys)                              # (train.py's prog: as it is run)
        assert "extension row 'lr-row' of --adv: its option 'lr' is " in line and "'s own --lr" in line
    finally:
        extension.unregister(losses.ADVANTAGES, "lr-row")
    losses.ADVANTAGES["a"] = losses.AdvantageRow(row.fn, "a", OPTIONS=(("my_k", 1, "a"),))   # as register
    losses.ADVANTAGES["b"] = losses.AdvantageRow(row.fn, "b", OPTIONS=(("my_k", 2, "b"),))   # does undeclared
    try:
        assert "both declare the option 'my_k'" in refused_at_parse(capsys)
    finally:
        extension.unregister(losses.ADVANTAGES, "a"), extension.unregister(losses.ADVANTAGES, "b")
    train.parse_args([])                                             # the shipped rows pass


def test_plan_lengths_files_are_read_or_refused_in_one_line(tmp_path):
    """A histogram with a negative count, or none at all, was planned from (negative probabilities,
    nan): refused. A run's metrics.jsonl whose rows are all cut (the tiny world's at 24 tokens) was
    refused: two points now, its mean and cut fraction exactly."""
    for hist, says in (({"20": 5, "30": -3}, "counts -3 prompts of 30 tokens"), ({"20": 0}, "counts no prompt"),
                       ({"0": 4}, "has a length of 0 tokens")):
        path = tmp_path / "h.json"
        path.write_text(json.dumps({"prompt": {"histogram": hist}}))
        with pytest.raises(SystemExit, match=says):
            lengths_file.read_lengths(str(path), 96)
    assert lengths_file.bad_histogram({20: 5.0, 21: 0.0}) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_new_tokens": 24}))
    for cut, mean in ((1.0, 24.0), (0.5, 20.0)):
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "response_len": mean,
                                                            "truncated_frac": cut}) + "\n")
        got = lengths_file.read_lengths(str(tmp_path / "metrics.jsonl"), 24)["response"]
        assert got.mean() == pytest.approx(mean) and got.truncated() == pytest.approx(cut)
        assert "as two points" in got.source


def test_an_absurd_length_is_not_modelled_in_host_memory():
    """--max-new-tokens 1e9 built float64 arrays of that length (22 GB, killed): the time model says it
    does not model it, in one line, without them."""
    import train
    args, _ = train.parse_args(["--dry-run", "--max-new-tokens", "1000000000"])
    line = time_model.report(args, 8, False, "h100")
    assert line.startswith("time model: not modelled: --max-prompt-len 128 + --max-new-tokens 1,000,000,000")
    assert "\n" not in line


def test_an_inert_loss_knob_in_a_config_for_its_own_algorithm_is_refused_as_its_flag_is(tmp_path, capsys):
    """--surrogate sapo --eps-high 0.5 was refused, the same two keys in a config of grpo's accepted
    (SAPO has no clip: eps_high did nothing)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algo": "grpo", "surrogate": "sapo", "eps_high": 0.5}))
    line = refused_at_parse(capsys, "--config", str(path))
    assert f"--config {path}: eps_high cannot act on --algo grpo as configured" in line
    assert line.endswith("or remove the keys")
    assert "--eps-high cannot act" in refused_at_parse(capsys, "--algo", "grpo", "--surrogate", "sapo",
                                                       "--eps-high", "0.5")
    import train
    path.write_text(json.dumps({"algo": "grpo", "surrogate": "gspo", "eps_high": 0.5}))   # where it acts
    assert train.parse_args(["--config", str(path)])[1].eps_high == 0.5


def test_a_config_key_the_command_line_leaves_idle_is_said_not_refused(capsys):
    """The released ERPO config run as GRPO with the loss knobs the foreign-knob message suggests:
    its qkl_ref live acts in the file (alpha 0.01) but not under --alpha 0 from the command line, so
    one note says so and the run is parsed (the config stays usable as a base); the same value given
    as a flag is refused."""
    import train
    config = os.path.join(ROOT, "configs", "released_qwen25_7b.json")
    drop = ["--agg", "token-mean", "--alpha", "0", "--dual-clip", "3", "--eps-high", "0.3", "--weights", "none"]
    args, algo = train.parse_args(["--config", config, "--algo", "grpo", *drop])
    assert algo == train.losses.ALGOS["grpo"] and args.qkl_ref == "live"
    out = capsys.readouterr().out
    assert "note: --config" in out and "qkl_ref live does not act" in out
    assert "--qkl-ref live cannot act" in refused_at_parse(capsys, "--config", config, "--algo", "grpo", *drop,
                                                           "--qkl-ref", "live")
