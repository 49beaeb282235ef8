"""A run's first steps against the time model (plumbing/time_model.py): on a GPU, train.py prints and
logs at step CHECK_STEPS the model's seconds per phase beside the run's own timer, and the hours the
measured step projects for --steps beside --dry-run's, so a user sees at step 3 whether the run will
take 9 h or 30. (Its own module: time_model.py is at the line cap.)

    check = time_check.FirstSteps(args, run.dist, needs_ref, old_rows, start, say=print0)
    log(check(line))                    # every step; on CUDA at step 3: + time_model/* keys, printed once
"""

import math
from dataclasses import dataclass

import numpy as np

import torch

from plumbing import distributed, memory_plan
from plumbing.lengths_file import Lengths, _point, fitted_responses
from plumbing.time_model import GPUS, plan_lengths, slots_for, step_terms

CHECK_STEPS = 3                 # the run's first steps it reads: step 1 warms up, steps 2..3 are measured
# The model's phases against the run's timer (rl/experience.py, train.rl_step): the sampler's time_gen
# holds its prefill and its decode; step_time also holds the host work the model's `host` term counts
# (grading, time_reward; FSDP2's decoding copy; the length deal) and what it leaves out (the Query-KL
# reference; monitors), so the step's ratio is the one a user's hours follow.
MEASURED = {"gen": "time_gen", "score": "time_score", "update": "time_update", "step": "step_time"}


# ----------------------------------------------------------------------------------------------
# What each rollout got: the sampler's one pass records itself here (sampler/kv_cache.py decode_pass,
# kv_budget_from_memory; plumbing may not import the sampler), the hook logs it on every step's line

@dataclass
class Pass:
    """One decode_pass as it ran on this rank (the time model's slots are the plan's)."""
    rows: int
    slots: int
    columns: int                       # the cache's capacity: the longest prompt + max_new_tokens
    kv_bytes: int                      # the slot cache: slots x columns positions
    compiled: bool                     # --compile-decode
    steps: int = 0                     # tokens chosen per slot (set when the pass ends)
    fell_back: bool = False            # --compile-decode gave up the compiled step (decode.fall_back)


PASSES: list[Pass] = []                # since the last take_passes()
BUDGET = {}                            # the last --kv-budget 0 sizing: positions, gib, free_gib


def take_passes() -> list[Pass]:
    """The passes run since the last call (a step's rollout first, then any evaluation's), emptied."""
    out = PASSES[:]
    PASSES.clear()
    return out


def pass_metrics(passes: list[Pass]) -> dict:
    """metrics.jsonl keys of a step's first pass (its rollout's) and the KV budget it was sized from:
    sampler/{slots,columns,rows,kv_gib,decode_steps,passes}, sampler/kv_budget{,_gib,_free_gib}
    (--kv-budget 0 only) and sampler/compile_fell_back (--compile-decode only). {} without a pass."""
    if not passes:
        return {}
    p = passes[0]
    out = {"sampler/slots": p.slots, "sampler/columns": p.columns, "sampler/rows": p.rows,
           "sampler/kv_gib": p.kv_bytes / 2 ** 30, "sampler/decode_steps": p.steps,
           "sampler/passes": len(passes)}
    out.update({"sampler/kv_budget" + ("" if k == "positions" else "_" + k): v for k, v in BUDGET.items()})
    if p.compiled:
        out["sampler/compile_fell_back"] = int(p.fell_back)
    return out


def gpu_key(device_name: str):
    """torch.cuda.get_device_name() -> the GPUS entry whose numbers it has, or None. Variants with
    other peaks are no entry (H100 PCIe / NVL, H200 NVL, GH200: other FLOP/s or bandwidth)."""
    n = device_name.upper()
    if "GH200" in n or "NVL" in n or ("PCIE" in n and "H100" in n):
        return None
    for key, words in (("h100", ("H100",)), ("h200", ("H200",)), ("a100-40gb", ("A100", "40GB")),
                       ("a100", ("A100",)), ("l40s", ("L40S",))):
        if all(w in n for w in words):
            return key
    return None


def measured_responses(mean: float, cut: float, limit: int, source: str) -> Lengths:
    """The responses of a run's measured mean length and cut fraction, fitted as --plan-lengths fits a
    metrics.jsonl (fitted_responses); where no gamma fits (a mean near the limit, every row cut), the
    same mean and cut fraction as two point masses: the cut rows at the limit, the rest at one length."""
    try:
        return fitted_responses(mean, cut, limit, source)
    except ValueError:
        if cut >= 1:
            return Lengths(_point(limit), source + " (every row cut)", cut=True)
        below = min(limit - 1, max(1, round((mean - cut * limit) / (1 - cut))))
        pmf = np.zeros(limit + 1)
        pmf[below], pmf[limit] = 1 - cut, cut
        return Lengths(pmf, source + " (no gamma fits: two point masses)", cut=True)


