"""Tests for evaluate.py: the pass@k estimator against brute force, the temperature-bucket /
benchmark-average layout and maj@n on hand-made records, and an end-to-end sweep (with resume) on
a tiny random Qwen2."""

import itertools
import json
import os

import pytest

import evaluate as E

# ----------------------------------------------------------------------------- pass@k


def brute_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (c correct) that hold at least one correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert E.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_pass1_is_mean():
    assert E.pass_at_k(10, 3, 8) == 1.0  # n - c = 7 < k
    assert E.pass_at_k(10, 0, 5) == 0.0
    assert E.pass_at_k(32, 1, 32) == 1.0
    for n, c in [(1, 0), (1, 1), (7, 3), (32, 5)]:
        assert E.pass_at_k(n, c, 1) == pytest.approx(c / n)  # avg@n = unbiased pass@1
    # Large n stays finite and exact-ish (product form, no huge binomials).
    assert E.pass_at_k(1000, 1, 10) == pytest.approx(10 / 1000)
    with pytest.raises(ValueError):
        E.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        E.pass_at_k(4, 1, 5)


# ----------------------------------------------------------------------------- summaries


def recs(model, bench, pid, t, correct, extracted=None):
    extracted = extracted or [None] * len(correct)
    return [{"model": model, "benchmark": bench, "id": pid, "temperature": t, "sample": i,
             "correct": c, "extracted": e} for i, (c, e) in enumerate(zip(correct, extracted))]


def test_summary_buckets_and_benchmark_average():
    # Two benchmarks, temperatures 0.5, 1.0, 1.2, 1.5; 2 problems each, n = 4.
    # Accuracy of benchmark A at T: problem p1 all correct, p2 has c(T) correct of 4.
    cA = {0.5: 4, 1.0: 2, 1.2: 1, 1.5: 0}
    cB = {0.5: 2, 1.0: 2, 1.2: 0, 1.5: 0}
    records = []
    for t in cA:
        records += recs("m", "A", "p1", t, [1, 1, 1, 1])
        records += recs("m", "A", "p2", t, [1] * cA[t] + [0] * (4 - cA[t]))
        records += recs("m", "B", "q1", t, [0, 0, 0, 0])
        records += recs("m", "B", "q2", t, [1] * cB[t] + [0] * (4 - cB[t]))
    records += recs("m", "A", "p1", 1.0, [0, 0, 0, 0, 0])[4:]  # a 5th sample: ignored at n=4
    s = E.summarize(records, ks=[1, 2, 4], n=4)
    res = s["results"]["m"]
    accA = {t: (1 + cA[t] / 4) / 2 for t in cA}
    accB = {t: (0 + cB[t] / 4) / 2 for t in cB}
    for t in cA:
        row = res["A"]["by_temperature"][f"{t:g}"]
        assert row["avg@4"] == pytest.approx(accA[t])
        assert row["pass@1"] == pytest.approx(accA[t])
        assert row["pass@4"] == pytest.approx((1 + (cA[t] > 0)) / 2)
        assert row["pass@2"] == pytest.approx((1 + E.pass_at_k(4, cA[t], 2)) / 2)
        assert row["num_problems"] == 2
        # Avg. = unweighted mean over the two benchmarks, per temperature.
        assert res["Avg."]["by_temperature"][f"{t:g}"]["avg@4"] == \
            pytest.approx((accA[t] + accB[t]) / 2)
    mean = res["A"]["mean"]
    assert mean["all"]["avg@4"] == pytest.approx(sum(accA.values()) / 4)
    assert mean["<=1.0"]["avg@4"] == pytest.approx((accA[0.5] + accA[1.0]) / 2)
    assert mean["1.2-1.5"]["avg@4"] == pytest.approx((accA[1.2] + accA[1.5]) / 2)
    avg_low = ((accA[0.5] + accA[1.0]) / 2 + (accB[0.5] + accB[1.0]) / 2) / 2
    assert res["Avg."]["mean"]["<=1.0"]["avg@4"] == pytest.approx(avg_low)
    assert s["benchmarks"] == ["A", "B"] and s["temperatures"] == [0.5, 1.0, 1.2, 1.5]
    # Filtering by temperature changes the buckets: only 1.2 left in "1.2-1.5", nothing <= 1.0.
    s2 = E.summarize(records, ks=[1], n=4, temperatures=[1.2])
    assert s2["results"]["m"]["A"]["mean"]["1.2-1.5"]["avg@4"] == pytest.approx(accA[1.2])
    assert s2["results"]["m"]["A"]["mean"]["<=1.0"] == {}
    # The table shows these numbers (in %).
    table = E.write_table(s)
    assert f"{100 * mean['all']['avg@4']:.1f}" in table and "1.2-1.5" in table


