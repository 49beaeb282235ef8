"""One real RL step of the tiny warm start, traced tensor by tensor: docs/walkthrough.md.

    python -m study.walkthrough                  # writes runs/walkthrough/walkthrough.md and img/
    python -m study.walkthrough --out docs       # rewrites docs/walkthrough.md and docs/img/walkthrough_*.png
    python -m study.walkthrough --tolerances     # re-measures tests/golden/walkthrough_tolerances.json

Nothing here re-implements the step. `trace` runs train.py's own code on `argv()`: `train.parse_args`,
`train.load_data`, `run_setup.setup_rl`, then `train.logged_step` for steps 1..TRACED + 1, with two
of the step's functions wrapped to keep what they are given in the traced step: `experience.collect`
(the graded experience) and `train.ppo_update` (the UpdateBatch and the rows' signal). It traces the
plain default step, `train.rl_step` (train.py's defaults: no fast path on), the step a reader reads.
The wrapped update runs the real one (ERPO's optimizer step, what train.py logs), then, from the
weights before it, splits the loss of the first update batch's first micro-batch (`train.micro_batches`)
into its terms as `train.accumulate_gradient` builds it, with `train.score` and losses.py's functions
for ERPO and for GRPO (each term's gradient alone, by autograd), checks Proposition 1 and runs GRPO's
real update from the same weights too, so "what changed" compares the two algorithms on one batch;
it puts ERPO's weights back before rl_step goes on. The numbers of the document are this trace's:
`walkthrough_doc.render` prints each through `Doc.num` (4 significant figures; study/
walkthrough_numbers.py), and tests/test_walkthrough.py regenerates the document, compares its text
exactly and each number within a tolerance measured across CPU kernel variants (as the golden
metrics', tests/rounding.py), and checks the traced step's metrics against the metrics.jsonl lines
of `train.py` run with the same arguments (`argv`).
"""

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace

import torch

import losses
from modeling import models
import train
from plumbing import distributed
from rl import experience
from study import walkthrough_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
TOLERANCES = os.path.join(ROOT, "tests", "golden", "walkthrough_tolerances.json")
SUBSET = 64        # the golden test's training subset, the first 64 tiny-train problems (s-bar: their NLL)
TRACED = 4         # the traced RL step (1-based): after 3 updates the policy is no longer the reference
SEED = 7           # its step 4 has groups with 1, 2 and 3 of 4 responses correct and one with none
FOLLOWED = 0       # the group (prompt) whose Query-KL and Policy-KL are shown token by token
GRPO = losses.ALGOS["grpo"]
METRICS = ("reward", "query_kl", "policy_kl", "loss", "grad_norm")   # checked against metrics.jsonl


def argv(data, out):
    """train.py's arguments: 4 prompts x G = 4 responses per step, one optimizer step of one
    micro-batch per RL step (so the step's loss IS the micro-batch's), up to 48 new tokens."""
    return ["--algo", "erpo", "--train-data", data, "--out", out, "--steps", str(TRACED + 1),
            "--rollout-batch", "4", "--update-batch", "4", "--group-size", "4", "--micro-batch", "16",
            "--max-new-tokens", "48", "--eval-every", "0", "--save-every", "0", "--seed", str(SEED),
            "--query-cache-dir", "", "--measure-policy-kl", "true"]   # the traced step's Policy-KL


def write_subset(folder) -> str:
    path = os.path.join(folder, "train-subset.jsonl")
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        rows = [next(f) for _ in range(SUBSET)]
    with open(path, "w") as f:
        f.write("".join(rows))
    return path


# ----------------------------------------------------------------------------------------------
# The trace


