"""The --dry-run's time model (plumbing/time_model.py): its default lengths against issue #42's
review, its closed-form schedule against a replay of the code's own decode_pass and micro-batch plan
on sampled lengths, the --plan-lengths readers, its terms by hand, and a run's first steps against it
(plumbing/time_check.py: what train.py prints and logs at step 3 on a GPU, nothing on CPU)."""

import argparse
import json
import os

import numpy as np
import pytest
import torch

import train
from data.prompts import encode_prompts
from plumbing import batching, lengths_file, memory_plan, time_check, time_model
from sampler import kv_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tinymath", "warmstart")


def paper(*extra):
    return train.parse_args(["--config", os.path.join(ROOT, "configs", "paper_qwen7b.json"), *extra])


def test_the_schedule_constants_are_the_sampler_s():
    assert (time_model.CHECK_EVERY, time_model.REFILL_FRACTION, time_model.COMPACT_FRACTION,
            time_model.PREFILL_TOKENS) == (kv_cache.CHECK_EVERY, kv_cache.REFILL_FRACTION,
                                           kv_cache.COMPACT_FRACTION, kv_cache.PREFILL_TOKENS)


def test_the_default_lengths_are_the_review_s_central_case():
    """No more optimistic than issue #42's review: mean 753 response tokens, 5% cut at 3,072;
    prompts of mean 144 tokens whose longest of a rank's 64 is ~430."""
    resp, prompt = time_model.plan_lengths(paper()[0])
    assert resp.mean() == pytest.approx(753, abs=0.5) and resp.truncated() == pytest.approx(0.05)
    assert prompt.mean() == pytest.approx(144, abs=1) and prompt.expected_max(64) == pytest.approx(430, abs=3)
    assert "issue #42's review" in resp.source and "summary statistics" in prompt.source
    short = resp.cut_at(1024)                                   # a lower limit cuts more rows
    assert short.truncated() > 0.05 and short.mean() < 753
    long = time_model.default_responses().cut_at(8192)          # a higher one: cut rows run to it
    assert long.truncated() == pytest.approx(0.05)
    assert long.mean() == pytest.approx(753 + 0.05 * 5120, abs=0.5)


class FakeStep:
    """decode.LeanStep's interface without a model: each step logs (slots, columns read)."""
    log: list = []

    def __init__(self, model, cache):
        self.cache = cache

    def select(self, idx):
        pass

    def __call__(self, tok, pos, width):
        FakeStep.log.append((len(tok), width))
        return torch.zeros(len(tok), 2)


def replay_pass(prompt_lens, resp_lens, slots, R, monkeypatch):
    """The real kv_cache.decode_pass over rows that end at the given lengths (token 1 is the EOS,
    chosen at each row's last step): -> (decode steps, KV positions read: slots x columns summed)."""
    FakeStep.log = []
    monkeypatch.setattr(kv_cache.decode, "LeanStep", FakeStep)
    monkeypatch.setattr(kv_cache, "slot_cache", lambda model, S, C: None)
    monkeypatch.setattr(kv_cache, "admit", lambda m, c, ps, free, pad: torch.zeros(len(free), 2))
    ends = torch.tensor(resp_lens)

    def choose(logits, rows, t):
        return (t >= ends[rows] - 1).long(), torch.zeros(len(t))
    d = kv_cache.decode_pass(torch.nn.Linear(1, 1), [[0] * p for p in prompt_lens], torch.arange(len(ends)),
                             choose, slots=slots, max_new_tokens=R, eos=torch.tensor([1]), pad_id=0)
    assert d.mask[:, :R].sum(1).tolist() == resp_lens
    return len(FakeStep.log), sum(s * w for s, w in FakeStep.log)


