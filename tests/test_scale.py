"""Paper-scale rollouts, checked in miniature: stop ids from the chat template, the DAPO overlong
default, and (under torchrun, 2 CPU processes) rollouts of an FSDP2-sharded policy decoded from
weights gathered once, not re-gathered per token."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sampler import kv_cache
from modeling import logprobs
import losses
from modeling import models
import rollout
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


@pytest.fixture(scope="module")
def base_like(tmp_path_factory):
    """The warm start, configured like a Qwen2.5 *base* model: its generation config and tokenizer
    stop on <|endoftext|> only, while its chat template ends a turn with <|im_end|>."""
    d = tmp_path_factory.mktemp("baselike") / "model"
    shutil.copytree(WARM, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = 0
    (d / "generation_config.json").write_text(json.dumps(gen))
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return str(d)


def test_chat_templated_model_stops_at_the_end_of_turn_token(base_like):
    model, tok = models.load_policy(base_like)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == 0 and model.generation_config.eos_token_id == 0
    eos = rollout.eos_token_ids(model, tok)
    assert im_end in eos and 0 in eos
    prompts = [tok(f"<|im_start|>user\nMia has {n} apples. Mia gives 5 apples to Tom. How many apples does Mia "
                   f"have now?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
               for n in (23, 41, 17, 30)]
    ro = rollout.sample(model, prompts, max_new_tokens=96, eos_ids=eos, pad_id=0, temperature=0)
    lens = ro.response_mask.sum(1)
    assert ro.finished.all()
    for i in range(len(prompts)):
        resp = ro.response_ids[i, :lens[i]].tolist()
        assert resp[-1] == im_end and im_end not in resp[:-1]
    # The same model stopping on <|endoftext|> alone runs past the end of its turn.
    ro2 = rollout.sample(model, prompts, max_new_tokens=96, eos_ids=[0], pad_id=0, temperature=0)
    assert any(im_end in r[:n].tolist()[:-1] or not f for r, n, f in
               zip(ro2.response_ids, ro2.response_mask.sum(1), ro2.finished))
    assert rollout.turn_starts(tok) == ["<|im_start|>"]


def test_new_turns_counts_responses_that_start_a_turn(base_like):
    model, tok = models.load_policy(base_like)
    texts = ["<think> 1 </think> \\boxed{1}", "\\boxed{2}<|im_start|>user\nmore", "no marker"]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    R = max(map(len, ids))
    ro = rollout.Rollout(prompt_ids=torch.ones(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.long),
                         response_ids=torch.tensor([x + [0] * (R - len(x)) for x in ids]),
                         response_mask=torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in ids]),
                         logprobs=torch.zeros(3, R), finished=torch.ones(3, dtype=torch.bool))
    assert rollout.new_turns(tok, ro) == 1


def test_overlong_cache_defaults_to_dapos_fraction_of_the_length():
    dapo = losses.ALGOS["dapo"]
    assert dapo.overlong_cache == 0.2                                     # DAPO: 4,096 of 20,480
    assert dapo.overlong_cache_len(3072) == 614 and dapo.overlong_cache_len(96) == 19
    assert losses.make_algo("dapo", overlong_cache=16).overlong_cache_len(3072) == 16
    L = torch.tensor([3072 - 614, 3072 - 307, 3072, 3073])
    pen = losses.overlong_penalty(L, 3072, dapo.overlong_cache_len(3072))
    assert pen.tolist() == pytest.approx([0.0, -0.5, -1.0, -1.0], abs=1e-3)  # a ramp, not a cliff
    with open(os.path.join(ROOT, "configs", "paper_qwen7b.json")) as f:
        assert json.load(f)["overlong_cache"] == 0.2


WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

torch.set_num_threads(1)
dist.init_process_group("gloo")
sys.path.insert(0, sys.argv[1])
from modeling import models
import rollout
from plumbing import distributed

NEVER = 5  # "#": a token the tiny model never writes, so every row decodes the full length
COMMS = ("all_gather", "allgather", "all_reduce", "allreduce", "broadcast", "reduce_scatter", "record_param_comms")
model, tok = models.load_policy(sys.argv[2])
policy = distributed.wrap_model(model, torch.device("cpu"), fsdp=True)
prompts, seeds = json.loads(sys.argv[3]), json.loads(sys.argv[4])
out = {}
for path in ("gathered", "sharded"):
    for n in (8, 32):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if path == "gathered":
                with distributed.gathered(policy) as dec:
                    ro = rollout.sample(dec, prompts, max_new_tokens=n, eos_ids=[NEVER], pad_id=0, seeds=seeds)
            else:  # decoding through the sharded model itself: the per-token all-gathers
                ro = rollout.sample(policy, prompts, max_new_tokens=n, eos_ids=[NEVER], pad_id=0, seeds=seeds)
        comms = sum(any(c in e.name.lower() for c in COMMS) for e in prof.events())
        out[f"{path}/{n}"] = {"comms": comms, "tokens": ro.response_ids.tolist(), "width": ro.response_ids.shape[1]}
json.dump(out, open(f"{sys.argv[5]}/rank{dist.get_rank()}.json", "w"))
dist.destroy_process_group()
'''


def test_sharded_rollout_gathers_once(tmp_path):
    """FSDP2 on 2 CPU processes (gloo): the collectives of one rollout do not grow with the number
    of decoded tokens (the weights are gathered once), and the sampled tokens equal a 1-process
    run's. Decoding through the sharded model itself, the count grows: the counter can fail."""
    model, tok = models.load_policy(WARM)
    from data.prompts import build_prompt
    prompts = [tok(build_prompt(tok, f"Mia has {n} apples. Mia gives 5 apples to Tom. How many apples does Mia "
                                     f"have now?", "plain"), add_special_tokens=False).input_ids for n in (23, 41, 7)]
    seeds, NEVER = [11, 12, 13], 5
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port",
           str(29600 + os.getpid() % 1000), str(tmp_path / "worker.py"), ROOT, WARM, json.dumps(prompts),
           json.dumps(seeds), str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank} comm events:", {k: v["comms"] for k, v in res.items()})  # pytest -s shows them
        assert res["gathered/8"]["width"] == 8 and res["gathered/32"]["width"] == 32      # really decoded 8 / 32
        assert res["gathered/8"]["comms"] == res["gathered/32"]["comms"] > 0
        assert res["sharded/32"]["comms"] > res["sharded/8"]["comms"] + 20                  # per-token gathers
        for n in (8, 32):
            one = rollout.sample(model, prompts, max_new_tokens=n, eos_ids=[NEVER], pad_id=0, seeds=seeds)
            assert res[f"gathered/{n}"]["tokens"] == one.response_ids.tolist()
            assert res[f"sharded/{n}"]["tokens"] == one.response_ids.tolist()