def test_majority_vote():
    # "27", "27.0" and " 027" vote together (3 votes) and beat "5" (2 votes): correct.
    ex = ["5", "27", "27.0", "5", " 027", None]
    co = [0, 1, 1, 0, 1, 0]
    assert E.majority_correct(ex, co) == 1.0
    # Wrong majority: "5" x3 beats the correct "27" x2.
    assert E.majority_correct(["5", "27", "5", "27", "5"], [0, 1, 0, 1, 0]) == 0.0
    # Tie: the answer seen first wins.
    assert E.majority_correct(["27", "5", "5", "27"], [1, 0, 0, 1]) == 1.0
    assert E.majority_correct(["5", "27", "27", "5"], [0, 1, 1, 0]) == 0.0
    # No answers at all: wrong. Missing answers do not vote.
    assert E.majority_correct([None, None], [0, 0]) == 0.0
    assert E.majority_correct([None, None, None, "\\frac{1}{2}"], [0, 0, 0, 1]) == 1.0
    # Answers vote under the grader's normaliser (one for the whole repo): \dfrac12, \frac{1}{2},
    # x = 1/2's right-hand side and \left/\right spacing all vote together, as the grader reads them.
    ex = ["\\dfrac12", "3", "\\frac{1}{2}", "3", "x = \\frac{1}{2}"]
    assert E.majority_correct(ex, [1, 0, 1, 0, 1]) == 1.0
    assert E.majority_correct(["(1,2)", "5", "\\left( 1, 2 \\right)"], [1, 0, 1]) == 1.0
    import reward
    for a, b in (("\\dfrac12", "\\frac{1}{2}"), ("x=5", "5"), ("5\\text{ cm}", "5")):
        assert reward.normalize(a) == reward.normalize(b) and reward.grade(a, b)
    # maj@n in a summary: problem 1 majority right, problem 2 majority wrong -> 0.5.
    r = recs("m", "A", "p1", 1.0, [1, 1, 0], ["3", "3", "4"]) + \
        recs("m", "A", "p2", 1.0, [1, 0, 0], ["3", "4", "4"])
    assert E.summarize(r, n=3)["results"]["m"]["A"]["by_temperature"]["1"]["maj@3"] == 0.5


# ----------------------------------------------------------------------------- end to end


def make_tiny_model(folder):
    """A random 2-layer Qwen2 with a character-level tokenizer, saved as an HF folder."""
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=1,
                      pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("rollout")
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_end_to_end_sweep_and_resume(tmp_path, monkeypatch, tiny_model_dir):
    rollout = pytest.importorskip("rollout")
    pytest.importorskip("reward")
    model = tiny_model_dir
    bench = tmp_path / "mini.jsonl"
    bench.write_text("\n".join(json.dumps({"id": f"p{i}", "problem": f"{i}+{i}=?",
                                           "answer": str(2 * i)}) for i in range(3)) + "\n")
    out = tmp_path / "out"
    argv = ["--model", model, "--benchmarks", str(bench), "--temperatures", "0.7", "1.3",
            "--n", "2", "--k", "1", "2", "--max-new-tokens", "8", "--batch-size", "4",
            "--out", str(out), "--no-progress"]
    summary = E.main(argv)
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 3 * 2 * 2  # problems x temperatures x n
    assert {(r["id"], r["temperature"], r["sample"]) for r in samples} == \
        {(f"p{i}", t, j) for i in range(3) for t in (0.7, 1.3) for j in range(2)}
    # Each sample has its own seed: the n samples of a problem differ (random model, T >= 0.7).
    assert len({r["completion"] for r in samples}) >= 10
    for f in ("summary.json", "results.md", "accuracy_vs_temperature.png"):
        assert (out / f).stat().st_size > 0
    key = os.path.normpath(model)
    res = summary["results"][key]["mini"]["by_temperature"]
    for t in ("0.7", "1.3"):
        rs = [r for r in samples if f"{r['temperature']:g}" == t]
        assert res[t]["avg@2"] == pytest.approx(sum(r["correct"] for r in rs) / len(rs))
    assert json.loads((out / "summary.json").read_text())["n"] == 2

    # Resume after a kill: drop the last 5 samples (and leave half a line). Only those are
    # regenerated, and the per-sample seeds make them identical to the first run's.
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(lines[:-5]) + lines[-5][:10])
    calls = []
    real_sample = rollout.sample
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: calls.append(len(a[1])) or
                        real_sample(*a, **k))
    E.main(argv)
    assert sum(calls) == 5
    again = [r for r in read_jsonl_lenient(out / "samples.jsonl")]
    assert len(again) == 12
    by_key = {(r["id"], r["temperature"], r["sample"]): r["completion"] for r in again}
    assert by_key == {(r["id"], r["temperature"], r["sample"]): r["completion"] for r in samples}

    # A complete run resumes without generating anything (not even loading the model).
    from modeling import models
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("model loaded"))
    E.main(argv)
    assert sum(calls) == 5
    # Other generation settings into the same folder: refused with a one-line error.
    with pytest.raises(SystemExit):
        E.main(argv[:-3] + ["--max-new-tokens", "9", "--out", str(out), "--no-progress"])