def test_the_closed_form_agrees_with_a_replay_of_the_code_s_schedule(monkeypatch):
    """8 ranks of the paper config: lengths sampled from the default distributions (64 prompts of
    G = 8 rows a rank), the real decode_pass (a stub model whose rows end at their sampled lengths) in
    the slots rollout gives them, and batching.microbatch_plan over the update's, pi_old's and the
    reference's rows: the model's expectations within 10% of the replays' mean, in decode steps, KV
    positions read and padded tokens. The worst case, every row to the limit, too."""
    a, _ = paper()
    a = memory_plan.as_planned(a, 8, False)                     # --kv-budget 0: what fits an H100
    a.pack = False                                              # the padded plan (the packed: below)
    budget = a.kv_budget
    resp, prompt = time_model.plan_lengths(a)
    R, G, n_p = a.max_new_tokens, a.group_size, a.rollout_batch // 8
    N, rng = n_p * G, np.random.default_rng(0)
    got = {"steps": [], "kv": [], 128: [], 384: [], 512: []}
    for _ in range(8):
        prompts = [p for p in rng.choice(len(prompt.pmf), n_p, p=prompt.pmf).tolist() for _ in range(G)]
        rows = [max(1, r) for r in rng.choice(len(resp.pmf), N, p=resp.pmf).tolist()]
        steps, kv = replay_pass(prompts, rows, budget // (max(prompts) + R), R, monkeypatch)
        got["steps"].append(steps), got["kv"].append(kv)
        for n in (128, 384, 512):
            lengths = list(zip(prompts[:n], rows[:n]))
            plan = batching.microbatch_plan(lengths, a.micro_batch, a.micro_tokens)
            got[n].append(sum(len(mb) * batching.padded_width(lengths, mb) for mb in plan))
            got.setdefault(("packed", n), []).append(sum(p + r for p, r in lengths))
    S = time_model.slots_for(a, 8, prompt)
    segments = time_model.decode_schedule(resp, prompt, N, n_p, S)
    model = {"steps": sum(s.steps for s in segments), "kv": sum(s.steps * s.kv for s in segments),
             **{n: time_model.planned_tokens(resp, prompt, n, G, a.micro_batch, a.micro_tokens)[0]
                for n in (128, 384, 512)},
             **{("packed", n): time_model.packed_tokens(resp, prompt, n, a.micro_batch, a.micro_tokens)[0]
                for n in (128, 384, 512)}}
    assert S > 200                                              # ~229 slots of 4,096 + 429 at most
    for key, value in model.items():
        assert value == pytest.approx(np.mean(got[key]), rel=0.10), key
    steps, kv = replay_pass(prompts, [R] * N, S, R, monkeypatch)         # every row to the limit
    worst = time_model.worst_schedule(R, prompt, N, n_p, S)
    assert sum(s.steps for s in worst) == pytest.approx(steps, rel=0.01)
    assert sum(s.steps * s.kv for s in worst) == pytest.approx(kv, rel=0.10)


PACKED_LENGTHS = {   # the review's central case, and out of sample: shorter, longer, a higher limit
    "review": lambda: time_model.default_responses().cut_at(3072),
    "short": lambda: lengths_file.fitted_responses(400, 0.01, 3072, "short").cut_at(3072),
    "long": lambda: lengths_file.fitted_responses(1100, 0.15, 3072, "long").cut_at(3072),
    "8k": lambda: lengths_file.fitted_responses(1500, 0.05, 8192, "8k").cut_at(8192)}


def replay_packed(resp, prompt, cap, samples=60, ranks=8, G=8, n=128, size=16, seed=0):
    """batching.microbatch_plan(packed=True) over each rank's n update rows (n / G prompts of G rows)
    of `ranks` ranks, after batching.deal has dealt their groups by tokens (scale_step.deal_by_length)
    -> (the mean count over ranks and samples, the mean over samples of the most any rank needs)."""
    rng, counts, most = np.random.default_rng(seed), [], []
    for _ in range(samples):
        groups = []
        for _ in range(ranks * n // G):
            p = int(rng.choice(len(prompt.pmf), p=prompt.pmf))
            groups.append([(p, max(1, int(r))) for r in rng.choice(len(resp.pmf), G, p=resp.pmf)])
        dealt = batching.deal([sum(p + r for p, r in g) for g in groups], ranks)
        got = [len(batching.microbatch_plan([x for i in mine for x in groups[i]], size, cap, packed=True))
               for mine in dealt]
        counts += got
        most.append(max(got))
    return float(np.mean(counts)), float(np.mean(most))


@pytest.mark.parametrize("cap", [None, 16384])
@pytest.mark.parametrize("name", list(PACKED_LENGTHS))
def test_the_packed_micro_batch_count_is_next_fit_s(name, cap):
    """The packed plan's micro-batches (next-fit, longest first) at the paper config's shapes (its
    --micro-batch, its --micro-tokens or 16,384; a rank's 128 update rows of 8 ranks), replayed on
    sampled lengths: the model's count within 5% of the replays' mean count (measured: 0.98-1.03 of it),
    and under FSDP2's "as many on every rank" (ranks=8) within 6% of the most any rank needed after the
    deal (0.95-1.04; the model's normal spread is high where --micro-batch binds: short, 16,384 tokens,
    whose count is 9 on nearly every rank). Perfect packing (tokens / --micro-tokens, the old model)
    counted 4-21% fewer."""
    a, _ = paper()
    resp, prompt = PACKED_LENGTHS[name](), time_model.default_prompts().at_most(a.max_prompt_len)
    cap = cap or a.micro_tokens
    n = a.update_batch // 8 * a.group_size
    mean, most = replay_packed(resp, prompt, cap, n=n, size=a.micro_batch)
    one = time_model.packed_tokens(resp, prompt, n, a.micro_batch, cap)[1]
    eight = time_model.packed_tokens(resp, prompt, n, a.micro_batch, cap, ranks=8)[1]
    print(f"{name} --micro-tokens {cap}: replay {mean:.2f} / model {one:.2f} = {mean / one:.3f}; "
          f"the most of 8 ranks {most:.2f} / {eight:.2f} = {most / eight:.3f}")
    assert one == pytest.approx(mean, rel=0.05)
    assert eight == pytest.approx(most, rel=0.06) and eight >= one


def test_measured_lengths_from_samples_and_metrics(tmp_path):
    samples = tmp_path / "samples.jsonl"
    rows = [(100, True), (300, True), (2048, False), (500, True)]
    samples.write_text("".join(json.dumps({"id": i, "num_tokens": n, "finished": f}) + "\n"
                               for i, (n, f) in enumerate(rows)))
    got = lengths_file.read_lengths(str(samples), 3072)["response"]
    assert got.truncated() == pytest.approx(0.25) and got.mean() == pytest.approx((900 + 3072) / 4)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"max_new_tokens": 2048}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "response_len": m, "truncated_frac": t}) + "\n"
        for s, m, t in [(1, 700, 0.04), (2, 800, 0.06)]))
    got = lengths_file.read_lengths(str(run / "metrics.jsonl"), 2048)["response"]
    assert got.mean() == pytest.approx(750, abs=1) and got.truncated() == pytest.approx(0.05)
    a, _ = paper("--steps", "10")
    a.plan_lengths = str(samples)
    assert "4 samples of" in time_model.report(a, 8, True, "h100", 0.75)


