"""No evaluation lost to a mistyped command (issues #20, #31): evaluate.py's resume key (every setting
that changes a sample, dtype included, a fingerprint of every byte of each model's weights, and the
version of each benchmark row), an --out that is no evaluation folder refused, flag values
refused before --out is made, models without a tokenizer or without weights refused in one line,
and Ctrl-C / SIGTERM ending a sweep with one line and a status that says so, the rerun finishing
it. All on the tiny warm-start model with a few samples."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

import analysis
import evaluate as E
from evaluation import heldout
from modeling import models
import rollout
from evaluation import eval_folder
from plumbing import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
# Two samples of one problem: the smallest sweep that writes something.
TINY = ["--benchmarks", "tiny-test", "--limit", "1", "--n", "2", "--temperatures", "1.0",
        "--max-new-tokens", "16", "--no-progress"]


def refusal(main, argv, capsys):
    """The exit status and the stderr lines of a command that must stop."""
    capsys.readouterr()                                         # (what the commands before it printed)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def copy_of_warm(folder):
    """A model folder of our own (the tests change its files)."""
    shutil.copytree(WARM, folder)
    return str(folder)


def retrain(folder):
    """What retraining does to a checkpoint's files: every weight moves, names and shapes stay."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    save_file({k: v + 1e-3 for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


def no_sampling(monkeypatch):
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: pytest.fail("sampled"))


def config_of(out):
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the resume key


def test_a_checkpoint_retrained_at_the_same_path_is_refused_not_reported_as_done(tmp_path, capsys,
                                                                                  monkeypatch):
    model, out = copy_of_warm(tmp_path / "ckpt"), str(tmp_path / "out")
    E.main(["--model", model, *TINY, "--out", out])
    retrain(model)
    no_sampling(monkeypatch)
    code, err = refusal(E.main, ["--model", model, *TINY, "--out", out], capsys)
    assert code == 2
    assert err == [f"evaluate.py: error: {out} holds samples of {os.path.normpath(model)} made from other "
                   "weights (its weight, config or tokenizer files changed since: retrained?); use another "
                   "--out, or another --labels name"]
    # Under a new name the retrained weights are sampled beside the old samples, which stay.
    monkeypatch.undo()
    summary = E.main(["--model", model, "--labels", "retrained", *TINY, "--out", out])
    assert summary["models"] == ["retrained"]
    records = E.run_dir.read_jsonl(os.path.join(out, "samples.jsonl"))
    assert sorted(r["model"] for r in records) == [os.path.normpath(model)] * 2 + ["retrained"] * 2