def against_measured(a, gpus: int, needs_ref: bool, gpu_name: str, old_rows: float, lines) -> dict:
    """The model of one step at the lengths the run measured, against the run's own timer.
    lines: the run's first metrics lines (steps 1..k; a line without step_time, step 0's evaluation,
    is skipped). Measured: each phase's mean over steps 2..k (step 1 warms up: allocator, kernels'
    first launches, compilation), over step 1 alone where it is all there is. Modelled: step_terms at
    the responses of the k steps' mean response_len and truncated_frac (cut at --max-new-tokens) and
    the plan's prompts (--plan-lengths, else the defaults: a run logs no prompt lengths).
    -> {"phases": {"gen" | "score" | "update" | "step": {"modelled", "measured", "ratio"}} (ratio:
    measured / modelled), "projected_h": the measured step x --steps, "modelled_h": the model's at the
    measured lengths, "dry_run_h": --dry-run's realistic estimate (the plan's lengths), "steps": the
    steps measured, "warm_up": whether they include the first (only one step), "lengths": what the
    model was given, "gpu": gpu_name, "total_steps": --steps, "slots": {"planned": the plan's slots,
    "got": the fewest a line's sampler/slots has (FirstSteps: the slowest rank's), or None}}: the model
    decodes in the slots the run got where its lines say so."""
    rows = [r for r in lines if "step_time" in r]
    if not rows:
        raise ValueError("no RL step's metrics line (step_time) to compare")
    used = rows[1:] if len(rows) >= 2 else rows
    mean_of = lambda key, rs: sum(float(r.get(key, 0.0)) for r in rs) / len(rs)  # noqa: E731
    plan = memory_plan.as_planned(memory_plan._with(a, plan_gpu=gpu_name), gpus, needs_ref)
    plan_resp, prompt = plan_lengths(plan)
    planned, had = slots_for(plan, gpus, prompt), [r["sampler/slots"] for r in used if "sampler/slots" in r]
    run = memory_plan._with(plan, gen_batch=min(had), kv_budget=0) if had else plan  # the slots it had
    length, cut, limit = mean_of("response_len", rows), mean_of("truncated_frac", rows), plan.max_new_tokens
    resp = measured_responses(length, cut, limit, f"the mean of steps {rows[0]['step']}-{rows[-1]['step']}: "
                              f"{length:.0f} tokens, {cut:.1%} cut at {limit}")
    arch, gpu = memory_plan.arch_for(a.model), GPUS[gpu_name]

    def phases(resp_lengths, p):
        s = {t.name: t.seconds[0] for t in step_terms(arch, p, gpus, gpu, needs_ref, old_rows,
                                                      resp_lengths, prompt)}
        return {"gen": s["decode"] + s["prefill"], "score": s["score"], "update": s["update"],
                "step": sum(s.values())}
    modelled, as_planned = phases(resp, run), phases(plan_resp, plan)
    out = {}
    for name, key in MEASURED.items():
        got = mean_of(key, used)
        out[name] = {"modelled": modelled[name], "measured": got,
                     "ratio": got / modelled[name] if modelled[name] > 0 else None}  # (none modelled)
    hours = lambda s: s * a.steps / 3600                                       # noqa: E731
    return {"phases": out, "projected_h": hours(out["step"]["measured"]),
            "modelled_h": hours(modelled["step"]), "dry_run_h": hours(as_planned["step"]),
            "slots": {"planned": planned, "got": min(had) if had else None},
            "steps": [r["step"] for r in used], "warm_up": used is rows, "gpu": gpu_name,
            "lengths": f"responses: {resp.source}; prompts: {prompt.source}", "total_steps": a.steps}


def check_metrics(check: dict) -> dict:
    """The comparison as metrics.jsonl keys: time_model/<phase>_{modelled,measured,ratio} (seconds),
    time_model/{projected,modelled,dry_run}_h, time_model/slots_{planned,got} (got: where the lines
    had it)."""
    out = {f"time_model/{name}_{k}": v for name, p in check["phases"].items() for k, v in p.items()}
    out.update({f"time_model/slots_{k}": v for k, v in check["slots"].items() if v is not None})
    return {**out, **{f"time_model/{k}": check[k] for k in ("projected_h", "modelled_h", "dry_run_h")}}


