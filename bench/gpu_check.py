"""The one-shot GPU check of the codebase: one PASS / FAIL / SKIP line per item, then a summary.

    python bench/gpu_check.py                                  # CUDA: Qwen2.5-Math-7B widths, < 5 minutes
    python bench/gpu_check.py --preset tiny --device cpu       # the same code in seconds (a test runs it)
    python bench/gpu_check.py --items train,kv                 # a subset, for a rerun in little device time

For ONE 80-141 GB NVIDIA GPU, random weights, no download. Each line is `PASS <item> <figures>`,
`FAIL <item> <why>` or `SKIP <item> <why>`; the exit status is 1 if any item failed. Every item runs
in its own try/except, so an API difference (another transformers, no flash-attn, an OOM) costs
that item a FAIL or SKIP line, not the run. The items, in the order they run:

1. ragged-score/<attn>/<precision> and ragged-sample/<attn>/<precision>: left-padded prompts of
   different lengths with right-padded responses through `logprobs.token_logprobs` (forward and
   backward) and through our "kv" sampler (`rollout.sample`); attn sdpa or flash_attention_2 (SKIP
   where flash_attn does not import, and for fp32, which flash-attn does not compute); precision
   fp32, bf16 (bf16 weights) or bf16-mixed (fp32 weights under bf16 autocast, training's default
   on CUDA; the CPU runs fp32 and bf16-mixed). Every output must be finite, pad positions included
   (SDPA with fully masked left-padding rows can give NaN on recent GPUs, and NaN * 0 is NaN in a
   masked sum), and each row must equal that row alone without padding within TOL (bf16 is not
   bitwise): log-probs by max |difference|, the gradient of the summed log-probs by relative L2.
   The batch scored with its padding NOT masked must miss by more than 3x the tolerance, or the
   tolerance could not see a masking or position bug ("blind"). The sampler's rows are compared
   teacher-forced (each row's sampled tokens rescored alone), which rounding cannot flip; how many
   rows sample the same tokens alone is reported, not required (in bf16 a near-tie flips a token).
2. train/fsdp2, train/memory, train/reload: `train.main` itself, under FSDP2 on a process group
   of one (nccl; gloo on the CPU), with a random model of Qwen2.5-Math-7B's widths and a few layers
   (tiny: the tiny widths) in a temporary folder with the embedded tokenizer (data/tinymath/warmstart).
   That tokenizer has 665 tokens and a random model with 152,064 embedding rows samples ids it
   cannot decode, so the embedding and lm_head have the tokenizer's vocabulary; every other width is
   the 7B's, and the plan is computed for this same architecture. Data: the first 256 problems of
   data/tinymath/train.jsonl. A random model solves none, so every group would have zero advantage
   and the update would move nothing: rewards are seeded coin flips of the response text (the
   grader still runs). ERPO, the reference model (the Policy-KL monitor), activation checkpointing,
   2 RL steps of 2 optimizer steps, the final save (DCP shards and the HF export <out>/hf).
   train/fsdp2: the policy was FSDP2-sharded; the step-1 Query-KL is finite and ~0 (<= QKL_STEP1:
   the cache comes from the same training forward); every step's loss and grad norm are finite.
   train/memory: torch.cuda.max_memory_allocated per phase (rollout, score, update, optimizer step;
   the peak is reset at the boundaries of train.py's timer phases and around optimizer.step) next to
   memory_plan.phases(), or where that does not exist the rollout/update sums of memory_plan.terms()
   (the line says which); FAIL where a phase exceeds its plan by more than 20% + 256 MiB (the plan
   would hide an out-of-memory). SKIP on the CPU (no CUDA allocator), with the plan's figures.
   train/reload: <out>/hf loads with `models.load_policy`, gives finite logits, and differs from
   the initial weights (the optimizer moved them).
3. kv-cache: our sampler under the training precision (`rollout.SampleSpec.make`, `sample_with`):
   the cache's buffers are in the compute dtype (bf16 under autocast on CUDA) and, with a budget of
   2.5 rows, every sampler call holds <= budget positions and exactly rows x capacity x
   memory_plan.Arch.kv_bytes_per_position bytes. On CUDA also the default budget (a share of free
   memory) is reported.
4. update-mfu: one ERPO optimizer step (bf16 autocast over fp32 master weights, activation
   checkpointing, token micro-batches, after a small warm-up step) of the preset's widths with the
   full vocabulary and --layers layers (at most what the plan fits in 75% of the GPU): tokens/s,
   peak memory, MFU = 6 x parameters x tokens / seconds / the GPU's dense bf16 peak (recomputation
   not counted). decode-speed: tokens/s of our sampler next to HF `generate`, same bf16 model and prompts.
"""

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from types import SimpleNamespace

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import kv_cache  # noqa: E402
import logprobs  # noqa: E402
import losses  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
from plumbing import batching, distributed, memory_plan, optimizer  # noqa: E402

WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
GIB, MIB = 2 ** 30, 2 ** 20
FA2 = "flash_attention_2"
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "B200": 2250}  # dense bf16

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)
PRESETS = {
    # model: a configs/models/ name or a config dict. ragged_layers: item 1 and 3; train_*: item 2;
    # layers, rows, prompt_len, new_tokens, micro_tokens: item 4's update; decode_*: its decoding.
    "7b": dict(model="Qwen2.5-Math-7B", ragged_layers=2, train_layers=4, train_new_tokens=512, train_prompts=8,
               train_group=8, layers=8, rows=32, prompt_len=256, new_tokens=2048, micro_tokens=16384,
               decode_rows=64, decode_new=256),
    "tiny": dict(model=TINY, ragged_layers=2, train_layers=2, train_new_tokens=32, train_prompts=4, train_group=4,
                 layers=2, rows=8, prompt_len=16, new_tokens=32, micro_tokens=256, decode_rows=8, decode_new=64),
}
ITEMS = ("ragged", "train", "kv", "mfu", "decode")
PRECISIONS = ("fp32", "bf16", "bf16-mixed")   # float32 weights; bf16 weights; float32 under bf16 autocast
# A row of a padded batch vs the row alone: max |log p| difference (nats) of token_logprobs and of
# the sampler (whose decode steps are decode.py's own math and, in bf16, a bf16 KV cache), and the
# gradient's relative L2 difference. Measured at 7B widths (1 layer, CPU): fp32 2e-6 / 6e-6 / 3e-7;
# bf16 and bf16-mixed 8e-3 / 5e-2 / 6e-3. Attending to the padding instead moves log-probs by ~4 nats.
TOL = {
    "fp32": dict(logp=1e-3, sample=1e-3, grad=1e-3),
    "bf16": dict(logp=0.1, sample=0.25, grad=0.05),
    "bf16-mixed": dict(logp=0.1, sample=0.25, grad=0.05),
}
QKL_STEP1 = {"fp32": 1e-6, "bf16": 1e-3}      # step-1 Query-KL (k3, token mean) by compute dtype
PROMPT_LENS, RESPONSE_LENS = (96, 70, 33, 5), (40, 64, 1, 17)  # item 1's ragged batch (prompt, response)
SAMPLE_NEW = 48                                 # item 1's sampled tokens per row (at most: some rows stop)


# ----------------------------------------------------------------------------------------------
# Reporting: one line per item


class Skip(Exception):
    """Raised by an item that does not apply here (the why is printed)."""


class Failed(Exception):
    """Raised by an item whose check did not hold."""


def check(ok, why):
    if not ok:
        raise Failed(why)


class Report:
    def __init__(self):
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}

    def line(self, status, item, text) -> str:
        self.counts[status] += 1
        print(f"{status} {item} {text}", flush=True)
        return status

    def item(self, name, fn, *args) -> str:
        """Run fn(*args) -> its figures (a str); print the item's line; return its status."""
        t0 = time.perf_counter()
        try:
            figures = fn(*args)
        except Skip as e:
            return self.line("SKIP", name, str(e))
        except Failed as e:
            return self.line("FAIL", name, f"{e} ({time.perf_counter() - t0:.1f} s)")
        except (Exception, SystemExit) as e:  # an API difference, an OOM, train.py's one-line exits
            return self.line("FAIL", name, f"{type(e).__name__}: {one_line(e)}")
        finally:
            free_memory()
        return self.line("PASS", name, f"{figures} ({time.perf_counter() - t0:.1f} s)")


def one_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Models with random weights


def model_config(preset, layers, vocab=None):
    from transformers import Qwen2Config

    c = PRESETS[preset]["model"]
    if isinstance(c, str):
        with open(os.path.join(memory_plan.ROOT, "configs", "models", c + ".json")) as f:
            c = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    c = {**c, "num_hidden_layers": layers or c["num_hidden_layers"]}
    return Qwen2Config(**{**c, "vocab_size": vocab} if vocab else c)


def build(cfg, dev, dtype, attn="sdpa"):
    """A random model of config `cfg` on `dev` (seeded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn).eval()


def precision(name, dev):
    """(weights dtype, autocast context factory) of an item-1 precision name."""
    if name == "bf16-mixed":
        return torch.float32, lambda: torch.autocast(dev.type, dtype=torch.bfloat16)
    return (torch.bfloat16 if name == "bf16" else torch.float32), contextlib.nullcontext


def planned_peaks(arch, a, needs_ref, device) -> tuple[dict, str]:
    """memory_plan's peak bytes per phase on one GPU for train.py's options `a` -> ({phase: bytes or
    None}, the source): memory_plan.phases, or where it does not exist the rollout and update sums of
    memory_plan.terms (its older API)."""
    if hasattr(memory_plan, "phases"):
        kw = {"device": device} if "device" in inspect.signature(memory_plan.phases).parameters else {}
        return dict(memory_plan.phases(arch, a, 1, needs_ref, **kw)), "memory_plan.phases"
    ts = memory_plan.terms(arch, a, 1, needs_ref, memory_plan.kv_rows(a, 1))
    sums = {ph: sum(t.bytes for t in ts if t.phase in ("both", ph)) for ph in ("rollout", "update")}
    return {**sums, "score": None, "optimizer": None}, "memory_plan.terms (there is no memory_plan.phases)"


def update_options(a):
    """Item 4's update step as train.py options (for the plan): one GPU, bf16-mixed, checkpointing."""
    return SimpleNamespace(max_prompt_len=a.prompt_len, max_new_tokens=a.new_tokens, micro_batch=a.rows,
                           micro_tokens=a.micro_tokens, fsdp=False, grad_ckpt=True, rollout_batch=a.rows // a.group,
                           group_size=a.group, gen_batch=a.rows, kv_budget=0, dtype="auto")