def test_activation_checkpointing_gives_the_same_gradients():
    """--grad-ckpt recomputes each decoder layer in backward: same loss and gradients (float32,
    to rounding: a measured tolerance), same KV-cache sampling, and a checkpoint saved from it loads as a plain model."""
    from plumbing import distributed
    torch.manual_seed(0)
    plain, tok = models.load_policy(WARM)
    ckpt, _ = models.load_policy(WARM)
    ckpt = distributed.wrap_model(ckpt, torch.device("cpu"), grad_ckpt=True)
    assert "CheckpointWrapper" in type(ckpt.model.layers[0]).__name__
    ids = torch.randint(3, 600, (4, 40))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0                                                        # a left-padded row
    grads = []
    for m in (plain, ckpt):
        logp, _ = logprobs.token_logprobs(m, ids, mask, temperature=0.8)
        (logp * mask[:, 1:]).sum().backward()
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert_rounding(f"scale.grad_ckpt_vs_plain.grad.{n}", grads[1][n], grads[0][n])
    prompts = [tok(f"Mia has {n} apples.", add_special_tokens=False).input_ids for n in (3, 14, 27)]
    a = rollout.sample(plain, prompts, max_new_tokens=12, eos_ids=[2], pad_id=0, seeds=[1, 2, 3])
    b = rollout.sample(ckpt, prompts, max_new_tokens=12, eos_ids=[2], pad_id=0, seeds=[1, 2, 3])
    assert torch.equal(a.response_ids, b.response_ids)
    assert set(ckpt.state_dict()) == set(plain.state_dict())              # saved without the wrapper's prefix


def test_memory_plan_terms_match_real_tensor_bytes():
    """--dry-run's terms against the bytes of real tensors (the whole step's phases against the
    measured peaks: tests/test_memory.py) of a ~100M-parameter random Qwen2 on
    CPU (float32): parameters, gradients, Adam state and one KV-cache chunk, within 15%."""
    from argparse import Namespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from plumbing import memory_plan
    cfg = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
               num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
    arch = memory_plan.Arch.from_config(cfg)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    n = sum(p.numel() for p in model.parameters())
    assert 80e6 < n < 120e6 and arch.params() == n
    a = Namespace(fsdp=False, grad_ckpt=False, max_prompt_len=24, max_new_tokens=8, micro_batch=2, rollout_batch=2,
                  group_size=2, gen_batch=4, kv_budget=0, dtype="float32")
    plan = {t.name: t.bytes for t in memory_plan.terms(arch, a, 1, needs_ref=False, device="cpu")}
    ids = torch.randint(0, 32000, (2, 16))
    logp, _ = logprobs.token_logprobs(model, ids, torch.ones_like(ids))
    logp.sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    real = {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
            "Adam state": sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                              if t.dim() > 0)}
    prompts = torch.randint(0, 32000, (4, 24))
    cache = kv_cache.kv_cache(model.config, capacity=24 + 8)
    with torch.no_grad():
        model(input_ids=prompts, use_cache=True, **{logprobs.forward_kwargs(model)[0]: cache})
    real["KV cache"] = sum(layer.k_buf.numel() * 4 + layer.v_buf.numel() * 4 for layer in cache.layers)
    for name, b in real.items():
        assert abs(plan[name] - b) <= 0.15 * b, (name, plan[name], b)
    assert memory_plan.arch_for("Qwen/Qwen2.5-Math-7B").params() == pytest.approx(7.62e9, rel=0.01)
    assert memory_plan.arch_for("Qwen/Qwen2.5-32B").params() == pytest.approx(32.5e9, rel=0.02)