def test_another_dtype_is_refused_and_auto_is_the_dtype_it_resolves_to(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    E.main(["--model", WARM, *TINY, "--out", out])                   # --dtype auto: float32 on a CPU
    assert config_of(out)["dtype"] == "float32"
    assert list(config_of(out)["models"]) == [os.path.normpath(WARM)]
    no_sampling(monkeypatch)
    code, err = refusal(E.main, ["--model", WARM, *TINY, "--dtype", "bfloat16", "--out", out], capsys)
    assert code == 2
    assert err == [f"evaluate.py: error: {out} holds samples made with other settings: --dtype float32 "
                   "(now bfloat16); use another --out"]
    E.main(["--model", WARM, *TINY, "--dtype", "float32", "--out", out])  # the same dtype, named: all in
    assert "all samples already in" in capsys.readouterr().out


def test_a_refused_or_crashed_command_leaves_out_accepting_the_corrected_one(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    code, err = refusal(E.main, ["--model", WARM, *TINY, "--top-p", "1.5", "--out", out], capsys)
    assert (code, err) == (2, ["evaluate.py: error: --top-p must be in (0, 1], got 1.5"])
    assert not os.path.exists(out)

    # A command that crashes after writing config.json (here: while loading the model) sampled
    # nothing: the corrected command takes the folder over.
    def crash(*args, **kwargs):
        raise RuntimeError("crash")

    monkeypatch.setattr(heldout, "load_model", crash)
    with pytest.raises(RuntimeError, match="crash"):
        E.main(["--model", WARM, *TINY, "--top-p", "0.5", "--out", out])
    assert config_of(out)["top_p"] == 0.5
    monkeypatch.undo()
    E.main(["--model", WARM, *TINY, "--out", out])
    assert config_of(out)["top_p"] == 1.0
    assert len(E.run_dir.read_jsonl(os.path.join(out, "samples.jsonl"))) == 2
    # Now that samples are in, other settings are refused, and the refusal changes nothing.
    argv = ["--model", WARM, *TINY, "--top-p", "0.5", "--max-new-tokens", "8", "--out", out]
    code, err = refusal(E.main, argv, capsys)
    assert code == 2
    assert err == [f"evaluate.py: error: {out} holds samples made with other settings: --max-new-tokens 16 "
                   "(now 8), --top-p 1.0 (now 0.5); use another --out"]
    no_sampling(monkeypatch)
    E.main(["--model", WARM, *TINY, "--out", out])
    assert "all samples already in" in capsys.readouterr().out


def test_weights_that_do_not_load_are_one_line_and_the_repaired_model_is_accepted(tmp_path, capsys):
    """A truncated model.safetensors fails after config.json took its fingerprint; nothing was
    sampled, so the repaired file (another fingerprint) is evaluated into the same folder."""
    model, out = copy_of_warm(tmp_path / "ckpt"), str(tmp_path / "out")
    weights = os.path.join(model, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    code, err = refusal(E.main, ["--model", model, *TINY, "--out", out], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"evaluate.py: error: cannot load model {model!r}: ")
    shutil.copy(os.path.join(WARM, "model.safetensors"), weights)
    E.main(["--model", model, *TINY, "--out", out])
    assert len(E.run_dir.read_jsonl(os.path.join(out, "samples.jsonl"))) == 2


def test_only_samples_on_disk_make_a_folder_refuse(tmp_path):
    """check_config on hand-made folders: no samples (or none of that model) -> any key is taken;
    samples in samples.jsonl or in a killed torchrun sweep's rank file -> the key they were made
    under holds; a config.json that cannot be read refuses only a folder that has samples."""
    settings = {k: 1 for k in eval_folder.GENERATION_KEYS}
    out = str(tmp_path)
    eval_folder.write_config(out, settings, {"a": "fp-a"})
    eval_folder.check_config(out, {**settings, "top_p": 0.5}, {"a": "fp-new"})    # nothing sampled yet
    (tmp_path / "samples.rank1.jsonl").write_text(json.dumps({"model": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"other settings: --top-p 1 \(now 0.5\)"):
        eval_folder.check_config(out, {**settings, "top_p": 0.5}, {"a": "fp-a"})
    with pytest.raises(ValueError, match="samples of a made from other weights"):
        eval_folder.check_config(out, settings, {"a": "fp-new"})
    eval_folder.check_config(out, settings, {"a": "fp-a", "b": "fp-b"})          # b: a new model, nothing of it yet
    eval_folder.write_config(out, settings, {"b": "fp-b"})
    assert config_of(out)["models"] == {"a": "fp-a", "b": "fp-b"}      # a's fingerprint is kept
    (tmp_path / "config.json").write_text('{"top_p": 1, "mod')
    with pytest.raises(ValueError, match="config.json, the settings its samples were made under, cannot be"):
        eval_folder.check_config(out, settings, {"a": "fp-a"})
    os.remove(tmp_path / "samples.rank1.jsonl")
    eval_folder.check_config(out, settings, {"a": "fp-a"})
    # a config.json of before the seed scheme was recorded: its samples have other seeds
    (tmp_path / "samples.jsonl").write_text(json.dumps({"model": "a"}) + "\n")
    old = {k: v for k, v in settings.items() if k not in ("seed_scheme", "dtype")}
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="the seed scheme None"):
        eval_folder.check_config(out, settings, {"a": "fp-a"})
    eval_folder.check_config(out, {**settings, "seed_scheme": None}, {"a": "fp-a"})   # dtype: newer, any value


def test_a_finished_sweep_with_dtype_auto_rebuilds_its_tables_on_another_device(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    E.main(["--model", WARM, *TINY, "--out", out])
    config = {**config_of(out), "dtype": "bfloat16"}                     # as a GPU's --dtype auto wrote it
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    no_sampling(monkeypatch)
    E.main(["--model", WARM, *TINY, "--out", out])                       # here auto is float32: all in
    assert "all samples already in" in capsys.readouterr().out and config_of(out) == config
    code, err = refusal(E.main, ["--model", WARM, *TINY, "--dtype", "float32", "--out", out], capsys)
    assert code == 2 and "--dtype bfloat16 (now float32)" in err[0]     # named: still compared


def test_the_weights_fingerprint_follows_the_files_contents(tmp_path):
    """Same bytes at another path: the same fingerprint; retrained, another shard, or an edited config,
    tokenizer or chat template: another one.
    An FSDP2 checkpoint's dcp/ folder is read the same way (.metadata and shards); a hub id is itself."""
    a, b = copy_of_warm(tmp_path / "a"), copy_of_warm(tmp_path / "b")
    fp = eval_folder.weights_fingerprint(checkpoints.ModelSource(a))
    assert fp == eval_folder.weights_fingerprint(checkpoints.ModelSource(b))
    retrain(b)
    assert eval_folder.weights_fingerprint(checkpoints.ModelSource(b)) != fp
    for name in ("chat_template.jinja", "generation_config.json", "tokenizer.json", "config.json"):
        c = copy_of_warm(tmp_path / name)                                # what makes the prompt and its end
        with open(os.path.join(c, name), "a") as f:
            f.write("\n")
        assert eval_folder.weights_fingerprint(checkpoints.ModelSource(c)) != fp, name
    dcp = tmp_path / "run" / "ckpt" / "dcp"
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"layout" * 100)
    (dcp / "__0_0.distcp").write_bytes(os.urandom(100_000))
    src = checkpoints.ModelSource(WARM, str(dcp))
    assert [os.path.basename(p) for p in eval_folder.weight_files(src)] == [".metadata", "__0_0.distcp"]
    before = eval_folder.weights_fingerprint(src)
    assert eval_folder.weights_fingerprint(src) == before
    (dcp / "__0_0.distcp").write_bytes(os.urandom(100_000))        # retrained: every byte of the data moves
    assert eval_folder.weights_fingerprint(src) != before
    assert eval_folder.weights_fingerprint(checkpoints.ModelSource("Qwen/Qwen2.5-Math-7B")) == "hub:Qwen/Qwen2.5-Math-7B"


def tensor_spans(path):
    """{tensor name: (first byte, end)} in a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: (8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def flip_byte(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_tensor_edited_in_place_changes_the_fingerprint_whichever_it_is(tmp_path):
    """Every byte of every tensor counts: one byte flipped in the middle of any of the tiny model's 50
    tensors gives another fingerprint (the sampled reads of before missed most of them)."""
    model = copy_of_warm(tmp_path / "m")
    src, weights = checkpoints.ModelSource(model), os.path.join(model, "model.safetensors")
    fp, old = eval_folder.weights_fingerprint(src), eval_folder._sampled_fingerprint(src)
    spans, missed = tensor_spans(weights), 0
    assert len(spans) == 50
    for start, end in spans.values():
        flip_byte(weights, (start + end) // 2)
        assert eval_folder.weights_fingerprint(src) != fp
        missed += eval_folder._sampled_fingerprint(src) == old
        flip_byte(weights, (start + end) // 2)                         # back: the same bytes, the same print
        assert eval_folder.weights_fingerprint(src) == fp
    assert missed > 25


def test_weights_edited_in_place_are_refused_and_an_older_folders_fingerprint_still_checks(tmp_path, capsys,
                                                                                         monkeypatch):
    model, out = copy_of_warm(tmp_path / "ckpt"), str(tmp_path / "out")
    src, weights = checkpoints.ModelSource(model), os.path.join(model, "model.safetensors")
    E.main(["--model", model, *TINY, "--out", out])
    old = eval_folder._sampled_fingerprint(src)
    start, end = tensor_spans(weights)["model.layers.0.mlp.down_proj.weight"]
    unseen = (start + end) // 2
    flip_byte(weights, unseen)                                       # a byte the sampled reads miss
    assert eval_folder._sampled_fingerprint(src) == old
    no_sampling(monkeypatch)
    code, err = refusal(E.main, ["--model", model, *TINY, "--out", out], capsys)
    assert code == 2 and "made from other weights" in err[0] and len(err) == 1
    flip_byte(weights, unseen)
    # A folder an older evaluate.py made holds the sampled fingerprint: checked the way it was made
    config = config_of(out)
    config["models"][os.path.normpath(model)] = old
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    E.main(["--model", model, *TINY, "--out", out])
    assert "all samples already in" in capsys.readouterr().out
    retrain(model)
    code, err = refusal(E.main, ["--model", model, *TINY, "--out", out], capsys)
    assert code == 2 and "made from other weights" in err[0]


def test_an_edited_gold_answer_is_refused_not_kept_with_the_old_grades(tmp_path, capsys, monkeypatch):
    """Each sample names the version of its row: a benchmark file edited since is refused in one
    line and the samples stay; the file as it was is accepted again. Records of an older
    evaluate.py (no digest) are checked by the gold answer they stored."""
    bench, out = tmp_path / "mine.jsonl", tmp_path / "out"
    rows = [{"problem": "What is 2+3?", "answer": "5"}, {"problem": "What is 2*4?", "answer": "8"}]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model", WARM, *TINY, "--benchmarks", str(bench), "--limit", "2", "--out", str(out)]
    E.main(argv)
    samples = out / "samples.jsonl"
    kept = samples.read_bytes()
    bench.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "answer": "9"}) + "\n")
    no_sampling(monkeypatch)
    code, err = refusal(E.main, argv, capsys)
    assert (code, err) == (2, [f"evaluate.py: error: {out} holds samples of mine problem 1 made from another "
                               "version of its row (the file changed since: an edited gold answer or "
                               "problem?); use another --out"])
    assert samples.read_bytes() == kept
    older = [{k: v for k, v in r.items() if k != "row"} for r in E.run_dir.read_jsonl(samples)]
    samples.write_text("".join(json.dumps(r) + "\n" for r in older))
    assert refusal(E.main, argv, capsys)[0] == 2
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    E.main(argv)
    assert "all samples already in" in capsys.readouterr().out


def test_the_tables_are_of_the_problems_asked(tmp_path, monkeypatch):
    """A smaller --limit, or a row deleted from the file: its samples stay on disk, out of the tables."""
    bench, out = tmp_path / "mine.jsonl", tmp_path / "out"
    rows = [{"id": "a", "problem": "What is 2+3?", "answer": "5"},
            {"id": "b", "problem": "What is 2*4?", "answer": "8"}]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model", WARM, "--labels", "warm", *TINY, "--benchmarks", str(bench), "--out", str(out)]

    def problems(summary):
        return summary["results"]["warm"]["mine"]["by_temperature"]["1"]["num_problems"]

    assert problems(E.main(argv + ["--limit", "2"])) == 2
    no_sampling(monkeypatch)
    assert problems(E.main(argv + ["--limit", "1"])) == 1
    bench.write_text(json.dumps(rows[0]) + "\n")
    assert problems(E.main(argv)) == 1
    assert len(E.run_dir.read_jsonl(out / "samples.jsonl")) == 4


def fake_run(folder, steps=2):
    """What train.py leaves in its --out: its config.json and metrics (no model: enough to be a run)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"algo": "erpo", "lr": 2e-4, "template": "plain",
                                                    "max_new_tokens": 24, "seed": 0}, indent=2))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(steps + 1)))
    return folder


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_an_out_that_holds_a_training_run_or_anything_else_is_refused_and_left_as_it_was(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    model = tmp_path / "model"
    shutil.copytree(WARM, model)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    orphans = tmp_path / "orphans"
    orphans.mkdir()
    (orphans / "samples.jsonl").write_text(json.dumps({"model": "m"}) + "\n")
    cases = [(run, f"--out {run} holds a training run (metrics up to step 2): evaluate.py would replace its "
                   f"config.json; give the evaluation a folder of its own (e.g. --out {run / 'eval'})"),
             (model, f"--out {model} holds a config.json that is not evaluate.py's resume key (its keys: "
                     "architectures, attention_dropout, bos_token_id, ...); use another --out"),
             (notes, f"--out {notes} holds files evaluate.py does not write (todo.txt); use a new or empty "
                     "folder"),
             (orphans, f"--out {orphans} holds samples but not the config.json they were made under; "
                       "use another --out")]
    for out, message in cases:
        before = snapshot(out)
        assert refusal(E.main, ["--model", WARM, *TINY, "--out", str(out)], capsys) == \
            (2, [f"evaluate.py: error: {message}"])
        assert snapshot(out) == before
    damaged = fake_run(tmp_path / "damaged")            # a run whose config.json an older evaluate.py replaced
    (damaged / "config.json").write_text(json.dumps({"template": "plain", "max_new_tokens": 16, "models": {}}))
    assert "holds a training run (metrics up to step 2)" in refusal(E.main, ["--model", WARM, *TINY, "--out",
                                                                           str(damaged)], capsys)[1][0]
    (run / "metrics.jsonl").unlink()                    # a run that stopped before its first step
    assert "holds a training run (the files of a run" in refusal(E.main, ["--model", WARM, *TINY, "--out",
                                                                          str(run)], capsys)[1][0]
    E.main(["--model", WARM, *TINY, "--out", str(run / "eval")])      # a folder of its own: works
    (run / "eval" / "notes.txt").write_text("the user's own file beside the samples\n")
    E.main(["--model", WARM, *TINY, "--out", str(run / "eval")])
    assert "all samples already in" in capsys.readouterr().out


# ----------------------------------------------------------------------------- flag values

LIMIT = "--limit must be >= 1 (leave it out for every problem), got"
BAD_FLAGS = [
    (["--limit", "-1"], f"{LIMIT} -1"),
    (["--limit", "0"], f"{LIMIT} 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--temperatures", "0.5", "nan"], "--temperatures must be finite and >= 0, got [nan]"),
    (["--temperatures", "inf"], "--temperatures must be finite and >= 0, got [inf]"),
    (["--temperatures", "-0.5"], "--temperatures must be finite and >= 0, got [-0.5]"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--n", "0"], "--n must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--grade-timeout", "0"], "--grade-timeout must be a finite number of seconds > 0, got 0.0"),
    (["--grade-timeout", "inf"], "--grade-timeout must be a finite number of seconds > 0, got inf"),
    (["--k", "3"], "--k values must be in 1..n=2, got [3]"),
    (["--nccl-timeout", "nan"], "--nccl-timeout must be a finite number of minutes > 0, got nan"),
    (["--device", "gpu"], "--device 'gpu' is not a device (auto, cpu, cuda, cuda:1)"),
    (["--model", WARM, WARM, "--labels", "a", "a"],
     "--labels gives two models the name 'a': each needs its own"),
    (["--model", WARM, WARM + "/"],
     f"--model {WARM} is given twice (both would be stored under one name); drop one, or name them with "
     "--labels"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS,
                         ids=[" ".join(os.path.basename(x.rstrip("/")) for x in f) for f, _ in BAD_FLAGS])
def test_a_flag_value_outside_its_meaning_is_one_line_before_out_is_made(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = refusal(E.main, ["--model", WARM, *TINY, *flags, "--out", str(out)], capsys)
    assert (code, err) == (2, [f"evaluate.py: error: {message}"])
    assert not out.exists()


def test_analysis_nll_checks_the_same_flags_and_its_temperature(tmp_path, capsys):
    out = tmp_path / "out"
    nll = ["nll", "--model", WARM, "--limit", "1", "--no-progress", "--out", str(out)]
    for flags, message in ((["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
                           (["--limit", "-1"], f"{LIMIT} -1"),
                           (["--temperature", "nan"], "--temperature must be finite and >= 0, got nan")):
        code, err = refusal(analysis.main, nll + flags, capsys)
        assert (code, err) == (2, [f"analysis.py: error: {message}"])
    assert not out.exists()


def test_an_out_that_is_a_file_or_lies_under_one_is_one_line(tmp_path, capsys):
    taken = tmp_path / "results.md"
    taken.write_text("a file\n")
    for out, message in ((taken, f"--out {taken} is a file, not a folder"),
                         (taken / "eval", f"--out {taken / 'eval'} cannot be made: {taken} is a file")):
        code, err = refusal(E.main, ["--model", WARM, *TINY, "--out", str(out)], capsys)
        assert (code, err) == (2, [f"evaluate.py: error: {message}"])
    assert taken.read_text() == "a file\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = refusal(E.main, ["--model", WARM, *TINY, "--out", str(locked / "eval")], capsys)
    assert (code, err) == (2, [f"evaluate.py: error: --out {locked / 'eval'} cannot be made: {locked} "
                               "cannot be written"])


# ----------------------------------------------------------------------------- models


def test_a_model_folder_without_a_tokenizer_is_one_line_before_anything_is_written(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(WARM, f), bare / f)
    # (transformers would build an empty tokenizer here: every prompt zero tokens, then a traceback)
    why = (f"{bare} holds no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt, "
           "spiece.model): copy the tokenizer files of the model it was trained from into it")
    with pytest.raises(OSError) as e:                         # what train.py turns into its one line
        models.load_policy(str(bare))
    assert str(e.value) == why
    out = tmp_path / "out"
    assert refusal(E.main, ["--model", str(bare), *TINY, "--out", str(out)], capsys) == \
        (2, [f"evaluate.py: error: {why}"])
    nll = ["nll", "--model", str(bare), "--limit", "1", "--out", str(out)]
    assert refusal(analysis.main, nll, capsys) == (2, [f"analysis.py: error: {why}"])
    assert not out.exists()


def test_analysis_nll_with_a_folder_holding_no_model_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    nll = ["nll", "--model", str(empty), "--limit", "1", "--out", str(out)]
    code, err = refusal(analysis.main, nll, capsys)
    assert code == 2
    assert err == [f"analysis.py: error: {empty} is neither a model folder (config.json and *.safetensors) "
                   "nor a training checkpoint (a run folder, or its ckpt/ with state.pt)"]
    assert not out.exists()


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM


def complete_lines(path):
    """Records fully on disk (a line the writer is still writing does not count)."""
    try:
        with open(path) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def popen_interruptible(cmd, **kw):
    """Popen whose child takes SIGINT as from a terminal: under a test runner started in the
    background SIGINT is ignored, and children inherit that."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.signal(signal.SIGINT, previous)


def signal_once_sampling(procs, outs, timeout=300):
    """Send each process its signal as soon as its first chunk of samples is on disk (timeout: a
    watchdog for a process that never starts sampling, not a bound the test asserts)."""
    waiting, deadline = set(procs), time.time() + timeout
    while waiting and time.time() < deadline:
        for sig in list(waiting):
            if complete_lines(outs[sig] / "samples.jsonl") or procs[sig].poll() is not None:
                procs[sig].send_signal(sig)
                waiting.discard(sig)
        time.sleep(0.01)


def test_sigint_and_sigterm_stop_a_sweep_in_one_line_and_the_rerun_finishes_it(tmp_path, capsys):
    """A real `python evaluate.py` of 40 samples (20 chunks) is signalled once its first chunk is
    on disk: exit status 130 / 143, one line with the count of samples kept, no traceback; the
    same command then finishes with the summary and samples of an uninterrupted sweep."""
    argv = ["--model", WARM, "--labels", "warm", "--benchmarks", "tiny-test", "--limit", "10", "--n", "2",
            "--temperatures", "0.7", "1.0", "--max-new-tokens", "16", "--batch-size", "2", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = {sig: tmp_path / sig.name for sig in (signal.SIGINT, signal.SIGTERM)}
    procs = {sig: popen_interruptible([sys.executable, "evaluate.py", *argv, "--out", str(out)], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for sig, out in outs.items()}
    try:
        whole = E.main(argv + ["--out", str(tmp_path / "whole")])      # while they start: the sweep uncut
        signal_once_sampling(procs, outs)
        errs = {sig: p.communicate(timeout=300)[1] for sig, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for sig, err in errs.items():
        kept = complete_lines(outs[sig] / "samples.jsonl")
        assert procs[sig].returncode == 128 + sig, err[-3000:]
        assert "Traceback" not in err and 0 < kept < 40
        assert err.strip().splitlines()[-1] == \
            (f"evaluate.py: interrupted ({sig.name}): {kept} samples are in {outs[sig] / 'samples.jsonl'}; "
             "rerun the same command to continue")
    capsys.readouterr()
    uncut = E.run_dir.read_jsonl(tmp_path / "whole" / "samples.jsonl")
    for out in outs.values():
        assert E.main(argv + ["--out", str(out)]) == whole
        rerun = E.run_dir.read_jsonl(out / "samples.jsonl")
        assert len(rerun) == 40
        assert {E.record_key(r): r["completion"] for r in rerun} == \
            {E.record_key(r): r["completion"] for r in uncut}


def test_analysis_nll_interrupted_is_one_line_and_its_status(tmp_path, capsys, monkeypatch):
    """(In process: the helper evaluate.py uses too, whose real signals are the test above.) The
    SIGTERM handler is the script's only while it runs."""
    before = signal.getsignal(signal.SIGTERM)

    def ctrl_c(args):
        raise KeyboardInterrupt

    def sigterm(args):
        if signal.getsignal(signal.SIGTERM) is before:        # (the default would end pytest itself)
            pytest.fail("no SIGTERM handler while the command runs")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)                                        # (the handler raises before this ends)

    nll = ["nll", "--model", WARM, "--limit", "1", "--out", str(tmp_path / "out")]
    for stop, sig in ((ctrl_c, signal.SIGINT), (sigterm, signal.SIGTERM)):
        monkeypatch.setattr(analysis, "analyze_nll", stop)
        assert refusal(analysis.main, nll, capsys) == \
            (128 + sig, [f"analysis.py: interrupted ({sig.name}): nothing written (the results are written "
                         "at the end); rerun the command"])
    assert signal.getsignal(signal.SIGTERM) is before