@pytest.mark.parametrize("text,why", [("", "no records"), ("{not json\n", "not JSON"),
                                      ('{"step": 1}\n', "neither num_tokens"),
                                      ('{"prompt": {"mean": 1}}\n', "not a lengths JSON")])
def test_a_bad_lengths_file_is_one_line(tmp_path, text, why):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        lengths_file.read_lengths(str(path), 3072)
    assert str(e.value).startswith(f"error: --plan-lengths {path}: ") and why in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="no such file"):
        lengths_file.read_lengths(str(tmp_path / "missing.jsonl"), 3072)


def test_a_prompt_histogram_of_the_data_under_its_tokenizer(tmp_path):
    """Where a tokenizer and the data are present: the prompt lengths under the template, with the
    data's and the tokenizer's hashes; --plan-lengths reads it back."""
    data = tmp_path / "math.jsonl"
    problems = ["What is 2 + 2?", "Leo owns 36 buttons and gives 19 to Zoe. How many are left?", "1 + 1?"]
    data.write_text("".join(json.dumps({"problem": p, "answer": "0"}) + "\n" for p in problems))
    out = tmp_path / "hist.json"
    spec = lengths_file.prompt_histogram(TINY, str(data), "plain", str(out), encode_prompts)
    from transformers import AutoTokenizer
    ids = encode_prompts(AutoTokenizer.from_pretrained(TINY), [{"problem": p} for p in problems], "plain")
    assert spec["prompt"]["histogram"] == {str(n): sum(len(i) == n for i in ids) for n in map(len, ids)}
    assert len(spec["prompt"]["data_sha256"]) == 64 and len(spec["prompt"]["tokenizer_sha256"]) == 64
    got = lengths_file.read_lengths(str(out), 3072)["prompt"]
    assert got.mean() == pytest.approx(np.mean([len(i) for i in ids]))
    assert "histogram of math.jsonl" in got.source