LOAD_WORKER = r'''
import json, sys
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
sys.path.insert(0, sys.argv[1])
from modeling import models
import rollout
from plumbing import distributed

shard = lambda m: distributed.wrap_model(m, torch.device("cpu"), fsdp=True, grad_ckpt=sys.argv[4] == "ckpt")
model, tok = models.load_policy(sys.argv[2], shard=shard)
ids = torch.tensor(json.loads(sys.argv[3]))
sharded = all(hasattr(p, "to_local") for p in model.parameters())     # (before a forward unshards the root)
local = sum(p.to_local().numel() for p in model.parameters())
with torch.no_grad():
    logits = model(input_ids=ids).logits
json.dump({"logits": logits.tolist(), "eos": model.generation_config.eos_token_id, "local": local,
           "sharded": sharded},
          open(f"{sys.argv[5]}/rank{dist.get_rank()}.json", "w"))
dist.destroy_process_group()
'''


@pytest.mark.parametrize("ckpt", ["plain", "ckpt"])
def test_sharded_loading_gives_the_single_process_logits(tmp_path, ckpt):
    """FSDP2 on 2 CPU processes: built on the meta device, sharded, each rank reads only its slice
    of every tensor; the logits equal a plain single-process load's."""
    model, tok = models.load_policy(WARM)
    ids = [tok("Mia has 23 apples. Mia gives 5 apples to Tom.", add_special_tokens=False).input_ids[:10],
           tok("Leo owns 36 buttons. How many buttons?", add_special_tokens=False).input_ids[:10]]
    (tmp_path / "w.py").write_text(LOAD_WORKER)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-port",
                        str(29700 + os.getpid() % 1000), str(tmp_path / "w.py"), ROOT, WARM, json.dumps(ids), ckpt,
                        str(tmp_path)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)).logits
    n = sum(p.numel() for p in model.parameters())
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert_rounding("scale.sharded_load_logits", torch.tensor(res["logits"]), want)
        assert res["sharded"] and res["local"] < 0.6 * n                  # about half of the model per rank
        assert res["eos"] == model.generation_config.eos_token_id


def test_sharded_checkpoint_resumes_at_world_size_1_and_2(tmp_path):
    """An FSDP2 run saves torch.distributed.checkpoint shards (no gather to rank 0); killed after
    step 2, it resumes at world size 2 and at world size 1 to the uninterrupted run's metrics."""
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        (tmp_path / "train.jsonl").write_text("".join(next(f) for _ in range(64)))

    def run(nproc, out, steps, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master-port",
               str(29300 + nproc + os.getpid() % 1000), os.path.join(ROOT, "train.py"), "--model", WARM,
               "--train-data", str(tmp_path / "train.jsonl"), "--out", str(out), "--steps", str(steps),
               "--algo", "grpo", "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4",
               "--micro-batch", "8", "--max-new-tokens", "32", "--eval-every", "0", "--save-every", "2",
               "--fsdp", "true", "--lr", "1e-3", "--no-signal", "step", *extra]   # every step taken
        r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f], r.stdout

    full, _ = run(2, tmp_path / "full", 4)
    exported, _ = models.load_policy(str(tmp_path / "full" / "hf"))          # the final save's HF export
    assert exported.num_parameters() == models.load_policy(WARM)[0].num_parameters()
    run(2, tmp_path / "cut2", 2)
    assert (tmp_path / "cut2" / "ckpt" / "dcp").is_dir() and not list((tmp_path / "cut2" / "ckpt").glob("*.safetensors"))
    shutil.copytree(tmp_path / "cut2", tmp_path / "cut1")
    for nproc, name in ((2, "cut2"), (1, "cut1")):
        resumed, out = run(nproc, tmp_path / name, 4, "--resume")
        assert f"resumed from {tmp_path / name}/ckpt at step 2" in out
        assert [m["step"] for m in resumed] == [1, 2, 3, 4]
        for a, b in zip(full, resumed):
            for k in ("reward", "train_acc", "query_kl", "policy_kl", "grad_norm", "pg_loss", "entropy"):
                assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (nproc, a["step"], k)