@dataclass
class Terms:
    """One algorithm's micro-batch loss, term by term (losses.py's functions on rl_loss's inputs)."""
    values: dict                       # term -> value (pg, policy_kl or query_kl: with beta / alpha)
    grads: dict                        # term -> flat gradient of that term alone
    shares: dict                       # term -> each prompt's part of it (they sum to the term)
    share_norms: dict                  # term -> the gradient norm of each prompt's part
    rl_loss: float                     # losses.rl_loss's loss on the same inputs
    query_kl: torch.Tensor             # (groups,) each prompt's Query-KL (k3 mean over its tokens)


@dataclass
class Trace:
    """What the wrapped functions of train.py saw in the traced step, and what was measured there."""
    collected: object = None           # experience.Collected
    batch: object = None               # experience.UpdateBatch
    mb: slice = None                   # the rows of the micro-batch whose loss is split into terms
    counts: dict = field(default_factory=dict)  # its update batch's num_tokens and num_seqs
    terms: dict = field(default_factory=dict)   # "erpo" / "grpo" -> Terms
    prop1: dict = field(default_factory=dict)   # Proposition 1: gradients with the responses swapped
    after: dict = field(default_factory=dict)   # "erpo" / "grpo" -> (response, prompt) log-probs after
    updates: dict = field(default_factory=dict)  # "erpo" / "grpo" -> ppo_update's statistics
    metrics: dict = field(default_factory=dict)  # train.rl_step's metrics line of the step
    next_metrics: dict = field(default_factory=dict)  # and of the step after it


def snapshot(run):
    model = distributed.unwrap(run.policy)
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            copy.deepcopy(run.opt.state_dict()), copy.deepcopy(run.sched.state_dict()))


def restore(run, snap):
    distributed.unwrap(run.policy).load_state_dict(snap[0])
    run.opt.load_state_dict(copy.deepcopy(snap[1]))
    run.sched.load_state_dict(snap[2])


def flat_grad(term, params):
    """d term / d params as one float64 vector (float32 norms over ~1M entries are off by ~1e-5)."""
    grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    flat = [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]
    return torch.cat(flat).double()


def first_micro_batch(run, batch) -> tuple[slice, dict]:
    """The rows of the first update batch's first micro-batch (experience.update_batches,
    train.micro_batches), and what train.ppo_update divides its loss terms by: the update batch's
    global response tokens and rows."""
    rows = experience.update_batches(len(batch.valid), run.args, run.dist.world)[0]
    n = distributed.all_sums({"tokens": batch.resp_mask[rows], "seqs": batch.valid[rows]})
    return train.micro_batches(run, rows)[0], {"num_tokens": max(1.0, n["tokens"]), "num_seqs": n["seqs"]}


def loss_terms(run, algo, batch, mb, counts) -> Terms:
    """The micro-batch's loss as train.accumulate_gradient builds it, one term at a time."""
    args, G = run.args, run.args.group_size
    now = train.score(run.policy, batch.packed, mb, args.temperature, algo.uses_entropy)
    old, ref, sampler = batch.scores.old[mb], batch.scores.ref[mb], batch.sampler[mb]
    mask, pmask, qref = batch.resp_mask[mb], batch.prompt_mask[mb], batch.qref[mb]
    weights = None if algo.weights == "none" else batch.weights[mb]
    denom = dict(**counts, max_len=args.max_new_tokens)
    adv = batch.adv[mb] * (1.0 if weights is None else weights)
    per_token = {"pg": losses.surrogate_loss(algo, now.response, old, adv, mask, sampler).loss}
    if algo.has_policy_kl_loss:
        per_token["policy_kl"] = algo.beta * losses.policy_kl(now.response, ref, algo.kl or "k3",
                                                              clamp=algo.kl_clamp, old_logp=old)
    qkl = losses.query_kl(now.prompt, qref, pmask, algo.qkl_estimator, algo.kl_clamp)   # (B,)

    def term(name, r):                                                   # rows r of one term
        if name == "query_kl":
            return algo.alpha * losses.aggregate(qkl[r], None, "seq-mean", num_seqs=counts["num_seqs"])
        return losses.aggregate(per_token[name][r], mask[r], algo.agg, **denom)
    names = [*per_token, *(["query_kl"] if algo.alpha > 0 else [])]
    groups = [slice(k, k + G) for k in range(0, len(qkl), G)]           # each prompt's G consecutive rows
    params = [p for p in run.policy.parameters() if p.requires_grad]
    values = {n: term(n, slice(None)) for n in names}
    loss, _ = losses.rl_loss(algo, logp=now.response, old_logp=old,
                             ref_logp=ref if algo.has_policy_kl_loss else None, resp_mask=mask,
                             advantages=batch.adv[mb], weights=weights, prompt_logp=now.prompt,
                             prompt_ref_logp=qref, prompt_mask=pmask, sampler_logp=sampler,
                             entropy=now.entropy, **denom)
    parts = {n: [term(n, g) for g in groups] for n in names}
    return Terms({n: v.item() for n, v in values.items()},
                 {n: flat_grad(v, params) for n, v in values.items()},
                 {n: [x.item() for x in xs] for n, xs in parts.items()},
                 {n: [flat_grad(x, params).norm().item() for x in xs] for n, xs in parts.items()},
                 loss.item(),
                 torch.stack([qkl.detach()[g.start] for g in groups]))


