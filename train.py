"""Train a policy with ERPO, GRPO or a relative of theirs, or warm-start it with SFT.

    torchrun train.py --algo erpo --alpha 0.01            # ERPO on the embedded tiny world (CPU ok)
    torchrun train.py --algo grpo                         # the GRPO baseline, same setup
    torchrun --nproc_per_node=8 train.py --config configs/paper_qwen7b.json --algo erpo
    python train.py --algo sft --export data/tinymath/warmstart   # the warm start (from data/tinymath/base)

One RL step reads top to bottom in `rl_step`: pick prompts -> sample G responses each -> rewards ->
advantages (x query weights) -> PPO updates over micro-batches -> log. What distinguishes the
algorithms is a row of `losses.ALGOS`; every loss term is in `losses.py`.
"""

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

import losses
import reward
import rollout
from data.benchmarks import load_benchmark, load_problems
from data.prompts import build_prompt

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "data", "tinymath")

# ----------------------------------------------------------------------------------------------
# Defaults: the embedded tiny world, sized to finish in minutes on 2 CPU cores. The paper's full
# setup is configs/paper_qwen7b.json (loaded with --config; command-line flags override it).
DEFAULTS = dict(
    algo="erpo", model=os.path.join(TINY, "warmstart"), train_data=os.path.join(TINY, "train.jsonl"),
    eval_data=["tiny-test", "tiny-ood", "tiny-hard"], template="plain", out=None, seed=0,
    # rollout: prompts per step, responses per prompt, sampling
    steps=50, rollout_batch=32, update_batch=16, group_size=8, temperature=1.0, top_p=1.0,
    max_prompt_len=128, max_new_tokens=96, sampler="kv", gen_batch=256,
    # optimisation
    lr=2e-4, weight_decay=0.01, warmup=0, grad_clip=1.0, ppo_epochs=1, micro_batch=64, dtype="auto",
    fsdp=False,
    # algorithm parts (None = the algorithm's own default from losses.ALGOS)
    alpha=None, beta=None, kl=None, kl_in=None, weights=None, adv=None, eps_low=None, eps_high=None,
    dual_clip=None, agg=None, dynamic_sampling=None, overlong=None, overlong_cache=16,
    max_resample_rounds=4, reward="acc", measure_policy_kl=True,
    # evaluation / checkpoints
    eval_every=10, eval_temperature=1.0, eval_limit=200, save_every=20, resume=False, export=None,
    # sft (warm start)
    sft_data=os.path.join(TINY, "sft.jsonl"), sft_steps=750, sft_batch=64, sft_lr=3e-3,
    sft_warmup=100, max_seq_len=192,
)


