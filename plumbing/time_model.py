"""What one RL step costs on GPUs, estimated from the config and the architecture before launch
(`train.py --dry-run` prints it above the memory plan). A model, not a measurement: every term is a
formula whose assumption is named beside its number, so a user can see which one to doubt.

Two columns: the REALISTIC estimate, over the lengths a run will meet, and beside it the WORST CASE,
every response to --max-new-tokens. The lengths (`Lengths`, `plan_lengths`):
    responses  a stated distribution: by default issue #42's review central case (Qwen2.5-Math-7B at
               the start of RL: mean 753 tokens, 5% cut at the 3,072 limit; configs/lengths/), or one
               measured by --plan-lengths (an evaluate.py samples.jsonl: each sample's num_tokens; a
               run's metrics.jsonl: its response_len and truncated_frac)
    prompts    as the code pads them, from a distribution of prompt lengths: the review's summary
               statistics by default (mean 144 tokens, a rank's longest of 64 prompts ~430), or a
               histogram of the data under the template (lengths_file.prompt_histogram writes one, with
               the data's and the tokenizer's hashes, where both are at hand; --plan-lengths reads it;
               plumbing/lengths_file.py reads every such file)
The step's phases, per rank (the ranks run in parallel), each an expectation over those lengths
(formulas of the distributions, no sampling; tests/test_time_model.py replays the code's own
schedule on sampled lengths against them):
    decode   one pass over the rank's N rows in S slots (sampler/kv_cache.py's decode_pass, S = the
             KV budget // (the rank's longest prompt + max_new_tokens)): the slots stay full until the
             queue drains, each row holding its slot for its length plus the wait for a refill, then
             the last rows finish. Each step reads the bf16 weights and every slot's KV cache up to
             the longest slot's column (memory-bound), or is bound by launching its eager kernels
    prefill  each distinct prompt once, left-padded in groups of PREFILL_TOKENS (2 N FLOPs per token;
             N = matmul_params, all but the input embedding)
    score    pi_old's no-grad forward over the rows (and the reference's, where one is loaded), in the
             micro-batches batching.microbatch_plan makes: longest first, each padded to its longest
             prompt + its longest response
    update   forward + backward over the same micro-batches (6 N FLOPs per token, 8 N with activation
             checkpointing; LoRA: 2 N less), and under FSDP2 the weights gathered twice and the gradients
             reduce-scattered per micro-batch (packed: next-fit's count, as many on every rank)
    host     what the GPU phases leave out: grading, FSDP2's decoding copy, the length-dealing gather
"""

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from plumbing import batching, lengths_file, memory_plan
from plumbing.lengths_file import Lengths, fitted_prompts, fitted_responses, fixed


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float                  # dense bf16 peak
    hbm_tbs: float                      # memory bandwidth, TB/s
    link_gbs: float                     # NVLink bandwidth per GPU, one direction, GB/s (PCIe: its own)
    memory_gib: float = 79.1            # what torch.cuda reports (memory_plan.CARD_GIB: the plan's card)


GPUS = {key: GPU(*spec, memory_plan.CARD_GIB[key]) for key, spec in {
    "h100": ("H100 SXM", 989.0, 3.35, 450.0), "h200": ("H200", 989.0, 4.8, 450.0),
    "a100": ("A100 80GB", 312.0, 2.0, 300.0), "a100-40gb": ("A100 40GB", 312.0, 1.56, 300.0),
    "l40s": ("L40S", 362.0, 0.864, 32.0)}.items()}
# The constants the estimate rests on, (central, fast end, slow end): public measurements cited in
# docs/gpus.md ("The time model's constants") until bench/gpu_check.py measures them (its JSON, read by
# --plan-constants: `constants`). The dry-run's range is every constant at its fast end, then its slow.
CONSTANTS = {"decode_bw_fraction": (0.7, 0.85, 0.55),   # of HBM bandwidth an eager decode step reaches
             "launch_us": (8.0, 5.0, 15.0),            # host microseconds per eager kernel of a decode step
             "update_mfu": (0.3, 0.4, 0.25),           # 6N MFU of the training and scoring forwards
             "exposed_comm": (0.3, 0.1, 0.6),          # of FSDP2's gathers + reduce-scatters prefetch leaves
             "slowest_rank": (1.08, 1.04, 1.13),       # the slowest rank's decode over the modelled mean
             "verify_ms": (20.0, 6.0, 50.0)}           # ms a math-verify runner takes an answer (CPU, here)