def swap_responses(packed, shift):
    """The same prompts with each row's response replaced by the one `shift` rows before it (rows in
    the step's order: shift = G gives each prompt another prompt's responses), its mask coming along."""
    P = packed.P
    ids = torch.cat([packed.input_ids[:, :P], packed.input_ids[:, P:].roll(shift, 0)], 1)
    mask = torch.cat([packed.attention_mask[:, :P], packed.attention_mask[:, P:].roll(shift, 0)], 1)
    return replace(packed, input_ids=ids, attention_mask=mask, lengths=None)


def proposition_1(run, batch, mb, counts) -> dict:
    """Gradients of ERPO's alpha * Query-KL and PG terms from train.score's forward over [prompt |
    response] rows, with the sampled responses and with each prompt given another prompt's
    responses. The Query-KL gradient is the same (method.md §3, Proposition 1)."""
    algo, args = run.algo, run.args
    swapped = swap_responses(batch.packed, args.group_size)
    qref, pmask = batch.qref[mb], batch.prompt_mask[mb]
    adv = batch.adv[mb] * batch.weights[mb]
    params = [p for p in run.policy.parameters() if p.requires_grad]
    out = {}
    for name, packed in (("sampled", batch.packed), ("swapped", swapped)):
        s = train.score(run.policy, packed, mb, args.temperature)
        qkl = losses.query_kl(s.prompt, qref, pmask, algo.qkl_estimator, algo.kl_clamp)
        mask = packed.attention_mask[mb, packed.P:].float()
        pg = losses.aggregate(losses.ppo_surrogate(s.response, s.response.detach(), adv, mask, algo).loss,
                              mask, algo.agg, num_tokens=mask.sum(), num_seqs=len(mask))
        q = algo.alpha * losses.aggregate(qkl, None, "seq-mean", num_seqs=counts["num_seqs"])
        out[name] = {"query_kl": flat_grad(q, params), "pg": flat_grad(pg, params)}
    return out


@torch.no_grad()
def rescore(run, batch):
    """(response, prompt) log-probs of the step's rows under the current weights."""
    s = train.score(run.policy, batch.packed, slice(0, len(batch.valid)), run.args.temperature)
    return s.response.clone(), s.prompt.clone()


