"""The run's instruments (issue #43; definitions: docs/method.md §11): is the regulariser doing
anything, is the policy drifting on questions it never trained on, and is the paper's premise in
this data? Each is a pure function here with a small hook in train.py.

- Per-term gradients (`term_gradients`, every --monitor-every steps): the gradient of each loss term
  as it enters the loss (its coefficient and sign: PG, beta * Policy-KL, alpha * Query-KL,
  -c * entropy), measured on one micro-batch (`measured_micro_batch`: the first, among the update
  batches that take a step, with a row of nonzero advantage) at the rollout weights, before any
  update: its norm (grad_norm/<term>) and the cosine between the policy gradient and each
  regulariser's (grad_cos/pg_<term>), null where the term's gradient is under its noise floor
  (NOISE_FLOOR: rounding has no direction) and for a regulariser the loss lacks (its norm: 0). A
  forward of its own on the unwrapped policy, and one backward per term (torch.autograd.grad:
  nothing accumulates into .grad), so the update itself is untouched.
  Its terms are divided by the micro-batch's own counts (tokens, sequences), so each norm is on the
  scale of the whole update's grad_norm (before clipping).
- Held-out Query-KL (`HeldoutQueryKL`, at every evaluation): the Query-KL monitor's estimator (k3 over
  the prompt tokens, mean over prompts) of the held-out prompts against their log-probs under the
  initial policy, cached before RL as the training prompts' are (<out>/heldout_query_cache.pt, shared
  by --query-cache-dir), beside as many prompts the run has trained on (the first it sampled:
  trained_prompts) against the training cache, scored by the same weights: eval_query_kl[/<set>]
  and eval_query_kl_trained. Their gap is the memorisation curve.
- The premise meter, premise_r, every step, is rl/experience.py's (`premise_sums`, beside the step's
  other monitors in step_metrics): the Pearson correlation over the step's prompts between each
  prompt's mean per-token NLL under the initial policy (the Query-KL cache's) and the
  mean over its G rows of each response's mean per-token NLL under pi_old (paper App. D, measured
  offline by `analysis.py nll`), from tensors the step already has.
"""

import math
import os

import torch

import losses
from evaluation.heldout import heldout_at_temperatures
from modeling import logprobs
from plumbing import distributed
from plumbing.distributed import print0
from rl import experience, query_reference, scale_step


# ----------------------------------------------------------------------------------------------
# Per-term gradients


def loss_terms(algo, *, logp, old_logp, ref_logp, resp_mask, advantages, weights, prompt_logp,
               prompt_ref_logp, prompt_mask, num_tokens, num_seqs, max_len, sampler_logp=None,
               entropy=None) -> dict[str, torch.Tensor]:
    """losses.rl_loss's terms one at a time, each as it enters the loss (coefficient and sign), for
    the terms `algo` has: {"pg", "policy_kl", "query_kl", "entropy"}. Their sum is rl_loss's loss
    (a test), whose arguments these are."""
    denom = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    adv = advantages if weights is None else advantages * (weights if advantages.dim() == 1
                                                           else weights[:, None])
    sur = losses.surrogate_loss(algo, logp, old_logp, adv, resp_mask, sampler_logp)
    kept = 1.0 if algo.top_entropy_quantile >= 1 else losses.high_entropy_tokens(entropy, resp_mask,
                                                                                 algo.top_entropy_quantile)
    terms = {"pg": losses.aggregate(sur.loss * kept, resp_mask, algo.agg, **denom)}
    if algo.has_policy_kl_loss:
        kl = losses.policy_kl(logp, ref_logp, algo.kl, clamp=algo.kl_clamp, old_logp=old_logp)
        terms["policy_kl"] = algo.beta * losses.aggregate(kl, resp_mask, algo.agg, **denom)
    if algo.alpha > 0:
        qkl = losses.query_kl(prompt_logp, prompt_ref_logp, prompt_mask, algo.qkl_estimator, algo.kl_clamp)
        terms["query_kl"] = algo.alpha * losses.aggregate(qkl, None, "seq-mean", num_seqs=num_seqs)
    if algo.entropy_coef > 0:
        terms["entropy"] = -algo.entropy_coef * losses.aggregate(entropy, resp_mask, algo.agg, **denom)
    return terms