def layers_that_fit(a, total_bytes) -> int:
    """The most decoder layers whose planned peak (1 GPU) stays under 75% of the GPU."""
    cfg = model_config(a.preset, 0).to_dict()
    best = 1
    for n in range(1, cfg["num_hidden_layers"] + 1):
        arch = memory_plan.Arch.from_config({**cfg, "num_hidden_layers": n})
        peak = max(v for v in planned_peaks(arch, update_options(a), False, "cuda")[0].values() if v)
        best = n if peak < 0.75 * total_bytes else best
    return best


class Mem:
    """Allocated bytes now and the peak since the last reset (CUDA); zeros on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def flash_attn_missing() -> str | None:
    try:
        import flash_attn  # noqa: F401
    except Exception as e:
        return f"flash_attn does not import ({type(e).__name__})"
    return None


# ----------------------------------------------------------------------------------------------
# Item 1: ragged batches, each row as if alone


def ragged_batch(vocab, dev):
    """Left-padded prompts and right-padded responses of PROMPT_LENS / RESPONSE_LENS tokens:
    (ids, mask (B, P+R), spans: each row's real columns [start, stop))."""
    g = torch.Generator().manual_seed(1)
    P, R = max(PROMPT_LENS), max(RESPONSE_LENS)
    ids = torch.zeros(len(PROMPT_LENS), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        ids[i, P - p:P + r] = torch.randint(1, vocab, (p + r,), generator=g)
        mask[i, P - p:P + r] = 1
    return ids.to(dev), mask.to(dev), [(P - p, P + r) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def rel_l2(xs, ys) -> float:
    num = sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(xs, ys))
    den = sum(float(y.float().pow(2).sum()) for y in ys)
    return (num / max(den, 1e-30)) ** 0.5


def ragged_score(model, amp, tol):
    """token_logprobs forward + backward of the ragged batch vs each row alone."""
    dev = next(model.parameters()).device
    ids, mask, spans = ragged_batch(model.config.vocab_size, dev)
    model.zero_grad(set_to_none=True)
    with amp():
        logp, _ = logprobs.token_logprobs(model, ids, mask)       # (B, L-1): position j scores token j+1
    bad = int((~torch.isfinite(logp)).sum())                      # pads included: NaN * 0 is NaN
    sum(logp[i, s:e - 1].sum() for i, (s, e) in enumerate(spans)).backward()
    g_batch = grads(model)
    check(bad == 0, f"{bad} non-finite log-probs in the padded batch (pad positions included)")
    check(all(bool(torch.isfinite(x).all()) for x in g_batch), "non-finite gradient from the padded batch")
    model.zero_grad(set_to_none=True)
    diff = 0.0
    logp = logp.detach().float()
    diff = 0.0
    for i, (s, e) in enumerate(spans):                            # each row alone, no padding
        with amp():
            alone, _ = logprobs.token_logprobs(model, ids[i:i + 1, s:e], mask[i:i + 1, s:e])
        alone.sum().backward()                                    # gradients add up over the rows
        diff = max(diff, float((logp[i, s:e - 1] - alone[0].detach().float()).abs().max()))
    g_rel = rel_l2(g_batch, grads(model))
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), amp():                                  # the same batch, its padding attended
        blind, _ = logprobs.token_logprobs(model, ids, torch.ones_like(mask))
    bug = max(float((blind[i, s:e - 1].float() - logp[i, s:e - 1]).abs().max()) for i, (s, e) in enumerate(spans))
    figures = (f"max|dlogp|={diff:.2e} (tol {tol['logp']:g}) grad_rel={g_rel:.2e} (tol {tol['grad']:g}) "
               f"unmasked_padding={bug:.2e}")
    check(diff <= tol["logp"], f"a padded row's log-probs differ from the row alone: {figures}")
    check(g_rel <= tol["grad"], f"the padded batch's gradient differs from the rows' alone: {figures}")
    check(bug > 3 * tol["logp"], f"blind: attending to the padding moves log-probs < 3x the tolerance: {figures}")
    return figures


def ragged_sample(model, amp, tol):
    """Our kv sampler on the ragged prompts vs each row alone: sampled log-probs against the row's
    tokens rescored alone (teacher-forced), and whether the row alone samples the same tokens."""
    dev, V = next(model.parameters()).device, model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, V, (p,), generator=g).tolist() for p in PROMPT_LENS]
    eos = list(range(1, 1 + max(1, V // 25)))      # ~4% of the vocabulary stops a row: ragged responses
    seeds = [rollout.row_seed(7, i) for i in range(len(prompts))]
    kw = dict(max_new_tokens=SAMPLE_NEW, eos_ids=eos, pad_id=0, temperature=1.0)
    with amp():
        ro = rollout.sample(model, prompts, seeds=seeds, **kw)
    lens = ro.response_mask.sum(1).tolist()
    check(bool(torch.isfinite(ro.logprobs).all()), "non-finite sampled log-probs")
    diff, same = 0.0, 0
    for i, p in enumerate(prompts):
        toks = torch.tensor([p + ro.response_ids[i, :lens[i]].tolist()], device=dev)
        with torch.no_grad(), amp():
            alone, _ = logprobs.token_logprobs(model, toks, torch.ones_like(toks))
        diff = max(diff, float((ro.logprobs[i, :lens[i]].float() - alone[0, len(p) - 1:].float()).abs().max()))
        with amp():
            solo = rollout.sample(model, [p], seeds=seeds[i:i + 1], **kw)
        n = int(solo.response_mask.sum())
        same += solo.response_ids[0, :n].tolist() == ro.response_ids[i, :lens[i]].tolist()
    figures = (f"response_lens={lens} max|dlogp|={diff:.2e} (tol {tol['sample']:g}) "
               f"same_tokens_alone={same}/{len(prompts)}")
    check(diff <= tol["sample"], f"sampled log-probs differ from the rows rescored alone: {figures}")
    return figures


def ragged_items(rep, a, dev, attn, prec):
    names = [f"ragged-score/{attn}/{prec}", f"ragged-sample/{attn}/{prec}"]
    why = None
    if attn == FA2:
        why = ("flash-attn needs CUDA" if dev.type != "cuda" else flash_attn_missing()
               or ("flash-attn computes only bf16/fp16 (float32 weights get sdpa)" if prec == "fp32" else None))
    elif prec == "bf16" and dev.type == "cpu":
        why = "CPU: fp32 and bf16-mixed are enough (bf16 weights are the GPU's decoding precision)"
    if why:
        for n in names:
            rep.line("SKIP", n, why)
        return
    dtype, amp = precision(prec, dev)
    try:
        model = build(model_config(a.preset, a.p["ragged_layers"]), dev, dtype, attn)
    except Exception as e:
        for n in names:
            rep.line("FAIL", n, f"building the model: {type(e).__name__}: {one_line(e)}")
        return
    rep.item(names[0], ragged_score, model, amp, TOL[prec])
    rep.item(names[1], ragged_sample, model, amp, TOL[prec])
    del model


# ----------------------------------------------------------------------------------------------
# Item 2: train.main end to end under FSDP2 on one rank


class PhasePeaks:
    """Peak CUDA memory per phase: at every phase boundary the allocator's peak so far is credited
    to the phase that was running and the peak is reset, so a phase's figure is the most bytes
    allocated at once while it ran (everything alive then, not only its own tensors)."""

    def __init__(self, cuda):
        self.cuda, self.stack, self.peaks = cuda, ["other"], {}

    def _cut(self):
        if self.cuda:
            torch.cuda.synchronize()
            name = self.stack[-1]
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def phase(self, name):
        self._cut()
        self.stack.append(name)
        try:
            yield
        finally:
            self._cut()
            self.stack.pop()


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def instrumented_training(peaks, sharded):
    """train.main as it is, observed from outside: its timer phases and optimizer steps also
    cut `peaks`; wrap_model records whether the policy came back FSDP2-sharded; rewards become
    coin flips of the response text (a random model solves nothing: no advantage, no update)."""
    import reward
    from plumbing import timer

    base_phases, base_step, base_wrap = timer.Phases, optimizer.step, distributed.wrap_model
    base_score = reward.score_batch

    class Phases(base_phases):
        @contextlib.contextmanager
        def __call__(self, name):
            with peaks.phase(name), base_phases.__call__(self, name):
                yield

    def step(opt, sched):
        with peaks.phase("optimizer"):
            return base_step(opt, sched)

    def wrap_model(*args, **kw):
        out = base_wrap(*args, **kw)
        if inspect.signature(base_wrap).bind(*args, **kw).arguments.get("trainable", True):  # the policy
            sharded.append(distributed.is_fsdp(out))
        return out

    def score_batch(texts, answers, **kw):
        _, counts = base_score(texts, answers, **kw)
        return [float(zlib.crc32(t.encode()) & 1) for t in texts], counts

    with contextlib.ExitStack() as stack:
        for obj, name, value in ((timer, "Phases", Phases), (optimizer, "step", step),
                                 (distributed, "wrap_model", wrap_model), (reward, "score_batch", score_batch)):
            stack.enter_context(patched(obj, name, value))
        yield


def write_random_model(folder, cfg, dev):
    """A random model + the embedded tokenizer (and its generation config: stop ids) as a HF folder."""
    model = build(cfg, dev, torch.bfloat16)        # bf16 on disk: half the bytes; train.py loads float32
    model.save_pretrained(folder)
    del model
    for f in os.listdir(WARM):
        if f not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(WARM, f), folder)


def train_argv(a, tmp, steps=2):
    p = a.p
    return ["--model", os.path.join(tmp, "model"), "--train-data", os.path.join(tmp, "train.jsonl"),
            "--out", os.path.join(tmp, "run"), "--algo", "erpo", "--steps", str(steps),
            "--rollout-batch", str(p["train_prompts"]), "--update-batch", str(p["train_prompts"] // 2),
            "--group-size", str(p["train_group"]), "--max-new-tokens", str(p["train_new_tokens"]),
            "--max-prompt-len", "128", "--micro-batch", "16", "--micro-tokens", "8192", "--fsdp", "true",
            "--grad-ckpt", "true", "--lr", "1e-6", "--eval-every", "0", "--save-every", str(steps),
            "--query-cache-dir", "", "--seed", "0",
            "--no-signal", "step"]    # coin-flip rewards may leave a batch without signal: step anyway


def plan_phases(argv, dev):
    """The plan for train.main's own options (parsed by train.py) -> ({phase: bytes or None}, source)."""
    import train

    ta, algo = train.parse_args(argv)
    needs_ref = algo.kl is not None or ta.measure_policy_kl
    return planned_peaks(memory_plan.arch_for(ta.model), ta, needs_ref, dev.type)


def train_run(a, dev, tmp, out):
    """Write the model and data, run train.main in this process; fills `out` for the two items after."""
    import torch.distributed as dist

    if dev.type == "cpu" and torch.cuda.is_available():
        raise Skip("train.main picks the GPU when there is one: run --device cpu on a machine without CUDA")
    with open(os.path.join(WARM, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]                   # the embedded tokenizer's vocabulary
    cfg = model_config(a.preset, a.train_layers, vocab=vocab)
    write_random_model(os.path.join(tmp, "model"), cfg, dev)
    with open(os.path.join(ROOT, "data", "tinymath", "train.jsonl")) as f:
        head = [next(f) for _ in range(256)]
    with open(os.path.join(tmp, "train.jsonl"), "w") as f:
        f.writelines(head)
    argv = train_argv(a, tmp)
    try:                                                     # (train/memory reports a failure here)
        out["plan"] = plan_phases(argv, dev)
    except Exception as e:
        out["plan_error"] = f"the plan: {type(e).__name__}: {one_line(e)}"
    import train

    free_memory()
    peaks, sharded = PhasePeaks(dev.type == "cuda"), []
    out["baseline"] = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    out["peaks"] = peaks.peaks
    distributed.setup(str(dev), fsdp=True)                # a process group of one: FSDP2 shards over it
    log = os.path.join(tmp, "train.log")
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f), \
                instrumented_training(peaks, sharded):
            train.main(argv)
    except BaseException as e:
        raise Failed(f"train.main: {type(e).__name__}: {one_line(e)} (log: {log})") from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out["seconds"] = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(tmp, "run", "metrics.jsonl"))]
    steps = [r for r in rows if "query_kl" in r]
    check(sharded and all(sharded), f"the policy was not FSDP2-sharded (wrap_model gave {sharded})")
    check(len(steps) == 2, f"{len(steps)} RL steps logged, expected 2 (log: {log})")
    q1 = steps[0]["query_kl"]
    limit = QKL_STEP1["bf16" if dev.type == "cuda" else "fp32"]
    check(q1 == q1 and abs(q1) <= limit, f"step-1 Query-KL {q1} is not finite and <= {limit}")
    for r in steps:
        for k in ("loss", "grad_norm", "policy_kl", "entropy"):
            check(r.get(k) is not None and abs(r[k]) < float("inf"), f"step {r['step']}: {k} = {r.get(k)}")
    tok = sum(r["response_tokens"] for r in steps)
    return (f"steps=2 query_kl@1={q1:.2e} (<= {limit:g}) query_kl@2={steps[1]['query_kl']:.2e} "
            f"policy_kl@1={steps[0]['policy_kl']:.2e} grad_norm={steps[0]['grad_norm']:.3g},"
            f"{steps[1]['grad_norm']:.3g} response_tokens={tok:.0f} layers={cfg.num_hidden_layers} vocab={vocab} "
            f"rewards=coin-flips train.main {out['seconds']:.0f} s")


def train_memory(dev, out):
    """The per-phase peaks of the run next to the plan."""
    check("plan" in out, out.get("plan_error", "train/fsdp2 did not get as far as the plan"))
    plan, source = out["plan"]
    names = {"rollout": ("gen", "rollout"), "score": ("score",), "update": ("update",), "optimizer": ("optimizer",)}
    cells, over, missing = [], [], []
    for ph, keys in names.items():                 # the plan's phase <- train.py's timer phase(s)
        got = max((out["peaks"].get(k, 0) for k in keys), default=0)
        want = plan.get(ph)
        cells.append(f"{ph} {got / GIB:.2f}/{'-' if want is None else f'{want / GIB:.2f}'}")
        over += [ph] if want is not None and got > 1.2 * want + 256 * MIB else []
        missing += [ph] if not got else []
    other = out["peaks"].get("other", 0)
    figures = (f"GiB measured/plan: {', '.join(cells)}; outside these phases {other / GIB:.2f} "
               f"(plan: {source}; allocated before the run {out['baseline'] / GIB:.2f})")
    if dev.type != "cuda":
        raise Skip(f"no CUDA allocator on {dev.type}; plan GiB: " + ", ".join(
            f"{ph} {'-' if plan.get(ph) is None else f'{plan[ph] / GIB:.3f}'}" for ph in names) + f" ({source})")
    check("seconds" in out, f"train.main did not finish; {figures}")
    check(not missing, f"no peak for {', '.join(missing)} (train.py's timer phases renamed?): {figures}")
    check(not over, f"{', '.join(over)} over the plan by > 20% + 256 MiB: {figures}")
    return figures


def safetensors_in(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, f)).items()}