CENTRAL = {k: v[0] for k, v in CONSTANTS.items()}
MFU = CENTRAL["update_mfu"]            # (named: bench/gpu_check.py scales by it)
PREFILL_MFU = 0.5          # of the prefill (large dense matmuls, no backward)
KERNELS_PER_LAYER = 43     # eager kernels of one decoder layer's decode step (~1,200 at 28 layers, on CPU)
LINK_EFFICIENCY = 0.7      # of NVLink's bandwidth an all-gather / reduce-scatter reaches
# The host's work (host_seconds; docs/gpus.md cites each): grading, the FSDP2 decoding copy, the deal
VERIFY_FRACTION = 0.3      # of the responses reward.py's exact paths leave to math-verify (assumed)
VERIFY_RUNNERS = 4         # math-verify runners a rank grades on (mathverify_pool: min(4, its CPUs))
GATHER_US = 100.0          # a decoding copy's per-tensor cost beside its bytes: a collective, an alloc
TENSORS_PER_LAYER = 12     # a Qwen2 decoder layer's parameter tensors (q, k, v + biases, o, MLP x3, norms x2)
PICKLE_GBS = 1.0           # GB/s of all_gather_object's round trip: pickle, to GPU, back, unpickle
# sampler/kv_cache.py's schedule (plumbing may not import the sampler; a test holds them equal)
CHECK_EVERY, REFILL_FRACTION, COMPACT_FRACTION, PREFILL_TOKENS = 8, 8, 4, 1024
GRID = 64                  # decode steps per segment of the modelled pass
MAX_SEGMENTS = 2000        # more (absurd --max-new-tokens): longer segments, ages in blocks (coarser)
AGE_BINS = 4096            # ages of a segment in at most this many blocks (exact below 4,096 tokens)
PACKED_ROWS = 1 << 16      # more rows a forward (absurd batches): next-fit walked over this many, scaled
REVIEW = os.path.join(memory_plan.ROOT, "configs", "lengths", "review_issue42.json")
# The lengths are distributions over 0 .. --max-new-tokens, held as float64 arrays (about a dozen at
# once: ~100 bytes a token, measured). Past this many tokens a row (no model has as many positions)
# the model is not run: --max-new-tokens 1e9 took 22 GB and was killed by the kernel.
MODELLED_TOKENS = 2 ** 24


def _review():
    with open(REVIEW) as f:
        return json.load(f)


_FITTED = {}


def default_prompts() -> Lengths:
    """The review's summary statistics of MATH L3-5 prompts under --template paper (fitted once)."""
    if "prompt" not in _FITTED:
        p = _review()["prompt"]
        _FITTED["prompt"] = fitted_prompts(p["mean"], p["longest"], p["longest_of"],
                                           "issue #42's review: its summary statistics, not a histogram "
                                           "of the data")
    return _FITTED["prompt"]


def default_responses() -> Lengths:
    r = _review()["response"]
    return fitted_responses(r["mean"], r["truncated"], r["limit"],
                            f"issue #42's review central case: {r['what'].split(' (')[0]}")


def plan_lengths(a) -> tuple[Lengths, Lengths]:
    """(responses cut at --max-new-tokens, prompts of at most --max-prompt-len): --plan-lengths'
    where it gives them (getattr(a, "plan_lengths")), else the defaults."""
    path = getattr(a, "plan_lengths", None)
    got = lengths_file.read_lengths(path, a.max_new_tokens) if path else {}
    resp = got.get("response") or default_responses()
    prompt = got.get("prompt") or default_prompts()
    return resp.cut_at(a.max_new_tokens), prompt.at_most(a.max_prompt_len)



# ----------------------------------------------------------------------------------------------
# The code's schedules, in expectation over the lengths

@dataclass
class Segment:
    steps: float                        # decode steps
    kv: float                           # KV positions each of them reads (slots x columns)
    rows: float                         # slots each of them computes