def parse_args(argv=None):
    algos = "\n".join(f"  {k:10s} {a.doc}" for k, a in losses.ALGOS.items())
    p = argparse.ArgumentParser(
        description=__doc__ + "\nalgorithms (--algo):\n  sft        supervised warm start, prompt tokens in the loss\n" + algos,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON file of defaults (keys as below, with _), e.g. configs/paper_qwen7b.json")
    add = p.add_argument
    add("--algo", choices=["sft", *losses.ALGOS])
    add("--model", help="HF folder or hub id of the policy (also the reference model)")
    add("--train-data", help="training problems: JSONL path or benchmark name")
    add("--eval-data", nargs="*", help="held-out sets for periodic evaluation (names or paths)")
    add("--template", choices=["plain", "paper"], help="prompt template (data/prompts.py)")
    add("--out", help="run folder (config.json, metrics.jsonl, checkpoints); default runs/<algo>")
    add("--seed", type=int)
    add("--steps", type=int, help="RL steps (one rollout batch each)")
    add("--rollout-batch", type=int, help="prompts sampled per RL step (global, all ranks)")
    add("--update-batch", type=int, help="prompts per optimizer step (global); rollout/update = optimizer steps per RL step")
    add("--group-size", type=int, help="responses per prompt (G)")
    add("--temperature", type=float, help="rollout temperature; log-probs are computed on logits/T")
    add("--top-p", type=float)
    add("--max-prompt-len", type=int, help="longer prompts are dropped from the training set")
    add("--max-new-tokens", type=int)
    add("--sampler", choices=["kv", "hf"], help="our KV-cache sampler or HF generate")
    add("--gen-batch", type=int, help="rows per sampler call")
    add("--lr", type=float)
    add("--weight-decay", type=float)
    add("--warmup", type=int, help="linear warm-up, in optimizer steps")
    add("--grad-clip", type=float)
    add("--ppo-epochs", type=int)
    add("--micro-batch", type=int, help="sequences per forward/backward on each rank")
    add("--dtype", choices=["auto", "float32", "bfloat16"], help="auto: fp32 weights + bf16 autocast on CUDA, fp32 on CPU")
    add("--fsdp", type=_bool, help="shard the policy with FSDP2 instead of DDP replicas (true/false; large models)")
    add("--alpha", type=float, help="Query-KL coefficient")
    add("--beta", type=float, help="Policy-KL coefficient")
    add("--kl", choices=["k1", "k2", "k3", "none"], help="Policy-KL estimator (none = no Policy-KL)")
    add("--kl-in", choices=["loss", "reward"], help="where the Policy-KL goes")
    add("--weights", choices=["none", "paper", "code"], help="query reweighting (ERPO.md §4)")
    add("--adv", choices=["grpo", "drgrpo", "rloo"], help="advantage estimator")
    add("--eps-low", type=float)
    add("--eps-high", type=float)
    add("--dual-clip", type=float, help="dual-clip constant c (0 = off)")
    add("--agg", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
    add("--dynamic-sampling", type=_bool, help="DAPO: drop groups whose accuracies are all equal, resample (true/false)")
    add("--overlong", type=_bool, help="DAPO soft overlong punishment (true/false)")
    add("--overlong-cache", type=int, help="L_cache of the overlong punishment (L_max = --max-new-tokens)")
    add("--max-resample-rounds", type=int, help="dynamic sampling: extra sampling rounds at most")
    add("--reward", choices=["acc", "acc+format"], help="binary accuracy or 0.9*acc + 0.1*format")
    add("--measure-policy-kl", type=_bool, help="keep a reference model to log Policy-KL even when the loss has none")
    add("--eval-every", type=int)
    add("--eval-temperature", type=float)
    add("--eval-limit", type=int, help="problems per held-out set (0 = all)")
    add("--save-every", type=int)
    add("--resume", action="store_true", default=None, help="continue the run in --out from its checkpoint")
    add("--export", help="after training, save the final model + tokenizer to this folder")
    add("--sft-data")
    add("--sft-steps", type=int)
    add("--sft-batch", type=int)
    add("--sft-lr", type=float)
    add("--sft-warmup", type=int)
    add("--max-seq-len", type=int, help="SFT: longer examples are dropped")
    args = p.parse_args(argv)

    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            extra = json.load(f)
        unknown = set(extra) - set(cfg)
        if unknown:
            p.error(f"{args.config}: unknown keys {sorted(unknown)}")
        cfg.update(extra)
    cfg.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    if cfg["algo"] == "sft" and args.model is None and "model" not in _config_keys(args):
        cfg["model"] = os.path.join(TINY, "base")
    cfg["out"] = cfg["out"] or os.path.join("runs", cfg["algo"])
    return argparse.Namespace(**cfg)


def _config_keys(args):
    if not args.config:
        return set()
    with open(args.config) as f:
        return set(json.load(f))


def _bool(s):
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def algo_from_args(args) -> losses.Algo:
    """The algorithm's row of losses.ALGOS, with any part overridden by a flag."""
    dual = None if args.dual_clip is None else ("none" if args.dual_clip <= 0 else args.dual_clip)
    return losses.make_algo(
        args.algo, alpha=args.alpha, beta=args.beta, policy_kl=args.kl, kl_in=args.kl_in,
        weights=args.weights, advantage=args.adv, eps_low=args.eps_low, eps_high=args.eps_high,
        dual_clip=dual, agg=args.agg, dynamic_sampling=args.dynamic_sampling, overlong=args.overlong)


# ----------------------------------------------------------------------------------------------
# Distributed set-up: torchrun sets RANK / WORLD_SIZE; one process without torchrun works too.


def setup_distributed():
    """-> (rank, world, device). DDP over gloo on CPU, nccl on GPU (torchrun sets the env)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def all_sum(x: torch.Tensor, op=None) -> torch.Tensor:
    """Reduce a tensor over ranks (sum by default; a no-op on one process). nccl reduces only
    CUDA tensors, so CPU scalars make a round trip."""
    if not dist.is_initialized():
        return x
    y = x.detach().clone().to("cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(y, op=op or dist.ReduceOp.SUM)
    return y.to(x.device)


def all_max(x: torch.Tensor) -> torch.Tensor:
    return all_sum(x, dist.ReduceOp.MAX) if dist.is_initialized() else x


def all_gather_list(items: list) -> list:
    """Concatenate per-rank Python lists in rank order."""
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def wrap_model(model, device, fsdp=False, bf16=False):
    """DDP (a full replica per rank), or FSDP2 (`fully_shard` each decoder layer, then the root:
    parameters, gradients and Adam state sharded across ranks, what 7B/32B models need)."""
    if not dist.is_initialized():
        return model
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        return fully_shard(model, **kw)
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextmanager
def grad_sync(model, sync):
    """Gradient accumulation: skip the cross-rank gradient reduction on all but the last
    micro-batch (DDP's no_sync, FSDP2's set_requires_gradient_sync)."""
    if sync or not dist.is_initialized():
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def full_state(model, opt=None):
    """Full (unsharded, CPU) model and optimizer state dicts on rank 0 -- a collective under
    FSDP2, where each rank holds only shards; the plain state dicts otherwise."""
    if not is_fsdp(model):
        return _unwrap(model).state_dict(), (opt.state_dict() if opt is not None else None)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=o), (get_optimizer_state_dict(model, opt, options=o) if opt is not None else None)


def is_fsdp(model):
    return type(model).__name__.startswith("FSDP")


def precision(name, device):
    """-> (parameter dtype, autocast context factory). "auto": float32 master weights with bf16
    autocast on CUDA (updates of lr ~1e-6 vanish in bf16 weights), plain float32 on CPU."""
    if name == "auto" and device.type == "cuda":
        return torch.float32, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return (torch.float32 if name == "auto" else getattr(torch, name)), nullcontext


# ----------------------------------------------------------------------------------------------
# Data


def load_prompts(source, tokenizer, template, max_prompt_len=None, limit=None, training=False):
    """Problems -> (rows, prompt token ids). Prompts longer than max_prompt_len are dropped."""
    rows = (load_problems if training else load_benchmark)(source, limit=limit)
    ids = [tokenizer(build_prompt(tokenizer, r["problem"], template), add_special_tokens=False).input_ids
           for r in rows]
    keep = [i for i, x in enumerate(ids) if max_prompt_len is None or len(x) <= max_prompt_len]
    if len(keep) < len(rows):
        print(f"dropped {len(rows) - len(keep)} of {len(rows)} prompts longer than {max_prompt_len} tokens")
    return [rows[i] for i in keep], [ids[i] for i in keep]


def row_seed(*parts) -> int:
    """A 62-bit seed from integers, the same on every rank (per-row sampling seeds)."""
    h = 1469598103934665603
    for x in parts:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h >> 2


def step_prompts(n_data, step, batch, seed):
    """Global indices of the prompts of RL step `step`: an epoch-wise shuffle (drop_last), so a
    run is a function of (seed, step) and resuming needs no data-loader state."""
    per_epoch = n_data // batch
    if per_epoch == 0:
        raise ValueError(f"rollout batch {batch} is larger than the training set ({n_data})")
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_data, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return perm[k * batch:(k + 1) * batch]


def rank_slice(n, rank, world, update_batch):
    """Positions (within a rollout batch of n prompts) that this rank owns: each update batch is
    split evenly across ranks, so every optimizer step sees the same global prompts at any world
    size (what makes 1-process and 2-process runs comparable)."""
    per = update_batch // world
    return [u + rank * per + i for u in range(0, n, update_batch) for i in range(per)]


# ----------------------------------------------------------------------------------------------
# Sequence layout: a rollout row is [left-padded prompt | right-padded response]. One forward over
# it gives both the response log-probs (policy loss) and the prompt log-probs (Query-KL).


def pack(ro):
    """-> input_ids, attention_mask (B, P+R), prompt_tok_mask (B, P-1) and P. Position j of a
    token_logprobs output scores token j+1: the prompt slice [:, :P-1] scores prompt tokens after
    the first one (the mask needs the previous token to be a real prompt token too); the response
    slice is [:, P-1:]."""
    P = ro.prompt_ids.shape[1]
    input_ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)
    attn = torch.cat([ro.prompt_mask, ro.response_mask], 1)
    prompt_tok_mask = ro.prompt_mask[:, 1:] * ro.prompt_mask[:, :-1]
    return input_ids, attn, prompt_tok_mask, P


def forward_logprobs(model, input_ids, attn, P, temperature, with_entropy=False):
    """One forward -> (response logp (B,R), prompt logp (B,P-1), entropy (B,R) or None)."""
    logp, ent = rollout.token_logprobs(model, input_ids, attn, temperature, with_entropy)
    return logp[:, P - 1:], logp[:, :P - 1], (ent[:, P - 1:] if ent is not None else None)


def right_align(seqs: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D tensors right-aligned into (B, width) (zeros on the left), matching the
    left-padded prompt layout."""
    out = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        s = s[-width:] if len(s) > width else s
        if len(s):
            out[i, width - len(s):] = s
    return out


def take(ro, idx):
    """Rows `idx` of a Rollout."""
    return rollout.Rollout(**{f: getattr(ro, f)[idx] for f in
                              ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "finished")})


def cat_rollouts(ros, pad_id):
    """Concatenate Rollouts of different widths (prompts stay left-padded, responses right-padded)."""
    if len(ros) == 1:
        return ros[0]
    P = max(r.prompt_ids.shape[1] for r in ros)
    R = max(r.response_ids.shape[1] for r in ros)
    F = torch.nn.functional
    left = lambda x, v: F.pad(x, (P - x.shape[1], 0), value=v)   # noqa: E731
    right = lambda x, v: F.pad(x, (0, R - x.shape[1]), value=v)  # noqa: E731
    return rollout.Rollout(
        prompt_ids=torch.cat([left(r.prompt_ids, pad_id) for r in ros]),
        prompt_mask=torch.cat([left(r.prompt_mask, 0) for r in ros]),
        response_ids=torch.cat([right(r.response_ids, pad_id) for r in ros]),
        response_mask=torch.cat([right(r.response_mask, 0) for r in ros]),
        logprobs=torch.cat([right(r.logprobs, 0.0) for r in ros]),
        finished=torch.cat([r.finished for r in ros]))


def decode(tokenizer, ro):
    lens = ro.response_mask.sum(1).tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(ro.response_ids.tolist(), lens)],
                                  skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# The Query-KL reference cache (ERPO.md §3): per-token log-probs of every training prompt under the