def train_reload(dev, tmp, out):
    """<out>/hf loads with models.load_policy, gives finite logits, and moved from the initial weights."""
    check("seconds" in out, "train.main did not finish")
    hf = os.path.join(tmp, "run", "hf")
    model, tok = models.load_policy(hf, device=dev)
    ids = torch.tensor([tok("Leo owns 36 buttons. How many buttons does Leo have?").input_ids], device=dev)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    check(bool(torch.isfinite(logits).all()), "non-finite logits from the exported model")
    init, final = safetensors_in(os.path.join(tmp, "model")), safetensors_in(hf)
    moved = max(float((final[k].float() - init[k].float()).abs().max()) for k in init.keys() & final.keys())
    check(moved > 0, "the exported weights equal the initial ones: the optimizer did not move them")
    return (f"{model.num_parameters() / 1e9:.3f}B parameters, {next(model.parameters()).dtype}, finite logits, "
            f"max|dw|={moved:.2e} from the initial weights")


# ----------------------------------------------------------------------------------------------
# Item 3: the KV cache's dtype and bytes against the budget


def kv_cache_check(a, dev):
    _, tok = models.load_policy(WARM)                   # stop and pad ids for SampleSpec.make
    dtype, amp = distributed.precision("auto", dev)      # train.py's default: bf16 autocast on CUDA
    bf16 = distributed.uses_bf16("auto", dev)
    model = build(model_config(a.preset, a.p["ragged_layers"]), dev, dtype)
    arch = memory_plan.Arch.from_config(model.config.to_dict())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 31, 17, 8)]
    prompts = [p for p in prompts for _ in range(2)]     # G = 2: a prompt's rows get copies of its cache rows
    new = 32
    auto = rollout.SampleSpec.make(model, tok, new, "kv", None, 0, bf16)
    budget = int(2.5 * (max(map(len, prompts)) + new))   # room for 2 rows: 4 sampler calls of 8 rows
    spec = rollout.SampleSpec.make(model, tok, new, "kv", None, budget, bf16)
    spec = dataclasses.replace(spec, eos_ids=[])         # eos off: no row is compacted out of its cache
    made = []

    def recording(*args, **kw):
        made.append(base(*args, **kw))
        return made[-1]

    with patched(kv_cache, "kv_cache", recording) as base, amp():
        ro = rollout.sample_with(model, prompts, spec, temperature=1.0, seeds=list(range(len(prompts))))
    check(made, "rollout.sample_with made no kv_cache.kv_cache")
    want = torch.bfloat16 if bf16 and dev.type == "cuda" else dtype   # precision("auto")'s compute dtype
    bpp = arch.kv_bytes_per_position(want.itemsize)
    per_call = []
    for cache in made:
        bufs = [t for layer in cache.layers for t in (getattr(layer, "k_buf", None), getattr(layer, "v_buf", None))]
        check(all(t is not None for t in bufs), f"{type(cache.layers[0]).__name__}: not a preallocated cache")
        dtypes = {t.dtype for t in bufs}
        check(dtypes == {want}, f"KV cache dtype {dtypes}, expected the compute dtype {want}")
        rows, cap = bufs[0].shape[0], bufs[0].shape[2]
        nbytes = sum(t.numel() * t.element_size() for t in bufs)
        check(nbytes == rows * cap * bpp, f"cache bytes {nbytes} != {rows} rows x {cap} positions x {bpp} B")
        check(rows * cap <= budget, f"a sampler call holds {rows} x {cap} positions > the budget {budget}")
        per_call.append((rows, cap, nbytes))
    check(bool(torch.isfinite(ro.logprobs).all()) and bool(ro.response_mask.all()), "non-finite or short rollout")
    figures = (f"dtype={want} calls={len(made)} rows/call={[r for r, _, _ in per_call]} "
               f"positions/call<={max(r * c for r, c, _ in per_call)}/{budget} "
               f"bytes/call<={max(b for _, _, b in per_call) / MIB:.2f}/{budget * bpp / MIB:.2f} MiB")
    if dev.type == "cuda":
        check(auto.kv_budget > 0, "the default budget (0: a share of free memory) gave 0 positions")
        figures += f" default budget {auto.kv_budget} positions = {auto.kv_budget * bpp / GIB:.1f} GiB"
    return figures