def slots_for(a, gpus, prompt: Lengths) -> int:
    """rollout.SampleSpec.rows_per_call: --gen-batch, capped so slots x (the rank's longest prompt +
    max_new_tokens) <= --kv-budget (0 on a GPU: what fits, memory_plan.as_planned has set it)."""
    rows = min(a.rollout_batch // gpus * a.group_size, a.gen_batch or 1 << 30)
    longest = math.ceil(prompt.expected_max(a.rollout_batch // gpus))
    return min(rows, max(1, a.kv_budget // (longest + a.max_new_tokens))) if a.kv_budget else rows


def decode_schedule(resp: Lengths, prompt: Lengths, N: int, n_prompts: int, S: int) -> list[Segment]:
    """kv_cache.decode_pass over N rows (of n_prompts prompts) in S slots, in expectation, as segments
    of GRID steps: the slots full until the queue drains, then the last rows' tail, their slots
    compacted away. Each step reads up to the longest slot's column: its prompt + its row's age."""
    R, L, S = len(resp.pmf) - 1, resp.mean(), min(S, N)
    sf = resp.sf()
    if N == S:
        fill, fresh, idle = 0.0, N, 0
    else:  # a freed slot waits for the check and for S/8 slots to be free (REFILL_FRACTION)
        k, w = max(1, S // REFILL_FRACTION), (max(1, S // REFILL_FRACTION) - 1) / (2 * S)
        idle = (w * L + CHECK_EVERY / 2) / (1 - w)
        fill, fresh = (N - S) * (L + idle) / S, min(k, N - S)
    res = np.append(0.0, sf[:-1]) / L                              # a slot's remaining tokens
    res_cdf = np.minimum(np.cumsum(res), 1.0)
    last = resp.cdf ** fresh * res_cdf ** (S - fresh)               # when the last row ends
    tail = float(np.sum(1 - last[:-1])) + CHECK_EVERY / 2 * float(last[R - 1])
    age = np.concatenate([sf[:-1], np.ones(int(idle))])             # a row's age, then its slot's wait
    csum = np.concatenate([[0.0], np.cumsum(age)])
    segments, grid = [], max(GRID, math.ceil((fill + tail) / MAX_SEGMENTS))
    for t in range(0, math.ceil(fill + tail), grid):
        # the first rows are t steps old while they last; other slots hold later rows, younger than t
        width = _longest_column(prompt, age, csum, t, sf[min(t, R)], S)
        since = min(R, int(t - fill))                               # steps since the queue drained
        alive = S if t < fill else fresh * sf[since] + (S - fresh) * (1 - res_cdf[since])
        batch = min(S, alive / (1 - 1 / (2 * COMPACT_FRACTION)))    # finished slots wait to be compacted
        segments.append(Segment(min(grid, fill + tail - t), batch * width, batch))
    return segments


def _longest_column(prompt: Lengths, age, csum, t: int, first_alive: float, S: int) -> float:
    """The column a step at t reads up to: E[max over S slots of prompt + age] + 1, the age of a slot
    t while the first rows last (first_alive), else a later row's. Ages in blocks of b tokens where
    there are more than AGE_BINS of them (only absurd --max-new-tokens: b = 1 is exact)."""
    n = min(t + 1, len(age))
    b = max(1, math.ceil(n / AGE_BINS))
    if b == 1:
        now = age[:n] * (1 - first_alive) / max(1e-12, csum[n])
        now[n - 1] += first_alive
        return Lengths(np.convolve(prompt.pmf, now), "").expected_max(S) + 1
    now = np.diff(csum[np.append(np.arange(0, n, b), n)]) * (1 - first_alive) / max(1e-12, csum[n])
    now[-1] += first_alive
    blocks = np.add.reduceat(prompt.pmf, np.arange(0, len(prompt.pmf), b))
    return Lengths(np.convolve(blocks, now), "").expected_max(S) * b + 1


def matmul_params(arch) -> int:
    """The model's N: the parameters a token is multiplied by (a forward is 2N FLOPs a token, forward +
    backward 6N; a decode step reads them), all but the input embedding, a lookup (tied: counted once,
    as lm_head)."""
    return arch.params() - (0 if arch.tied else arch.vocab * arch.hidden)


def decode_seconds(arch, gpu: GPU, segments, captured=False, k=None) -> tuple[float, float, float]:
    """-> (seconds, steps, seconds per step at the fullest segment) of a decode schedule: each step
    the slowest of reading the weights and KV, launching its kernels (none when a CUDA graph
    replays them: --compile-decode), and its 2N FLOPs per slot (at PREFILL_MFU: dense matmuls; the
    bound a few hundred slots reach; none for a GPU of 0 TFLOP/s)."""
    k = k or CENTRAL                    # (the constants: decode_bw_fraction, launch_us)
    weights = 2 * matmul_params(arch)
    launch = 0.0 if captured else KERNELS_PER_LAYER * arch.layers * k["launch_us"] * 1e-6
    flops = 2 * matmul_params(arch) / (gpu.bf16_tflops * 1e12 * PREFILL_MFU) if gpu.bf16_tflops else 0.0

    def step_s(seg):
        bandwidth = gpu.hbm_tbs * 1e12 * k["decode_bw_fraction"]
        read = (weights + seg.kv * arch.kv_bytes_per_position()) / bandwidth
        return max(launch, read, seg.rows * flops)
    return (sum(s.steps * step_s(s) for s in segments), sum(s.steps for s in segments),
            max(map(step_s, segments)))


def worst_schedule(R: int, prompt: Lengths, N: int, n_prompts: int, S: int) -> list[Segment]:
    """Every row to the limit: waves of S rows that start and end together, each step reading the
    rank's longest prompt + the step's columns (their mean: + R / 2)."""
    S, cols = min(S, N), prompt.expected_max(n_prompts) + R / 2 + 1
    return [Segment(R, min(S, N - w) * cols, min(S, N - w)) for w in range(0, N, S)]


def planned_tokens(resp: Lengths, prompt: Lengths, n: int, group: int, size: int,
                   max_tokens: int) -> tuple[float, int]:
    """batching.microbatch_plan over n rows (groups of `group` rows share a prompt), in expectation:
    longest first, at most `size` rows and max_tokens padded tokens each, a micro-batch as wide as
    its longest response (the first row's, at its rank among the n) + the longest of its distinct
    prompts. -> (padded tokens, micro-batches). Not modelled: --share-prompts' whole groups, and
    FSDP2's splitting to the most micro-batches any rank needs (more forwards, the same tokens;
    packed_tokens models it for the packed plan, the default)."""
    total = Lengths(np.convolve(prompt.pmf, resp.pmf), "")          # a row's prompt + response
    prompts_in, j, tokens, micro = max(1.0, n / group), 0, 0.0, 0
    while j < n:
        r, k = total.top((j + 0.5) / n) - prompt.mean(), min(size, n - j)
        for _ in range(3):
            d = prompts_in * (1 - (1 - 1 / prompts_in) ** k)        # distinct prompts among k rows
            width = r + prompt.expected_max(d)
            k = max(1, min(size, n - j, int(max_tokens // width) if max_tokens else size))
        m = max(1, min(int(n / k / MAX_SEGMENTS), (n - j) // k))     # absurd sizes: m alike at once
        tokens, micro, j = tokens + m * k * width, micro + m, j + m * k
    return tokens, micro


def packed_tokens(resp: Lengths, prompt: Lengths, n: int, size: int, max_tokens: int,
                  ranks: int = 1) -> tuple[float, float]:
    """The same n rows packed (--pack: the full-row path's forwards take the rows' real tokens, no
    padding) as batching.microbatch_plan packs them: longest first (prompt + response), NEXT-FIT, a
    micro-batch closed at `size` rows or where the next row would pass max_tokens real tokens.
    Walked on the rows' lengths by rank, as planned_tokens walks them: the j-th longest of n at the
    (j + 0.5) / n quantile of prompt + response. Sorted rows are locally alike, so the rows a
    micro-batch of consecutive ranks takes are about what their quantiles say (perfect packing,
    tokens / max_tokens + 1, counted 4-21% fewer than tests/test_time_model.py's replays: next-fit
    leaves each micro-batch's gap unfilled, and a row over half the cap goes alone).
    ranks > 1: every rank runs as many as the rank that needs the most (microbatch_plan's count=):
    the expected most of `ranks` counts, each ~ normal around the mean, its spread what is left once
    deal_by_length has evened the tokens per rank (a count is a sum over rows of 1 / their
    micro-batch's rows: its part linear in the row's tokens is what dealing evens out).
    -> (real tokens, micro-batches)."""
    tokens = n * (prompt.mean() + resp.mean())
    total = Lengths(np.convolve(prompt.pmf, resp.pmf), "")          # a row's prompt + response
    m = min(n, PACKED_ROWS)
    u = (np.arange(m) + 0.5) / m                                    # the rows, longest first
    rows = np.searchsorted(-total.sf(), -(u + 1e-12)).astype(float)  # = total.top(u), at once
    share, start, used = np.empty(m), 0, 0.0                       # a row's 1 / its micro-batch's rows
    for j, x in enumerate(rows):
        if j > start and (j - start == size or (max_tokens and used + x > max_tokens)):
            share[start:j], start, used = 1 / (j - start), j, 0.0
        used += x
    share[start:] = 1 / (m - start)
    micro = float(share.sum()) * n / m
    if ranks > 1 and rows.var() > 0:
        evened = np.mean((share - share.mean()) * (rows - rows.mean())) ** 2 / rows.var()
        micro += _normal_max(ranks) * math.sqrt(max(0.0, n * (share.var() - evened)))
    return tokens, micro


def _normal_max(k: int) -> float:
    """E[the largest of k independent standard normals] (1.42 for 8): -10 + the integral of
    1 - Phi(x)^k from -10 (midpoints)."""
    x = np.arange(-10.0, 10.0, 0.01) + 0.005
    phi = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return float(-10.0 + np.sum(1 - phi ** k) * 0.01)


def forward_tokens(a, resp: Lengths, prompt: Lengths, n: int, ranks: int = 1) -> tuple[float, float]:
    """Tokens and micro-batches of a training forward over n rows on each of `ranks`: packed where
    --pack applies (getattr(a, "pack", True): the option's default, before and after it exists; the
    full-row path, batching.prompt_group 1), else padded as batching.microbatch_plan pads them."""
    cap = getattr(a, "micro_tokens", 0)
    if packs(a):
        return packed_tokens(resp, prompt, n, a.micro_batch, cap, ranks)
    return planned_tokens(resp, prompt, n, a.group_size, a.micro_batch, cap)


def packs(a) -> bool:
    return bool(getattr(a, "pack", True)) and batching.prompt_group(a) == 1


# ----------------------------------------------------------------------------------------------
# The report

@dataclass
class Term:
    name: str
    seconds: tuple                      # per set of lengths (step_terms: one; decode_terms: one per L)
    note: str


def decode_terms(arch, a, gpus, gpu: GPU, lengths) -> list[Term]:
    """Every row at a FIXED length L (each of `lengths`), prompts at --max-prompt-len, in
    memory_plan.kv_rows's slots: the bound bench/gpu_check.py sets a measured pass against (each step
    reading every slot up to prompt + L columns)."""
    rows, slots = a.rollout_batch // gpus * a.group_size, memory_plan.kv_rows(a, gpus)
    prompt = fixed(a.max_prompt_len, "--max-prompt-len")
    out = []
    for L in lengths:
        n = L if rows <= slots else math.ceil(rows * L / slots) + (a.max_new_tokens - L)
        out.append(decode_seconds(arch, gpu, [Segment(n, slots * (prompt.expected_max(1) + L), slots)]))
    return [Term("decode", tuple(o[0] for o in out) + (0.0,) * (2 - len(out)),
                 f"{out[0][1]:,.0f} decode steps of {rows} rows in {slots} slots")]


def step_terms(arch, a, gpus, gpu: GPU, needs_ref, old_rows, resp: Lengths, prompt: Lengths,
               k=None) -> list[Term]:
    """The step's four phases and its host work over these lengths: one column of the report. k: the constants
    (CENTRAL; `constants` reads measured ones); decode is the slowest rank's (k["slowest_rank"])."""
    k = k or CENTRAL
    N, n_p, G = a.rollout_batch // gpus * a.group_size, a.rollout_batch // gpus, a.group_size
    S = slots_for(a, gpus, prompt)
    R = len(resp.pmf) - 1
    worst = resp.truncated() == 1.0
    segs = (worst_schedule if worst else decode_schedule)(R if worst else resp, prompt, N, n_p, S)
    dec_s, steps, step_s = decode_seconds(arch, gpu, segs, getattr(a, "compile_decode", False), k)
    dec_s *= k["slowest_rank"]
    Nf, flops = matmul_params(arch), gpu.bf16_tflops * 1e12
    refills = 0 if N <= S else (N - S) / max(1, S // REFILL_FRACTION)
    prefill = (n_p + refills) * prompt.expected_max(2)              # a refill's distinct prompts
    update = a.rollout_batch // a.update_batch * a.ppo_epochs, a.update_batch // gpus * G
    old = round(old_rows * N)
    score = forward_tokens(a, resp, prompt, old)[0] if old else 0.0
    score += forward_tokens(a, resp, prompt, N)[0] if needs_ref else 0.0
    upd, micro = forward_tokens(a, resp, prompt, update[1], gpus)        # as many on every rank
    train_flops = 8 if a.grad_ckpt else 6
    rank = getattr(a, "lora_rank", 0)
    adapters = memory_plan.lora_params(arch, rank) if rank else 0
    per_token = (train_flops - 2) * Nf + 6 * adapters if rank else train_flops * Nf
    comm = (3 * 2 * arch.params() * (gpus - 1) / gpus) / (gpu.link_gbs * 1e9 * LINK_EFFICIENCY) if a.fsdp \
        else 0.0                                                     # (bf16 bytes of every parameter)
    real = update[1] * (prompt.mean() + resp.mean())
    most = f" (the most of {gpus} ranks)" if gpus > 1 and packs(a) else ""     # FSDP2's count=
    return [Term("decode", (dec_s,), f"{steps:,.0f} steps of {N} rows in {S} slots, "
                 f"{step_s * 1e3:.1f} ms at the fullest"),
            Term("prefill", (2 * Nf * prefill / (flops * PREFILL_MFU),), f"{prefill:,.0f} prompt tokens"),
            Term("score", (2 * Nf * score / (flops * k["update_mfu"]),), f"{score:,.0f} tokens"),
            Term("update", (update[0] * (per_token * upd / (flops * k["update_mfu"])
                                         + micro * comm * k["exposed_comm"]),),
                 f"{update[0]} x {upd:,.0f} tokens ({'packed: ' if packs(a) else ''}{upd / real:.2f}x the "
                 f"real) in {micro:.1f} micro-batches{most}"),
            Term("host", *host_seconds(arch, a, gpus, gpu, resp, prompt, k))]


def host_seconds(arch, a, gpus, gpu: GPU, resp: Lengths, prompt: Lengths, k) -> tuple[tuple, str]:
    """The step's host work, which no GPU phase holds (step_time does: rl/experience.py's time_reward
    and no timer): grading the rank's N responses (reward.py decides most by string and number; the
    rest, VERIFY_FRACTION, on the rank's math-verify pool, k["verify_ms"] each on one of VERIFY_RUNNERS);
    under FSDP2 the decoding copy rebuilt every rollout (distributed.gathered_copy: every float32
    parameter all-gathered, tensor by tensor; a LoRA policy's merged copy: not modelled, on-device); over
    several ranks the length-dealing all-gather (scale_step.deal_by_length: each group trimmed to its
    prompt + its longest response, 16 bytes a prompt position and 20 a response's, gathered to all).
    -> ((seconds,), the note)."""
    N, G = a.rollout_batch // gpus * a.group_size, a.group_size
    grade = N * VERIFY_FRACTION * k["verify_ms"] * 1e-3 / VERIFY_RUNNERS
    copy = 0.0
    if a.fsdp and gpus > 1 and not getattr(a, "lora_rank", 0):
        gathered = 4 * arch.params() * (gpus - 1) / gpus / (gpu.link_gbs * 1e9 * LINK_EFFICIENCY)
        copy = gathered + (TENSORS_PER_LAYER * arch.layers + 3) * GATHER_US * 1e-6
    dealt = gpus * N * (16 * prompt.mean() + 20 * resp.expected_max(G)) if gpus > 1 else 0.0
    deal = dealt / (PICKLE_GBS * 1e9)
    return (grade + copy + deal,), (f"grading {grade:.1f} s + decoding copy {copy:.1f} s + deal {deal:.1f} s "
                                    f"({dealt / 1e6:,.0f} MB)")


def _flops_note(arch, a, gpu, k) -> str:
    rank, train_flops = getattr(a, "lora_rank", 0), 8 if a.grad_ckpt else 6
    adapters = memory_plan.lora_params(arch, rank) if rank else 0
    what = (f"{train_flops - 2}N + 6 x {adapters / 1e6:.1f}M FLOPs per token (LoRA rank {rank}: the frozen "
            "base passes gradients back, computes none of its own)" if rank
            else f"{train_flops}N FLOPs per token")
    fsdp = (f"; FSDP2: per micro-batch the weights all-gathered x2 + reduce-scattered at "
            f"{LINK_EFFICIENCY:.0%} of {gpu.link_gbs:g} GB/s, {k['exposed_comm']:.0%} of it exposed") \
        if a.fsdp else ""
    return what + f" at {k['update_mfu']:.0%} MFU" + fsdp


def report(a, gpus: int, needs_ref: bool, gpu_name: str, old_rows=1.0) -> str:
    """The model's table, the realistic estimate first and the worst case beside it; old_rows: the
    fraction of rows pi_old's own forward scores (the first update's rows are scored by the update's
    forward: train.on_policy_rows). Lengths: plan_lengths(a) (--plan-lengths, else the defaults)."""
    tokens = a.max_new_tokens + a.max_prompt_len
    if tokens > MODELLED_TOKENS:                            # (memory for the arrays, not for the run)
        return (f"time model: not modelled: --max-prompt-len {a.max_prompt_len:,} + --max-new-tokens "
                f"{a.max_new_tokens:,} tokens a row is more than any model's positions, and its length "
                f"distributions would take ~{tokens * 100 / 2 ** 30:.0f} GiB of host memory (the model "
                f"runs up to {MODELLED_TOKENS:,} tokens a row)")
    arch, gpu, given = memory_plan.arch_for(a.model), GPUS[gpu_name], a
    a = memory_plan.as_planned(memory_plan._with(a, plan_gpu=gpu_name), gpus, needs_ref)
    resp, prompt = plan_lengths(a)
    R, (k, fast, slow, source) = a.max_new_tokens, constants(given)    # (read before a is planned)
    cols = [step_terms(arch, a, gpus, gpu, needs_ref, old_rows, lengths, prompt, k)
            for lengths in (resp, fixed(R, "every response to the limit"))]
    ends = [sum(t.seconds[0] for t in step_terms(arch, a, gpus, gpu, needs_ref, old_rows, resp, prompt, e))
            for e in (fast, slow)]
    launch = KERNELS_PER_LAYER * arch.layers
    weights = 2 * matmul_params(arch)
    captured = getattr(a, "compile_decode", False)
    budget = (f"--kv-budget 0: {a.kv_budget:,} positions fit the {gpu.memory_gib:g} GiB card less "
              f"{memory_plan.KV_MARGIN:.0%}" if not given.kv_budget else f"--kv-budget {a.kv_budget:,}")
    notes = {"decode": f"slots: {budget}; each step reads {weights / 1e9:.1f} GB of bf16 weights + the "
                       f"slots' KV cache at {gpu.hbm_tbs} TB/s, "
                       + ("(--compile-decode: its kernels replayed by a CUDA graph, no launch bound) "
                          if captured else f"or launches {launch} eager kernels at {k['launch_us']:g} us "
                          "(--compile-decode off), ")
                       + f"or computes 2N FLOPs a slot at {PREFILL_MFU:.0%} MFU, whichever is slowest",
             "prefill": f"2N FLOPs per token at {PREFILL_MFU:.0%} of {gpu.bf16_tflops:g} TFLOP/s",
             "score": f"pi_old over {old_rows:.0%} of the rows"
                      f"{' + the reference over all' if needs_ref else ' (no reference model loaded)'}, "
                      f"{'packed' if packs(a) else 'padded'}, no grad, at {k['update_mfu']:.0%} MFU",
             "update": _flops_note(arch, a, gpu, k),
             "host": f"{VERIFY_FRACTION:.0%} of the answers to math-verify at {k['verify_ms']:g} ms on "
                     f"{VERIFY_RUNNERS} runners; FSDP2's copy all-gathers float32 weights + {GATHER_US:g} "
                     f"us a tensor; the deal at {PICKLE_GBS:g} GB/s"}
    lines = [f"time model of one RL step on {gpus} x {gpu.name} (a model from the config, not a measurement; "
             f"--plan-gpu): REALISTIC / worst case (every response to --max-new-tokens {R})",
             f"  responses: mean {resp.mean():.0f} tokens, {resp.truncated():.1%} cut at {R} ({resp.source}; "
             "--plan-lengths: measured ones)",
             f"  prompts: mean {prompt.mean():.0f} tokens, a rank's longest of {a.rollout_batch // gpus} "
             f"~{prompt.expected_max(a.rollout_batch // gpus):.0f} ({prompt.source}); each forward pads "
             "to its own longest (batching.microbatch_plan), not to --max-prompt-len",
             "  constants (docs/gpus.md cites the assumed; bench/gpu_check.py's JSON, --plan-constants, the "
             "measured): " + ", ".join(f"{n} {k[n]:g} ({source[n]})" for n in CONSTANTS),
             f"  the levers as the options set them: {levers(a, given, needs_ref)}"]
    for real, worst in zip(*cols):
        lines.append(f"  {real.name:8s} {real.seconds[0]:7.1f} s / {worst.seconds[0]:7.1f} s   "
                     f"{real.note} / {worst.note}; {notes[real.name]}")
    total = [sum(t.seconds[0] for t in c) for c in cols]
    hours = [s * a.steps / 3600 for s in total]
    lines.append(f"  {'step':8s} {total[0]:7.1f} s / {total[1]:7.1f} s   x {a.steps} steps: {hours[0]:.1f} h "
                 f"realistic / {hours[1]:.1f} h worst case (evaluations and checkpoints not counted)")
    lo, hi = (e * a.steps / 3600 for e in ends)
    lines.append(f"  {'range':8s} {ends[0]:7.1f} .. {ends[1]:.1f} s realistic, {lo:.1f} .. {hi:.1f} h: every "
                 "constant at its fast end .. at its slow end (CONSTANTS)")
    return "\n".join(lines)


def constants(a) -> tuple[dict, dict, dict, dict]:
    """(central, fast end, slow end, {name: "measured (FILE)" | "assumed"}): CONSTANTS, but where
    bench/gpu_check.py's JSON (--plan-constants; getattr: before train.py has the option) measured one."""
    path, got = getattr(a, "plan_constants", None), {}
    if path:
        with open(path) as f:
            got = {n: float(v) for n, v in json.load(f).get("constants", {}).items() if n in CONSTANTS and v}
    ends = [{n: got.get(n, v[i]) for n, v in CONSTANTS.items()} for i in range(3)]
    return (*ends, {n: f"measured ({os.path.basename(path)})" if n in got else "assumed" for n in CONSTANTS})


def levers(a, given, needs_ref) -> str:
    """The speed levers as this run has them (a lever that is off is not counted)."""
    return ", ".join([
        "a reference model" if needs_ref else "no reference model (--measure-policy-kl off, no Policy-KL)",
        "packed forwards" if packs(a)
        else "padded forwards" + ("" if getattr(a, "pack", True) else " (--pack off)"),
        ("activation checkpointing" if a.grad_ckpt else "no activation checkpointing")
        + (" (--grad-ckpt auto)" if given.grad_ckpt == "auto" else ""),
        "KV slots that fit (--kv-budget 0)" if not given.kv_budget else f"--kv-budget {given.kv_budget:,}",
        "a captured decode (--compile-decode)" if getattr(a, "compile_decode", False)
        else "an eager decode (--compile-decode off)"])


disk_report = memory_plan.disk_report   # (what a run writes: memory_plan's, beside the memory)