def test_the_report_puts_the_realistic_estimate_first_and_names_its_assumptions():
    a, _ = paper("--steps", "10")
    lines = time_model.report(a, 8, True, "h200", old_rows=0.75).splitlines()
    assert lines[0].startswith("time model of one RL step on 8 x H200") and "not a measurement" in lines[0]
    assert "REALISTIC / worst case (every response to --max-new-tokens 3072)" in lines[0]
    assert "mean 753 tokens, 5.0% cut at 3072 (issue #42's review" in lines[1]
    assert "mean 144 tokens" in lines[2] and "not to --max-prompt-len" in lines[2]
    assert lines[3].startswith("  constants (docs/gpus.md cites the assumed") and "update_mfu 0.3 (assumed)" in lines[3]
    assert "a reference model, packed forwards, no activation checkpointing (--grad-ckpt auto)" in lines[4]
    secs = {ln.split()[0]: (float(ln.split()[1]), float(ln.split()[4])) for ln in lines[5:-1]}
    assert list(secs) == ["decode", "prefill", "score", "update", "host", "step"]
    for i in (0, 1):
        assert secs["step"][i] == pytest.approx(sum(v[i] for k, v in secs.items() if k != "step"), abs=0.3)
        assert all(v[0] < v[1] for k, v in secs.items() if k not in ("prefill", "host"))   # (host: ~alike)
    text = "\n".join(lines)
    assert "4.8 TB/s" in text and "30% MFU" in text and "x 10 steps" in text and "steps of 512 rows in" in text
    assert "--kv-budget 0: " in text and "139.8 GiB card" in text and "--compile-decode off" in text


def test_the_update_term_by_hand():
    """Padded (--pack false), with activation checkpointing (8N) and the reference scored."""
    a, _ = paper("--grad-ckpt", "true", "--micro-tokens", "16384")
    a.pack = False
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    resp, prompt = time_model.plan_lengths(a)
    terms = {t.name: t for t in time_model.step_terms(arch, a, 8, gpu, True, 0.75, resp, prompt)}
    tokens, micro = time_model.planned_tokens(resp, prompt, 128, 8, a.micro_batch, a.micro_tokens)
    N = arch.params() - arch.vocab * arch.hidden                # FLOPs: the input embedding is a lookup
    comm = 3 * 2 * arch.params() * 7 / 8 / (450e9 * 0.7)        # bytes: every parameter
    k = time_model.CENTRAL                                       # the constants' central values
    assert terms["update"].seconds[0] == pytest.approx(4 * (8 * N * tokens / (989e12 * k["update_mfu"])
                                                            + micro * comm * k["exposed_comm"]))
    real = 128 * (prompt.mean() + resp.mean())
    assert 1.0 < tokens / real < 1.4                             # padding, not --max-prompt-len
    old = time_model.planned_tokens(resp, prompt, 384, 8, a.micro_batch, a.micro_tokens)[0]
    ref = time_model.planned_tokens(resp, prompt, 512, 8, a.micro_batch, a.micro_tokens)[0]
    assert terms["score"].seconds[0] == pytest.approx(2 * N * (old + ref) / (989e12 * k["update_mfu"]))


def test_the_host_term_by_hand():
    """Grading, FSDP2's decoding copy and the length-dealing gather, each from its named constant; one
    GPU without FSDP2: grading alone."""
    a, _ = paper()
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    resp, prompt = time_model.plan_lengths(a)
    terms = {t.name: t for t in time_model.step_terms(arch, a, 8, gpu, False, 0.75, resp, prompt)}
    k, N = time_model.CENTRAL, 512
    grade = N * 0.3 * k["verify_ms"] / 1e3 / 4                   # 30% to math-verify, on 4 runners
    copy = 4 * arch.params() * 7 / 8 / (450e9 * 0.7) + (12 * 28 + 3) * 100e-6
    deal = 8 * N * (16 * prompt.mean() + 20 * resp.expected_max(8)) / 1e9
    assert terms["host"].seconds[0] == pytest.approx(grade + copy + deal)
    assert 0.5 < grade + copy + deal < 3.0 and "grading 0.8 s" in terms["host"].note
    a.fsdp = False
    alone = time_model.step_terms(arch, a, 1, gpu, False, 0.75, resp, prompt)[-1]
    assert alone.name == "host" and alone.seconds[0] == pytest.approx(N * 8 * 0.3 * k["verify_ms"] / 1e3 / 4)


def test_the_fixed_length_decode_bound_bench_gpu_check_uses():
    """S rows in S slots, every row L tokens: L steps, each reading the weights + S x (P + L) KV
    (bench/gpu_check.py sets a measured pass against it; its GPU of 0 TFLOP/s has no compute bound)."""
    a, _ = paper("--kv-budget", "524288")
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    (term,) = time_model.decode_terms(arch, a, 8, gpu, (3072, 1536))
    assert "12,288 decode steps of 512 rows in 128 slots" in term.note
    weights = 2 * (arch.params() - arch.vocab * arch.hidden)        # the input embedding is a lookup
    kv = 128 * (1024 + 3072) * arch.kv_bytes_per_position()
    k = time_model.CENTRAL                                       # HBM at its achievable fraction
    assert term.seconds[0] == pytest.approx(12288 * (weights + kv) / (3.35e12 * k["decode_bw_fraction"]))
    # the other two bounds: launching ~1,200 eager kernels, and 1,000 slots' 2N FLOPs each at 50% MFU
    few, many = (time_model.Segment(1, 0, rows) for rows in (1, 1000))
    assert time_model.decode_seconds(arch, gpu, [few])[0] == pytest.approx(43 * 28 * k["launch_us"] * 1e-6)
    compute = 1000 * 2 * (arch.params() - arch.vocab * arch.hidden) / (989e12 * 0.5)
    assert time_model.decode_seconds(arch, gpu, [many])[0] == pytest.approx(compute)


