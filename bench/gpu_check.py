"""The one-shot GPU check of the codebase: one PASS / FAIL / SKIP line per item, then a summary.

    python bench/gpu_check.py                                  # CUDA: Qwen2.5-Math-7B widths, < 5 minutes
    python bench/gpu_check.py --preset tiny --device cpu       # the same code in seconds (a test runs it)
    python bench/gpu_check.py --items train,kv                 # a subset, for a rerun in little device time
    python bench/gpu_check.py --minutes 5                      # no GPU: the host side at toy widths

--minutes N (5): no item starts that would not end in the budget (on a GPU by its estimated seconds,
EST_S). The timing items run first and measure the time model's constants at the paper run's own shapes
(configs/paper_qwen7b.json on 8 of this card, as `train.py --dry-run` plans it); then one line per phase
of that step (plumbing/time_model.step_terms): "model X s / measured: Y s / ratio: Y/X", the measured
being the same step_terms replayed with the measured constants and slots ("measured: n/a (no GPU)" on a
CPU), and the hours they imply; the JSON (--json) is written then, and again after the correctness gates.
It holds the items' lines, the raw measurements, the phases and the measured `constants` that
`train.py --plan-constants` reads (None: not measured, the assumed value kept).

For ONE NVIDIA H100 of 80 GB (141 GB for update-memory, which SKIPs on 80), random weights, no download.
Each line is `PASS <item> <figures>`, `FAIL <item> <why>` or `SKIP <item> <why>`; the exit status is 1
if any item failed. Every item runs in its own try/except, so an API difference (another transformers,
no flash-attn, an OOM) costs that item a FAIL or SKIP line, not the run. The items, in the order they
run, with their --items name and the seconds each is estimated to take on one H100 (EST_S: from FLOPs
and bytes, not measured: no GPU has run this file yet), ~180 s in all, plus start-up:

0. The timing items, the time model's constants at the run's shapes (they run first):
   fp32-matmul (matmul, ~2 s): the fused head's float32-output GEMM of bf16 operands (torch.mm out_dtype,
   which exists only on CUDA: logprobs._Gemm), forward and backward through logprobs._TokenLogprob under
   bf16 autocast over float32 leaves at small shapes, against float64 of the same bf16-rounded operands
   (MATMUL_TOL); the GEMM alone must beat a bf16-output GEMM's error by 10x. SKIP on a CPU.
   decode-grid (decode-grid, ~20 s): the full-depth bf16 decoder (built once, shared with kv-budget and
   decode-pass) at 3 slot counts x 3 column counts taken from the time model's decode schedule of the
   paper step (time_model.decode_schedule: the busy phase, ~229 slots reading ~1,030 columns on 8 H100s,
   and the tail, ~52 slots at ~2,750; the busy phase's first columns): a kv_cache.slot_cache of each
   shape, decode.LeanStep + rollout._choose (one step of the run's pass). Per point: device ms per step
   (CUDA events over back-to-back steps), wall ms, and the host's enqueue ms (one step issued from an
   idle GPU: launching its kernels), beside the time model's per-step figure (decode_seconds on one
   segment of that shape), its bandwidth bound (weights + KV at the card's HBM) and launch bound
   (KERNELS_PER_LAYER x layers x launch_us); the ops a step dispatches (not views) beside the model's
   kernel count. Derives decode_bw_fraction (bound / device, median over the points the host issues in
   under HOST_SHARE of their device time) and launch_us (enqueue / the model's kernel count).
   kv-budget (kv-budget, ~2 s): the slots --kv-budget 0 would give on this card
   (kv_cache.kv_budget_from_memory beside the resident decoding copy, less the plan's other rollout-phase
   bytes of a rank of the paper run; time_model.slots_for) against the plan's (memory_plan.as_planned);
   the replayed phases use them. SKIP on a CPU, with the plan's figure.
   decode-pass (decode-pass, ~10 s): item 5 below, at the plan's slots (229 on an H100).
   update-fit (update-fit, ~15 s): the update's forward + backward as train.py runs it on the paper's
   micro-batch: logprobs.packed_row_scores over 4,096 packed tokens (4 rows of the mean prompt, 144, +
   880), the attention models.attention_for gives train.py, bf16 autocast over float32 master weights,
   activation checkpointing only where the plan has it (--grad-ckpt auto: off at 4,096 tokens on 8 H100s),
   at 2 and 4 layers with the full vocabulary (fit_layers), then the no-grad scoring forward at the same
   shapes; fitted as seconds = a + b x layers, extrapolated to 28 layers: MFU in the time model's own
   FLOPs (6N a token, 8N checkpointed; 2N the forward) and its N (time_model.matmul_params: all but the
   input embedding, a lookup; the constant then replays exactly), beside the time model's seconds at its
   assumed MFU. update_mfu is the update's.
1. ragged-score/<attn>/<precision> and ragged-sample/<attn>/<precision> (ragged, ~25 s): left-padded
   prompts of different lengths with right-padded responses through `logprobs.token_logprobs`
   (forward and backward) and through our sampler (`rollout.sample`: sampler/kv_cache.py's one pass); attn
   sdpa -- the pad-safe SDPA train.py loads (models.attention_for: models.SDPA, on a CPU under bf16
   autocast models.SDPA_FLOAT32), never transformers' plain "sdpa" -- or flash_attention_2 (SKIP
   where flash_attn does not import, and for fp32, which flash-attn does not compute); precision
   fp32, bf16 (bf16 weights) or bf16-mixed (fp32 weights under bf16 autocast, training's default
   on CUDA; the CPU runs fp32 and bf16-mixed). Every output must be finite, pad positions included
   (SDPA with fully masked left-padding rows can give NaN on recent GPUs, and NaN * 0 is NaN in a
   masked sum), and every boolean mask handed to torch's SDPA (watched) must give every query row
   a key: the batch has pad queries that see only pads (their count is printed), torch's CPU
   kernels return finite values for an empty row where GPU kernels may not, so the mask is what a
   CPU run can check (flash-attn unpads and takes no mask). Each row must equal that row alone
   without padding within TOL (bf16 is not bitwise): log-probs by max |difference|, the gradient
   of the summed log-probs by relative L2. The batch scored with its padding NOT masked must miss
   by more than 3x the tolerance, or the tolerance could not see a masking or position bug
   ("blind"). The sampler's rows are compared teacher-forced (each row's sampled tokens rescored
   alone), which rounding cannot flip; how many rows sample the same tokens alone is reported,
   not required (in bf16 a near-tie flips a token).
2. train/fsdp2, train/memory, train/reload (train, ~60 s): `train.main` itself, under FSDP2 on a
   process group of one (nccl; gloo on the CPU), with a random model of Qwen2.5-Math-7B's widths
   and a few layers (tiny: the tiny widths) in a temporary folder with the embedded tokenizer
   (data/tinymath/warmstart). That tokenizer has 665 tokens and a random model with 152,064
   embedding rows samples ids it cannot decode, so the embedding and lm_head have the tokenizer's
   vocabulary; every other width is the 7B's, and the plan is computed for this same
   architecture. Data: the first 256 problems of data/tinymath/train.jsonl. A random model solves
   none, so every group would have zero advantage and the update would move nothing: rewards are
   seeded coin flips of the response text (the grader still runs). ERPO, the reference model (the
   Policy-KL monitor), activation checkpointing, 2 RL steps of 2 optimizer steps, the final save
   (DCP shards and the HF export <out>/hf).
   train/fsdp2: the policy was FSDP2-sharded; the step-1 Query-KL is finite and ~0 (<= QKL_STEP1:
   the cache comes from the same training forward); every step's loss and grad norm are finite.
   train/memory: torch.cuda.max_memory_allocated per phase (rollout, score, update, optimizer step;
   the peak is reset at the boundaries of train.py's timer phases and around optimizer.step) next to
   memory_plan.phases(), or where that does not exist the rollout/update sums of memory_plan.terms()
   (the line says which); FAIL where a phase exceeds its plan by more than 20% + 256 MiB (the plan
   would hide an out-of-memory), or where metrics.jsonl lacks train.py's own per-phase memory
   (rl/experience.Phases: mem_alloc_<phase>, mem_reserved_<phase>, mem_used_<phase>; printed). SKIP on
   the CPU (no CUDA allocator), with the plan's figures.
   train/reload: <out>/hf loads with `models.load_policy`, gives finite logits, and differs from
   the initial weights (the optimizer moved them).
3. kv-cache (kv, ~5 s): our sampler under the training precision (`rollout.SampleSpec.make`,
   `sample_with`): the cache's buffers are in the compute dtype (bf16 under autocast on CUDA) and,
   with a budget of 2.5 rows, the rows are decoded in ONE pass (one cache, sampler/kv_cache.py) of 2 slots
   holding <= budget positions and exactly slots x capacity x memory_plan.Arch.kv_bytes_per_position
   bytes. On CUDA also the default budget (a share of free memory) is reported.
4. update-memory (update-memory, ~15 s): the same code at FULL depth (28 layers) and vocabulary on
   one update micro-batch of the paper config's shape (configs/paper_qwen7b.json: --micro-tokens
   16384 = 4 rows of the longest 1,024 + 3,072 tokens; activation checkpointing, as the config):
   torch.cuda.max_memory_allocated around its forward (logprobs.score_tokens, entropy on, as the
   first update's pi_old forward) + ERPO loss + backward, against memory_plan's update phase for
   that micro-batch on one GPU without FSDP2, LESS its Adam state (SKIP on an 80 GB card). Why that:
   what an unsharded 7B update holds in train.py's precision (bf16-mixed) is float32 master weights
   (28.4 GiB) + their float32 gradients (28.4) + autocast's bf16 weight copies (13.2) + the
   micro-batch's saved activations and lm_head's backward (9.0): 78.9 GiB planned, within an H200's
   131 GiB; Adam's 56.7 GiB more would not fit, and a forward + backward does not touch it (bf16 weights
   instead would test a precision train.py does not train in). FAIL if measured > plan x 1.2 + 256 MiB;
   SKIP where the plan does not fit 90% of the GPU. On the CPU the peak is the live tensor bytes
   torch's MemTracker sees (memory_measure.PhasePeaks) against the plan's CPU figures.
5. decode-pass (decode-pass, runs with the timing items): decode throughput at the real widths and
   depth (decode-grid's decoder: all 28 layers, bf16 weights, train.py's attention) through train.py's
   path (`rollout.sample` under autocast -> kv_cache.decode_pass -> decode.LeanStep), with the paper
   run's slots on this card (time_model.slots_for of the plan, whole groups: 224 on an H100; G = 8
   rows per prompt; prompts of 7/8 to 1x its --max-prompt-len, 1,024 tokens): a pass of --pass-steps
   decode steps (256) after a warm-up pass, the clock started once the prefill (kv_cache.admit, one for all
   the slots) has returned. Reports tokens/s, ms per step, the bound of reading once per step the
   bf16 weights (all but the input embedding, a lookup) and the slots' KV cache up to the longest
   slot at the GPU's HBM bandwidth (HBM_TBS by name, --hbm-tbs), measured/bound, and the time
   model's per-step figure for the same slots and widths (plumbing/time_model.decode_terms: the
   slower of that read, counting the embedding too, and launching the step's eager kernels). PASS
   if each call was one pass, its rows admitted at once and run to their limit, and every figure is
   finite; no threshold on speed.
   decode-speed (decode, ~15 s): tokens/s of our sampler next to HF `generate`, same bf16 model
   (--layers layers) and prompts.
6. sampler-gap (sampler-gap, ~15 s): how far the sampler is from pi_old on the full-depth model:
   the decoding copy (bf16 weights) samples gap_prompts x G rows of the paper config's prompt
   length under autocast, as train.rollouts does; the training forward (logprobs.score_tokens
   under bf16 autocast over float32 master weights holding the copy's values, as after loading a
   bf16 checkpoint; the attention models.attention_for gives train.py) rescores the same tokens;
   experience.sampler_vs_old's mean |log pi_sampler - log pi_old| and k3 per response token, what
   train.py logs as sampler_logp_gap and sampler_kl. FAIL if not finite or if the k3 exceeds
   GAP_K3_MAX (why that value: beside it). The k3 of pi_old at temperature 1.1 is printed for scale.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import math
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
from sampler import decode, kv_cache  # noqa: E402
from modeling import logprobs  # noqa: E402
import losses  # noqa: E402
from rl import experience  # noqa: E402
from modeling import models  # noqa: E402
import rollout  # noqa: E402
from plumbing import batching, distributed, memory_plan, optimizer, time_model  # noqa: E402

WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
GIB, MIB = 2 ** 30, 2 ** 20
FA2 = "flash_attention_2"
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "B200": 2250}  # dense bf16
# HBM bandwidth, TB/s, by the first key in the device name (the more specific names first)
HBM_TBS = {"H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35, "H200": 4.8, "A100-SXM4-40GB": 1.55, "A100": 2.0,
           "L40S": 0.864, "B200": 8.0}

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)
# The run whose shapes the timing items take: the paper config on 8 of this card (as --dry-run plans it:
# paper_plan), at the 7b preset's full size or divided by the tiny preset's shape_div.
PAPER = os.path.join(ROOT, "configs", "paper_qwen7b.json")
TINY_RUN = dict(rollout_batch=2, group_size=4, gen_batch=8, kv_budget=0, max_prompt_len=32, max_new_tokens=64,
                micro_batch=16, micro_tokens=384, grad_ckpt=True, fsdp=False)
PRESETS = {
    # model: a configs/models/ name or a config dict. ragged_layers: item 1 and 3; train_*: item 2;
    # fit_layers: update-fit's depths; shape_div: the paper's decode and micro-batch shapes divided by it;
    # layers, prompt_len, decode_*: decode-speed; run, gpus: the run update-memory, sampler-gap (and the
    # tiny decode-pass) take their shapes from; pass_steps: decode-pass's timed steps; gap_prompts,
    # gap_new: sampler-gap's prompts (x G rows) and new tokens.
    "7b": dict(model="Qwen2.5-Math-7B", ragged_layers=2, train_layers=4, train_new_tokens=512, train_prompts=8,
               train_group=8, fit_layers=(2, 4), shape_div=1, layers=8, prompt_len=256, decode_rows=64,
               decode_new=256, run=PAPER, gpus=8, pass_steps=256, gap_prompts=4, gap_new=256),
    "tiny": dict(model=TINY, ragged_layers=2, train_layers=2, train_new_tokens=32, train_prompts=4, train_group=4,
                 fit_layers=(1, 2), shape_div=16, layers=2, prompt_len=16, decode_rows=8, decode_new=64,
                 run=TINY_RUN, gpus=1, pass_steps=64, gap_prompts=2, gap_new=48),
}
ITEMS = ("matmul", "decode-grid", "kv-budget", "decode-pass", "update-fit", "ragged", "train", "kv",
         "update-memory", "decode", "sampler-gap")
PRECISIONS = ("fp32", "bf16", "bf16-mixed")   # float32 weights; bf16 weights; float32 under bf16 autocast
# A row of a padded batch vs the row alone: max |log p| difference (nats) of token_logprobs and of
# the sampler (whose decode steps are sampler/decode.py's own math and, in bf16, a bf16 KV cache), and the
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
WARM_STEPS = 8                                  # decode-pass: tokens per slot of its warm-up pass
# decode-grid, per point: untimed steps (kernels, cuBLAS heuristics), steps timed one at a time from an
# idle GPU (the host's enqueue time), steps timed back to back (device and wall ms per step)
GRID_WARM, GRID_ENQUEUE, GRID_STEPS = 2, 3, 8
# decode-grid: a point is bandwidth-bound (it measures decode_bw_fraction) where the host issues the
# step in under this share of its device time: the GPU then never waits for a launch
HOST_SHARE = 0.8
FIT_REPS = 3                                    # update-fit: timed forward+backward (and forward) repetitions
# fp32-matmul's tolerances, float32-output GEMM of bf16 operands against float64 of the same operands:
# only the summation order differs (~1e-6 relative); the gradient's GEMMs take bf16 operands (the
# logits' gradient rounded to bf16, as on the GPU path): ~4e-3 relative L2.
MATMUL_TOL = dict(logp=1e-3, grad=2e-2)
# sampler-gap's most k3 (nats per token). The same comparison on the CPU (random init, bf16 copy sampling
# and float32 master scoring under bf16 autocast) gave k3 1.5e-4 (mean |gap| 0.014) at 7B widths with 2
# layers; at Qwen2.5-0.5B's widths and the same logit spread k3 grew 3.5x from 2 to 24 layers (6.8e-5 ->
# 2.4e-4): ~5e-4 is expected at 28, and 1e-2 is 20x that. A bug of positions, padding or precision moves
# log-probs by ~1 nat (k3 >> 1e-2); a 10% temperature mismatch (k3 ~6e-3 here: printed) it does not see.
GAP_K3_MAX = 1e-2
# Each item's seconds on one H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s), from its FLOPs and bytes, not
# measured (no GPU has run this file yet); --minutes skips an item that would not end in them. Python
# building a 7.6B random model is taken as ~10 s (module construction and init, not FLOPs).
EST_S = {
    "fp32-matmul": 2,        # a few GEMMs of 10^8 FLOPs and their float64 references: CUDA start-up only
    # the 7.6B bf16 decoder built (~10 s); 9 points x 13 steps of <= (15.2 GB weights + 36 GB KV) /
    # (3.35 TB/s x 0.7) = 22 ms (~3 s), each point's cache zeroed (<= 36 GB at ~3 TB/s); one counted step
    "decode-grid": 20,
    "kv-budget": 2,          # mem_get_info and the plan's arithmetic (the decoder is decode-grid's)
    # the decoder shared; a warm-up pass and a timed one: each prefills 229 rows' 29 prompts (~29k
    # tokens x 2N = 0.45 PFLOP: ~1 s at 50%), then 256 steps x ~12 ms (15.2 GB + 229 x ~1,150 x 57 KB)
    "decode-pass": 10,
    # float32 models of 2 and 4 layers at full vocabulary built (~2.0 and 2.5B: ~5 s); 4,096 tokens x
    # 6N = 38 and 50 TFLOP per forward+backward: 0.13 / 0.17 s at 30% MFU, x (1 warm-up + 3 timed) and
    # a third of that forward-only: ~2 s; first calls (cuBLAS, flash-attn) ~3 s
    "update-fit": 15,
    "ragged-score": 2, "ragged-sample": 2,   # 2-layer models of 7B widths on 4 rows (10 lines: ~20 s)
    "train/fsdp2": 60,       # train.main's start-up, 2 RL steps of a 4-layer model, the save (train/*)
    "kv-cache": 5, "update-memory": 15, "decode-speed": 15, "sampler-gap": 15,
}
# What the timing items measured, for the phases' lines and the JSON (--plan-constants reads its
# "constants", measured_constants derives them from this): decode-grid's points, kv-budget's slots,
# update-fit's per-layer fit and MFUs, decode-pass's ms per step.
MEASURED = {}


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
    """The items' lines, kept for the JSON; deadline: perf_counter() time after which no item starts
    (--minutes), est: whether an item also needs its EST_S seconds left (on a GPU, where they hold)."""

    def __init__(self, deadline=math.inf, est=False):
        self.counts, self.results, self.deadline, self.est = {"PASS": 0, "FAIL": 0, "SKIP": 0}, [], deadline, est

    def line(self, status, item, text) -> str:
        self.counts[status] += 1
        self.results.append({"item": item, "status": status, "text": text})
        print(f"{status} {item} {text}", flush=True)
        return status

    def item(self, name, fn, *args) -> str:
        """Run fn(*args) -> its figures (a str); print the item's line; return its status. SKIP where the
        --minutes budget has no room left for it."""
        t0 = time.perf_counter()
        need = EST_S.get(name, EST_S.get(name.split("/")[0], 0)) if self.est else 0
        if t0 + need > self.deadline:
            return self.line("SKIP", name, f"the --minutes budget: {max(0, self.deadline - t0):.0f} s left, "
                                           f"the item takes ~{need} s")
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


def size(nbytes) -> str:
    """Bytes as GiB, or MiB below one GiB (the tiny preset's figures)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


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


def build(cfg, dev, dtype, attn=models.SDPA):
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
    """update-memory's micro-batch as train.py options (for the plan): one GPU, bf16-mixed, checkpointing."""
    return SimpleNamespace(max_prompt_len=a.prompt_len, max_new_tokens=a.new_tokens, micro_batch=a.rows,
                           micro_tokens=a.micro_tokens, fsdp=False, grad_ckpt=True, rollout_batch=a.rows // a.group,
                           group_size=a.group, gen_batch=a.rows, kv_budget=0, dtype="bf16-mixed")


@contextlib.contextmanager
def patched(obj, name, value):
    """obj.name = value while inside; yields the original."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)


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
# The timing items (they run first): the time model's constants at the paper run's own shapes


class Clock:
    """Seconds of device work between start() and stop(): CUDA events on the current stream (what
    the GPU spent, the gaps it waited for a launch included); on a CPU, whose ops run as they are
    called, perf_counter."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def start(self):
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def card_key(name, cuda) -> str:
    """time_model.GPUS's key of this card (an H100 without a GPU, or for a card it does not know)."""
    from plumbing import time_check

    return (time_check.gpu_key(name) if cuda else None) or "h100"


@functools.lru_cache(maxsize=None)
def paper_plan(key) -> SimpleNamespace:
    """The paper config on 8 of `key`'s card as `train.py --dry-run` plans it (memory_plan.as_planned:
    --kv-budget 0 the positions that fit, --grad-ckpt auto resolved) with what time_model.step_terms
    takes beside it: the options `a`, arch, gpus, needs_ref, old_rows, the lengths resp and prompt."""
    import train
    from rl.run_setup import needs_reference_model, old_rows

    given, algo = train.parse_args(["--config", PAPER])
    needs_ref = needs_reference_model(given, algo)
    a = memory_plan.as_planned(memory_plan._with(given, plan_gpu=key), 8, needs_ref)
    resp, prompt = time_model.plan_lengths(a)
    return SimpleNamespace(a=a, arch=memory_plan.arch_for(a.model), gpus=8, needs_ref=needs_ref,
                           old_rows=old_rows(given, algo), resp=resp, prompt=prompt, key=key)


def schedule_shapes(p) -> dict:
    """The paper step's decode as the time model replays it (time_model.decode_schedule, as step_terms
    does) -> {"start", "busy", "tail": (slots, columns)}: the first segment; the step-weighted means of
    the segments whose slots are all full, and of those after (the tail, its slots emptying): their
    slots, and the column their steps read up to (a segment's KV positions / its slots)."""
    N, n_p = p.a.rollout_batch // p.gpus * p.a.group_size, p.a.rollout_batch // p.gpus
    S = min(N, time_model.slots_for(p.a, p.gpus, p.prompt))
    segs = time_model.decode_schedule(p.resp, p.prompt, N, n_p, S)
    out = {"start": (segs[0].rows, segs[0].kv / segs[0].rows)}
    busy = [s for s in segs if s.rows >= S - 1e-6]
    for name, part in (("busy", busy), ("tail", [s for s in segs if s not in busy])):
        if part:
            steps = sum(s.steps for s in part)
            out[name] = (sum(s.steps * s.rows for s in part) / steps,
                         sum(s.steps * s.kv / s.rows for s in part) / steps)
    return out


def grid_shapes(a, key) -> tuple[list[int], list[int]]:
    """decode-grid's (slot counts, column counts): the tail's slots, the busy phase's and their geometric
    mean, x the columns of the busy phase's start, its mean and the tail's (schedule_shapes; divided by
    the preset's shape_div)."""
    sh, div = schedule_shapes(paper_plan(key)), a.p["shape_div"]
    tail = sh.get("tail", sh["busy"])
    slots = (tail[0], math.sqrt(tail[0] * sh["busy"][0]), sh["busy"][0])
    cols = (sh["start"][1], sh["busy"][1], tail[1])
    return ([max(1, int(round(s / div))) for s in sorted(set(slots))],
            [max(2, int(round(c / div))) for c in sorted(set(cols))])


DECODER = {}       # the full-depth bf16 model decode-grid, kv-budget and decode-pass share: built once


def decoder(a, dev):
    """The decoding copy at full depth: bf16 weights, train.py's attention (the prefill's)."""
    if "model" not in DECODER:
        attn = models.attention_for(dev, torch.float32, bf16=True).implementation
        DECODER["model"] = build(model_config(a.preset, 0), dev, torch.bfloat16, attn)
    return DECODER["model"]


def fp32_matmul(dev):
    """The fused head's float32-output GEMM of bf16 operands (torch.mm out_dtype, logprobs._Gemm) on
    the device, forward and backward through logprobs._TokenLogprob under bf16 autocast over float32
    leaves, as train.py's update runs it, against float64 of the same bf16-rounded operands."""
    if dev.type != "cuda":
        raise Skip("torch.mm(out_dtype=float32) of bf16 operands is the CUDA path "
                   "(logprobs._on_tensor_cores); a CPU upcasts the operands to float32 instead")
    g = torch.Generator(device=dev).manual_seed(8)
    B, L, D, V, T = 2, 37, 512, 3001, 0.9                        # odd sizes: blocks with remainders
    h = (torch.randn(B, L, D, device=dev, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(V, D, device=dev, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, V, (B, L), device=dev, generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        gemm = logprobs._Gemm.of(h, w)
        check(gemm.dtype == torch.bfloat16, f"_Gemm under bf16 autocast takes {gemm.dtype} operands")
        logp, ent = logprobs._TokenLogprob.apply(h, w, targets, T, 2 ** 16, True, True)   # small blocks
        (logp.sum() + ent.sum()).backward()
    check(logp.dtype == ent.dtype == torch.float32, f"log-probs in {logp.dtype}, entropy in {ent.dtype}")
    hb, wb = (t.detach().bfloat16().double().requires_grad_() for t in (h, w))     # the operands it used
    z = (hb @ wb.t()) / T
    ref = z.log_softmax(-1)
    ref_logp, ref_ent = ref.gather(-1, targets[..., None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    (ref_logp.sum() + ref_ent.sum()).backward()
    d_logp = float((logp.double() - ref_logp).abs().max())
    d_ent = float((ent.double() - ref_ent).abs().max())
    d_grad = max(rel_l2([h.grad], [hb.grad]), rel_l2([w.grad], [wb.grad]))
    a2, b2 = h.detach()[0].bfloat16(), w.detach().t().bfloat16()
    exact = a2.double() @ b2.double()
    out32, out16 = torch.mm(a2, b2, out_dtype=torch.float32), torch.mm(a2, b2)     # the GEMM alone
    err32 = float(((out32.double() - exact).norm() / exact.norm()))
    err16 = float(((out16.double() - exact).norm() / exact.norm()))
    tol = MATMUL_TOL
    figures = (f"bf16 operands ({B}x{L} x {D} x {V}): max|dlogp|={d_logp:.2e} max|dH|={d_ent:.2e} (tol "
               f"{tol['logp']:g}) grad_rel={d_grad:.2e} (tol {tol['grad']:g}) vs float64; the GEMM alone: "
               f"float32 output {out32.dtype} rel {err32:.1e}, bf16 output rel {err16:.1e}")
    check(out32.dtype == torch.float32, f"torch.mm out_dtype gave {out32.dtype}: {figures}")
    check(max(d_logp, d_ent) <= MATMUL_TOL["logp"], f"log-probs off the float64 reference: {figures}")
    check(d_grad <= MATMUL_TOL["grad"], f"gradients off the float64 reference: {figures}")
    check(err32 < err16 / 10, f"the float32 output is rounded like a bf16 one: {figures}")
    return figures


def count_ops(fn) -> int:
    """Ops fn() dispatches that are not views (a view launches no kernel): about the kernels it
    launches (some ops launch more than one, a few none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def decode_step(model, S, C, temperature):
    """One decode step of the run's pass at S slots each reading C columns, as a function of nothing:
    decode.LeanStep over a kv_cache.slot_cache of that shape (zeroed: finite, as a pass's unfilled
    columns), every slot writing its last column, then rollout._choose's sampling. Make it under the
    autocast and no_grad it runs in (the cache's dtype follows them: kv_cache.kv_dtype)."""
    dev, V = next(model.parameters()).device, model.config.vocab_size
    step = decode.LeanStep(model, kv_cache.slot_cache(model, S, C))
    tok, pos = torch.randint(1, V, (S,), device=dev), torch.full((S,), C - 1, device=dev)
    keys, t = torch.arange(S, device=dev), torch.zeros(S, dtype=torch.long, device=dev)
    return lambda: rollout._choose(step(tok, pos, C), temperature, 1.0, keys, t)[0]


def decode_grid(a, dev, name):
    """Per (slots, columns) point of grid_shapes, one decode step of the run (decode.LeanStep over a
    kv_cache.slot_cache of that shape, every slot reading `columns` columns, then rollout._choose's
    sampling): device ms (CUDA events over GRID_STEPS steps back to back), wall ms, and the host's
    enqueue ms (one step issued from an idle GPU: what launching its kernels costs the host), beside
    the time model's per-step figure for one segment of that shape and its bounds."""
    cuda, key = dev.type == "cuda", card_key(name, dev.type == "cuda")
    gpu, slot_counts, col_counts = time_model.GPUS[key], *grid_shapes(a, key)
    model = decoder(a, dev)
    check(decode.supports(model), "decode.LeanStep does not implement this model")
    arch = memory_plan.Arch.from_config(model.config.to_dict())
    weights = 2 * time_model.matmul_params(arch)                                 # as decode_seconds reads
    kernels = time_model.KERNELS_PER_LAYER * arch.layers
    _, amp = precision("bf16-mixed", dev)                       # train.rollouts samples under it
    mem, clock, points, ops = Mem(dev), Clock(dev), [], None
    for S in slot_counts:
        for C in col_counts:
            with torch.no_grad(), amp():
                one = decode_step(model, S, C, a.temperature)
                for _ in range(GRID_WARM):
                    one()
                ops = ops or count_ops(one)
                enqueue = []
                for _ in range(GRID_ENQUEUE):
                    mem.sync()
                    t0 = time.perf_counter()
                    one()
                    enqueue.append(time.perf_counter() - t0)
                mem.sync()
                w0 = time.perf_counter()
                clock.start()
                for _ in range(GRID_STEPS):
                    one()
                device = clock.stop() / GRID_STEPS
                wall = (time.perf_counter() - w0) / GRID_STEPS
            del one                                 # (its cache: the next point's must not meet it)
            free_memory()
            model_s = time_model.decode_seconds(arch, gpu, [time_model.Segment(1, S * C, S)])[0]
            bound = (weights + S * C * arch.kv_bytes_per_position()) / (gpu.hbm_tbs * 1e12)
            points.append(dict(slots=S, columns=C, device_ms=device * 1e3 if cuda else None,
                               wall_ms=wall * 1e3, enqueue_ms=sorted(enqueue)[len(enqueue) // 2] * 1e3,
                               model_ms=model_s * 1e3, bound_ms=bound * 1e3,
                               launch_ms=kernels * time_model.CENTRAL["launch_us"] / 1e3))
    check(all(math.isfinite(p["wall_ms"]) and p["wall_ms"] > 0 for p in points), f"not finite: {points}")
    MEASURED["decode_grid"] = dict(points=points, layers=arch.layers, model_kernels=kernels, ops_per_step=ops,
                                   gpu=key, on_gpu=cuda, preset=a.preset)
    for p in points:
        dev_s = "n/a (no GPU)" if p["device_ms"] is None else f"{p['device_ms']:.3g}"
        print(f"  grid {p['slots']:4d} slots x {p['columns']:5d} columns: device {dev_s} / wall "
              f"{p['wall_ms']:.3g} / enqueue {p['enqueue_ms']:.3g} ms per step; model {p['model_ms']:.3g} ms "
              f"(bandwidth bound {p['bound_ms']:.3g} at {gpu.hbm_tbs} TB/s, launch bound "
              f"{p['launch_ms']:.3g})",
              flush=True)
    bw, launch = grid_constants(MEASURED["decode_grid"])
    div = "" if a.p["shape_div"] == 1 else f" / {a.p['shape_div']}"
    return (f"{len(points)} points ({slot_counts} slots x {col_counts} columns: the paper step's decode "
            f"schedule on 8 x {gpu.name}{div}), "
            f"{arch.layers} layers, {ops} ops per step (not views) vs the model's {kernels} kernels; "
            f"decode_bw_fraction {'n/a' if bw is None else f'{bw:.2f}'}, launch_us "
            f"{'n/a' if launch is None else f'{launch:.1f}'} (the model assumes "
            f"{time_model.CENTRAL['decode_bw_fraction']:g}, {time_model.CENTRAL['launch_us']:g})")


def grid_constants(grid) -> tuple[float | None, float | None]:
    """(decode_bw_fraction, launch_us) of decode-grid's points, None where not measured (no GPU, or
    not the paper's model): the median of bound / device over the points whose host issues a step in
    under HOST_SHARE of its device time (bandwidth-bound: the GPU never waits for a launch), and the
    median enqueue time over the model's kernel count (so that time_model's launch bound,
    KERNELS_PER_LAYER x layers x launch_us, is the measured enqueue time)."""
    if not grid or not grid["on_gpu"] or grid["preset"] != "7b":
        return None, None
    pts = grid["points"]
    bound = [p["bound_ms"] / p["device_ms"] for p in pts if p["enqueue_ms"] < HOST_SHARE * p["device_ms"]]
    enqueue = sorted(p["enqueue_ms"] for p in pts)
    bw = sorted(bound)[len(bound) // 2] if bound else None
    return bw, enqueue[len(enqueue) // 2] * 1e3 / grid["model_kernels"]


def kv_budget(a, dev, name):
    """--kv-budget 0's slots on this card: the positions kv_cache.kv_budget_from_memory finds (the rule
    the sampler sizes its cache by) beside the decoding copy (resident: decode-grid's model), less what
    the plan's rollout phase holds besides on each of the paper run's 8 GPUs (the policy's and Adam's
    shards, the reference, the prefill's working set), as slots of the rank's longest prompt + new
    tokens (time_model.slots_for) -- against the plan's figure for the same card."""
    cuda, key = dev.type == "cuda", card_key(name, dev.type == "cuda")
    p = paper_plan(key)
    plan_slots = time_model.slots_for(p.a, p.gpus, p.prompt)
    others = {t.name: t.bytes for t in memory_plan.terms(p.arch, p.a, p.gpus, p.needs_ref)
              if "rollout" in t.phases and t.name not in ("KV cache", "decoding copy")}
    MEASURED["kv_budget"] = dict(plan_positions=p.a.kv_budget, plan_slots=plan_slots, positions=None,
                                 slots=None, gpu=key)
    plan = (f"the plan: {p.a.kv_budget:,} positions = {plan_slots} slots on 8 x {time_model.GPUS[key].name} "
            f"(memory_plan.as_planned; rollout phase besides: "
            + ", ".join(f"{n} {size(b)}" for n, b in others.items() if b) + ")")
    if not cuda:
        raise Skip(f"measured: n/a (no GPU); {plan}")
    if a.preset != "7b":
        raise Skip(f"the {a.preset} preset's model is not the plan's; {plan}")
    model = decoder(a, dev)
    positions = kv_cache.kv_budget_from_memory(model.config, torch.bfloat16, sum(others.values()))
    slots = time_model.slots_for(memory_plan._with(p.a, kv_budget=positions), p.gpus, p.prompt)
    MEASURED["kv_budget"].update(positions=positions, slots=slots)
    check(positions > 0, f"no position fits; {plan}")
    free, total = torch.cuda.mem_get_info()
    copy = sum(t.numel() * t.element_size() for t in model.parameters())
    return (f"measured {positions:,} positions = {slots} slots ({free / GIB:.1f} of {total / GIB:.1f} GiB "
            f"free beside the {size(copy)} decoding copy) / {plan}: ratio {slots / plan_slots:.2f}")


def packed_micro_batch(a, p, vocab, dev) -> logprobs.Packed:
    """The paper's update micro-batch, packed: memory_plan.micro_batch_tokens real tokens (4,096) in
    rows of the mean prompt and the length that fills it (4 x (144 + 880); / shape_div on tiny)."""
    div = a.p["shape_div"]
    tokens = memory_plan.micro_batch_tokens(p.a) // div
    rows = max(1, tokens // max(2, round((p.prompt.mean() + p.resp.mean()) / div)))
    P = max(2, round(p.prompt.mean() / div))
    R = tokens // rows - P
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, vocab, (rows, P + R), generator=g).to(dev)
    prompt_tokens = torch.ones(rows, P - 1, dtype=torch.long, device=dev)
    return logprobs.Packed(ids, torch.ones_like(ids), prompt_tokens, P, [(P, R)] * rows, pack=True)


def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x -> (a, b) (two points: the line through them)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def update_pass(model, packed, amp, temperature):
    """train.py's update forward + backward on one micro-batch (the loss's own arithmetic is a few
    (B, L) ops: a sum stands in), forward and backward in one autocast region, as train.py's."""
    with amp():
        s = logprobs.packed_row_scores(model, packed, temperature, with_entropy=True)
        (s.response.sum() + s.prompt.sum()).backward()


def scoring_forward(model, packed, amp, temperature):
    """pi_old's (and the reference's) no-grad scoring forward on the same micro-batch."""
    with torch.no_grad(), amp():
        logprobs.packed_row_scores(model, packed, temperature)


def update_fit(a, dev, name):
    """The update's forward + backward (train.py's: logprobs.packed_row_scores on the paper's packed
    micro-batch, the attention models.attention_for gives it, bf16 autocast over float32 master weights,
    activation checkpointing only where the plan has it) and the no-grad scoring forward, timed at the
    depths fit_layers with the full vocabulary, fitted as seconds = a + b x layers and extrapolated to
    the model's depth; MFU in the time model's own FLOPs (6N a token, 8N checkpointed; 2N the forward)
    with its N, memory_plan.Arch.params(), beside the same with the input embedding (a lookup) left out."""
    cuda, key = dev.type == "cuda", card_key(name, dev.type == "cuda")
    p = paper_plan(key)
    ckpt = bool(p.a.grad_ckpt)                                  # --grad-ckpt auto as the plan resolves it
    attn = models.attention_for(dev, torch.float32, bf16=True).implementation
    _, amp = precision("bf16-mixed", dev)
    clock, mem, depths = Clock(dev), Mem(dev), []
    for layers in a.p["fit_layers"]:
        model = build(model_config(a.preset, layers), dev, torch.float32, attn)
        model = distributed.wrap_model(model.train(), dev, grad_ckpt=ckpt)
        packed = packed_micro_batch(a, p, model.config.vocab_size, dev)
        update = functools.partial(update_pass, model, packed, amp, a.temperature)
        forward = functools.partial(scoring_forward, model, packed, amp, a.temperature)
        row = {"layers": layers}
        for what, fn in (("update", update), ("forward", forward)):
            fn()                            # warm-up: kernels, cuBLAS heuristics, the gradients allocated
            mem.reset()
            clock.start()
            for _ in range(FIT_REPS):       # gradients accumulate, as over a step's micro-batches
                fn()
            row[f"{what}_s"], row[f"{what}_peak"] = clock.stop() / FIT_REPS, mem.peak()
        grads = [float(q.grad.float().sum()) for q in model.parameters() if q.grad is not None]
        check(grads and all(map(math.isfinite, grads)), f"no or non-finite gradients at {layers} layers")
        depths.append(row)
        del model, update, forward
        free_memory()
    full = memory_plan.Arch.from_config(model_config(a.preset, 0).to_dict())
    xs = [r["layers"] for r in depths]
    a_u, b_u = fit_line(xs, [r["update_s"] for r in depths])
    a_f, b_f = fit_line(xs, [r["forward_s"] for r in depths])
    t_u, t_f = a_u + b_u * full.layers, a_f + b_f * full.layers
    tokens = sum(pr + rs for pr, rs in packed.lengths)
    N = time_model.matmul_params(full)
    per_token = 8 if ckpt else 6                                # time_model.step_terms' train FLOPs
    card = time_model.GPUS[key].bf16_tflops * 1e12
    peak = (a.peak_tflops or by_name(PEAK_TFLOPS, name)) if cuda else None
    mfu = (lambda flops, s: flops * tokens / s / (peak * 1e12)) if peak else (lambda flops, s: None)
    fit = dict(layers=xs, update_s=[r["update_s"] for r in depths],
               forward_s=[r["forward_s"] for r in depths],
               update_peak_bytes=[r["update_peak"] for r in depths], a_s=a_u, b_s_per_layer=b_u,
               forward_a_s=a_f, forward_b_s_per_layer=b_f, full_layers=full.layers, update_full_s=t_u,
               forward_full_s=t_f, tokens=tokens, rows=len(packed.lengths), grad_ckpt=ckpt, attention=attn,
               n_params=N, mfu=mfu(per_token * N, t_u), forward_mfu=mfu(2 * N, t_f),
               model_update_s=per_token * N * tokens / (card * time_model.CENTRAL["update_mfu"]),
               model_forward_s=2 * N * tokens / (card * time_model.CENTRAL["update_mfu"]),
               on_gpu=cuda, preset=a.preset)
    MEASURED["update_fit"] = fit
    check(all(math.isfinite(v) and v > 0 for v in fit["update_s"] + fit["forward_s"]), f"not finite: {fit}")
    pct = lambda v: "n/a (no peak: --peak-tflops)" if v is None else f"{v:.1%}"  # noqa: E731
    depth_s = ", ".join(f"{r['layers']} layers {r['update_s'] * 1e3:.4g} / {r['forward_s'] * 1e3:.4g} ms"
                        + (f" (peak {size(r['update_peak'])})" if cuda else "") for r in depths)
    rows = len(packed.lengths)
    return (f"{rows} packed rows x {tokens // rows} = {tokens} tokens, attention {attn}, "
            f"{'' if ckpt else 'no '}checkpointing (the plan's), bf16-mixed; update / forward: {depth_s}; "
            f"fit {a_u * 1e3:.4g} + {b_u * 1e3:.4g} ms per layer / {a_f * 1e3:.4g} + {b_f * 1e3:.4g}; at "
            f"{full.layers} layers {t_u * 1e3:.4g} / {t_f * 1e3:.4g} ms (time model at "
            f"{time_model.CENTRAL['update_mfu']:.0%}: {fit['model_update_s'] * 1e3:.4g} / "
            f"{fit['model_forward_s'] * 1e3:.4g}); MFU {pct(fit['mfu'])} ({per_token}N, N = "
            f"{N / 1e9:.3g}B as the time model counts it: no input embedding), forward "
            f"{pct(fit['forward_mfu'])} (2N)")


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


def pad_queries(mask) -> int:
    """Query positions before their row's first real token: causal attention lets them see only
    pads, so their row of a plain padding mask is empty."""
    return int((mask.cumsum(1) == 0).sum())


@contextlib.contextmanager
def sdpa_masks():
    """Every attn_mask handed to torch's scaled_dot_product_attention while inside (as
    tests/test_forward.py watches them): transformers' SDPA forward and decode.LeanStep call it."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask, *args, **kw)

    with patched(torch.nn.functional, "scaled_dot_product_attention", spy):
        yield seen


def masks_ok(seen, pads, uses_sdpa) -> str:
    """FAIL where a boolean mask SDPA received leaves a query row without a key; -> the figure."""
    if not uses_sdpa:
        check(not seen, f"flash-attn: {len(seen)} calls of torch's SDPA")
        return "masks: none (flash-attn unpads)"
    bool_masks = [m for m in seen if m is not None and m.dtype == torch.bool]
    empty = sum(int((~m.any(-1)).sum()) for m in bool_masks)
    check(bool_masks, f"SDPA received no boolean mask ({len(seen)} calls): is the padding masked at all?")
    check(empty == 0, f"{empty} query rows without a key in the {len(bool_masks)} masks SDPA received "
                      f"(pad queries: {pads}): not the pad-safe mask (models.SDPA)")
    return f"empty_mask_rows=0/{len(bool_masks)} masks (pad queries {pads})"


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def rel_l2(xs, ys) -> float:
    num = sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(xs, ys))
    den = sum(float(y.float().pow(2).sum()) for y in ys)
    return (num / max(den, 1e-30)) ** 0.5


def ragged_score(model, amp, tol, uses_sdpa):
    """token_logprobs forward + backward of the ragged batch vs each row alone; the masks SDPA got."""
    dev = next(model.parameters()).device
    ids, mask, spans = ragged_batch(model.config.vocab_size, dev)
    model.zero_grad(set_to_none=True)
    with amp(), sdpa_masks() as seen:
        logp, _ = logprobs.token_logprobs(model, ids, mask)       # (B, L-1): position j scores token j+1
    masks = masks_ok(seen, pad_queries(mask), uses_sdpa)
    bad = int((~torch.isfinite(logp)).sum())                      # pads included: NaN * 0 is NaN
    sum(logp[i, s:e - 1].sum() for i, (s, e) in enumerate(spans)).backward()
    g_batch = grads(model)
    check(bad == 0, f"{bad} non-finite log-probs in the padded batch (pad positions included)")
    check(all(bool(torch.isfinite(x).all()) for x in g_batch), "non-finite gradient from the padded batch")
    model.zero_grad(set_to_none=True)
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
               f"unmasked_padding={bug:.2e} {masks}")
    check(diff <= tol["logp"], f"a padded row's log-probs differ from the row alone: {figures}")
    check(g_rel <= tol["grad"], f"the padded batch's gradient differs from the rows' alone: {figures}")
    check(bug > 3 * tol["logp"], f"blind: attending to the padding moves log-probs < 3x the tolerance: {figures}")
    return figures


def ragged_sample(model, amp, tol, uses_sdpa):
    """Our kv sampler on the ragged prompts vs each row alone: sampled log-probs against the row's
    tokens rescored alone (teacher-forced), and whether the row alone samples the same tokens; the
    masks SDPA got in the pass (the prefill of the left-padded prompts, LeanStep's steps)."""
    dev, V = next(model.parameters()).device, model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, V, (p,), generator=g).tolist() for p in PROMPT_LENS]
    eos = list(range(1, 1 + max(1, V // 25)))      # ~4% of the vocabulary stops a row: ragged responses
    seeds = [rollout.row_seed(7, i) for i in range(len(prompts))]
    kw = dict(max_new_tokens=SAMPLE_NEW, eos_ids=eos, pad_id=0, temperature=1.0)
    with amp(), sdpa_masks() as seen:
        ro = rollout.sample(model, prompts, seeds=seeds, **kw)
    _, prompt_mask = kv_cache.left_pad(prompts, 0, "cpu")
    masks = masks_ok([m for m in seen if m is not None and m.dim() == 4 and m.shape[2] > 1],  # prefills
                     pad_queries(prompt_mask), uses_sdpa)
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
               f"same_tokens_alone={same}/{len(prompts)} prefill {masks}")
    check(diff <= tol["sample"], f"sampled log-probs differ from the rows rescored alone: {figures}")
    return figures


def sdpa_for(dev, dtype, bf16) -> str:
    """The pad-safe SDPA train.py would load for this compute dtype (models.attention_for, which
    picks flash-attn instead where it imports: that is the other attn of item 1)."""
    impl = models.attention_for(dev, dtype, bf16).implementation
    return models.SDPA if impl == models.FLASH else impl


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
    impl = attn if attn == FA2 else sdpa_for(dev, dtype, prec == "bf16-mixed")
    try:
        model = build(model_config(a.preset, a.p["ragged_layers"]), dev, dtype, impl)
    except Exception as e:
        for n in names:
            rep.line("FAIL", n, f"building the model: {type(e).__name__}: {one_line(e)}")
        return
    rep.item(names[0], ragged_score, model, amp, TOL[prec], impl != FA2)
    rep.item(names[1], ragged_sample, model, amp, TOL[prec], impl != FA2)
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
def instrumented_training(peaks, sharded):
    """train.main as it is, observed from outside: its timer phases and optimizer steps also
    cut `peaks`; wrap_model records whether the policy came back FSDP2-sharded; rewards become
    coin flips of the response text (a random model solves nothing: no advantage, no update)."""
    import reward
    from rl import experience

    base_phases, base_step, base_wrap = experience.Phases, optimizer.step, distributed.wrap_model
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
        for obj, name, value in ((experience, "Phases", Phases), (optimizer, "step", step),
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
            "--query-cache-dir", "", "--seed", "0", "--measure-policy-kl", "true",   # policy_kl checked below
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
    logged = {k for r in steps for k in r if k.startswith("mem_")}       # train.py's own (GiB; CUDA only)
    out["logged"] = {k: max(r.get(k, 0.0) for r in steps) for k in logged}
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
    logged = out.get("logged", {})                 # train.py's own record (rl/experience.Phases), GiB
    lost = [f"mem_{kind}_{ph}" for kind in ("alloc", "reserved", "used") for ph in ("gen", "score", "update")
            if f"mem_{kind}_{ph}" not in logged]
    figures = (f"GiB measured/plan: {', '.join(cells)}; outside these phases {other / GIB:.2f} "
               f"(plan: {source}; allocated before the run {out['baseline'] / GIB:.2f}); metrics.jsonl GiB "
               + ", ".join(f"{k.removeprefix('mem_')} {v:.2f}" for k, v in sorted(logged.items())
                           if k.endswith(("_gen", "_score", "_update"))))
    if dev.type != "cuda":
        check(not logged, f"metrics.jsonl has GPU memory fields on {dev.type}: {sorted(logged)}")
        raise Skip(f"no CUDA allocator on {dev.type}; plan GiB: " + ", ".join(
            f"{ph} {'-' if plan.get(ph) is None else f'{plan[ph] / GIB:.3f}'}" for ph in names) + f" ({source})")
    check("seconds" in out, f"train.main did not finish; {figures}")
    check(not missing, f"no peak for {', '.join(missing)} (train.py's timer phases renamed?): {figures}")
    check(not lost, f"metrics.jsonl lacks train.py's per-phase memory {', '.join(lost)}: {figures}")
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
    budget = int(2.5 * (max(map(len, prompts)) + new))   # room for 2 rows: one pass of 2 slots over 8 rows
    spec = rollout.SampleSpec.make(model, tok, new, "kv", None, budget, bf16)
    spec = dataclasses.replace(spec, eos_ids=[])         # eos off: no row is compacted out of its cache
    made = []

    def recording(*args, **kw):
        made.append(base(*args, **kw))
        return made[-1]

    with patched(kv_cache, "kv_cache", recording) as base, amp():
        ro = rollout.sample_with(model, prompts, spec, temperature=1.0, seeds=list(range(len(prompts))))
    check(made, "rollout.sample_with made no kv_cache.kv_cache")
    check(len(made) == 1 or not kv_cache.supports(model, lockstep=False),
          f"{len(made)} KV caches: the rows were decoded in chunks, not in one pass (sampler/kv_cache.py)")
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
        check(rows * cap <= budget, f"a cache holds {rows} x {cap} positions > the budget {budget}")
        per_call.append((rows, cap, nbytes))
    check(bool(torch.isfinite(ro.logprobs).all()) and bool(ro.response_mask.all()), "non-finite or short rollout")
    figures = (f"dtype={want} passes={len(made)} slots={[r for r, _, _ in per_call]} for {len(prompts)} rows "
               f"positions<={max(r * c for r, c, _ in per_call)}/{budget} "
               f"bytes<={max(b for _, _, b in per_call) / MIB:.2f}/{budget * bpp / MIB:.2f} MiB")
    if dev.type == "cuda":
        check(auto.kv_budget > 0, "the default budget (0: a share of free memory) gave 0 positions")
        figures += f" default budget {auto.kv_budget} positions = {auto.kv_budget * bpp / GIB:.1f} GiB"
    return figures


# ----------------------------------------------------------------------------------------------
# Item 4: the update micro-batch's memory, decoding tokens/s


def synthetic_rollout(a, vocab, dev, full=False) -> rollout.Rollout:
    """a.rows rows in groups of a.group sharing a prompt of a.prompt_len/2 to a.prompt_len tokens
    (left-padded), responses of a.new_tokens/2 to a.new_tokens (right-padded): what a rollout hands
    the update (update-memory's options: micro_batch_options).
    full: every prompt and response at its longest (the rows the memory plan sizes)."""
    g = torch.Generator().manual_seed(4)
    B, P, N = a.rows, a.prompt_len, a.new_tokens
    lo_p, lo_n = (P, N) if full else (P // 2, max(1, N // 2))
    plen = torch.randint(lo_p, P + 1, (B // a.group,), generator=g).repeat_interleave(a.group)
    rlen = torch.randint(lo_n, N + 1, (B,), generator=g)
    cols_p, cols_r = torch.arange(P), torch.arange(N)
    pmask = (cols_p[None] >= P - plen[:, None]).long()
    rmask = (cols_r[None] < rlen[:, None]).long()
    prompt = torch.randint(1, vocab, (B // a.group, P), generator=g).repeat_interleave(a.group, 0) * pmask
    resp = torch.randint(1, vocab, (B, N), generator=g) * rmask
    return rollout.Rollout(prompt, pmask, resp, rmask, torch.zeros(B, N), torch.zeros(B, dtype=torch.bool)).to(dev)


def erpo_update(model, ro, qref_logp, a, opt, amp, mem):
    """One optimizer step of the ERPO loss over the rollout, micro-batched by tokens, forward and
    backward inside one autocast region as train.py's (its bf16 weight copies live until the region
    ends). The first update's forward is pi_old's too: entropy on. opt None: forward + backward
    only, no optimizer step. -> (tokens, micro-batches, peak of the micro-batches, of the step, norm)"""
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
    with amp():
        for mb in plan:
            r = torch.tensor(mb, device=packed.input_ids.device)
            pk, pc, rc = packed.trimmed(r)
            s = logprobs.score_tokens(model, pk, a.temperature, with_entropy=True)
            loss, _ = losses.rl_loss(algo, logp=s.response, old_logp=s.response.detach(), ref_logp=None,
                                     resp_mask=resp_mask[r][:, rc], advantages=adv[r], weights=w[r],
                                     prompt_logp=s.prompt, prompt_ref_logp=qref_logp[r][:, pc],
                                     prompt_mask=packed.prompt_tok_mask[r][:, pc].float(),
                                     num_tokens=num_tokens, num_seqs=B, max_len=a.new_tokens)
            loss.backward()
            del s, loss
    mem.sync()
    peak_loop = mem.peak()                     # weights + gradients + one micro-batch's activations
    mem.reset()
    norm = optimizer.clip_grad(model, 1.0)
    if opt is not None:
        opt.step()                             # Adam state appears here (and its temporaries)
        opt.zero_grad(set_to_none=True)
    mem.sync()
    return int(packed.attention_mask.sum()), len(plan), peak_loop, mem.peak(), float(norm)


def update_model(a, dev, layers, ro_full=False):
    """A float32 model of `layers` layers (0: all) for the update, its synthetic rollout and the
    Query-KL cache (the prompts' log-probs under the initial weights), wrapped as train.py does on
    one GPU (activation checkpointing) -> (model, rollout, qref, autocast factory)."""
    model = build(model_config(a.preset, layers), dev, torch.float32)
    _, amp = precision("bf16-mixed", dev)
    ro = synthetic_rollout(a, model.config.vocab_size, dev, ro_full)
    with torch.no_grad(), amp():
        qref = logprobs.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, a.temperature)[0].float()
    return distributed.wrap_model(model.train(), dev, grad_ckpt=True), ro, qref, amp


def by_name(table, name):
    """The value of the first key of `table` in the device name, or None."""
    return next((v for k, v in table.items() if k in name), None)


def paper_run(a) -> tuple[SimpleNamespace, int]:
    """The options (train.py's names) whose shapes update-memory, sampler-gap and the tiny decode-pass
    take, and its GPU count: the paper config on 8 GPUs (7b), or its tiny stand-in on one."""
    run = a.p["run"]
    if isinstance(run, str):
        with open(run) as f:
            run = json.load(f)
    return SimpleNamespace(**run), a.p["gpus"]


def micro_batch_options(a) -> SimpleNamespace:
    """update-memory's micro-batch: the paper config's --micro-tokens in rows of its longest prompt +
    response, as item 4's options (the update's) and, for the plan, train.py's."""
    run, _ = paper_run(a)
    seq = run.max_prompt_len + run.max_new_tokens
    rows = max(1, memory_plan.micro_batch_tokens(run) // seq)
    return argparse.Namespace(**{**vars(a), "rows": rows, "group": rows, "prompt_len": run.max_prompt_len,
                                 "new_tokens": run.max_new_tokens, "micro_tokens": rows * seq})


class LiveTensors:
    """Mem's figures on the CPU: the peak bytes of live tensors (torch's MemTracker as
    memory_measure.PhasePeaks runs it), what torch.cuda.max_memory_allocated gives on a GPU. Enter
    `tracker` around the code; what existed before is counted through `external`."""

    def __init__(self, *external):
        from rl import memory_measure

        self.tracker, self.external = memory_measure.PhasePeaks(), external

    def __enter__(self):
        self.tracker.__enter__()
        self.tracker.track_external(*self.external)
        return self

    def __exit__(self, *exc):
        return self.tracker.__exit__(*exc)

    def reset(self):
        self.tracker.switch("update")

    def sync(self):
        self.tracker.switch(None)

    def peak(self):
        return self.tracker.peaks.get("update", 0)


def update_memory(a, dev):
    """One full-depth, full-vocabulary update micro-batch's peak memory against the plan (no Adam)."""
    m = micro_batch_options(a)
    cfg = model_config(a.preset, 0)
    arch = memory_plan.Arch.from_config(cfg.to_dict())
    opts = update_options(m)
    ts = memory_plan.terms(arch, opts, 1, False, dev.type)
    plan = sum(t.bytes for t in ts if "update" in t.phases and t.name != "Adam state")
    adam = sum(t.bytes for t in ts if t.name == "Adam state")
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    if total and plan > 0.9 * total:
        raise Skip(f"the plan, {plan / GIB:.1f} GiB without Adam, does not fit 90% of this GPU's "
                   f"{total / GIB:.0f} GiB (141 GB needed)")
    model, ro, qref, amp = update_model(m, dev, 0, ro_full=True)
    mem = Mem(dev) if dev.type == "cuda" else LiveTensors(model, qref, *(getattr(ro, k) for k in (
        "prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "finished")))
    with contextlib.nullcontext() if dev.type == "cuda" else mem:
        tokens, n_mb, peak, _, norm = erpo_update(model, ro, qref, m, None, amp, mem)
    check(norm == norm and norm < float("inf"), f"non-finite grad norm {norm}")
    check(n_mb == 1, f"{n_mb} micro-batches, expected the one of {m.micro_tokens} tokens")
    check(peak > 0, "no peak measured")
    big = sorted((t for t in ts if "update" in t.phases and t.name != "Adam state" and t.bytes),
                 key=lambda t: -t.bytes)
    figures = (f"{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, {m.rows} rows x "
               f"{m.prompt_len}+{m.new_tokens} = {tokens} tokens, checkpointing, bf16-mixed: peak "
               f"{size(peak)} measured{'' if dev.type == 'cuda' else ' (live tensors, CPU)'} / {size(plan)} "
               f"planned = {peak / plan:.2f}x (memory_plan's update phase on 1 GPU less Adam's {size(adam)}: "
               + ", ".join(f"{t.name} {size(t.bytes)}" for t in big) + ")")
    check(peak <= 1.2 * plan + 256 * MIB, f"over the plan by > 20% + 256 MiB: {figures}")
    return figures


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


def group_prompts(n, G, P, vocab, seed) -> list[list[int]]:
    """n prompts of 7/8 P to P random tokens, each repeated for its G rows (GRPO's groups)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(P - P // 8, P + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens for _ in range(G)]


def decode_bytes(model, slots_, width, kv_itemsize) -> tuple[int, int]:
    """Bytes one decode step must read: every weight it multiplies by (all but the input embedding,
    a lookup of S rows, unless lm_head shares it) and the slots' K/V over `width` columns."""
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if emb is not model.get_output_embeddings().weight:
        weights -= emb.numel() * emb.element_size()
    arch = memory_plan.Arch.from_config(model.config.to_dict())
    return weights, slots_ * width * arch.kv_bytes_per_position(kv_itemsize)


def decode_pass(a, dev, name):
    """Item 5: decode steps/s of the full-depth bf16 model (decode-grid's) through rollout.sample's one
    pass over the paper run's slots on this card (time_model.slots_for of the plan: whole groups of
    them), against reading the weights and the KV cache once per step, and the time model's per-step
    figure for the same shape."""
    run, gpus = paper_run(a)
    p = paper_plan(card_key(name, dev.type == "cuda"))
    G = run.group_size
    S = time_model.slots_for(p.a, p.gpus, p.prompt) if a.preset == "7b" else memory_plan.kv_rows(run, gpus)
    S = max(G, S // G * G)                          # whole groups: the rows of S // G prompts in S slots
    model = decoder(a, dev)                         # every layer: the decoding copy
    check(kv_cache.supports(model, lockstep=False), "decode.LeanStep does not implement this model: no one pass")
    _, amp = precision("bf16-mixed", dev)                                # train.rollouts samples under it
    prompts = group_prompts(S // G, G, run.max_prompt_len, model.config.vocab_size, seed=6)
    mem, passes, admitted = Mem(dev), [], []
    base_pass, base_admit = kv_cache.decode_pass, kv_cache.admit

    def recording(*args, **kw):                     # each call's kv_cache.Decoded: its length in tokens
        passes.append(base_pass(*args, **kw))
        return passes[-1]

    def admit(*args, **kw):                         # the prefill: the clock of the decode steps starts after it
        logits = base_admit(*args, **kw)
        mem.sync()
        admitted.append(time.perf_counter())
        return logits

    def decode_seconds(n):
        with patched(kv_cache, "decode_pass", recording), patched(kv_cache, "admit", admit), amp():
            ro = rollout.sample(model, prompts, max_new_tokens=n, eos_ids=[], pad_id=0,
                                temperature=a.temperature, seeds=list(range(S)), batch_size=S)
        mem.sync()
        return time.perf_counter() - admitted[-1], ro

    n = a.pass_steps + 1                            # tokens per slot: the prefill's, then pass_steps steps
    decode_seconds(WARM_STEPS)                      # warm-up: kernels, allocator, cuBLAS
    seconds, ro = decode_seconds(n)
    lengths = [d.steps for d in passes]
    check(lengths == [WARM_STEPS, n] and len(admitted) == 2,
          f"not one pass per call, every row admitted at once and run to its limit: {lengths} tokens per "
          f"slot, {len(admitted)} admissions")
    check(bool(torch.isfinite(ro.logprobs).all()), "non-finite sampled log-probs")
    step_s = seconds / a.pass_steps
    check(0 < step_s < float("inf"), f"{a.pass_steps} decode steps took {seconds} s")
    with amp():
        kv_item = kv_cache.kv_dtype(model).itemsize
    longest = max(map(len, prompts))
    L = n // 2                                      # step k reads longest + k columns: their mean
    weights, kv = decode_bytes(model, S, longest + L, kv_item)
    hbm = a.hbm_tbs or by_name(HBM_TBS, name)
    gpu = time_model.GPU(name, 0.0, hbm or time_model.GPUS["h200"].hbm_tbs, 0.0)
    bound_s = (weights + kv) / (gpu.hbm_tbs * 1e12)
    shape = SimpleNamespace(rollout_batch=S // G, group_size=G, gen_batch=S, kv_budget=0,
                            max_prompt_len=longest, max_new_tokens=L)      # S rows in S slots, L tokens each
    arch = memory_plan.Arch.from_config(model.config.to_dict())
    predicted = time_model.decode_terms(arch, shape, 1, gpu, (L, L))[0].seconds[0] / L
    at = f"{hbm} TB/s" if hbm else f"an H200's {gpu.hbm_tbs} TB/s (no HBM figure for {name}: --hbm-tbs)"
    MEASURED.update(decode_step_ms=step_s * 1e3, decode_bound_ms=bound_s * 1e3, decode_model_ms=predicted * 1e3,
                    decode_slots=S, decode_columns=longest + L, hbm_tbs=hbm)
    ratio = f"measured/bound {step_s / bound_s:.2f}x" if hbm else "measured/bound: n/a"
    return (f"{S} slots ({G} rows per prompt, prompts <= {longest}), {arch.layers} layers, bf16 weights, "
            f"{kv_item * 8}-bit cache, one pass: {a.pass_steps} decode steps after the prefill in {seconds:.2f} s "
            f"= {S * a.pass_steps / seconds:.0f} tok/s, {step_s * 1e3:.3g} ms/step; bound {bound_s * 1e3:.3g} "
            f"ms/step (weights {weights / 1e9:.3g} GB + KV {kv / 1e9:.3g} GB at {at}), {ratio}; time model "
            f"{predicted * 1e3:.3g} ms/step")


def sampler_gap(a, dev):
    """Item 6: the decoding copy's sampled log-probs against the training forward's (pi_old) on the
    same tokens, as train.py's sampler_logp_gap / sampler_kl."""
    run, _ = paper_run(a)
    G, T = run.group_size, a.temperature
    cfg = model_config(a.preset, 0)
    _, amp = precision("bf16-mixed", dev)
    attn = models.attention_for(dev, torch.float32, bf16=True).implementation   # train.py's, by compute dtype
    prompts = group_prompts(a.p["gap_prompts"], G, run.max_prompt_len, cfg.vocab_size, seed=7)
    seeds = [rollout.row_seed(11, i) for i in range(len(prompts))]
    decoder = build(cfg, dev, torch.bfloat16, attn)
    with amp():                                      # train.rollouts: the bf16 copy under autocast
        ro = rollout.sample(decoder, prompts, max_new_tokens=a.p["gap_new"], eos_ids=[], pad_id=0,
                            temperature=T, seeds=seeds)
    master = build(cfg, dev, torch.float32, attn)
    master.load_state_dict(decoder.state_dict())     # float32 weights holding the copy's values (a bf16
    del decoder                                      # checkpoint loaded), the copy freed before scoring
    free_memory()
    mask = ro.response_mask.float()

    def vs_sampler(temperature) -> dict:             # train.score_old: score_tokens under autocast
        with torch.no_grad(), amp():
            old = logprobs.score_tokens(master, ro.packed(), temperature).response
        sums = experience.sampler_vs_old(ro.logprobs, old, mask)
        means = {k: float(v.sum() / mask.sum()) for k, v in sums.items()}
        return {"max": float(sums["samp_gap"].max()), **means}

    got, hot = vs_sampler(T), vs_sampler(1.1 * T)
    gap, k3 = got["samp_gap"], got["samp_kl"]
    figures = (f"{len(prompts)} rows x {int(mask.sum(1).max())} tokens, {cfg.num_hidden_layers} layers, "
               f"attention {attn}: sampler_logp_gap={gap:.2e} sampler_kl={k3:.2e} (k3; FAIL above "
               f"{GAP_K3_MAX:g}) max|gap|={got['max']:.2e}; for scale, pi_old at temperature {1.1 * T:g}: "
               f"k3 {hot['samp_kl']:.2e}")
    check(math.isfinite(gap) and math.isfinite(k3), f"not finite: {figures}")
    check(k3 <= GAP_K3_MAX, f"the sampler is not pi_old: {figures}")
    return figures



# ----------------------------------------------------------------------------------------------
# The time model's phases against what the timing items measured, and the JSON of the results


# What each phase of time_model.step_terms rests on that this check measures: a phase is "measured"
# where one of them was (a phase the table does not name: where the measured inputs moved it).
PHASE_INPUTS = {"decode": ("decode_bw_fraction", "launch_us", "kv_budget"), "prefill": ("kv_budget",),
                "score": ("update_mfu",), "update": ("update_mfu", "exposed_comm")}


def step_phases(p, k=None, kv_budget=None) -> dict:
    """{phase: seconds} of the paper step as `train.py --dry-run` models it (time_model.step_terms on
    paper_plan `p`), with the constants k (None: CENTRAL) and --kv-budget's positions (None: the plan's)."""
    a = p.a if kv_budget is None else memory_plan._with(p.a, kv_budget=kv_budget)
    terms = time_model.step_terms(p.arch, a, p.gpus, time_model.GPUS[p.key], p.needs_ref, p.old_rows, p.resp,
                                  p.prompt, k=k)
    return {t.name: t.seconds[0] for t in terms}


def replayed_phases(p, constants, kv_budget=None) -> dict:
    """The paper step's phases and the step, each {"model_s", "measured_s", "ratio"}: the model's at the
    assumed constants (CENTRAL) and the plan's slots, and the same replay with the measured ones --
    `constants` as measured_constants gives them (None: not measured, the assumed value kept) and the
    measured --kv-budget 0 positions -- where the phase rests on a measured input (PHASE_INPUTS), else
    None. The measured step is the whole replay's (its unmeasured phases at the model's constants)."""
    got = {n: v for n, v in constants.items() if v is not None}
    inputs = set(got) | ({"kv_budget"} if kv_budget else set())
    model = step_phases(p)
    replay = step_phases(p, {**time_model.CENTRAL, **got}, kv_budget) if inputs else model
    out = {}
    for ph, mod in model.items():
        rests = inputs & set(PHASE_INPUTS[ph]) if ph in PHASE_INPUTS else replay[ph] != mod
        out[ph] = {"model_s": mod, "measured_s": replay[ph] if rests else None}
    out["step"] = {"model_s": sum(model.values()), "measured_s": sum(replay.values()) if inputs else None}
    for v in out.values():
        meas = v["measured_s"]
        v["ratio"] = meas / v["model_s"] if meas is not None and v["model_s"] > 0 else None
    return out


def measured_constants(m=None) -> dict:
    """The time model's constants this run measured, from MEASURED (or a dict like it; None: not
    measured, --plan-constants keeps the assumed value): decode-grid's decode_bw_fraction and launch_us
    (grid_constants), update-fit's update_mfu at the model's depth; only on a GPU at the 7b preset (the
    run's model and shapes). FSDP2's exposed communication needs 8 GPUs: never."""
    m = MEASURED if m is None else m
    bw, launch = grid_constants(m.get("decode_grid"))
    fit = m.get("update_fit") or {}
    mfu = fit.get("mfu") if fit.get("on_gpu") and fit.get("preset") == "7b" else None
    return {"decode_bw_fraction": bw, "update_mfu": mfu, "launch_us": launch, "exposed_comm": None}


def phase_lines(name, cuda) -> dict:
    """Print one "model / measured / ratio" line per phase, then the step and the hours; -> the same
    as a dict for the JSON. No GPU: "measured: n/a (no GPU)" (the model on 8 H100s)."""
    key = card_key(name, cuda)
    p = paper_plan(key)
    kv = (MEASURED.get("kv_budget") or {}).get("positions") if cuda else None
    out = replayed_phases(p, measured_constants(), kv)
    why = "n/a (no GPU)" if not cuda else "n/a (not measured)"
    for phase, v in out.items():
        meas, ratio = v["measured_s"], v["ratio"]
        print(f"phase {phase:8s} model {v['model_s']:8.2f} s / measured: "
              f"{why if meas is None else f'{meas:.2f} s'} / ratio: {'n/a' if ratio is None else f'{ratio:.2f}'}")
    steps = p.a.steps
    hours = {k: None if out["step"][k] is None else out["step"][k] * steps / 3600 for k in ("model_s", "measured_s")}
    meas = why if hours["measured_s"] is None else f"{hours['measured_s']:.1f} h"
    print(f"phase hours    the paper run's {steps} steps on 8 x {time_model.GPUS[key].name}: model "
          f"{hours['model_s']:.1f} h / measured: {meas}", flush=True)
    return {"phases": out, "hours": {"model": hours["model_s"], "measured": hours["measured_s"]}, "gpu": key,
            "kv_budget": kv}


def write_json(path, a, name, rep, phases, seconds):
    """One JSON file of the run's results: the items' lines, the raw measurements, the constants
    --plan-constants reads, the phases against the model."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"device": name, "torch": torch.__version__, "preset": a.preset, "minutes": a.minutes,
           "seconds": seconds, "items": rep.results, "measured": MEASURED, "constants": measured_constants(),
           **phases}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"gpu_check: results in {path}", flush=True)


# ----------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="items: " + ", ".join(ITEMS) + " (what each checks: the module docstring)")
    ap.add_argument("--preset", default="7b" if torch.cuda.is_available() else "tiny", choices=sorted(PRESETS),
                    help="7b on a GPU; tiny (toy widths: the host side in seconds) without one")
    ap.add_argument("--minutes", type=float, default=5.0, help="the budget: no item starts that would not end "
                    "in it (on a GPU by the item's estimated seconds), the timing items first")
    ap.add_argument("--json", default=None, help="the results file (default: bench/results/gpu_check_<gpu>.json "
                    "on a GPU, gpu_check_cpu.json in the temporary folder without one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (if any) or cpu")
    ap.add_argument("--items", default=",".join(ITEMS), help="comma-separated subset of the items to run")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of decode-speed's model (0: the "
                    "preset's; the full-depth items take every layer)")
    ap.add_argument("--train-layers", type=int, default=0, help="decoder layers of train.main's model (0: preset's)")
    ap.add_argument("--prompt-len", type=int, default=None, help="decode-speed's prompt tokens")
    ap.add_argument("--decode-new", type=int, default=None, help="new tokens of the ours-vs-HF decode comparison")
    ap.add_argument("--pass-steps", type=int, default=None, help="decode-pass's timed decode steps")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: by name)")
    ap.add_argument("--hbm-tbs", type=float, default=None, help="HBM bandwidth, TB/s, of decode-pass's bound "
                    "(default: by name; decode-grid's bound is the time model's card)")
    ap.add_argument("--tmp", default=None, help="folder for train.main's model and run, kept (default: a temporary "
                    "one, deleted at the end but for train.log where a train item failed)")
    a = ap.parse_args(argv)
    a.p = PRESETS[a.preset]
    for k in ("prompt_len", "decode_new", "pass_steps"):
        setattr(a, k, getattr(a, k) or a.p[k])
    a.layers, a.train_layers = a.layers or a.p["layers"], a.train_layers or a.p["train_layers"]
    a.items = [i for i in a.items.split(",") if i]
    unknown = set(a.items) - set(ITEMS)
    if unknown:
        ap.error(f"unknown items {sorted(unknown)}; choose from {', '.join(ITEMS)}")
    return a


def phases_or_error(name, cuda) -> dict:
    """phase_lines, or the error in its place (a report, as an item's: never the run's end)."""
    try:
        return phase_lines(name, cuda)
    except Exception as e:
        print(f"phase lines failed: {type(e).__name__}: {one_line(e)}", flush=True)
        return {"phases": None, "error": f"{type(e).__name__}: {one_line(e)}"}


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
    print(f"gpu_check: {name}{f' ({total / GIB:.0f} GiB)' if cuda else ''}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, flash_attn {'absent' if flash_attn_missing() else 'present'}, "
          f"preset {a.preset}, decode-speed layers {a.layers}, items {','.join(a.items)}", flush=True)
    rep = Report(t_start + 60 * a.minutes, est=cuda)
    tag = name.replace(" ", "_") if cuda else "cpu"
    path = a.json or (os.path.join(ROOT, "bench", "results", f"gpu_check_{tag}.json") if cuda
                      else os.path.join(tempfile.gettempdir(), "gpu_check_cpu.json"))
    # The timing items first (what the time model rests on), the first of them the CUDA-only GEMM the
    # update's head runs; the decoder decode-grid builds serves kv-budget and decode-pass, then goes.
    if "matmul" in a.items:
        rep.item("fp32-matmul", fp32_matmul, dev)
    for item, fn in (("decode-grid", decode_grid), ("kv-budget", kv_budget), ("decode-pass", decode_pass)):
        if item in a.items:
            rep.item(item, fn, a, dev, name)
    DECODER.clear()
    free_memory()
    if "update-fit" in a.items:
        rep.item("update-fit", update_fit, a, dev, name)
    phases = phases_or_error(name, cuda)          # the step they imply, and the JSON now: a run cut short
    write_json(path, a, name, rep, phases, time.perf_counter() - t_start)   # by the device's time keeps them
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
                gone = os.path.join(tmp, entry)
                shutil.rmtree(gone, ignore_errors=True) if os.path.isdir(gone) else os.remove(gone)
            if not keep:
                os.rmdir(tmp)
    if "kv" in a.items:
        rep.item("kv-cache", kv_cache_check, a, dev)
    if "update-memory" in a.items:
        rep.item("update-memory", update_memory, a, dev)
    if "decode" in a.items:
        rep.item("decode-speed", decode_speed, a, dev)
    if "sampler-gap" in a.items:
        rep.item("sampler-gap", sampler_gap, a, dev)
    write_json(path, a, name, rep, phases, time.perf_counter() - t_start)
    c = rep.counts
    print(f"gpu_check: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP in {time.perf_counter() - t_start:.0f} s "
          f"({name}, preset {a.preset})", flush=True)
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
