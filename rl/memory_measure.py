"""An RL step's memory measured from the code that runs it: the peak of live tensor bytes per phase.

    python train.py --config configs/paper_qwen7b.json --dry-run   # 7B widths, 8 fake GPUs, ~30 s
    python bench/memory_check.py   # 12 small CPU configurations, real tensors

plumbing/memory_plan.py says what an RL step should hold, as formulas; this module measures what the code
holds. measure_memory runs the real phases of a step (the FSDP2 decoding copy with the
sampler's prefill and one decode step, the no-grad scoring forwards, `train.ppo_update` with its
micro-batches, gradient sync and optimizer step) under `PhasePeaks`, torch's MemTracker: every
storage an op creates is followed by a weak reference until it is freed, so the measurement is
everything alive at once, not a sum of named tensors. Two ways to run it:
- real tensors, on a CPU: small models, any process group (1 process, DDP, FSDP2 over gloo);
- fake tensors (FakeTensorMode: shapes and dtypes, no data, no arithmetic) with a fake process
  group of N ranks: the paper's widths on a laptop, in seconds. Fake tensors have no values, so
  every host-side decision of the step is planned first from the (small, real) masks
  (scale_step.plan_step), and the two reads of values after backward -- the step's scalars
  (distributed.read_scalars) and their cross-rank sums (distributed.all_sums) -- are stubbed
  (stub_scalar_reads; tests/test_memory.py lists them). Fake tensors stand for a GPU's: the
  KV cache takes the compute dtype and LeanStep fuses no weights (what CPU tensors would do).
Not measured, because they are not tensors: the CUDA context, NCCL's buffers, allocator
fragmentation (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True keeps that small).
"""

import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from sampler import decode
from rl import experience, run_setup, scale_step
from sampler import kv_cache
from modeling import models
import rollout
from plumbing import batching, distributed, memory_plan, optimizer, step_guard