def test_the_disk_a_run_needs():
    """Two checkpoints of 12 bytes per parameter at most (checkpoints.make_room), the bf16 export,
    and for a run over several nodes the shared --out it needs."""
    a, _ = paper()
    n = memory_plan.arch_for(a.model).params()
    line = time_model.disk_report(a, 8)
    assert f"a checkpoint is {12 * n / 1e9:.1f} GB" in line and f"{24 * n / 1e9:.1f} GB" in line
    assert f"{2 * n / 1e9:.1f} GB for the final bf16 export" in line and "node" not in line
    assert "file system every node sees" in time_model.disk_report(a, 16)


def test_the_levers_as_shipped():
    """configs/paper_qwen7b.json as shipped: no reference forward (ERPO loads none), packed forwards
    (real tokens), no activation checkpointing (auto: the 4,096-token micro-batch fits), the KV
    slots that fit an H100 less the margin, an eager decode (--compile-decode off): <= 10 h."""
    a, algo = paper()
    arch, gpu = memory_plan.arch_for(a.model), time_model.GPUS["h100"]
    p = memory_plan.as_planned(a, 8, False)
    assert p.grad_ckpt is False and a.grad_ckpt == "auto"
    rollout_others = sum(t.bytes for t in memory_plan.terms(arch, p, 8, False)
                         if "rollout" in t.phases and t.name != "KV cache")
    card = 79.1 * memory_plan.GIB
    assert p.kv_budget == memory_plan.kv_positions_that_fit(int(card), int(card), int(rollout_others),
                                                            arch.kv_bytes_per_position())
    resp, prompt = time_model.plan_lengths(p)
    terms = {t.name: t for t in time_model.step_terms(arch, p, 8, gpu, False, 0.75, resp, prompt)}
    real, micro = time_model.packed_tokens(resp, prompt, 128, a.micro_batch, a.micro_tokens, 8)  # 8 ranks
    assert real == pytest.approx(128 * (prompt.mean() + resp.mean())) and micro >= real / 4096
    N = arch.params() - arch.vocab * arch.hidden                # FLOPs: the input embedding is a lookup
    comm = 3 * 2 * arch.params() * 7 / 8 / (450e9 * 0.7)        # bytes: every parameter
    k = time_model.CENTRAL
    assert terms["update"].seconds[0] == pytest.approx(4 * (6 * N * real / (989e12 * k["update_mfu"])
                                                            + micro * comm * k["exposed_comm"]))
    old = time_model.packed_tokens(resp, prompt, 384, a.micro_batch, a.micro_tokens)[0]
    assert terms["score"].seconds[0] == pytest.approx(2 * N * old / (989e12 * k["update_mfu"]))  # pi_old alone
    with_ref = time_model.step_terms(arch, p, 8, gpu, True, 0.75, resp, prompt)[2].seconds[0]
    assert with_ref == pytest.approx(terms["score"].seconds[0] * 896 / 384)     # + the reference's 512 rows
    p.compile_decode = True                                      # captured: no kernel-launch bound
    captured = time_model.step_terms(arch, p, 8, gpu, False, 0.75, resp, prompt)[0].seconds[0]
    assert captured <= terms["decode"].seconds[0]
    hours = time_model.report(a, 8, False, "h100", 0.75).splitlines()[-2]         # (the range: last)
    assert float(hours.split("steps: ")[1].split(" h realistic")[0]) <= 10.0
    assert "6N FLOPs per token at 30% MFU" in time_model.report(a, 8, False, "h100", 0.75)