def format_check(check: dict) -> str:
    """A short block: one line per phase (seconds, measured / modelled), then the hours."""
    steps = check["steps"]
    which = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    which += " (its warm-up included)" if check["warm_up"] else f" (step {steps[0] - 1}: its warm-up, not)"
    ranks = f", the slowest of {check['ranks']} ranks per phase" if check.get("ranks", 1) > 1 else ""
    slots = check["slots"]
    got = (f"the {slots['got']} slots the run got (planned {slots['planned']})" if slots["got"] is not None
           else f"the plan's {slots['planned']} slots")
    lines = [f"time model vs this run on {GPUS[check['gpu']].name} (measured: the mean of {which}{ranks}; "
             f"modelled at the run's lengths, {check['lengths']}; decoding in {got})"]
    what = {"gen": "decode + prefill (time_gen)", "step": "step (step_time; with the host term)"}
    for name, p in check["phases"].items():
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.2f}"
        lines.append(f"  {what.get(name, name):44s} modelled {p['modelled']:9.3g} s   measured "
                     f"{p['measured']:9.3g} s   x {ratio}")
    lines.append(f"  --steps {check['total_steps']}: {check['projected_h']:.3g} h at the measured step "
                 f"(evaluations and checkpoints not counted); the model: {check['modelled_h']:.3g} h at "
                 f"these lengths, {check['dry_run_h']:.3g} h at --dry-run's (realistic)")
    return "\n".join(lines)


class FirstSteps:
    """train.py's hook: `log(check(line))` on every step's metrics line. Every line gets the step's
    first decode pass (its rollout's: slots, KV GiB, the --kv-budget 0 sizing; pass_metrics). On CUDA,
    at the run's CHECK_STEPS-th step in this process (or its last, if fewer), it takes each phase's
    slowest rank (`slowest`: a collective, every rank calls the hook at every step), prints the model
    against the measurement (format_check; an unknown card: one line) and returns the line with
    check_metrics' keys added; otherwise the line as given. On CPU no check: the model is of GPUs.
    reduce_max: a tensor's element-wise max over ranks (distributed.all_max; a test's stub)."""

    def __init__(self, a, dist, needs_ref: bool, old_rows: float, start: int, cuda=None, say=print,
                 reduce_max=None):
        self.a, self.world, self.needs_ref, self.old_rows, self.say = a, dist.world, needs_ref, old_rows, say
        self.cuda, self.reduce_max = cuda or torch.cuda, reduce_max or distributed.all_max
        self.at = min(CHECK_STEPS, a.steps - start) if torch.device(dist.device).type == "cuda" else 0
        self.rows = []
        take_passes()                                   # (set-up's and earlier runs' passes: not this step's)

    def __call__(self, line: dict) -> dict:
        line = {**line, **pass_metrics(take_passes())}
        if len(self.rows) >= self.at:
            return line
        self.rows.append(line)
        if len(self.rows) < self.at:
            return line
        rows = slowest(self.rows, self.reduce_max)
        name = self.cuda.get_device_name()
        key = gpu_key(name)
        if key is None:
            self.say(f"time model: no entry for this GPU ({name}; plumbing/time_model.GPUS has "
                     f"{sorted(GPUS)}): no comparison with the run's first steps")
            return line
        try:
            check = against_measured(self.a, self.world, self.needs_ref, key, self.old_rows, rows)
        except (OSError, ValueError, KeyError, SystemExit) as e:      # a diagnostic: never the run's end
            self.say(f"time model: no comparison with the run's first steps ({type(e).__name__}: {e})")
            return line
        self.say(format_check({**check, "ranks": self.world}))
        return {**line, **check_metrics(check)}


def slowest(lines, reduce_max) -> list[dict]:
    """The lines with each measured phase (MEASURED) at its slowest rank's seconds and sampler/slots at
    its fewest, step by step: the step waits for the slowest rank (rank 0's line is only its own), and
    the rank with the fewest slots decodes longest. One collective of every line's values; a key a line
    lacks stays absent."""
    keys = [(k, 1.0) for k in MEASURED.values()] + [("sampler/slots", -1.0)]      # (min = -max of -x)
    x = torch.tensor([sign * float(r[k]) if k in r else -math.inf for r in lines for k, sign in keys],
                     dtype=torch.float64)
    got = reduce_max(x).tolist()
    out = []
    for i, r in enumerate(lines):
        r = dict(r)
        for j, (k, sign) in enumerate(keys):
            if k in r:
                v = sign * got[i * len(keys) + j]
                r[k] = round(v) if k == "sampler/slots" else v
        out.append(r)
    return out