class PhasePeaks(MemTracker):
    """torch's MemTracker with a peak per phase: `with tracker.phase(name)` restarts the peak at
    the bytes alive on entry and keeps the largest total seen until its exit (a phase entered
    again keeps its largest peak). `switch(name)` does the same from a hook."""

    def __init__(self):
        super().__init__()
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}   # {phase: {kind of tensor: bytes}} at its peak
        self._phase = None

    # MemTracker's per-module statistics are not used here: its module hooks would put gradient
    # hooks on parameters (failing on a no-grad decoding copy) and refuse a root module's second
    # forward (every micro-batch is one). Parameters and buffers are still counted when a module runs.
    def _pre_fw_hook(self, module, inputs):
        self._track_module_params_and_buffers(module, install_grad_hooks=False)

    def _post_fw_hook(self, module, inputs, outputs):
        pass

    def _pre_bw_hook(self, module, args):
        pass

    def _post_bw_hook(self, module, args):
        pass

    # Under FakeTensorMode, DTensor's sharding propagation runs each op once more on fake tensors
    # of the GLOBAL shapes to learn the output's metadata, in the active fake mode: without this,
    # clip_grad_norm_ over the sharded gradients would count the whole model's gradient, unsharded.
    # Those tensors exist on no GPU; their ops are not counted.
    def __enter__(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._propagating, self._saved_propagate = 0, ShardingPropagator._propagate_tensor_meta_non_cached
        saved, tracker = self._saved_propagate, self

        def propagate(prop, op_schema):
            tracker._propagating += 1
            try:
                return saved(prop, op_schema)
            finally:
                tracker._propagating -= 1
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_non_cached = self._saved_propagate
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def switch(self, name):
        if self._phase is not None:
            peak = sum(self._peak_mem.values())
            if peak > self.peaks.get(self._phase, 0):
                self.peaks[self._phase] = peak
                self.at_peak[self._phase] = {str(kind): n for snap in self._peak_mem_snap.values()
                                             for kind, n in snap.items() if n}
        self._phase = name
        self._peak_mem = {dev: snap["Total"] for dev, snap in self.get_tracker_snapshot("current").items()}
        self._peak_mem_snap = self.get_tracker_snapshot("current")

    @contextmanager
    def phase(self, name):
        self.switch(name)
        try:
            yield
        finally:
            self.switch(None)

    def optimizer_phase(self, opt):
        """Mark every optimizer step of `opt` as the phase "optimizer" (then back to "update")."""
        return (opt.register_step_pre_hook(lambda *_: self.switch("optimizer")),
                opt.register_step_post_hook(lambda *_: self.switch("update")))


@dataclass
class Measured:
    """Per-GPU (per-rank) peaks of live tensor bytes by phase, and what was run to get them."""
    peaks: dict[str, int]
    world: int
    fake: bool
    micro_batches: int                  # update micro-batches run (each of the config's size)
    skipped: str = ""                   # why the step was not run (then no peaks): too_large_to_measure


@contextmanager
def fake_world(world: int):
    """A fake process group of `world` ranks (this process is rank 0, collectives return at once)
    and a device mesh over it, built outside fake mode, then FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the fake-tensor measurement needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mesh, mode
    finally:
        dist.destroy_process_group()


@contextmanager
def stub_scalar_reads():
    """Fake tensors have no values: the step's scalars read as 0 (and finite), their cross-rank
    sums as the values given. Only these two reads are replaced."""
    saved = distributed.read_scalars, distributed.all_sums
    distributed.read_scalars = lambda values, finite=(): {k: 0.0 for k in values}
    distributed.all_sums = lambda values: {k: 0.0 if torch.is_tensor(v) else float(v)
                                           for k, v in values.items()}
    try:
        yield
    finally:
        distributed.read_scalars, distributed.all_sums = saved


def model_config(model: str, layers: int = 0, **overrides):
    """A transformers config of `model`'s architecture (memory_plan.arch_for finds it), optionally
    with fewer decoder layers."""
    from transformers import AutoConfig

    path = memory_plan.config_path(model)
    with open(path) as f:
        c = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    c.update(overrides)
    if layers:
        c["num_hidden_layers"] = layers
        c.pop("layer_types", None)
    return AutoConfig.for_model(c.pop("model_type", "qwen2"), **c)


def random_model(config, dtype=torch.float32, attn=models.SDPA):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


@dataclass
class StepModels:
    """What a measured step trains with: the wrapped policy, the reference, AdamW with its state,
    and how it decodes."""
    policy: torch.nn.Module
    ref: torch.nn.Module | None
    opt: torch.optim.Optimizer
    spec: rollout.SampleSpec


def step_models(a, needs_ref: bool, device, bf16: bool, fake: bool, mesh=None) -> StepModels:
    """Random models of --model's architecture, wrapped as train.py wraps them (DDP / FSDP2 over
    `mesh`, --grad-ckpt), the reference in bf16 under bf16 compute, and AdamW (foreach: torch's
    choice on CUDA) holding its state already, as after a run's first step."""
    cfg = model_config(a.model)
    # models.attention_for's SDPA choices (fake tensors cannot run flash-attn, whose memory is SDPA's)
    attn = models.SDPA_FLOAT32 if bf16 and not fake else models.SDPA
    # DDP on fake ranks: a replica, unwrapped. DDP's construction and its gradient hooks need real
    # values (a parameter check across ranks, futures of reductions); what a rank holds is the same,
    # its gradients being views into the reduction buckets (distributed.wrap_model).
    replica = fake and not a.fsdp
    policy = distributed.wrap_model(random_model(cfg, attn=attn), device, a.fsdp, bf16, a.grad_ckpt,
                                    trainable=not replica, mesh=mesh)
    ref = None
    if needs_ref:
        ref = random_model(cfg, torch.bfloat16 if bf16 else torch.float32, attn).eval().requires_grad_(False)
        ref = distributed.wrap_model(ref, device, a.fsdp, bf16, trainable=False, mesh=mesh)
    opt = optimizer.adamw(policy, a.lr, a.weight_decay, foreach=True)
    allocate_adam_state(policy, opt)
    spec = rollout.SampleSpec(a.max_new_tokens, [0], 0, a.sampler, a.gen_batch,
                              torch.bfloat16 if bf16 else None, a.kv_budget)
    return StepModels(policy, ref, opt, spec)


def allocate_adam_state(model, opt):
    """One optimizer step on zero gradients: AdamW allocates its state at a parameter's first step,
    and every step after the first holds it (weight decay moves the random weights a little)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def real_tensors():
    """Real tensors inside FakeTensorMode (the host-side plan of the step); nothing outside it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# Host bytes per [prompt | response] token of the worst-case step's real tensors: int64 ids and
# masks of the rollout and its packed rows, float masks and reference log-probs, and the prompts as
# a Python list (about 36 bytes per token id): an estimate on the high side.
HOST_BYTES_PER_TOKEN = 96
HOST_BUDGET = 4 * 2 ** 30               # the paper's 7B step holds ~0.2 GiB of them per rank