def test_grad_ckpt_auto_true_false_and_old_booleans(tmp_path):
    """--grad-ckpt takes true / false (bools, as before) or auto (resolved by the plan); a --config
    file's and an old config.json's booleans still parse."""
    assert paper()[0].grad_ckpt == "auto"
    assert paper("--grad-ckpt", "false")[0].grad_ckpt is False
    assert paper("--grad-ckpt", "true")[0].grad_ckpt is True
    cfg = json.load(open(os.path.join(ROOT, "configs", "paper_qwen7b.json")))
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**cfg, "grad_ckpt": True}))
    assert train.parse_args(["--config", str(path)])[0].grad_ckpt is True
    with pytest.raises(SystemExit):
        paper("--grad-ckpt", "maybe")
    arch = memory_plan.arch_for(cfg["model"])
    card = 79.1 * memory_plan.GIB
    fits, big = paper()[0], paper("--micro-tokens", "16384")[0]
    assert memory_plan.needs_checkpointing(arch, fits, 8, False, card) is False
    assert memory_plan.needs_checkpointing(arch, big, 8, False, card) is True   # 16k tokens: ~110 GiB
    assert memory_plan.needs_checkpointing(arch, big, 8, False, None) is False  # a CPU: no card
    assert memory_plan.resolve_grad_ckpt(big, 8, False, 141 * memory_plan.GIB * 2) is False


def test_a_run_resolves_grad_ckpt_auto_once_on_its_card(monkeypatch):
    """run_setup.resolve_grad_ckpt: auto becomes a bool in the options every later reader sees --
    the plan's rule on the card the run finds (a mocked 80 GB CUDA card), off on a CPU."""
    from types import SimpleNamespace

    from rl import run_setup
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(79.1 * memory_plan.GIB)))
    for tokens, on in (("4096", False), ("16384", True)):
        a, algo = paper("--micro-tokens", tokens)
        assert run_setup.resolve_grad_ckpt(a, algo, 8, torch.device("cuda")) is on and a.grad_ckpt is on
    a, algo = paper("--micro-tokens", "16384")
    assert run_setup.resolve_grad_ckpt(a, algo, 8, torch.device("cpu")) is False and a.grad_ckpt is False
    a, algo = paper("--grad-ckpt", "true")
    assert run_setup.resolve_grad_ckpt(a, algo, 8, torch.device("cpu")) is True      # as given


# ----------------------------------------------------------------------------------------------
# The run's first steps against the model (plumbing/time_check.py: train.py's hook at step 3)

def modelled_at(a, length, cut, gpus=8, needs_ref=False, old=0.5):
    """The model's phases at these measured lengths (the lines carry no times yet)."""
    lines = [{"step": s, "step_time": 0.0, "response_len": length, "truncated_frac": cut} for s in (1, 2, 3)]
    return time_check.against_measured(a, gpus, needs_ref, "h100", old, lines)["phases"]


def test_measured_at_twice_the_model_reads_ratio_two_and_its_hours():
    """Steps 2-3 at exactly twice the model's seconds: every ratio 2, the projection the measured
    step x --steps; step 1 (its warm-up, here 100x) does not count; the lengths are every step's."""
    a = paper()[0]
    model = modelled_at(a, 900, 0.08)
    keys = time_check.MEASURED
    warm = {"step": 1, "response_len": 800, "truncated_frac": 0.06, **{keys[p]: 100 * model[p]["modelled"]
                                                                       for p in keys}}
    later = [{"step": s, "response_len": 950, "truncated_frac": 0.09, **{keys[p]: 2 * model[p]["modelled"]
                                                                         for p in keys}} for s in (2, 3)]
    check = time_check.against_measured(a, 8, False, "h100", 0.5, [{"step": 0, "eval_acc": 0.3}, warm, *later])
    assert check["steps"] == [2, 3] and not check["warm_up"]
    one = time_check.against_measured(a, 8, False, "h100", 0.5, [warm])     # only step 1: it counts
    assert one["steps"] == [1] and one["warm_up"] and one["phases"]["gen"]["measured"] == warm["time_gen"]
    assert "step 1 (its warm-up included)" in time_check.format_check(one)
    for p in keys:
        assert check["phases"][p]["modelled"] == pytest.approx(model[p]["modelled"])
        assert check["phases"][p]["ratio"] == pytest.approx(2.0)
    step = 2 * model["step"]["modelled"]
    assert check["projected_h"] == pytest.approx(step * a.steps / 3600)
    assert check["modelled_h"] == pytest.approx(model["step"]["modelled"] * a.steps / 3600)
    host = model["step"]["modelled"] - sum(model[p]["modelled"] for p in ("gen", "score", "update"))
    assert 0.5 < host < 3.0                                      # the host term: step_time alone holds it
    m = time_check.check_metrics(check)
    assert m["time_model/gen_ratio"] == pytest.approx(2.0) and m["time_model/projected_h"] == check["projected_h"]
    assert all(k.startswith("time_model/") for k in m) and len(m) == 4 * 3 + 3 + 1   # + slots_planned
    text = time_check.format_check(check)
    assert "steps 2-3" in text and "x 2.00" in text and f"{check['projected_h']:.3g} h" in text