def test_gpu_check_runs_its_code_on_a_tiny_model():
    """bench/gpu_check.py (the one-shot GPU check) at toy widths on the CPU runs every item of its
    code path: one line per item, no FAIL, the CPU-runnable items PASS (the decode grid, the update's
    per-layer fit, the ragged batch in fp32 and bf16-mixed with its SDPA masks, train.main under FSDP2
    on a process group of one, its export, the KV cache's one pass, the full-depth update micro-batch
    against the plan, the one pass's decode throughput, the decode comparison, the sampler vs pi_old),
    the GPU-only ones SKIP with their reason (the float32-output GEMM, the --kv-budget 0 slots,
    train/memory), then the summary."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--preset", "tiny", "--device", "cpu"],
                       cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = {}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASS", "FAIL", "SKIP"):
            item = rest.split(" ", 1)[0]
            assert item not in status, f"{item} reported twice:\n{r.stdout}"
            status[item] = word
    must_pass = ["decode-grid", "decode-pass", "update-fit", "ragged-score/sdpa/fp32",
                 "ragged-sample/sdpa/fp32", "ragged-score/sdpa/bf16-mixed", "ragged-sample/sdpa/bf16-mixed",
                 "train/fsdp2", "train/reload", "kv-cache", "update-memory", "decode-speed", "sampler-gap"]
    may_skip = [f"ragged-{k}/{attn}/{prec}" for k in ("score", "sample") for attn in ("sdpa", "flash_attention_2")
                for prec in ("fp32", "bf16", "bf16-mixed")] + ["train/memory", "fp32-matmul", "kv-budget"]
    assert "FAIL" not in status.values(), r.stdout
    assert {k: status.get(k) for k in must_pass} == dict.fromkeys(must_pass, "PASS"), r.stdout
    assert set(status) == set(must_pass) | set(may_skip), r.stdout
    assert status["fp32-matmul"] == status["kv-budget"] == "SKIP", r.stdout           # CUDA only
    step = next(ln for ln in r.stdout.splitlines() if ln.startswith("phase step "))
    assert "measured: n/a (no GPU)" in step, r.stdout
    assert r.stdout.splitlines()[-1].startswith(f"gpu_check: {len(must_pass)} PASS, 0 FAIL, "), r.stdout


# The memory check's model (configs/models/memcheck-20m.json) at widths a fake step runs in seconds.
MEMCHECK = ["--model", "memcheck-20m", "--max-prompt-len", "1008", "--max-new-tokens", "16", "--group-size", "2",
            "--rollout-batch", "16", "--update-batch", "16", "--micro-batch", "1", "--gen-batch", "2"]


def test_the_dry_run_measures_ddp_replicas(capsys):
    """--dry-run without --fsdp (DDP: a full replica per GPU) measures the step too: on fake ranks the
    replica runs unwrapped (DDP's construction and reduction hooks need values), holding what a DDP
    rank holds (its gradients are views into the reduction buckets); within 15% of the plan."""
    import train
    from plumbing import memory_plan
    from rl import memory_measure

    args, algo = train.parse_args([*MEMCHECK, "--dtype", "float32", "--fsdp", "false"])
    measured = memory_measure.measure_memory(args, algo, world=8)
    plan = memory_plan.phases(memory_plan.arch_for(args.model), args, 8, train.needs_reference_model(args, algo))
    for phase in memory_plan.PHASES:
        assert measured.peaks[phase] == pytest.approx(plan[phase], rel=0.15), phase
    train.main(["--dry-run"])                            # the tiny default (DDP): "data is not allocated yet"
    out = capsys.readouterr().out
    assert ", DDP" in out and "measured: fake tensors on 8 rank(s)" in out


@pytest.mark.parametrize("argv", [["--rollout-batch", "100000000"], ["--max-new-tokens", "10000000"],
                                  ["--group-size", "100000000"]])
def test_a_dry_run_of_absurd_sizes_plans_without_allocating_them(capsys, argv):
    """The measurement plans its worst-case step from real host tensors; sizes that would take more
    host memory than memory_measure.HOST_BUDGET are not measured (said), the plan is printed."""
    import train

    train.main(["--dry-run", *argv])
    out = capsys.readouterr().out
    assert "  not measured: its worst-case rollout (" in out and "GiB of host memory to plan" in out
    assert out.strip().splitlines()[-1].startswith("plan: peak_gib_per_gpu=")


def test_a_dry_run_refuses_the_sizes_a_run_refuses(capsys):
    import train

    with pytest.raises(SystemExit) as e:
        train.main(["--dry-run", "--plan-gpus", "64"])
    assert e.value.code == "error: --update-batch 16 must be divisible by the world size 64"