def traced_update(trace, real_update):
    """train.ppo_update, recording: the real ERPO update, then (from the weights before it) the
    loss terms of both algorithms, Proposition 1 and GRPO's real update; ERPO's weights go back."""
    def update(run, batch, signal):
        trace.batch = batch
        trace.mb, trace.counts = first_micro_batch(run, batch)
        before = snapshot(run)
        trace.updates["erpo"] = real_update(run, batch, signal)          # the step train.py takes
        trace.after["erpo"], erpo = rescore(run, batch), snapshot(run)
        restore(run, before)
        trace.terms["erpo"] = loss_terms(run, run.algo, batch, trace.mb, trace.counts)
        grpo_batch = replace(batch, weights=None)                        # the same pi_old, A and rows
        trace.terms["grpo"] = loss_terms(run, GRPO, grpo_batch, trace.mb, trace.counts)
        trace.prop1 = proposition_1(run, batch, trace.mb, trace.counts)
        trace.updates["grpo"] = real_update(replace(run, algo=GRPO), grpo_batch, signal)
        trace.after["grpo"] = rescore(run, batch)
        restore(run, erpo)
        return trace.updates["erpo"]
    return update


def trace(folder):
    """Steps 1..TRACED + 1 of train.py on argv(), step TRACED traced (the next one checks that the
    trace left ERPO's run as it was) -> (Trace, Run)."""
    args, algo = train.parse_args(argv(write_subset(folder), os.path.join(folder, "run")))
    torch.manual_seed(args.seed)
    dist = distributed.setup(fsdp=False)
    dtype, amp = distributed.precision(args.dtype, dist.device)
    model, tokenizer = models.load_for_training(args.model, dist.device, dtype)
    _, data = train.load_data(args, tokenizer)
    run = train.setup_rl(args, algo, dist, model, tokenizer, data, None, train.lr_schedule(args))
    with amp():
        for step in range(TRACED - 1):
            train.logged_step(run, step)
    t = Trace()
    real_collect, real_update = experience.collect, train.ppo_update     # as rl_step calls them

    def collect(run, decoder, step):
        t.collected = real_collect(run, decoder, step)
        return t.collected
    experience.collect, train.ppo_update = collect, traced_update(t, real_update)
    try:
        with amp():
            t.metrics = train.logged_step(run, TRACED - 1)
    finally:
        experience.collect, train.ppo_update = real_collect, real_update
    with amp():                                      # the next step: on the weights the trace put back
        t.next_metrics = train.logged_step(run, TRACED)
    return t, run


def own_metrics(t: Trace, run) -> dict:
    """The metrics train.py logs for the step, recomputed from the trace (experience.step_metrics's
    formulas): they must equal t.metrics (checked in `main`) and metrics.jsonl (the test)."""
    b, sc = t.batch, t.batch.scores
    erpo = t.terms["erpo"]
    k3 = losses.policy_kl(sc.old, sc.ref, "k3") * b.resp_mask
    return {"reward": t.collected.first_rewards.mean().item(),
            "query_kl": losses.query_kl(sc.prompt, b.qref, b.prompt_mask).mean().item(),
            "policy_kl": (k3.sum() / b.resp_mask.sum()).item(),
            "loss": sum(erpo.values.values()),
            "grad_norm": torch.stack(list(erpo.grads.values())).sum(0).norm().item()}


# ----------------------------------------------------------------------------------------------
# The command


def generate(out) -> dict:
    """Trace, render, write out/walkthrough.md and out/img/walkthrough_*.png -> what the test and
    --tolerances need: the skeleton, the numbers, the traced metrics."""
    torch.set_num_threads(1)                                             # as the golden runs: one thread
    with tempfile.TemporaryDirectory() as tmp:
        t, run = trace(tmp)
    mine = own_metrics(t, run)
    for k in METRICS:
        if abs(mine[k] - t.metrics[k]) > 1e-5 * abs(t.metrics[k]) + 1e-9:
            raise SystemExit(f"error: the walkthrough's {k} {mine[k]} is not train.rl_step's {t.metrics[k]}: "
                             "study/walkthrough.py is out of step with train.py")
    prop1 = walkthrough_doc.rel_diff(t.prop1["sampled"]["query_kl"], t.prop1["swapped"]["query_kl"])
    if prop1 > 1e-6:
        raise SystemExit(f"error: Proposition 1: the Query-KL gradient moved by {prop1:.2e} (relative) "
                         "when the responses were swapped")
    setup = {"traced": TRACED, "subset": SUBSET, "followed": FOLLOWED, "metrics": mine,
             "metric_keys": METRICS,
             "command": shlex.join(["python", "train.py", *argv("/tmp/subset.jsonl", "runs/walkthrough")])}
    doc, figures = walkthrough_doc.render(t, run, setup)
    os.makedirs(os.path.join(out, "img"), exist_ok=True)
    with open(os.path.join(out, "walkthrough.md"), "w") as f:
        f.write(doc.text())
    walkthrough_doc.figures(figures, os.path.join(out, "img"))
    values, atols = doc.in_order()
    return {"skeleton": doc.skeleton(), "values": values, "atols": atols, "metrics": mine,
            "next_metrics": {k: t.next_metrics[k] for k in METRICS}}