def dot(a: list, b: list) -> float:
    """<a, b> of two gradients given per parameter (None: a parameter the term does not reach), in
    float64 one parameter at a time (no flat copy of the model's size)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(float((x.double() * y.double()).sum()) for x, y in pairs)


# A regulariser's gradient per unit of its coefficient below this fraction of the policy gradient's
# norm is float32 rounding, not a direction: at step 1 (pi = pi_0) the Query-KL term's is exactly 0
# in theory, yet a cache one ulp off the forward (another kernel, another layout) leaves 1.1-1.5e-7
# of ||g_pg|| per unit of alpha (alpha 0.01 to 100, the tiny world), against 0.03-0.05 one step
# later. 1e-5 sits ~100x above the first and ~3000x below the second (docs/method.md §11).
NOISE_FLOOR = 1e-5
TERMS = ("policy_kl", "query_kl", "entropy")          # the regularisers: each logged, 0 where absent


def geometry(pg: list, others: dict[str, list], coefs: dict | None = None) -> dict:
    """grad_norm/pg, grad_norm/<term> and grad_cos/pg_<term>. The cosine is None where a norm is 0 (no
    direction) or where the term's norm is under its noise floor, NOISE_FLOOR * |coef| * ||g_pg||
    (`coefs`: each term's coefficient; a term without one gets no floor)."""
    pp = dot(pg, pg)
    out = {"grad_norm/pg": math.sqrt(pp)}
    for name, g in others.items():
        gg = dot(g, g)
        floor = NOISE_FLOOR * abs((coefs or {}).get(name, 0.0)) * math.sqrt(pp)
        out[f"grad_norm/{name}"] = math.sqrt(gg)
        above = pp > 0 and gg > 0 and math.sqrt(gg) >= floor
        out[f"grad_cos/pg_{name}"] = dot(pg, g) / math.sqrt(pp * gg) if above else None
    return out


def absent_terms(measured: dict) -> dict:
    """The regularisers a run's loss does not have (alpha = 0, GRPO's Query-KL, ...): a gradient of
    exactly 0 and no cosine, logged so that every run draws every term (an alpha = 0 run included)."""
    return {k: v for t in TERMS if f"grad_norm/{t}" not in measured
            for k, v in ((f"grad_norm/{t}", 0.0), (f"grad_cos/pg_{t}", None))}


def term_gradients(run, batch, plan) -> dict:
    """geometry of the loss terms' gradients on one micro-batch at the rollout weights (module doc):
    measured_micro_batch's. train.rl_step
    calls it every --monitor-every steps. None under --fsdp ({}): its parameters are shards, and
    autograd.grad would run FSDP2's gradient hooks."""
    if distributed.is_fsdp(run.policy):
        return {}
    with run.timer("monitors"):
        return _term_gradients(run, batch, plan or plain_plan(run, batch))


def plain_plan(run, batch) -> scale_step.StepPlan:
    """The plain step's micro-batches (train.rl_step: it plans none) as the monitors read them."""
    rows = experience.update_batches(len(batch.valid), run.args, run.dist.world)
    plan = scale_step.plan_step(run.args, batch.packed, batch.valid.tolist(), rows, slice(0, 0), False)
    scale_step.judge_signal(plan, batch.signal, batch.valid, rows)
    return plan


def measured_micro_batch(plan, adv, no_signal):
    """The first micro-batch of this rank, in update order among the update batches that take a step,
    with a row whose advantage is not 0 (a policy gradient to compare with; one host read each);
    else the first update's first."""
    for update in plan.updates:
        if update.takes_step(no_signal):
            for mb in update.micro_batches:
                if len(mb.rows) and bool((adv[mb.rows] != 0).any()):
                    return mb
    return plan.updates[0].micro_batches[0]


def _term_gradients(run, batch, plan) -> dict:
    args, algo = run.args, run.algo
    mb = measured_micro_batch(plan, batch.adv, args.no_signal)
    part, pcols, rcols = batch.packed.trimmed(mb)
    rows, policy = mb.rows, distributed.unwrap(run.policy)              # (no DDP hooks: nothing syncs)
    now = logprobs.score_tokens(policy, part, args.temperature, algo.uses_entropy, plan.group, checked=True,
                                entropy_grad=algo.entropy_coef > 0)
    resp_mask = batch.resp_mask[rows, rcols]
    terms = loss_terms(
        algo, logp=now.response, old_logp=now.response.detach(),     # the rollout weights: pi_old's, exactly
        ref_logp=batch.scores.ref[rows, rcols] if algo.has_policy_kl_loss else None, resp_mask=resp_mask,
        advantages=batch.adv[rows], weights=None if batch.weights is None else batch.weights[rows],
        prompt_logp=now.prompt, prompt_ref_logp=batch.qref[rows, pcols],
        prompt_mask=batch.prompt_mask[rows, pcols], num_tokens=resp_mask.sum().clamp_min(1.0),
        num_seqs=batch.valid[rows].sum(), max_len=args.max_new_tokens,
        sampler_logp=batch.sampler[rows, rcols], entropy=now.entropy)
    params = [p for p in policy.parameters() if p.requires_grad]

    def grad(term):
        return torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    pg = grad(terms.pop("pg"))
    coefs = {"policy_kl": algo.beta, "query_kl": algo.alpha, "entropy": algo.entropy_coef}
    out = geometry(pg, {})
    for name, term in terms.items():                   # one term's gradient at a time (memory: two)
        out.update(geometry(pg, {name: grad(term)}, coefs))
    return {**out, **absent_terms(out)}


# ----------------------------------------------------------------------------------------------
# Held-out Query-KL, at every evaluation


def per_prompt_query_kl(logp: list, ref: list) -> torch.Tensor:
    """(N,) the Query-KL monitor's estimator (losses.query_kl, k3, clamped) of each prompt, from
    per-prompt 1-D log-prob tensors (query_reference.build's) and their references."""
    width = max((len(t) for t in logp), default=1) or 1
    mask = logprobs.right_align([torch.ones_like(t) for t in logp], width)
    return losses.query_kl(logprobs.right_align(logp, width), logprobs.right_align(ref, width), mask)


def trained_prompts(n_data, steps, rollout_batch, seed, n) -> list[int]:
    """The first `n` distinct training-set indices that the run's first `steps` RL steps sampled
    (round 0 of each, experience.step_indices: a function of these arguments, so a resumed run draws
    the same), in sampling order: a sample of prompts the run has trained on, fixed once `n` are
    reached, fewer before."""
    seen = {}
    for step in range(steps):
        for i in experience.step_indices(n_data, step, rollout_batch, seed):
            seen.setdefault(i, None)
            if len(seen) == n:
                return list(seen)
    return list(seen)


class HeldoutQueryKL:
    """The held-out prompts (each set's, in --eval-data order) and the initial policy's log-probs of
    them; `data_ids` / `data_ref`: the training set's prompts and the training cache's log-probs of
    them (None without a cache), from which each evaluation scores up to as many prompts as the
    first held-out set has, among those the run has sampled (trained_prompts)."""
    FILE = "heldout_query_cache.pt"

    def __init__(self, sets: dict, ids: list, ref: list, data_ids=None, data_ref=None):
        self.sets, self.ids, self.ref, self.data_ids, self.data_ref = sets, ids, ref, data_ids, data_ref

    @classmethod
    def for_run(cls, run, evalsets: dict, resuming: bool) -> "HeldoutQueryKL | None":
        """Built as the training cache is (query_reference: shared by its meta, else scored by the
        initial policy before RL; on --resume, the run folder's). On --resume without a usable file
        (a run from before it existed, a damaged one): None, said in one line -- a measurement does
        not stop the training."""
        a, d, pad = run.args, run.dist, run.tokenizer.pad_token_id
        ids = [x for ps in evalsets.values() for x in ps.ids]
        if not ids:
            return None
        path = os.path.join(a.out, cls.FILE)
        numerics = query_reference.numerics_of(a, d, run.policy)
        what = "held-out: " + ",".join(map(str, evalsets))             # (meta's "data": the sets' names)
        meta = query_reference.cache_meta(a.model, what, a.template, a.temperature, ids, weights=None,
                                          numerics=numerics, batch=a.micro_batch)
        if resuming:
            try:
                cache = cls.resumed(run, path, meta, ids, pad)
            except SystemExit as e:                                     # (the true reason, in one line)
                print0(f"held-out Query-KL: not measured ({str(e.code).removeprefix('error: ')})")
                return None
        else:
            meta["weights"] = query_reference.weights_fingerprint(run.policy)
            cache = query_reference.load_or_build(path, meta, run.policy, ids, pad, a.temperature, d.device,
                                                  a.query_cache_dir)
        sets = {name: len(ps) for name, ps in evalsets.items()}
        data = (run.data.ids, run.cache.logp) if run.cache is not None else (None, None)
        return cls(sets, ids, cache.logp, *data)

    @classmethod
    def resumed(cls, run, path, meta, ids, pad) -> "query_reference.QueryCache":
        """On --resume: the run folder's held-out cache; where it has none (evaluation was off when
        the run began, or the run is older than the file) or an unreadable one, the same built from
        the initial model (--model), as a fresh run builds it, said in one line. The held-out prompts
        are not the training cache's, so the checkpoint's record of that cache cannot rebuild this one
        (it said "built with other settings"). SystemExit (one line): the initial model does not load,
        or no longer has the weights the run began from (the training cache's record says)."""
        a, d = run.args, run.dist
        why = "missing" if not os.path.exists(path) else None
        if why is None:
            try:
                torch.load(path)
            except Exception as e:      # empty or cut: torch raises anything, EOFError to RuntimeError
                why = f"unreadable ({type(e).__name__})"
        if why is None:
            return query_reference.resumed(path, meta, a, d, ids, pad)  # (its prompts and settings checked)

        def refuse(reason):
            raise SystemExit(f"{path} is {why} and cannot be built from the initial model: {reason}")
        initial = query_reference.initial_policy(a, d, refuse)
        meta["weights"] = query_reference.weights_fingerprint(initial)
        began = run.cache.meta.get("weights") if run.cache is not None else None   # (the training cache's)
        if began and began != meta["weights"]:
            refuse(f"{a.model} no longer has the weights the run began from")
        cache = query_reference.load_or_build(path, meta, initial, ids, pad, a.temperature, d.device,
                                              a.query_cache_dir)
        del initial
        print0(f"held-out Query-KL: {path} was {why}: built it from the initial model {a.model}")
        return cache

    def trained_sample(self, run, steps: int) -> list[int]:
        """Training-set indices of the trained prompts an evaluation after `steps` RL steps scores."""
        a = run.args
        n = next(iter(self.sets.values()))
        return trained_prompts(len(self.data_ids), steps, a.rollout_batch, a.seed, n)

    def measure(self, run, steps: int = 0) -> dict:
        """eval_query_kl (the first set's), eval_query_kl/<set>, and after `steps` >= 1 RL steps
        eval_query_kl_trained (on trained_sample's prompts; none before a step): this policy's prompt
        log-probs (one forward over the prompts, as the caches are built) against the caches."""
        a, d, pad = run.args, run.dist, run.tokenizer.pad_token_id

        def score(ids):
            return query_reference.build(distributed.unwrap(run.policy), ids, pad, a.temperature, d.device,
                                         a.micro_batch)
        kl, out, start = per_prompt_query_kl(score(self.ids), self.ref), {}, 0
        for name, n in self.sets.items():
            out[f"eval_query_kl/{name}"] = kl[start:start + n].mean().item() if n else None
            start += n
        out["eval_query_kl"] = out[f"eval_query_kl/{next(iter(self.sets))}"]
        trained = self.trained_sample(run, steps) if self.data_ids and steps > 0 else []
        if trained:
            kl = per_prompt_query_kl(score([self.data_ids[i] for i in trained]),
                                     [self.data_ref[i] for i in trained])
            out["eval_query_kl_trained"] = kl.mean().item()
        return out


class Evaluation:
    """train.py's held-out evaluations: at step 0 and every --eval-every steps and the last, the
    accuracy (heldout_at_temperatures, each set graded by its task: eval_acc, eval_acc/<set>[/L<level>])
    and the held-out Query-KL (its cache built here, before RL, under the run's autocast `amp`)."""

    def __init__(self, run, evalsets: dict, amp, start: int):
        self.run, self.evalsets, self.amp, self.start = run, evalsets, amp, start
        self.every = run.args.eval_every
        with amp():
            self.qkl = HeldoutQueryKL.for_run(run, evalsets, start > 0) if self.every else None

    def __call__(self, steps: int = 0) -> dict:
        """The evaluation after `steps` RL steps (0: the starting point)."""
        run = self.run
        with self.amp():
            out = heldout_at_temperatures(run.policy, run.tokenizer, self.evalsets, run.spec,
                                          run.args.eval_temperatures, run.args.seed)
            return {**out, **(self.qkl.measure(run, steps) if self.qkl else {})}

    def first(self, log):
        """The starting point (step 0 of a fresh run, where evaluations are on): logged, said in one line."""
        if self.start == 0 and self.every:
            m = {"step": 0, **self()}
            log(m)
            print0(f"step 0: eval_acc {m.get('eval_acc', float('nan')):.3f}")

    def at(self, step: int, last: bool) -> dict:
        """After RL step `step` (1-based): an evaluation's metrics where one is due (timed: eval), else {}."""
        if not self.every or (step % self.every and not last):
            return {}
        with self.run.timer("eval"):
            return self(step)