def test_at_the_plan_s_lengths_the_model_is_the_dry_run_s_estimate():
    """A run that measures the review's central case (mean 753, 5% cut at 3,072) is modelled as
    --dry-run models it: the report's realistic step and hours; longer responses cost more."""
    a, algo = paper()
    needs_ref, old = train.needs_reference_model(a, algo), train.old_rows(a, algo)
    lines = [{"step": s, "step_time": 100.0, "response_len": 753, "truncated_frac": 0.05} for s in (1, 2, 3)]
    check = time_check.against_measured(a, 8, needs_ref, "h100", old, lines)
    report = time_model.report(a, 8, needs_ref, "h100", old)
    step_line = next(ln for ln in report.splitlines() if ln.lstrip().startswith("step "))
    assert check["phases"]["step"]["modelled"] == pytest.approx(float(step_line.split()[1]), abs=0.05)
    assert check["modelled_h"] == pytest.approx(check["dry_run_h"], rel=1e-3)
    assert f"{check['dry_run_h']:.1f} h realistic" in report
    assert check["projected_h"] == pytest.approx(100.0 * 240 / 3600)
    longer = modelled_at(a, 1500, 0.2, needs_ref=needs_ref, old=old)
    assert longer["gen"]["modelled"] > check["phases"]["gen"]["modelled"]
    assert longer["update"]["modelled"] > check["phases"]["update"]["modelled"]


def test_a_cpu_run_s_own_lines():
    """The golden ERPO run's metrics.jsonl (3 steps of the tiny world on CPU): its step-0 evaluation
    line skipped, steps 2-3 measured, the model given the run's mean response length."""
    with open(os.path.join(ROOT, "tests", "golden", "erpo.jsonl")) as f:
        lines = [json.loads(ln) for ln in f][1:]
    a, algo = train.parse_args(["--steps", "3"])
    check = time_check.against_measured(a, 1, train.needs_reference_model(a, algo), "h100",
                                        train.old_rows(a, algo), lines)
    steps = [r for r in lines if "step_time" in r]
    assert check["steps"] == [2, 3]
    assert check["phases"]["gen"]["measured"] == pytest.approx((steps[1]["time_gen"] + steps[2]["time_gen"]) / 2)
    mean = sum(r["response_len"] for r in steps) / 3
    assert f"{mean:.0f} tokens" in check["lengths"]
    assert all(p["modelled"] > 0 and p["ratio"] > 0 for p in check["phases"].values())


@pytest.mark.parametrize("mean,cut", [(753, 0.05), (90, 0.0), (95, 0.5), (96, 1.0), (49, 0.004)])
def test_measured_responses_keep_the_run_s_mean_and_cut_fraction(mean, cut):
    """Fitted where a gamma fits, else two point masses (a mean near the limit, every row cut): the
    run's mean length and its fraction cut at the limit either way."""
    limit = 3072 if mean > 100 else 96
    resp = time_check.measured_responses(mean, cut, limit, "run")
    assert resp.mean() == pytest.approx(mean, abs=0.5) and resp.truncated() == pytest.approx(cut)
    assert len(resp.pmf) == limit + 1


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 SXM5 80GB", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA GH200 480GB", None), ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-16GB", None)])
def test_the_device_name_maps_to_its_card(name, key):
    assert time_check.gpu_key(name) == key


class FakeCuda:
    def __init__(self, name):
        self.name = name

    def get_device_name(self):
        return self.name


def hook(device, steps=50, start=0, name="NVIDIA H100 80GB HBM3"):
    a = train.parse_args(["--steps", str(steps)])[0]
    dist = argparse.Namespace(world=1, device=torch.device(device))
    said = []
    return time_check.FirstSteps(a, dist, False, 0.5, start, cuda=FakeCuda(name), say=said.append), said


def step_line(s):
    return {"step": s, "step_time": 2.0, "time_gen": 1.0, "time_score": 0.2, "time_update": 0.7,
            "response_len": 49.0, "truncated_frac": 0.0}