# reference (= initial) policy, computed once before RL. ERPO then needs no reference model.


@torch.no_grad()
def build_query_cache(model, prompt_ids, pad_id, temperature, device, batch=64, rank=0, world=1):
    """-> list over prompts of 1-D float32 tensors: log p_ref(x_t | x_<t) for t = 2..T."""
    mine = list(range(rank, len(prompt_ids), world))
    # Same number of forwards on every rank (FSDP2 gathers weights collectively): pad with repeats.
    mine += mine[-1:] * (-(-len(prompt_ids) // world) - len(mine))
    out = []
    for s in tqdm(range(0, len(mine), batch), desc="query-KL reference cache", disable=rank != 0, leave=False):
        rows = [prompt_ids[i] for i in mine[s:s + batch]]
        P = max(map(len, rows))
        ids = torch.tensor([[pad_id] * (P - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=device)
        logp, _ = rollout.token_logprobs(model, ids, mask, temperature)  # (b, P-1)
        out += [(mine[s + i], logp[i, P - len(r):].float().cpu()) for i, r in enumerate(rows)]
    out = all_gather_list(out)
    cache = [None] * len(prompt_ids)
    for i, t in out:
        cache[i] = t
    return cache


def load_or_build_cache(path, meta, model, prompt_ids, pad_id, args, device, rank, world, resuming):
    """A resumed run must reuse its cache (its policy is no longer the reference); a fresh run
    always rebuilds it, so a stale file from an older run in the same folder is never read."""
    if resuming:
        if not os.path.exists(path):
            raise SystemExit(f"error: resuming but {path} is missing; the reference cache must come "
                             "from the initial model, so start a fresh run")
        saved = torch.load(path)
        if saved["meta"] != meta:
            raise SystemExit(f"error: {path} was built for {saved['meta']}, this run is {meta}; "
                             "use a fresh --out or delete the cache")
        return saved["logp"]
    cache = build_query_cache(_unwrap(model), prompt_ids, pad_id, args.temperature, device,
                              batch=args.micro_batch, rank=rank, world=world)
    if rank == 0:
        torch.save({"meta": meta, "logp": cache}, path)
    return cache


def _unwrap(model):
    return getattr(model, "module", model)


# ----------------------------------------------------------------------------------------------
# Held-out evaluation during training: accuracy of one sample per problem at a fixed temperature.


@torch.no_grad()
def heldout_accuracy(model, tokenizer, evalsets, args, eos, rank, world, step):
    """-> {"eval_acc": acc on the first set, "eval_acc/<name>": ..., "eval_acc/<name>/L<level>": ...}."""
    out = {}
    for si, (name, (rows, ids)) in enumerate(evalsets.items()):
        mine = list(range(rank, len(rows), world))
        n_mine = len(mine)  # ranks can differ by one problem (or hold none); pad with repeats so
        mine += [mine[-1] if mine else 0] * (-(-len(rows) // world) - n_mine)  # all sample alike
        local = []
        if mine:
            ro = rollout.sample(_unwrap(model), [ids[i] for i in mine], max_new_tokens=args.max_new_tokens,
                                eos_ids=eos, pad_id=tokenizer.pad_token_id, temperature=args.eval_temperature,
                                top_p=1.0, seeds=[row_seed(args.seed, 99, si, i) for i in mine],
                                sampler=args.sampler, batch_size=args.gen_batch)
            scores, _ = reward.score_batch(decode(tokenizer, ro), [rows[i]["answer"] for i in mine])
            local = [(rows[i].get("level"), s) for i, s in zip(mine, scores)][:n_mine]
        res = all_gather_list(local)
        out[f"eval_acc/{name}"] = sum(s for _, s in res) / len(res)
        for lv in sorted({lv for lv, _ in res if lv is not None}):
            sel = [s for l_, s in res if l_ == lv]
            out[f"eval_acc/{name}/L{lv}"] = sum(sel) / len(sel)
    if evalsets:
        out["eval_acc"] = out[f"eval_acc/{next(iter(evalsets))}"]
    return out


# ----------------------------------------------------------------------------------------------
# SFT warm start: next-token loss over the WHOLE sequence, prompt tokens included, so the model
# learns a real query distribution (Query-KL measures its drift; a model that never modelled the
# questions would make Query-KL meaningless).


def train_sft(args, model, tokenizer, rank, world, device, log, on_checkpoint=None):
    rows = load_benchmark(args.sft_data) if os.path.exists(args.sft_data) or not args.sft_data.endswith(".jsonl") else None
    if rows is None:
        raise SystemExit(f"error: {args.sft_data} not found; run `python -m data.tinymath.prepare` first")
    eos = tokenizer.eos_token
    seqs = [tokenizer(build_prompt(tokenizer, r["problem"], args.template) + r["solution"] + eos,
                      add_special_tokens=False).input_ids for r in rows]
    seqs = [s for s in seqs if len(s) <= args.max_seq_len]
    if args.sft_batch % world:
        raise SystemExit(f"error: --sft-batch {args.sft_batch} must be divisible by the world size {world}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    # linear warm-up, then constant: every prefix of a run is itself a run, so the warm start's
    # length can be chosen from one curve and regenerated exactly with --sft-steps.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.sft_warmup)))
    per_rank = args.sft_batch // world
    print0(rank, f"sft: {len(seqs)} sequences, {args.sft_steps} steps x {args.sft_batch} sequences "
                 f"({per_rank} per rank, micro-batch {args.micro_batch})")
    pad = tokenizer.pad_token_id
    bar = tqdm(range(args.sft_steps), desc="sft", disable=rank != 0)
    for step in bar:
        t0 = time.time()
        idx = step_prompts(len(seqs), step, args.sft_batch, args.seed)[rank * per_rank:(rank + 1) * per_rank]
        batch = [seqs[i] for i in idx]
        n_tok = all_sum(torch.tensor(float(sum(len(s) - 1 for s in batch))))
        tot = torch.zeros(())
        for s in range(0, len(batch), args.micro_batch):
            mb = batch[s:s + args.micro_batch]
            L = max(map(len, mb))
            ids = torch.tensor([x + [pad] * (L - len(x)) for x in mb], device=device)
            mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in mb], device=device)
            last = s + args.micro_batch >= len(batch)
            with grad_sync(model, last):
                logp, _ = rollout.token_logprobs(model, ids, mask)
                loss = -(logp * mask[:, 1:]).sum() / n_tok  # token-mean NLL over the global batch
                (loss * world).backward()                  # DDP averages over ranks: undo it
            tot += loss.detach().cpu()
        gn = clip_grad(model, args.grad_clip)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        m = {"step": step + 1, "sft_loss": all_sum(tot).item(), "grad_norm": gn,
             "lr": sched.get_last_lr()[0], "step_time": time.time() - t0}
        if on_checkpoint and args.save_every and (step + 1) % args.save_every == 0:
            m.update(on_checkpoint(step + 1))
        bar.set_postfix(loss=f"{m['sft_loss']:.3f}", acc=m.get("eval_acc", ""))
        log(m)
    return model


# ----------------------------------------------------------------------------------------------
# RL: one step = collect rollouts -> score -> advantages -> PPO updates.


def sample_groups(policy, tokenizer, data_ids, gidx, step, round_, args, eos):
    """G responses for each prompt index in gidx (consecutive rows form a group)."""
    G = args.group_size
    prompts = [data_ids[i] for i in gidx for _ in range(G)]
    seeds = [row_seed(args.seed, step, round_, i, j) for i in gidx for j in range(G)]
    return rollout.sample(_unwrap(policy), prompts, max_new_tokens=args.max_new_tokens, eos_ids=eos,
                          pad_id=tokenizer.pad_token_id, temperature=args.temperature, top_p=args.top_p,
                          seeds=seeds, sampler=args.sampler, batch_size=args.gen_batch)


def score(tokenizer, ro, answers, args, algo):
    """-> rewards (B,), accuracy (B,), reward-outcome counts. DAPO adds its overlong shaping."""
    fmt = args.reward == "acc+format"
    scores, counts = reward.score_batch(decode(tokenizer, ro), answers, format_reward=fmt)
    scores = torch.tensor(scores)
    acc = (scores >= 0.9).float() if fmt else scores
    rewards = scores.clone()
    if algo.overlong:
        rewards += losses.overlong_penalty(ro.response_mask.sum(1).float(), args.max_new_tokens, args.overlong_cache)
    return rewards, acc, counts


def collect(policy, tokenizer, data, step, rank, world, args, algo, eos):
    """This rank's share of the rollout batch: rollouts, rewards, which groups count (`valid`,
    per row) and the prompt index of each row. DAPO's dynamic sampling drops groups whose rewards
    are all equal and samples more prompts (at most max_resample_rounds extra rounds) until this
    rank's share is full; if it never fills, the remaining slots are zero-weight groups, so every
    rank still runs the same number of micro-batches (DDP and FSDP2 need that)."""
    rows, ids = data
    G = args.group_size
    mine = [step_prompts(len(ids), step, args.rollout_batch, args.seed)[i]
            for i in rank_slice(args.rollout_batch, rank, world, args.update_batch)]
    ro = sample_groups(policy, tokenizer, ids, mine, step, 0, args, eos)
    rewards, acc, counts = score(tokenizer, ro, [rows[i]["answer"] for i in mine for _ in range(G)], args, algo)
    keep = losses.nonconstant_groups(acc, G)  # (n_groups,) bool: DAPO filters on accuracy
    info = {"zero_var_frac": 1 - keep.float().mean().item(), "resample_rounds": 0, **counts}
    first = (ro, rewards, acc, mine)  # the first sample is what train_acc/reward report
    if not algo.dynamic_sampling:
        return ro, rewards, torch.ones(len(mine) * G), mine, first, info

    parts, need = [(ro, rewards, keep, mine)], len(mine)
    have = int(keep.sum())
    for r in range(1, args.max_resample_rounds + 1):
        if all_sum(torch.tensor(float(have < need))).item() == 0:  # every rank full (ranks sample
            break                                                   # together: FSDP2 lock-step)
        extra = [step_prompts(len(ids), step * 7919 + r, args.rollout_batch, args.seed + r)[i]
                 for i in rank_slice(args.rollout_batch, rank, world, args.update_batch)]
        ro2 = sample_groups(policy, tokenizer, ids, extra, step, r, args, eos)
        rw2, acc2, _ = score(tokenizer, ro2, [rows[i]["answer"] for i in extra for _ in range(G)], args, algo)
        k2 = losses.nonconstant_groups(acc2, G)
        parts.append((ro2, rw2, k2, extra))
        have += int(k2.sum())
        info["resample_rounds"] = r
    # keep up to `need` informative groups, then fill with dropped ones marked invalid
    chosen, filler = [], []
    for pi, (_, _, k, gi) in enumerate(parts):
        for g in range(len(gi)):
            (chosen if k[g] else filler).append((pi, g))
    slots = chosen[:need] + filler[:max(0, need - len(chosen))]
    valid = torch.tensor([1.0] * min(need, len(chosen)) + [0.0] * (need - min(need, len(chosen))))
    ros, rws, gidx = [], [], []
    for pi, g in slots:
        p_ro, p_rw, _, p_gi = parts[pi]
        sel = torch.arange(g * G, (g + 1) * G)
        ros.append(take(p_ro, sel)), rws.append(p_rw[sel]), gidx.append(p_gi[g])
    info["kept_groups"] = int(valid.sum())
    return (cat_rollouts(ros, tokenizer.pad_token_id), torch.cat(rws), valid.repeat_interleave(G),
            gidx, first, info)


def microbatches(n, size):
    return [slice(s, min(n, s + size)) for s in range(0, n, size)]


@torch.no_grad()
def score_old_and_ref(policy, ref, input_ids, attn, P, args):
    """No-grad forwards over the rollout rows: the rollout policy's log-probs (the PPO 'old'
    policy), its prompt log-probs and entropy, and the reference's response log-probs."""
    outs = {"old": [], "prompt": [], "ent": [], "ref": []}
    for mb in microbatches(input_ids.shape[0], args.micro_batch):
        o, p, e = forward_logprobs(_unwrap(policy), input_ids[mb], attn[mb], P, args.temperature, with_entropy=True)
        outs["old"].append(o), outs["prompt"].append(p), outs["ent"].append(e)
        if ref is not None:
            outs["ref"].append(forward_logprobs(ref, input_ids[mb], attn[mb], P, args.temperature)[0])
    return {k: (torch.cat(v) if v else None) for k, v in outs.items()}


def query_weights(algo, gidx, G, prompt_logp, qmask, valid, upd_rows, nll_ref, nll_ref_mean):
    """Per-row query weights (ERPO.md §4), or None. paper: cached reference NLL, dataset mean,
    clip [0, 2]. code: current-policy NLL (no grad), mean over the global optimizer batch."""
    if algo.weights == "none":
        return None
    if algo.weights == "paper":
        w = losses.query_weights(nll_ref[gidx], mean_nll=nll_ref_mean, clip=(0.0, 2.0))
        return w.repeat_interleave(G)
    nll = -torch.where(qmask > 0, prompt_logp, 0.0).sum(1)  # (B,) sequence NLL of each row's prompt
    w = torch.ones_like(nll)  # DAPO filler rows (valid = 0) keep 1: they carry no loss anyway
    for rows in upd_rows:  # batch mean over each global optimizer batch, valid rows only
        v = valid[rows] > 0
        mean = (all_sum(nll[rows][v].sum()) / all_sum(v.sum().float()).clamp_min(1)).item()
        w[rows] = torch.where(v, losses.query_weights(nll[rows].clamp_min(1e-8), mean_nll=mean), 1.0)
    return w


def ppo_update(model, opt, sched, algo, batch, upd_rows, args, world):
    """One optimizer step per global update batch (x ppo_epochs), micro-batched with gradient
    accumulation. Every loss term is divided by the GLOBAL count of its update batch (tokens or
    sequences over all micro-batches and ranks), so the gradient equals that of one big batch at
    any micro-batch size and world size (DDP averages over ranks, hence the `* world`)."""
    stats, norms = {}, []
    for _ in range(args.ppo_epochs):
        for rows in upd_rows:
            mask = batch["resp_mask"][rows]
            num_tokens = all_sum(mask.sum().float()).clamp_min(1).item()
            num_seqs = all_sum(batch["valid"][rows].sum()).item()
            if num_seqs == 0:  # only DAPO filler groups (every rank sees the same count): no step
                continue
            mbs = microbatches(mask.shape[0], args.micro_batch)
            for k, mb in enumerate(mbs):
                r = range(*rows.indices(batch["input_ids"].shape[0]))[mb]
                r = slice(r.start, r.stop)
                sync = k == len(mbs) - 1 or not dist.is_initialized()
                with grad_sync(model, sync):
                    logp, plogp, _ = forward_logprobs(model, batch["input_ids"][r], batch["attn"][r],
                                                      batch["P"], args.temperature)
                    loss, st = losses.rl_loss(
                        algo, logp=logp, old_logp=batch["old"][r],
                        ref_logp=batch["ref"][r] if algo.has_policy_kl_loss else None,
                        resp_mask=batch["resp_mask"][r], advantages=batch["adv"][r],
                        weights=None if batch["w"] is None else batch["w"][r],
                        prompt_logp=plogp, prompt_ref_logp=batch["qref"][r], prompt_mask=batch["qmask"][r],
                        num_tokens=num_tokens, num_seqs=num_seqs, max_len=args.max_new_tokens)
                    (loss * world).backward()
                for key, v in st.items():
                    stats[key] = stats.get(key, 0.0) + v.item()
            norms.append(clip_grad(model, args.grad_clip))
            opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
    n_opt = max(1, len(norms))
    out = {k: all_sum(torch.tensor(v)).item() / n_opt for k, v in stats.items()}
    out["grad_norm"] = sum(norms) / n_opt
    return out


def clip_grad(model, max_norm):
    """Clip to max_norm (<= 0: no clipping) and return the pre-clip global grad norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # DTensor under FSDP2


def rl_step(step, policy, ref, opt, sched, tokenizer, data, cache, algo, args, rank, world, eos, device):
    """Everything of one RL step; returns its metrics (reduced over ranks)."""
    t0 = time.time()
    G = args.group_size
    ro, rewards, valid, gidx, first, info = collect(policy, tokenizer, data, step, rank, world, args, algo, eos)
    ro = ro.to(device)
    input_ids, attn, qmask, P = pack(ro)
    resp_mask = ro.response_mask.float() * valid.to(device)[:, None]
    qmask = qmask.float() * valid.to(device)[:, None]
    sc = score_old_and_ref(policy, ref, input_ids, attn, P, args)
    qref = right_align([cache["logp"][i] for i in gidx for _ in range(G)], P - 1).to(device)

    if algo.policy_kl is not None and algo.kl_in == "reward":  # RLOO: R - beta * sum_t KL_t
        rewards = losses.kl_penalized_rewards(rewards.to(device), sc["old"], sc["ref"], resp_mask, algo.beta, algo.policy_kl)
    adv = losses.group_advantages(rewards.to(device), G, algo.advantage)
    rows_per_update = args.update_batch // world * G
    upd_rows = microbatches(input_ids.shape[0], rows_per_update)
    w = query_weights(algo, torch.tensor(gidx), G, sc["prompt"], qmask, valid.to(device), upd_rows,
                      cache["nll"], cache["nll_mean"])
    batch = dict(input_ids=input_ids, attn=attn, P=P, resp_mask=resp_mask, qmask=qmask, valid=valid.to(device),
                 old=sc["old"], ref=sc["ref"], adv=adv, w=None if w is None else w.to(device), qref=qref)
    upd = ppo_update(policy, opt, sched, algo, batch, upd_rows, args, world)

    # --- metrics, measured on the rollout (pre-update) policy for every algorithm (paper Fig. 1)
    f_ro, f_rew, f_acc, _ = first
    n_rows = all_sum(torch.tensor(float(len(f_rew))))
    tok = all_sum(ro.response_mask.float().sum())
    m = {"step": step + 1,
         "reward": all_sum(f_rew.sum()).item() / n_rows.item(),
         "train_acc": all_sum(f_acc.sum()).item() / n_rows.item(),
         "query_kl": all_sum(losses.query_kl(sc["prompt"], qref, qmask).sum()).item() / all_sum(valid.sum()).clamp_min(1).item(),
         "entropy": all_sum((sc["ent"] * ro.response_mask).sum()).item() / tok.item(),
         "response_len": tok.item() / all_sum(torch.tensor(float(ro.response_mask.shape[0]))).item(),
         "truncated_frac": all_sum((~ro.finished).float().sum()).item() / n_rows.item(),
         "zero_var_frac": all_sum(torch.tensor(info["zero_var_frac"])).item() / world,
         **{k: upd[k] for k in ("pg_loss", "clip_frac", "grad_norm", "loss") if k in upd},
         "lr": sched.get_last_lr()[0]}
    if sc["ref"] is not None:  # k3 estimate of KL(pi_theta || pi_ref) on the sampled responses
        kl = losses.policy_kl(sc["old"], sc["ref"], "k3")
        m["policy_kl"] = all_sum((kl * resp_mask).sum()).item() / max(1.0, all_sum(resp_mask.sum()).item())
    if w is not None:
        m.update(weight_mean=all_sum(w.sum()).item() / n_rows.item(),
                 weight_min=-all_max(-w.min()).item(), weight_max=all_max(w.max()).item())
    for k in ("timeout", "error", "no_answer"):
        m[f"reward_{k}"] = all_sum(torch.tensor(float(info.get(k, 0)))).item()
    if algo.dynamic_sampling:
        m["resample_rounds"] = all_max(torch.tensor(float(info["resample_rounds"]))).item()
        m["kept_groups"] = all_sum(torch.tensor(float(info["kept_groups"]))).item()
    m["step_time"] = time.time() - t0
    return m


# ----------------------------------------------------------------------------------------------
# Run folder: config.json, metrics.jsonl, ckpt/ (HF model + tokenizer + training state).


def print0(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def open_metrics(out, start_step, rank):
    """Append-mode logger. On resume, records after the checkpoint's step are dropped (they will
    be recomputed), everything before is kept."""
    path = os.path.join(out, "metrics.jsonl")
    if rank != 0:
        return lambda m: None
    if start_step > 0 and os.path.exists(path):
        with open(path) as f:
            keep = [ln for ln in f if _step_of(ln) is not None and _step_of(ln) <= start_step]
        with open(path, "w") as f:
            f.writelines(keep)
    elif start_step == 0 and os.path.exists(path):
        os.replace(path, path + ".old")  # a fresh run never silently mixes with an older one
    f = open(path, "a")

    def log(m):
        f.write(json.dumps(m) + "\n")
        f.flush()
    return log


def _step_of(line):
    """The step of a metrics line, or None for a blank or half-written (killed mid-write) line."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return None


def save_checkpoint(out, model, tokenizer, opt, sched, step, rank):
    """HF folder (save_pretrained, safetensors) + optimizer/scheduler/step/RNG state, written to a
    temporary folder and renamed, so a run killed mid-save keeps its previous checkpoint."""
    model_sd, opt_sd = full_state(model, opt)  # every rank joins (a collective under FSDP2)
    if rank == 0:
        _save_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step)
    if dist.is_initialized():
        dist.barrier()


def _save_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step):
    import shutil
    tmp, final = os.path.join(out, "ckpt.tmp"), os.path.join(out, "ckpt")
    for leftover in (tmp, final + ".old"):  # from a run killed mid-save
        shutil.rmtree(leftover, ignore_errors=True)
    _unwrap(model).save_pretrained(tmp, state_dict=model_sd)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "opt": opt_sd, "sched": sched.state_dict(),
                "rng": torch.get_rng_state(), "py_rng": random.getstate()}, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def export(model, tokenizer, path, rank):
    if not path:
        return
    model_sd, _ = full_state(model)
    if rank == 0:
        _unwrap(model).save_pretrained(path, state_dict=model_sd)
        tokenizer.save_pretrained(path)


def print_sizes(args, world, rank, n_train):
    G, W = args.group_size, world
    n_upd = args.rollout_batch // args.update_batch
    rows = args.rollout_batch // W * G
    print0(rank, "\n".join([
        f"derived sizes (world size {W}):",
        f"  prompts / RL step          {args.rollout_batch} ({args.rollout_batch // W} per rank)",
        f"  responses / RL step        {args.rollout_batch * G} ({rows} per rank, G = {G})",
        f"  optimizer steps / RL step  {n_upd} x {args.ppo_epochs} PPO epoch(s), each on {args.update_batch} prompts"
        f" = {args.update_batch * G} responses",
        f"  micro-batches / opt step   {math.ceil(args.update_batch // W * G / args.micro_batch)} per rank"
        f" of <= {args.micro_batch} sequences",
        f"  RL steps                   {args.steps} ({args.steps * args.rollout_batch / n_train:.2f} epochs of {n_train} prompts)",
    ]))


def check_sizes(args, world):
    if args.rollout_batch % args.update_batch:
        raise SystemExit(f"error: --rollout-batch {args.rollout_batch} must be a multiple of --update-batch {args.update_batch}")
    if args.update_batch % world:
        raise SystemExit(f"error: --update-batch {args.update_batch} must be divisible by the world size {world}")


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "ckpt")
    resuming = args.resume and os.path.exists(os.path.join(ckpt, "state.pt"))
    if args.resume and not resuming:
        print0(rank, f"--resume: no checkpoint in {ckpt}, starting from scratch")
    if rank == 0:
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    dtype, amp = precision(args.dtype, device)
    try:
        model, tokenizer = rollout.load_policy(ckpt if resuming else args.model, device=device, dtype=dtype)
    except OSError as e:
        raise SystemExit(f"error: cannot load model {args.model!r}: {e}")
    eos = rollout.eos_token_ids(model, tokenizer)
    print0(rank, f"model {args.model}: {model.num_parameters() / 1e6:.2f}M parameters, {dtype}, {device}")
    state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False) if resuming else None
    start = state["step"] if state else 0
    log = open_metrics(args.out, start, rank)

    if args.algo == "sft":
        model = wrap_model(model, device, args.fsdp, bf16=device.type == "cuda" and args.dtype == "auto")
        evalsets = {n: load_prompts(n, tokenizer, args.template, limit=args.eval_limit or None) for n in args.eval_data}

        def on_checkpoint(step):  # held-out accuracy along the way + a loadable HF folder
            export(model, tokenizer, os.path.join(args.out, f"sft-{step:05d}"), rank)
            return heldout_accuracy(model, tokenizer, evalsets, args, eos, rank, world, step)
        with amp():
            train_sft(args, model, tokenizer, rank, world, device, log, on_checkpoint)
            acc = heldout_accuracy(model, tokenizer, evalsets, args, eos, rank, world, args.sft_steps)
        log({"step": args.sft_steps, **acc})
        print0(rank, json.dumps(acc, indent=1))
        export(model, tokenizer, args.export, rank)
        return

    algo = algo_from_args(args)
    check_sizes(args, world)
    print0(rank, f"algo {args.algo}: {algo}")
    data = load_prompts(args.train_data, tokenizer, args.template, args.max_prompt_len, training=True)
    evalsets = {n: load_prompts(n, tokenizer, args.template, limit=args.eval_limit or None) for n in args.eval_data}
    print_sizes(args, world, rank, len(data[0]))

    # The reference model is only needed for a Policy-KL (in the loss, the reward, or to measure
    # it). ERPO with --measure-policy-kl false keeps none: Query-KL reads the cache below.
    need_ref = algo.policy_kl is not None or args.measure_policy_kl
    ref_dtype = torch.bfloat16 if device.type == "cuda" and args.dtype == "auto" else dtype
    ref = rollout.load_policy(args.model, device=device, dtype=ref_dtype)[0].eval() if need_ref else None
    if ref is not None:
        ref.requires_grad_(False)
    meta = {"model": args.model, "data": args.train_data, "template": args.template,
            "temperature": args.temperature, "n": len(data[1]),
            "prompts_sha1": hashlib.sha1(json.dumps(data[1]).encode()).hexdigest()}
    with amp():
        logp = load_or_build_cache(os.path.join(args.out, "query_cache.pt"), meta, model, data[1],
                                   tokenizer.pad_token_id, args, device, rank, world, resuming)
    nll = torch.stack([-x.sum() for x in logp])  # s_i = -l_ref(q_i), the paper's query NLL
    cache = {"logp": logp, "nll": nll, "nll_mean": nll.mean().item()}

    model = wrap_model(model, device, args.fsdp, bf16=device.type == "cuda" and args.dtype == "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    if state:
        if is_fsdp(model):  # a full optimizer state -> this rank's shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, opt, state["opt"], options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"]), random.setstate(state["py_rng"])
        print0(rank, f"resumed from {ckpt} at step {start}")

    if start == 0 and args.eval_every:
        with amp():
            m = {"step": 0, **heldout_accuracy(model, tokenizer, evalsets, args, eos, rank, world, 0)}
        log(m)
        print0(rank, f"step 0: eval_acc {m.get('eval_acc', float('nan')):.3f}")
    bar = tqdm(range(start, args.steps), desc=args.algo, initial=start, total=args.steps, disable=rank != 0)
    for step in bar:
        with amp():
            m = rl_step(step, model, ref, opt, sched, tokenizer, data, cache, algo, args, rank, world, eos, device)
        last = step + 1 == args.steps
        if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
            with amp():
                m.update(heldout_accuracy(model, tokenizer, evalsets, args, eos, rank, world, step + 1))
        log(m)
        bar.set_postfix({k: f"{m[k]:.3f}" for k in ("train_acc", "eval_acc", "query_kl", "policy_kl", "entropy") if k in m})
        if args.save_every and ((step + 1) % args.save_every == 0 or last):
            save_checkpoint(args.out, model, tokenizer, opt, sched, step + 1, rank)
    export(model, tokenizer, args.export, rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