def read_jsonl_lenient(path):
    return E.run_dir.read_jsonl(str(path))


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        E.main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "model path not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        E.main(["--model", str(tmp_path), "--benchmarks", "nope", "--out", str(tmp_path / "o")])
    assert "unknown benchmark" in capsys.readouterr().err


def test_torchrun_two_processes_give_the_one_process_sweep(tmp_path):
    """`torchrun --nproc_per_node=2 evaluate.py` splits the problems (3 + 2 here) and merges them
    into the samples.jsonl and summary.json of one process; a rerun resumes with nothing to do."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    warm = os.path.join(root, "data", "tinymath", "warmstart")
    args = ["evaluate.py", "--model", warm, "--labels", "warm", "--benchmarks", "tiny-test", "--limit", "5",
            "--temperatures", "0.7", "1.0", "--num-samples", "2", "--max-new-tokens", "24", "--batch-size", "4",
            "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port",
                str(29400 + os.getpid() % 1000)]
    for cmd, out in (([sys.executable], "one"), (torchrun, "two"), (torchrun, "two")):
        r = subprocess.run(cmd + args + ["--out", str(tmp_path / out)], cwd=root, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "all samples already" in r.stdout                                  # the rerun resumed
    assert not list((tmp_path / "two").glob("samples.rank*"))                # merged and removed
    recs = {o: {E.record_key(x): x["completion"] for x in read_jsonl(tmp_path / o / "samples.jsonl")}
            for o in ("one", "two")}
    assert len(recs["one"]) == 20 and recs["one"] == recs["two"]
    summaries = [json.loads((tmp_path / o / "summary.json").read_text()) for o in ("one", "two")]
    assert summaries[0] == summaries[1]


def test_prompts_that_do_not_fit_the_models_positions_stop_before_any_sampling(tmp_path, monkeypatch, capsys,
                                                                              tiny_model_dir):
    """The tiny model has 256 positions (one per character here): a 200-character problem with 64 new
    tokens, or a 300-character one alone, is named with the count, the longest prompt and the fix."""
    rollout = pytest.importorskip("rollout")
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: pytest.fail("sampled"))
    bench = tmp_path / "long.jsonl"
    problems = ["1+1=?", "x" * 200, "y" * 150]
    bench.write_text("".join(json.dumps({"id": f"p{i}", "problem": p, "answer": "2"}) + "\n"
                             for i, p in enumerate(problems)))
    argv = ["--model", tiny_model_dir, "--benchmarks", str(bench), "--temperatures", "1.0", "--n", "1",
            "--max-new-tokens", "64", "--out", str(tmp_path / "o"), "--no-progress"]
    with pytest.raises(SystemExit):
        E.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]                # (after transformers' loading bar)
    assert err.startswith("evaluate.py: error: benchmark long: 1 of 3 prompts")
    assert "256 positions with --max-new-tokens 64 (longest prompt 201 tokens): lower --max-new-tokens to 55" in err
    bench.write_text(bench.read_text() + json.dumps({"id": "p3", "problem": "z" * 300, "answer": "2"}) + "\n")
    with pytest.raises(SystemExit):
        E.main(argv[:-3] + ["--out", str(tmp_path / "o2"), "--no-progress"])
    err = capsys.readouterr().err
    assert "2 of 4 prompts" in err and "drop those problems (a prompt of 301 tokens alone exceeds" in err
    assert not (tmp_path / "o" / "samples.jsonl").exists() or not (tmp_path / "o" / "samples.jsonl").read_text()


def test_heldout_sets_of_a_training_run_are_checked_against_the_positions():
    """heldout_accuracy (train.py's periodic evaluation) refuses, before sampling, a set whose prompts
    plus the rollout's new tokens exceed the model's max_position_embeddings (512 for the tiny model)."""
    from evaluation import heldout
    from modeling import models
    import rollout
    from data.prompts import PromptSet
    model, tok = models.load_policy(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "data", "tinymath", "warmstart"))
    sets = {"ok": PromptSet([{"answer": "1"}], [[5] * 400]),
            "long": PromptSet([{"answer": "1"}] * 2, [[5] * 10, [5] * 480])}
    spec = rollout.SampleSpec(48, [2], 0)
    heldout.check_fits(model, {"ok": sets["ok"]}, 48)                  # 400 + 48 <= 512
    with pytest.raises(SystemExit) as e:
        heldout.heldout_accuracy(model, tok, sets, spec, temperature=1.0, seed=0)
    assert e.value.code == ("error: held-out set long: 1 of 2 prompts do not fit the model's 512 positions with "
                            "--max-new-tokens 48 (longest prompt 480 tokens): lower --max-new-tokens to 32, "
                            "or leave the set out")


def test_nccl_timeout_option():
    assert E.parse_args(["--model", "data"]).nccl_timeout == 120.0
    assert E.parse_args(["--model", "data", "--nccl-timeout", "30"]).nccl_timeout == 30.0
    with pytest.raises(SystemExit):
        E.parse_args(["--model", "data", "--nccl-timeout", "0"])