def test_the_hook_on_a_gpu_logs_once_at_step_three_and_on_cpu_never():
    """On CUDA: lines 1, 2 and 4.. pass unchanged, line 3 gets the time_model/ keys, printed once;
    a run of 2 steps (or 2 left after --resume) at its last; an unknown card: one line, no keys. On
    CPU: no line changes and nothing is said (train.py's metrics.jsonl of a CPU run has no keys)."""
    check, said = hook("cuda")
    out = [check(step_line(s)) for s in range(1, 6)]
    assert [any(k.startswith("time_model/") for k in o) for o in out] == [False, False, True, False, False]
    assert out[2]["time_model/step_measured"] == pytest.approx(2.0) and len(said) == 1 and "steps 2-3" in said[0]
    for steps, start in ((2, 0), (12, 10)):
        check, said = hook("cuda", steps, start)
        out = [check(step_line(s)) for s in range(start + 1, steps + 1)]
        assert "time_model/step_measured" in out[-1] and len(said) == 1 and f"step {start + 2} (step {start + 1}: its warm-up, not)" in said[0]
    check, said = hook("cuda", name="NVIDIA GeForce RTX 4090")
    assert all(check(step_line(s)) == step_line(s) for s in range(1, 6))
    assert len(said) == 1 and "no entry for this GPU (NVIDIA GeForce RTX 4090" in said[0]
    check, said = hook("cpu")
    assert all(check(step_line(s)) == step_line(s) for s in range(1, 6)) and said == []


def rank_lines(update, slots):
    return [{**step_line(s), "time_update": update, "step_time": 1.3 + update, "sampler/slots": slots}
            for s in (1, 2, 3)]


def test_the_check_reports_the_slowest_rank_and_the_slots_the_run_got():
    """A fake 2-rank card: rank 1's update is 3x rank 0's and it got fewer slots. The stubbed reduce
    (distributed.all_max over 2 ranks) gives the check rank 1's update and step, rank 0's own
    decode where it is the slower, and the model decodes in rank 1's slots, not the plan's."""
    a = train.parse_args(["--steps", "50"])[0]
    theirs = []
    time_check.slowest(rank_lines(2.1, 3), lambda x: theirs.append(x) or x)       # rank 1's values
    said, reduced = [], []

    def reduce_max(x):
        reduced.append(x)
        return torch.maximum(x, theirs[0])
    dist = argparse.Namespace(world=2, device=torch.device("cuda"))
    check = time_check.FirstSteps(a, dist, False, 0.5, 0, cuda=FakeCuda("NVIDIA H100 80GB HBM3"),
                                  say=said.append, reduce_max=reduce_max)
    ours = [{**r, "time_gen": 1.5} for r in rank_lines(0.7, 5)]
    out = [check(r) for r in ours]
    assert len(reduced) == 1 and len(said) == 1 and "the slowest of 2 ranks per phase" in said[0]
    assert out[2]["time_model/update_measured"] == pytest.approx(2.1)              # rank 1's
    assert out[2]["time_model/step_measured"] == pytest.approx(3.4)
    assert out[2]["time_model/gen_measured"] == pytest.approx(1.5)                 # rank 0's own
    assert out[2]["time_model/slots_got"] == 3 and "the 3 slots the run got" in said[0]
    alone = time_check.against_measured(a, 2, False, "h100", 0.5, ours)            # rank 0's lines alone
    assert alone["slots"]["got"] == 5 and alone["phases"]["update"]["measured"] == pytest.approx(0.7)
    assert out[2]["time_model/gen_modelled"] > alone["phases"]["gen"]["modelled"]  # fewer slots: longer


def test_the_dry_run_gives_a_range_and_reads_measured_constants(tmp_path):
    """The report's central step sits inside its range, and names every constant assumed; a
    bench/gpu_check.py JSON whose update MFU is measured at twice the assumed (--plan-constants) moves
    the estimate down and names that one measured; a null constant stays assumed."""
    a, algo = paper()
    needs_ref, old = train.needs_reference_model(a, algo), train.old_rows(a, algo)

    def step_and_range(text):
        step = next(ln for ln in text.splitlines() if ln.lstrip().startswith("step "))
        rng = next(ln for ln in text.splitlines() if ln.lstrip().startswith("range "))
        return float(step.split()[1]), float(rng.split()[1]), float(rng.split()[3])
    text = time_model.report(a, 8, needs_ref, "h100", old)
    step, lo, hi = step_and_range(text)
    assert lo < step < hi and all(f"{n} {v[0]:g} (assumed)" in text for n, v in time_model.CONSTANTS.items())
    path = tmp_path / "gpu_check.json"
    mfu = 2 * time_model.CONSTANTS["update_mfu"][0]
    path.write_text(json.dumps({"constants": {"update_mfu": mfu, "decode_bw_fraction": None}}))
    a.plan_constants = str(path)
    measured = time_model.report(a, 8, needs_ref, "h100", old)
    assert step_and_range(measured)[0] < step - 10
    assert f"update_mfu {mfu:g} (measured (gpu_check.json))" in measured and "decode_bw_fraction 0.7 (assumed)" in measured