def measure_tolerances():
    """The walkthrough under each CPU kernel variant of tests/rounding.py this CPU can run, in fresh
    interpreters: SAFETY x the worst difference of each number from the native kernels'
    (rounding.tolerance), or the committed tolerance where that is larger (measured on another CPU
    kind, or under a variant this one cannot run: never shrinks)."""
    from tests.rounding import KERNELS, kernel_env, runnable_kernels, tolerance
    runs = {}
    for variant in runnable_kernels():                                   # (no AVX-512: those left out)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "study.walkthrough", "--out", tmp, "--record",
                            os.path.join(tmp, "record.json")], check=True, cwd=ROOT, env=kernel_env(variant))
            with open(os.path.join(tmp, "record.json")) as f:
                runs[variant] = json.load(f)
        print(f"{variant}: {len(runs[variant]['values'])} numbers")
    native = runs["native"]
    for variant, r in runs.items():
        if r["skeleton"] != native["skeleton"]:
            raise SystemExit(f"error: under the {variant} kernels the walkthrough's text differs "
                             "(its sampled tokens?)")
    worst = [[abs(r["values"][i] - v) for r in runs.values()] for i, v in enumerate(native["values"])]
    tol = [max(tolerance(w, v), atol) for w, v, atol in zip(worst, native["values"], native["atols"])]
    # never below what an earlier machine measured (another CPU kind's rounding: issue #40)
    before = json.load(open(TOLERANCES)) if os.path.exists(TOLERANCES) else {}
    kept = before.get("numbers") == len(tol)
    if kept:
        tol = [max(t, b) for t, b in zip(tol, before["tolerance"])]
    measured = set(runs) | set(before.get("kernels", []) if kept else [])   # the variants behind tol
    with open(TOLERANCES, "w") as f:
        json.dump({"numbers": len(tol), "kernels": [k for k in KERNELS if k in measured], "tolerance": tol},
                  f, indent=0)
        f.write("\n")
    print(f"wrote {TOLERANCES}: {len(tol)} tolerances, {sum(w > 0 for w in map(max, worst))} numbers moved")


def main(argv_=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "walkthrough"),
                   help="folder of walkthrough.md and img/ (default runs/walkthrough; --out docs rewrites the "
                        "committed page, whose numbers another CPU's kernels round a little differently: "
                        "tests/test_walkthrough.py compares within their tolerances)")
    p.add_argument("--record", help="also write the skeleton, numbers and traced metrics to this JSON file")
    p.add_argument("--tolerances", action="store_true",
                   help="re-measure " + os.path.relpath(TOLERANCES, ROOT))
    a = p.parse_args(argv_)
    if a.tolerances:
        return measure_tolerances()
    rec = generate(a.out)
    if a.record:
        with open(a.record, "w") as f:
            json.dump(rec, f)
    print(f"wrote {os.path.join(a.out, 'walkthrough.md')} ({len(rec['values'])} numbers) and its figures")


if __name__ == "__main__":
    main()