def too_large_to_measure(a, world: int) -> str:
    """Why the step of options `a` on `world` ranks is not measured ("" if it is): its worst-case
    rollout is planned from real host tensors (the masks of every row), which would exceed
    HOST_BUDGET or half of the memory free now. The plan's formulas cost nothing at any size.
    Sizes a run would refuse (batching.check: they do not divide) exit here with its one line."""
    batching.check(a, world)
    rows = a.rollout_batch // world * a.group_size
    need = rows * (a.max_prompt_len + a.max_new_tokens) * HOST_BYTES_PER_TOKEN
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):                      # (not every OS says)
        free = 2 * HOST_BUDGET
    if need <= min(HOST_BUDGET, free // 2):
        return ""
    return (f"its worst-case rollout ({rows} rows of {a.max_prompt_len} + {a.max_new_tokens} tokens a rank) "
            f"would take {need / 2 ** 30:.1f} GiB of host memory to plan (at most "
            f"{min(HOST_BUDGET, free // 2) / 2 ** 30:.1f} GiB here)")


def worst_case_rollout(a, rows: int, vocab: int, seed=0) -> rollout.Rollout:
    """`rows` rollout rows as long as the options allow: --max-prompt-len prompt tokens (groups of
    --group-size rows share one), --max-new-tokens response tokens, none finished early: the
    largest step the plan must hold. Random token ids (memory does not depend on them)."""
    g = torch.Generator().manual_seed(seed)
    G, P, R = a.group_size, a.max_prompt_len, a.max_new_tokens
    prompts = torch.randint(2, vocab, (rows // G, P), generator=g).repeat_interleave(G, 0)
    return rollout.Rollout(prompts, torch.ones(rows, P, dtype=torch.long),
                           torch.randint(2, vocab, (rows, R), generator=g),
                           torch.ones(rows, R, dtype=torch.long), torch.zeros(rows, R),
                           torch.zeros(rows, dtype=torch.bool))


@dataclass
class WorstCase:
    """The tensors of a worst-case step on this rank (real, on the CPU: the host-side plan reads them)."""
    ro: rollout.Rollout
    packed: object                     # logprobs.Packed of ro
    update_rows: list                  # the first optimizer step's rows (one is measured)
    resp_mask: torch.Tensor            # (B, R)
    prompt_mask: torch.Tensor          # (B, P-1)
    qref: torch.Tensor                 # (B, P-1) a Query-KL reference's prompt log-probs


def worst_case_step(a, world: int, vocab: int) -> WorstCase:
    """This rank's share of a worst-case RL step (worst_case_rollout) and its masks."""
    ro = worst_case_rollout(a, a.rollout_batch // world * a.group_size, vocab)
    packed, B = ro.packed(), ro.response_ids.shape[0]
    update_rows = experience.update_batches(B, a, world)[:1]
    return WorstCase(ro, packed, update_rows, ro.response_mask.float(), packed.prompt_tok_mask.float(),
                     torch.zeros(B, packed.P - 1))


def decode_once(policy, spec: rollout.SampleSpec, prompts: list[list[int]], max_new_tokens: int):
    """The rollout phase's largest moment: the decoding copy (distributed.gathered), the one pass's
    slot cache (sampler/kv_cache.py: rows_per_call slots of the longest prompt + max_new_tokens columns) with
    a full set of rows prefilled into it, and one decode step reading every column. (The rest of
    the pass writes into that cache and refills fewer slots at once: no new memory, but it needs
    real values.) Models the pass does not decode: the chunked loop's first chunk, prefilled, and
    one step."""
    rows = min(spec.rows_per_call(max(map(len, prompts))) or len(prompts), len(prompts))
    # (rollout.sample is no-grad)
    with torch.no_grad(), distributed.gathered(policy, spec.weights_dtype) as decoder:
        if spec.sampler == "kv" and kv_cache.supports(decoder, lockstep=False):
            columns = max(map(len, prompts)) + max_new_tokens
            cache = kv_cache.slot_cache(decoder, rows, columns)
            tok = kv_cache.admit(decoder, cache, prompts[:rows], list(range(rows)), spec.pad_id).argmax(-1)
            last = torch.full((rows,), columns - 1, dtype=torch.long, device=tok.device)
            decode.LeanStep(decoder, cache)(tok, last, columns)   # (kv_cache.py drops the logits first too)
            del cache
        else:
            pre = kv_cache.prefill(decoder, prompts[:rows], spec.pad_id, max_new_tokens)
            pre.step(pre.logits.argmax(-1), pre.pos[:, -1] + 1)
            del pre


def autocast_of(dtype_name, device, tensors_on):
    """The step's autocast context factory on `device` (what the run computes on: "cuda" for fake
    tensors) for tensors on `tensors_on`. Fake tensors live on the CPU, where --dtype auto means
    float32 (distributed.precision): their GPU's bf16 autocast is CPU autocast in bf16. (Was the
    CPU's choice: a --dtype auto DDP step measured in float32 -- a float32 KV cache, float32
    prefill -- 45.5 GiB at the 1.5B config's rollout against 35.3 planned, issue #42.)"""
    if tensors_on.type == device.type:
        return distributed.precision(dtype_name, device)[1]
    return (lambda: torch.autocast(tensors_on.type, dtype=torch.bfloat16)) \
        if distributed.uses_bf16(dtype_name, device) else nullcontext


# ----------------------------------------------------------------------------------------------
# The step, measured


def measure_memory(a, algo, world=1, fake=True, max_micro_batches=3) -> Measured:
    """The step's phases (at scale: rl/scale_step.py, what the GPU configs run) on a worst-case
    rollout of a random model of --model's architecture: fake tensors on `world` fake ranks (the
    paper's widths on a CPU, in seconds), or real tensors in the process group this process is in. One
    optimizer step, of at most max_micro_batches micro-batches (each of the config's size:
    gradients are sharded/reduced per micro-batch, so more of them hold no more). A step too large
    to plan on this host is not run (`skipped`)."""
    needs_ref = run_setup.needs_reference_model(a, algo)
    a = memory_plan.as_planned(a, world, needs_ref, "cuda" if fake or torch.cuda.is_available() else "cpu")
    skipped = too_large_to_measure(a, world)                          # (sizes that do not divide: exit)
    if getattr(a, "lora_rank", 0) and not skipped:                     # (random_model has no adapters)
        skipped = "a LoRA step (the measurement runs full fine-tuning's; the plan counts the adapters)"
    if skipped:
        return Measured({}, world, fake, 0, skipped)
    with fake_world(world) if fake else nullcontext((None, None)) as (mesh, _):
        d = distributed.Dist(*distributed.rank_world(), torch.device("cpu"))
        device = torch.device("cuda") if fake else d.device             # fake: what a GPU runs
        bf16 = distributed.uses_bf16(a.dtype, device)
        m = step_models(a, needs_ref, d.device, bf16, fake, mesh)
        sched = optimizer.warmup_then_constant(m.opt, a.warmup)
        run = run_setup.Run(a, algo, d, m.policy, m.ref, None, m.opt, sched, data=None, qref=None, cache=None,
                       spec=m.spec, timer=experience.Phases("cpu"),
                       guard=step_guard.StepGuard(a.out, a.max_bad_steps))
        with real_tensors():                                             # the host-side plan: from real masks
            w = worst_case_step(a, d.world, distributed.unwrap(m.policy).config.vocab_size)
            B, fresh = len(w.ro.finished), scale_step.on_policy_rows(run, w.update_rows)
            plan = scale_step.plan_step(a, w.packed, [1.0] * B, w.update_rows, fresh, m.ref is not None)
            for update in plan.updates:                                  # every row a signal: it steps
                update.num_signal = update.num_seqs
            for mbs in (plan.old, plan.ref, plan.updates[0].micro_batches):  # the longest come first
                del mbs[max_micro_batches:]
        tracker = PhasePeaks()
        stub = stub_scalar_reads() if fake else nullcontext()
        with tracker, stub, autocast_of(a.dtype, device, d.device)():
            tracker.track_external(m.policy, m.opt, *[m.ref] * (m.ref is not None), w.packed.input_ids,
                                   w.packed.attention_mask, w.resp_mask, w.prompt_mask, w.qref)
            tracker.optimizer_phase(m.opt)
            with tracker.phase("rollout"):
                decode_once(m.policy, m.spec, w.ro.prompt_ids.tolist(), a.max_new_tokens)
            with tracker.phase("score"):
                scores = scale_step.score_old_and_ref(run, w.packed, fresh, plan)
            batch = experience.UpdateBatch(w.packed, w.resp_mask, w.prompt_mask, valid=torch.ones(B),
                                           scores=scores, qref=w.qref, adv=torch.randn(B),
                                           weights=torch.ones(B), sampler=w.ro.logprobs)
            with tracker.phase("update"):
                scale_step.ppo_update(run, batch, plan)
    return Measured(tracker.peaks, d.world, fake, len(plan.updates[0].micro_batches))
