"""The SFT warm start: next-token loss over the WHOLE sequence, prompt tokens included.

Why the prompt is in the loss: the model must learn a real query distribution, or Query-KL (which
measures how the policy's scores of the questions drift, method.md §2) would measure nothing. The
tiny world's warm start is made by `python train.py --algo sft --export data/tinymath/warmstart`.
"""

import json
import os
import time

import torch
from tqdm import tqdm

from modeling import logprobs
import rollout
from data.benchmarks import DataError, load_benchmark
from data.prompts import build_prompt
from evaluation.heldout import heldout_at_temperatures
from plumbing import checkpoints, distributed, optimizer
from rl.experience import step_indices

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinymath")
OPTIONS = [  # train.py's options table ends with these (same columns)
    ("sft_data",          os.path.join(TINY, "sft.jsonl"),     "SFT corpus (problem + solution rows)"),
    ("sft_steps",         750,                                 "SFT optimizer steps", ">=0"),
    ("sft_batch",         64,                                  "SFT sequences per step (global)", ">=1"),
    ("sft_lr",            3e-3,                                "SFT learning rate (constant after warm-up)", ">0"),
    ("sft_warmup",        100,                                 "SFT warm-up steps", ">=0"),
    ("max_seq_len",       192,                                 "SFT: longer examples are dropped", ">=2"),
]


def load_sequences(path, tokenizer, template, max_seq_len) -> list[list[int]]:
    """prompt + solution + EOS token ids of every row of an SFT file; longer ones are dropped."""
    if path.endswith(".jsonl") and not os.path.exists(path):
        raise DataError(f"{path}: not found (run `python -m data.tinymath.prepare` to make the tiny world's)")
    rows = load_benchmark(path)
    has_solution = [isinstance(r.get("solution"), str) and bool(r["solution"].strip()) for r in rows]
    if not all(has_solution):                        # the solution is what SFT learns: no row goes without
        bad = has_solution.index(False)
        raise DataError(f"{path}: row {bad + 1} has no \"solution\" text (an SFT row is a problem and its "
                        "worked solution)")
    eos = tokenizer.eos_token
    seqs = [tokenizer(build_prompt(tokenizer, r["problem"], template) + r["solution"] + eos,
                      add_special_tokens=False).input_ids for r in rows]
    return [s for s in seqs if len(s) <= max_seq_len]


def sft_loss(model, batch, pad_id, n_tok_global, device):
    """Token-mean NLL of a micro-batch of token lists, divided by the GLOBAL token count (so the
    micro-batches and ranks add up to the one-big-batch loss)."""
    L = max(map(len, batch))
    ids = torch.tensor([x + [pad_id] * (L - len(x)) for x in batch], device=device)
    mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in batch], device=device)
    logp, _ = logprobs.token_logprobs(model, ids, mask)
    return -(logp * mask[:, 1:]).sum() / n_tok_global


def train_sft(model, tokenizer, seqs, *, steps, batch, micro_batch, lr, warmup, weight_decay, grad_clip,
              seed, device, log, save_every=0, on_checkpoint=None):
    """`steps` AdamW steps of `batch` sequences (split across ranks, micro-batched)."""
    rank, world = distributed.rank_world()
    if batch % world:
        raise SystemExit(f"error: --sft-batch {batch} must be divisible by the world size {world}")
    opt = optimizer.adamw(model, lr, weight_decay, betas=(0.9, 0.95))
    sched = optimizer.warmup_then_constant(opt, warmup)
    per_rank = batch // world
    distributed.print0(f"sft: {len(seqs)} sequences, {steps} steps x {batch} sequences "
                       f"({per_rank} per rank, micro-batch {micro_batch})")
    bar = tqdm(range(steps), desc="sft", disable=rank != 0)
    for step in bar:
        t0 = time.time()
        mine = [seqs[i]
                for i in step_indices(len(seqs), step, batch, seed)[rank * per_rank:(rank + 1) * per_rank]]
        n_tok = distributed.all_sum(torch.tensor(float(sum(len(s) - 1 for s in mine))))
        tot = torch.zeros(())
        for s in range(0, len(mine), micro_batch):
            with distributed.grad_sync(model, s + micro_batch >= len(mine)):
                loss = sft_loss(model, mine[s:s + micro_batch], tokenizer.pad_token_id, n_tok, device)
                (loss * world).backward()  # DDP averages over ranks: undo it
            tot += loss.detach().cpu()
        gn = float(optimizer.clip_grad(model, grad_clip))
        lr = opt.param_groups[0]["lr"]                                  # this step's (not the next's)
        optimizer.step(opt, sched)
        m = {"step": step + 1, "sft_loss": distributed.all_sum(tot).item(), "grad_norm": gn,
             "lr": lr, "step_time": time.time() - t0}
        if on_checkpoint and save_every and (step + 1) % save_every == 0:
            m.update(on_checkpoint(step + 1))
        bar.set_postfix(loss=f"{m['sft_loss']:.3f}", acc=m.get("eval_acc", ""))
        log(m)
    return model


def run(a, d, model, tokenizer, seqs, evalsets, log, amp):
    """--algo sft: the warm start, with an HF folder at each --save-every and held-out accuracy there
    and at the end (none with --eval-every 0)."""
    bf16 = distributed.uses_bf16(a.dtype, d.device)
    spec = rollout.SampleSpec.make(model, tokenizer, a.max_new_tokens, a.sampler, a.gen_batch, a.kv_budget,
                                   bf16, compile_decode=a.compile_decode)
    model = distributed.wrap_model(model, d.device, a.fsdp, bf16=bf16)

    def heldout():
        if not a.eval_every:
            return {}
        return heldout_at_temperatures(model, tokenizer, evalsets, spec, a.eval_temperatures, a.seed)

    def on_checkpoint(step):
        checkpoints.export(model, tokenizer, os.path.join(a.out, f"sft-{step:05d}"), a.export_dtype,
                           bf16=bf16)
        return heldout()
    with amp():
        train_sft(model, tokenizer, seqs, steps=a.sft_steps, batch=a.sft_batch, micro_batch=a.micro_batch,
                  lr=a.sft_lr, warmup=a.sft_warmup, weight_decay=a.weight_decay, grad_clip=a.grad_clip,
                  seed=a.seed, device=d.device, log=log, save_every=a.save_every, on_checkpoint=on_checkpoint)
        acc = heldout()
    if acc:
        log({"step": a.sft_steps, **acc})
        distributed.print0(json.dumps(acc, indent=1))
    checkpoints.export(model, tokenizer, a.export, a.export_dtype, bf16=bf16)