# ----------------------------------------------------------------------------------------------
# Item 4: update MFU and decoding tokens/s


def synthetic_rollout(a, vocab, dev) -> rollout.Rollout:
    """--rows rows in groups sharing a prompt of --prompt-len/2 to --prompt-len tokens (left-padded),
    responses of --new-tokens/2 to --new-tokens (right-padded): what a rollout hands the update."""
    g = torch.Generator().manual_seed(4)
    B, P, N = a.rows, a.prompt_len, a.new_tokens
    plen = torch.randint(P // 2, P + 1, (B // a.group,), generator=g).repeat_interleave(a.group)
    rlen = torch.randint(max(1, N // 2), N + 1, (B,), generator=g)
    cols_p, cols_r = torch.arange(P), torch.arange(N)
    pmask = (cols_p[None] >= P - plen[:, None]).long()
    rmask = (cols_r[None] < rlen[:, None]).long()
    prompt = torch.randint(1, vocab, (B // a.group, P), generator=g).repeat_interleave(a.group, 0) * pmask
    resp = torch.randint(1, vocab, (B, N), generator=g) * rmask
    return rollout.Rollout(prompt, pmask, resp, rmask, torch.zeros(B, N), torch.zeros(B, dtype=torch.bool)).to(dev)


def erpo_update(model, ro, qref_logp, a, opt, amp, mem):
    """One optimizer step of the ERPO loss over the rollout, micro-batched by tokens."""
    algo = losses.ALGOS["erpo"]
    packed = ro.packed()
    B = packed.input_ids.shape[0]
    rewards = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(0)).float().to(ro.prompt_ids.device)
    adv = losses.group_advantages(rewards, a.group, algo.adv, algo.adv_eps)
    nll = -(qref_logp * packed.prompt_tok_mask).sum(1)
    w = losses.query_weights(nll, mean_nll=nll.mean().item(), clip=algo.weight_clip)
    resp_mask = ro.response_mask.float()
    num_tokens = resp_mask.sum().item()
    plan = batching.microbatch_plan(packed.lengths, a.rows, a.micro_tokens)   # (prompt, response) widths
    mem.reset()
    for mb in plan:
        r = torch.tensor(mb, device=packed.input_ids.device)
        pk, pc, rc = packed.trimmed(r)
        with amp():
            s = logprobs.score_tokens(model, pk, a.temperature)
            loss, _ = losses.rl_loss(algo, logp=s.response, old_logp=s.response.detach(), ref_logp=None,
                                     resp_mask=resp_mask[r][:, rc], advantages=adv[r], weights=w[r],
                                     prompt_logp=s.prompt, prompt_ref_logp=qref_logp[r][:, pc],
                                     prompt_mask=packed.prompt_tok_mask[r][:, pc].float(),
                                     num_tokens=num_tokens, num_seqs=B, max_len=a.new_tokens)
        loss.backward()
    mem.sync()
    peak_loop = mem.peak()                     # weights + gradients + one micro-batch's activations
    mem.reset()
    norm = optimizer.clip_grad(model, 1.0)
    opt.step()                                 # Adam state appears here (and its temporaries)
    opt.zero_grad(set_to_none=True)
    mem.sync()
    return int(packed.attention_mask.sum()), len(plan), peak_loop, mem.peak(), float(norm)


def update_mfu(a, dev, name):
    """One timed ERPO optimizer step over --rows responses: tokens/s, MFU, peak memory."""
    mem, cuda = Mem(dev), dev.type == "cuda"
    model = build(model_config(a.preset, a.layers), dev, torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    _, amp = precision("bf16-mixed", dev)
    ro = synthetic_rollout(a, model.config.vocab_size, dev)
    with torch.no_grad(), amp():  # the Query-KL cache: the prompts' log-probs under the initial weights
        qref = logprobs.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, a.temperature)[0].float()
    model = distributed.wrap_model(model.train(), dev, grad_ckpt=True)
    opt = optimizer.adamw(model, 1e-6, 0.01)
    warm = argparse.Namespace(**{**vars(a), "rows": a.group})      # a first small step: kernels, Adam state
    erpo_update(model, ro.take(slice(0, a.group)), qref[:a.group], warm, opt, amp, mem)
    t0 = time.perf_counter()
    tokens, n_mb, loop_peak, opt_peak, norm = erpo_update(model, ro, qref, a, opt, amp, mem)
    t = time.perf_counter() - t0
    check(norm == norm and norm < float("inf"), f"non-finite grad norm {norm}")
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = (f"MFU={6 * n_params * tokens / t / (peak * 1e12) * 100:.1f}% of {peak} TFLOP/s" if peak
           else "MFU: unknown peak (--peak-tflops)")
    mem_s = f" peak GiB: micro-batches {loop_peak / GIB:.1f}, optimizer step {opt_peak / GIB:.1f}" if cuda else ""
    return (f"{n_params / 1e9:.2f}B params ({model.config.num_hidden_layers} layers) {tokens} tokens in {n_mb} "
            f"micro-batches {t:.2f} s = {tokens / t:.0f} tok/s {mfu}{mem_s}")


def decode_speed(a, dev):
    """tokens/s of our sampler and of plain HF generate on the same prompts (eos off), bf16 weights
    (the decoding precision: evaluate.py's load, FSDP2's gathered copy)."""
    from transformers import GenerationConfig

    mem = Mem(dev)
    model = build(model_config(a.preset, a.layers), dev, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    V, rows = model.config.vocab_size, a.p["decode_rows"]
    prompts = [torch.randint(1, V, (a.prompt_len,), generator=g).tolist() for _ in range(rows)]
    new = a.decode_new

    def ours(n):
        rollout.sample(model, prompts, max_new_tokens=n, eos_ids=[], pad_id=0, temperature=a.temperature,
                       seeds=list(range(len(prompts))))

    def hf(n):
        ids, mask = kv_cache.left_pad(prompts, 0, dev)
        model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=a.temperature, top_k=0, top_p=1.0,
            eos_token_id=None, pad_token_id=0))

    rates = {}
    for name, fn in (("ours", ours), ("hf", hf)):
        fn(4)                                    # warm-up: kernels, allocator
        mem.sync()
        t0 = time.perf_counter()
        fn(new)
        mem.sync()
        rates[name] = len(prompts) * new / (time.perf_counter() - t0)
    return (f"{len(prompts)} rows x {new} new tokens after {a.prompt_len}: ours {rates['ours']:.0f} tok/s, "
            f"HF generate {rates['hf']:.0f} tok/s, ratio {rates['ours'] / rates['hf']:.2f}x")


# ----------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="items: " + ", ".join(ITEMS) + " (what each checks: the module docstring)")
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (if any) or cpu")
    ap.add_argument("--items", default=",".join(ITEMS), help="comma-separated subset of the items to run")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the update/decode model (0: the "
                    "preset's, at most as many as the plan fits in 75%% of the GPU)")
    ap.add_argument("--train-layers", type=int, default=0, help="decoder layers of train.main's model (0: preset's)")
    ap.add_argument("--rows", type=int, default=None, help="responses in the update step")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--micro-tokens", type=int, default=None)
    ap.add_argument("--decode-new", type=int, default=None, help="new tokens of the ours-vs-HF decode comparison")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: by name)")
    ap.add_argument("--tmp", default=None, help="folder for train.main's model and run, kept (default: a temporary "
                    "one, deleted at the end but for train.log where a train item failed)")
    a = ap.parse_args(argv)
    a.p = PRESETS[a.preset]
    for k in ("rows", "prompt_len", "new_tokens", "micro_tokens", "decode_new"):
        setattr(a, k, getattr(a, k) or a.p[k])
    a.layers, a.train_layers = a.layers or a.p["layers"], a.train_layers or a.p["train_layers"]
    a.group = 8 if a.rows % 8 == 0 else a.rows
    a.items = [i for i in a.items.split(",") if i]
    unknown = set(a.items) - set(ITEMS)
    if unknown:
        ap.error(f"unknown items {sorted(unknown)}; choose from {', '.join(ITEMS)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    import transformers
    try:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else 0
    fit = ""
    if cuda and a.preset == "7b":
        try:
            n = layers_that_fit(a, total)
            fit, a.layers = f" (the plan fits {n} in 75%)", min(a.layers, n)
        except Exception as e:  # the update item then runs with the requested layers, and says so
            fit = f" (layers_that_fit failed: {type(e).__name__}: {one_line(e)})"
    print(f"gpu_check: {name}{f' ({total / GIB:.0f} GiB)' if cuda else ''}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, flash_attn {'absent' if flash_attn_missing() else 'present'}, "
          f"preset {a.preset}, update/decode layers {a.layers}{fit}, items {','.join(a.items)}", flush=True)
    rep = Report()
    if "ragged" in a.items:
        for attn in ("sdpa", FA2):
            for prec in PRECISIONS:
                ragged_items(rep, a, dev, attn, prec)
    if "train" in a.items:
        tmp = a.tmp or tempfile.mkdtemp(prefix="gpu_check_")
        os.makedirs(tmp, exist_ok=True)
        out, fails = {}, rep.counts["FAIL"]
        if rep.item("train/fsdp2", train_run, a, dev, tmp, out) == "SKIP":
            for n in ("train/memory", "train/reload"):
                rep.line("SKIP", n, "train/fsdp2 did not run")
        else:
            rep.item("train/memory", train_memory, dev, out)
            rep.item("train/reload", train_reload, dev, tmp, out)
        if a.tmp is None:                      # the disk is small: a rerun needs the room
            keep = {"train.log"} if rep.counts["FAIL"] > fails else set()   # a failure's log stays
            for entry in set(os.listdir(tmp)) - keep:
                path = os.path.join(tmp, entry)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            if not keep:
                os.rmdir(tmp)
    if "kv" in a.items:
        rep.item("kv-cache", kv_cache_check, a, dev)
    if "mfu" in a.items:
        rep.item("update-mfu", update_mfu, a, dev, name)
    if "decode" in a.items:
        rep.item("decode-speed", decode_speed, a, dev)
    c = rep.counts
    print(f"gpu_check: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP in {time.perf_counter() - t_start:.0f} s "
          f"({name}, preset {a.preset})", flush=True)
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
