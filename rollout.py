"""Rollouts: sample G responses per prompt.

Used by train.py (training rollouts) and evaluate.py (benchmark sampling). Works the same for the
embedded ~1M-parameter Qwen2 model on CPU (fp32) and for Qwen2.5-Math-7B on GPUs (bf16, possibly
wrapped in DDP or sharded with FSDP2 `fully_shard`): prompts go through the model's normal forward
into a preallocated KV cache (sampler/kv_cache.py); the sampler's one-token decode steps use
sampler/decode.py's lean step over the same weights for Llama/Qwen2 -- then every row of a call is
decoded in ONE pass over the slots of one cache, finished slots refilled with queued rows -- and the
normal forward otherwise, in chunks of rows one after another (`_sample_kv`). Loading a policy is
modeling/models.py; the training forward over the sampled rows (their log-probs, Query-KL's prompt
log-probs) is modeling/logprobs.py.

- `sample`   -> `Rollout`: our own KV-cache decoding ("kv", default) or HF `generate`
                ("hf", a reference). Returns the sampled tokens, masks, and the log-prob of each
                sampled token under log_softmax(logits / T) -- the same quantity the training
                forward recomputes (logprobs.score_tokens), so ratio pi_theta / pi_old = 1 on-policy
                up to the sampler's rounding (measured every step: rl/experience.py).
- `Rollout.packed()` -> the [prompt | response] layout every training forward reads.
- `fill_groups`, `decode_responses`: DAPO's dynamic sampling, and the texts the grader reads.

GRPO repeats each prompt for its G responses: the sampler prefills a repeated prompt once and gives
its G rows copies of its KV cache.

Per-row reproducible sampling (the "kv" sampler, and "hf" when seeds are given): the token of row i
at step t is drawn by inverting the CDF of softmax(z), z = logits / T (-inf outside the top-p nucleus):
    token = the first j with  sum_{k<=j} exp(z_k - max z)  >=  u * sum_k exp(z_k - max z),
    u = hash(seed_i, t) in (0, 1)
with a counter-based integer hash (2-round 32-bit avalanche mixes, computed vectorised in int64).
That is exact sampling from softmax(z) with ONE random number per row and step (Gumbel-max needs
one per vocabulary entry: (B, V) hashes and logs at every step), and because u depends only on
(seed_i, t), row i's sample depends only on seeds[i] and the model: not on the batch it shares, the
chunking, the slot it is decoded in, or which rank runs it. (Caveat: on GPUs the logits themselves
can differ in the last bits with batch shape and padding width; a near-tie can then flip a token. On
CPU fp32 we observe bitwise-equal runs.)
Without seeds, one 62-bit seed per row is drawn from torch's global RNG, so
`torch.manual_seed(s)` makes a call reproducible -- but two ranks with the same global seed draw
the same per-row seeds: pass `seeds` in distributed runs.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sampler import kv_cache
from sampler.kv_cache import left_pad, prefill
from modeling.logprobs import Packed
from plumbing import distributed

# ----------------------------------------------------------------------------------------------
# Stop tokens and turn markers


# Chat-template turn markers: (end of a turn, start of the next). A model that does not stop at the
# end of its turn writes an invented next turn, and the grader would read that turn's \boxed{}.
TURN_MARKERS = [("<|im_end|>", "<|im_start|>"), ("<|eot_id|>", "<|start_header_id|>"),
                ("<end_of_turn>", "<start_of_turn>"), ("<|end|>", "<|user|>")]


def _single_token_id(tokenizer, text):
    """The id of `text` if the tokenizer has it as one token, else None."""
    ids = tokenizer.convert_tokens_to_ids([text])
    unk = getattr(tokenizer, "unk_token_id", None)
    return ids[0] if ids and ids[0] is not None and ids[0] != unk else None


def eos_token_ids(model, tokenizer) -> list[int]:
    """Stop ids: generation_config.eos_token_id (int or list), tokenizer.eos_token_id, and the chat
    template's end-of-turn token. (Qwen2.5 base models' generation config stops on <|endoftext|>;
    their chat template ends a turn with <|im_end|>.)"""
    ids = []
    gen = getattr(getattr(model, "module", model), "generation_config", None)
    template = getattr(tokenizer, "chat_template", None) or ""
    turn_end = [_single_token_id(tokenizer, end) for end, _ in TURN_MARKERS if end in template]
    for e in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None), turn_end):
        if e is None:
            continue
        for i in e if isinstance(e, (list, tuple)) else [e]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an EOS")
    return ids


def turn_starts(tokenizer) -> list[str]:
    """Start-of-turn markers of the tokenizer's chat template: a response that contains one ran on
    into a turn of its own (counted by train.py as new_turn_frac)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return [start for end, start in TURN_MARKERS if end in template and start in template]


# ----------------------------------------------------------------------------------------------
# The rollout container


@dataclass(frozen=True)
class SampleSpec:
    """How responses are decoded, shared by training rollouts and held-out evaluation."""
    max_new_tokens: int
    eos_ids: list
    pad_id: int
    sampler: str = "kv"                # "kv" (our KV-cache loop) or "hf" (model.generate)
    batch_size: int | None = None      # rows decoded at once (the one pass's slots, or a chunk), at most
    weights_dtype: torch.dtype | None = None  # of the gathered decoding copy of a sharded policy
    kv_budget: int = 0                 # KV-cache positions (rows at once x (prompt + new)); 0 = no cap
    compile_decode: bool = False       # the one pass's decode step compiled (decode.CapturedStep)
    kv_fits: bool = False              # kv_budget is what fits (--kv-budget 0 on CUDA): `refit` per pass

    @classmethod
    def make(cls, model, tokenizer, max_new_tokens, sampler, batch_size, kv_budget, bf16, opt=None,
             compile_decode=False):
        """The spec of a training run: stop ids from the model and tokenizer; on CUDA a kv_budget
        of 0 means what fits in the free GPU memory (kv_budget_that_fits), on CPU no cap."""
        fits = kv_budget == 0 and next(model.parameters()).is_cuda
        if fits:
            kv_budget = kv_cache.kv_budget_that_fits(model, opt, bf16, batch_size, max_new_tokens)
        return cls(max_new_tokens, eos_token_ids(model, tokenizer), tokenizer.pad_token_id, sampler,
                   batch_size, torch.bfloat16 if bf16 else None, kv_budget, compile_decode, fits)

    def refit(self, decoder) -> "SampleSpec":
        """The budget sized again from the memory free now beside `decoder` (made): the set-up's figure
        goes stale (Adam's state arrives at the first step, the allocator fragments, an evaluation)."""
        if not self.kv_fits:
            return self
        return replace(self, kv_budget=kv_cache.kv_budget_that_fits(   # (bf16: weights_dtype, as make)
            decoder, None, self.weights_dtype is not None, self.batch_size, self.max_new_tokens))

    def rows_per_call(self, longest_prompt) -> int | None:
        """Rows decoded at once (sampler/kv_cache.py's slots; chunks where the one pass does not apply):
        batch_size, capped so rows x (prompt + new tokens) <= kv_budget."""
        if not self.kv_budget:
            return self.batch_size
        fit = max(1, self.kv_budget // (longest_prompt + self.max_new_tokens))
        return min(fit, self.batch_size) if self.batch_size else fit


@dataclass
class Rollout:
    prompt_ids: torch.LongTensor  # (B, P) LEFT-padded with pad_id
    prompt_mask: torch.LongTensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.LongTensor  # (B, R) RIGHT-padded with pad_id
    response_mask: torch.LongTensor  # (B, R) 1 on generated tokens, final EOS included
    logprobs: torch.FloatTensor  # (B, R) float32 log p(token) under log_softmax(logits/T); 0 on pads
    finished: torch.BoolTensor  # (B,) ended with an EOS (False = truncated at max_new_tokens)

    @property
    def lengths(self) -> torch.LongTensor:
        return self.response_mask.sum(1)

    def to(self, device) -> "Rollout":
        return Rollout(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def take(self, idx) -> "Rollout":
        """Rows `idx` (an index tensor, list or slice)."""
        return Rollout(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def packed(self) -> "Packed":
        """The one [left-padded prompt | right-padded response] layout every forward uses."""
        return Packed(input_ids=torch.cat([self.prompt_ids, self.response_ids], 1),
                      attention_mask=torch.cat([self.prompt_mask, self.response_mask], 1),
                      prompt_tok_mask=self.prompt_mask[:, 1:] * self.prompt_mask[:, :-1],
                      P=self.prompt_ids.shape[1],
                      lengths=list(zip(self.prompt_mask.sum(1).tolist(), self.response_mask.sum(1).tolist())))


def cat_rollouts(ros: list["Rollout"], pad_id) -> "Rollout":
    """Concatenate Rollouts of different widths (prompts stay left-padded, responses right-padded)."""
    if len(ros) == 1:
        return ros[0]
    return Rollout(
        prompt_ids=_cat_padded([r.prompt_ids for r in ros], pad_id, left=True),
        prompt_mask=_cat_padded([r.prompt_mask for r in ros], 0, left=True),
        response_ids=_cat_padded([r.response_ids for r in ros], pad_id, left=False),
        response_mask=_cat_padded([r.response_mask for r in ros], 0, left=False),
        logprobs=_cat_padded([r.logprobs for r in ros], 0.0, left=False),
        finished=torch.cat([r.finished for r in ros]))


@dataclass
class Graded:
    """One sampling round: G responses per prompt (consecutive rows), graded."""
    ro: Rollout
    rewards: torch.Tensor           # (B,) what enters the advantages (shaping included)
    acc: torch.Tensor               # (B,) 0/1 correctness
    prompt_idx: list                # (B / G,) training-set index of each group's prompt
    counts: dict                    # grader outcome counts
    keep: torch.Tensor | None = None  # (B / G,) bool: groups worth training on (DAPO)


@dataclass
class KeptGroups:
    ro: Rollout
    rewards: torch.Tensor           # (B,)
    valid: torch.Tensor             # (B,) 1 for kept groups, 0 for filler
    prompt_idx: list                # (B / G,)


def fill_groups(rounds: list[Graded], need, G, pad_id) -> KeptGroups:
    """DAPO's dynamic sampling: from the sampling rounds, keep up to `need` groups marked `keep`,
    then fill the remaining slots with dropped groups marked invalid (valid = 0: they carry no
    loss), so every rank ends with the same number of rows."""
    chosen, filler = [], []
    for ri, rd in enumerate(rounds):
        for g in range(len(rd.prompt_idx)):
            (chosen if rd.keep[g] else filler).append((ri, g))
    slots = chosen[:need] + filler[:max(0, need - len(chosen))]
    n_valid = min(need, len(chosen))
    valid = torch.tensor([1.0] * n_valid + [0.0] * (need - n_valid))
    ros, rws, gidx = [], [], []
    for ri, g in slots:
        rd, sel = rounds[ri], torch.arange(g * G, (g + 1) * G)
        ros.append(rd.ro.take(sel)), rws.append(rd.rewards[sel]), gidx.append(rd.prompt_idx[g])
    return KeptGroups(cat_rollouts(ros, pad_id), torch.cat(rws), valid.repeat_interleave(G), gidx)


def decode_responses(tokenizer, ro: Rollout) -> list[str]:
    lens = ro.response_mask.sum(1).tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(ro.response_ids.tolist(), lens)],
                                  skip_special_tokens=True)


def new_turns(tokenizer, ro: Rollout) -> int:
    """How many responses contain a start-of-turn marker of the chat template (see turn_starts)."""
    starts = turn_starts(tokenizer)
    if not starts:
        return 0
    lens = ro.response_mask.sum(1).tolist()
    texts = tokenizer.batch_decode([ids[:n] for ids, n in zip(ro.response_ids.tolist(), lens)])
    return sum(any(m in t for m in starts) for t in texts)


_FNV_OFFSET, _FNV_PRIME, _M64 = 1469598103934665603, 1099511628211, 0xFFFFFFFFFFFFFFFF


def row_seed(*parts) -> int:
    """A 62-bit sampling seed named by its parts (FNV-1a over 64-bit words), the same on every
    rank and in every process (training rollouts: seed, step, round, prompt, sample). A str part
    enters as the FNV-1a hash of its UTF-8 bytes."""
    h = _FNV_OFFSET
    for x in parts:
        if isinstance(x, str):
            x = _fnv_bytes(x.encode())
        h = ((h ^ (int(x) & _M64)) * _FNV_PRIME) & _M64
    return h >> 2


def _fnv_bytes(b: bytes) -> int:
    h = _FNV_OFFSET
    for byte in b:
        h = ((h ^ byte) * _FNV_PRIME) & _M64
    return h


# ----------------------------------------------------------------------------------------------
# Counter-based noise and token choice

_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective 32-bit avalanche mix (hash-prospector's 2-round [16 21f0aaad 15 735a2d97 15]).
    x: int64 tensor in [0, 2^32). Both multipliers are < 2^31, so x * c < 2^63 never overflows
    int64 and the integer ops give the same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _row_keys(seeds, device) -> torch.LongTensor:
    """Any Python ints -> (B,) int64 32-bit keys that use all 64 bits of each seed."""
    s = [((int(v) & (2**64 - 1)) ^ (1 << 63)) - (1 << 63) for v in seeds]  # wrap to signed int64
    s = torch.tensor(s, dtype=torch.int64, device=device)
    lo, hi = s & _M32, (s >> 32) & _M32
    return _mix32(_mix32(lo ^ 0x243F6A88) ^ hi)


def _uniform(keys, step) -> torch.DoubleTensor:
    """(B,) float64 u in (0, 1): u_i = hash(key_i, step_i), a pure function of the row's key and
    step. step: an int (every row's) or a (B,) int64 tensor (each row's own, sampler/kv_cache.py); both give
    the same bits (step < 2^31: step * 0x9E3779B9 < 2^63 fits int64)."""
    step = torch.full_like(keys, step) if isinstance(step, int) else step
    k = _mix32(keys ^ _mix32((step * 0x9E3779B9 + 0x85EBCA6B) & _M32))
    return (_mix32(k ^ 0x1B873593).to(torch.float64) + 0.5) * 2.0**-32


def _nucleus_mask(z, top_p: float) -> torch.BoolTensor:
    """(B, V) True on the top-p nucleus of softmax(z): the most likely tokens until their mass
    reaches top_p (the token that crosses top_p is kept; at least one token always)."""
    sz, si = z.sort(dim=-1, descending=True)
    p = sz.softmax(-1)
    keep = (p.cumsum(-1) - p) < top_p  # mass strictly before this token < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, si, keep)


def _choose(logits, temperature: float, top_p: float, keys, step):
    """logits (B, V) float32 -> (tokens (B,), logprobs (B,) float32 under log_softmax(logits/T)).
    T == 0 is greedy and reports log-probs at T = 1. Sampling inverts the CDF at u = hash(key, step);
    step: an int, or (B,) each row's own."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - logits.logsumexp(-1)
    z = logits / temperature
    top = z.max(-1, keepdim=True).values                                 # (B, 1)
    w = (z if top_p >= 1.0 else z.masked_fill(~_nucleus_mask(z, top_p), float("-inf"))) - top
    cdf = w.exp_().cumsum(-1)                                            # (B, V) unnormalised
    u = (_uniform(keys, step) * cdf[:, -1].double()).float()             # (B,) in (0, total)
    tok = torch.searchsorted(cdf, u[:, None]).squeeze(1).clamp_max(z.shape[-1] - 1)
    lse = top.squeeze(1) + (cdf[:, -1].log() if top_p >= 1.0 else (z - top).exp().sum(-1).log())
    return tok, z.gather(-1, tok[:, None]).squeeze(-1) - lse


# ----------------------------------------------------------------------------------------------
# Sampling


def _lockstep(model) -> bool:
    """FSDP2-sharded models all-gather parameters inside forward, so every rank must make the same
    number of forward calls: decoding then stops only when all ranks are done."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _any_across_ranks(flag: bool, device) -> bool:
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _sample_kv(model, prompts, keys, *, max_new_tokens, eos, pad_id, temperature, top_p,
               lockstep, progress):
    """The chunked KV-cache loop (models sampler/kv_cache.py's one pass does not decode): one
    left-padded chunk's prompts through the HF forward into a preallocated cache (prefill), then one
    decode.HFStep per token. Which rows are done is read every kv_cache.CHECK_EVERY steps (a host
    sync; under lockstep a collective, at the same steps on every rank); finished rows are dropped
    from the batch (and cache) at a check once they are a quarter of it, so long tails decode at
    small batch."""
    dev = next(model.parameters()).device
    pre = prefill(model, prompts, pad_id, max_new_tokens)
    ids, mask, logits, step = pre.ids, pre.mask, pre.logits, pre.step
    B = ids.shape[0]
    next_pos = pre.pos[:, -1] + 1  # (B,)
    del pre

    resp = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    lps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)
    rmask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    active = torch.arange(B, device=dev)  # rows of the full chunk still in the decoding batch
    steps = range(max_new_tokens)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="sample", leave=False)
    for t in steps:
        tok, lp = _choose(logits, temperature, top_p, keys[active], t)
        alive = ~done[active]
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        resp[active, t] = tok
        lps[active, t] = torch.where(alive, lp, torch.zeros_like(lp))
        rmask[active, t] = alive.long()
        done[active] = done[active] | (alive & torch.isin(tok, eos))
        if t == max_new_tokens - 1:
            break
        if (t + 1) % kv_cache.CHECK_EVERY:
            logits = step(tok, next_pos)
            next_pos = next_pos + 1
            continue
        n_alive = len(active) - sum(kv_cache.host_read(done[active]))
        if not (_any_across_ranks(n_alive > 0, dev) if lockstep else n_alive > 0):
            break
        if 0 < n_alive <= 0.75 * active.numel():
            # Compact: drop finished rows from batch, positions, the step's mask and every cache layer.
            sel = (~done[active]).nonzero().squeeze(1)
            active, next_pos, tok = active[sel], next_pos[sel], tok[sel]
            step.select(sel)
        logits = step(tok, next_pos)
        next_pos = next_pos + 1
    return ids, mask, resp, rmask, lps, done


def _sample_hf(model, prompts, keys, *, max_new_tokens, eos, pad_id, temperature, top_p,
               lockstep, seeded):
    """Reference sampler through model.generate. With seeds, sampling is done by a logits
    processor that makes the same draw as "kv" (temperature, top-p, inverse CDF at the row's
    uniform) followed by greedy choice, so both samplers draw identical tokens; without seeds, HF's
    own sampling."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    dev = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, dev)
    P = ids.shape[1]
    eos_list = eos.tolist()
    cfg = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_list, pad_token_id=pad_id,
               return_dict_in_generate=True, output_logits=True)
    procs = LogitsProcessorList()
    if temperature == 0:
        cfg.update(do_sample=False)
    elif seeded:

        class _Seeded(LogitsProcessor):  # the "kv" sampler's draw, then greedy picks it
            def __call__(self, input_ids, scores):
                tok = _choose(scores.float(), temperature, top_p, keys, input_ids.shape[1] - P)[0]
                return torch.full_like(scores, float("-inf")).scatter_(-1, tok[:, None], 0.0)

        cfg.update(do_sample=False)
        procs.append(_Seeded())
    else:
        cfg.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**cfg),
                         logits_processor=procs, synced_gpus=lockstep)
    resp = out.sequences[:, P:]
    R = resp.shape[1]
    # Mask = up to and including the first EOS (pad may equal eos, so never test `!= pad`).
    is_eos = torch.isin(resp, eos)
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(resp[:, 0], R))
    rmask = (torch.arange(R, device=dev)[None, :] <= first[:, None]).long()
    T = 1.0 if temperature == 0 else temperature
    lps = torch.stack([(lg.float() / T).log_softmax(-1).gather(-1, resp[:, t : t + 1]).squeeze(-1)
                       for t, lg in enumerate(out.logits)], 1) if R else resp.float()
    resp = resp.masked_fill(rmask == 0, pad_id)
    return ids, mask, resp, rmask, lps * rmask, is_eos.any(1)


def _cat_padded(ts, pad, left: bool):
    W = max(t.shape[1] for t in ts)
    padded = []
    for t in ts:
        extra = W - t.shape[1]
        padded.append(F.pad(t, (extra, 0) if left else (0, extra), value=pad) if extra else t)
    return torch.cat(padded, 0)


def _check_sample_args(prompts, max_new_tokens, temperature, top_p, seeds, sampler, batch_size):
    if sampler not in ("kv", "hf"):
        raise ValueError(f"sampler must be 'kv' or 'hf', got {sampler!r}")
    if not prompts:
        raise ValueError("prompts is empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (nothing to condition on)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts (need one per row)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def sample_with(model, prompts, spec: SampleSpec, *, temperature, seeds, top_p=1.0) -> Rollout:
    """Seeded rows: the plain sampler (`generate`), or `sample_by_spec` (--sampler kv's one pass)."""
    if spec.sampler == "hf" and seeds is not None and temperature > 0:
        return generate(model, prompts, seeds, spec, temperature, top_p)
    return sample_by_spec(model, prompts, spec, temperature, seeds, top_p)


def sample_by_spec(model, prompts, spec: SampleSpec, temperature, seeds, top_p) -> Rollout:
    """`sample` with the spec's sizes: --sampler kv's one pass; greedy (temperature 0) or unseeded rows
    for either sampler. --kv-budget 0 on CUDA: the budget of the memory free now (SampleSpec.refit)."""
    spec = spec.refit(model)
    return sample(model, prompts, max_new_tokens=spec.max_new_tokens, eos_ids=spec.eos_ids,
                  pad_id=spec.pad_id, temperature=temperature, top_p=top_p, seeds=seeds, sampler=spec.sampler,
                  batch_size=spec.rows_per_call(max(map(len, prompts))), compile_decode=spec.compile_decode)


@torch.no_grad()
def generate(model, prompts, seeds, spec: SampleSpec, temperature, top_p) -> Rollout:
    """The plain sampler: HF generate, --gen-batch rows at a time, each token drawn by `_choose` at the
    row's own uniform u = hash(seed, t) (the module doc), so a row's response depends on its seed alone."""
    model, n = distributed.unwrap(model), spec.batch_size or len(prompts)
    return cat_rollouts([generate_chunk(model, prompts[s:s + n], seeds[s:s + n], spec, temperature, top_p)
                         for s in range(0, len(prompts), n)], spec.pad_id)


def generate_chunk(model, prompts, seeds, spec: SampleSpec, temperature, top_p) -> Rollout:
    """One call of model.generate: the rows left-padded, responses up to and including their EOS."""
    from transformers import GenerationConfig, LogitsProcessor

    dev, rows = next(model.parameters()).device, [torch.tensor(p) for p in prompts]
    ids = pad_sequence(rows, batch_first=True, padding_value=spec.pad_id, padding_side="left").to(dev)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left").to(dev)
    keys, P = _row_keys(seeds, dev), ids.shape[1]

    class Draw(LogitsProcessor):                          # our draw; generate's greedy choice then takes it
        def __call__(self, input_ids, scores):
            tok = _choose(scores.float(), temperature, top_p, keys, input_ids.shape[1] - P)[0]
            return torch.full_like(scores, float("-inf")).scatter_(-1, tok[:, None], 0.0)
    cfg = GenerationConfig(max_new_tokens=spec.max_new_tokens, eos_token_id=spec.eos_ids, do_sample=False,
                           pad_token_id=spec.pad_id, return_dict_in_generate=True, output_logits=True)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, logits_processor=[Draw()])
    resp = out.sequences[:, P:]                                         # (b, R)
    is_eos = torch.isin(resp, torch.tensor(spec.eos_ids, device=dev))   # (pad may equal an EOS id)
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), resp.shape[1])
    rmask = (torch.arange(resp.shape[1], device=dev)[None, :] <= first[:, None]).long()  # up to the EOS
    logits = torch.stack(out.logits, 1).float() / temperature            # (b, R, V)
    lps = logits.log_softmax(-1).gather(-1, resp[..., None]).squeeze(-1) * rmask
    return Rollout(ids, mask, resp.masked_fill(rmask == 0, spec.pad_id), rmask, lps, is_eos.any(1))


@torch.no_grad()
def sample(model, prompts, *, max_new_tokens, eos_ids, pad_id, temperature=1.0, top_p=1.0,
           seeds=None, sampler="kv", batch_size=None, progress=False, lockstep=None,
           compile_decode=False) -> Rollout:
    """Sample one response per prompt (repeat prompts G times for G samples each).

    prompts: list of token-id lists (no padding). eos_ids: int or list of ints. temperature 0 is
    greedy. top_p: nucleus filtering (1.0 = off); note the returned logprobs are NOT renormalised
    over the nucleus -- they are log_softmax(logits / T), what the training forward recomputes.
    seeds: one int per row (see the module docstring), or None for torch's global RNG.
    sampler: "kv" (own KV-cache loop, default) or "hf" (model.generate; keeps every step's
    logits in memory, a reference for tests and benchmarks). batch_size: rows decoded at once --
    "kv" on a model decode.LeanStep implements: the slots of sampler/kv_cache.py's one pass over all rows;
    otherwise chunks of this many rows, one after another. lockstep: keep ranks in step (auto:
    True for FSDP2-sharded models in a multi-rank process group; chunked); then every rank must
    call sample() with the same batch_size. compile_decode: the one pass's decode step compiled
    (decode.CapturedStep; a backend's name, or True: inductor). Returns a Rollout on the model's device.
    """
    _check_sample_args(prompts, max_new_tokens, temperature, top_p, seeds, sampler, batch_size)
    # DDP: decode with the inner module -- DDP's forward may broadcast buffers (a collective), and
    # ranks decode different numbers of steps. FSDP2 modules are the model itself.
    m = distributed.unwrap(model)
    dev = next(m.parameters()).device
    seeded = seeds is not None
    if seeds is None:
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()  # torch's global RNG
    keys = _row_keys(seeds, dev)
    eos = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), dtype=torch.long,
                       device=dev)
    if lockstep is None:
        lockstep = _lockstep(m)
    kw = dict(max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, temperature=temperature, top_p=top_p)
    if sampler == "kv" and kv_cache.supports(m, lockstep):
        ro = _one_pass(m, prompts, keys, batch_size, progress, compile_decode, **kw)
    else:
        ro = _chunked(m, prompts, keys, batch_size, sampler, lockstep, seeded, progress, **kw)
    width = int(ro.response_mask.sum(1).max())  # the longest response (a pass may run past it)
    return Rollout(ro.prompt_ids, ro.prompt_mask, *(x[:, :width] for x in (ro.response_ids, ro.response_mask,
                                                                            ro.logprobs)), ro.finished)


def _one_pass(model, prompts, keys, slot_count, progress, compile_decode, *, max_new_tokens, eos, pad_id,
              temperature, top_p):
    """Every row in one decoding pass over `slot_count` KV-cache slots (sampler/kv_cache.py)."""
    def choose(logits, row_keys, t):
        return _choose(logits, temperature, top_p, row_keys, t)

    d = kv_cache.decode_pass(model, prompts, keys, choose, slots=slot_count, max_new_tokens=max_new_tokens,
                          eos=eos, pad_id=pad_id, progress=progress, compile_decode=compile_decode)
    ids, mask = left_pad(prompts, pad_id, keys.device)
    R = max_new_tokens  # column R is the pass's scratch column
    return Rollout(ids, mask, d.tokens[:, :R], d.mask[:, :R], d.logprobs[:, :R], d.finished)


def _chunked(model, prompts, keys, batch_size, sampler, lockstep, seeded, progress, **kw) -> Rollout:
    """Rows in chunks of batch_size, one after another: "kv"'s chunked loop (_sample_kv) or "hf"."""
    dev, pad_id = keys.device, kw["pad_id"]
    bs = batch_size or len(prompts)
    starts = list(range(0, len(prompts), bs))
    n_chunks = len(starts)
    if lockstep:  # every rank must run as many chunks (forward calls) as the busiest one
        n_chunks = int(distributed.all_max(torch.tensor([n_chunks], device=dev)).item())
    parts = []
    for c in range(n_chunks):
        if c < len(starts):
            sl = slice(starts[c], starts[c] + bs)
            chunk, ck = prompts[sl], keys[sl]
        else:  # a dummy chunk that only keeps this rank's forwards in step; discarded
            chunk, ck = [[pad_id]], keys[:1]
        if sampler == "kv":
            res = _sample_kv(model, chunk, ck, lockstep=lockstep, progress=progress, **kw)
        else:
            res = _sample_hf(model, chunk, ck, lockstep=lockstep, seeded=seeded, **kw)
        if c < len(starts):
            parts.append(res)
    cols = list(zip(*parts))
    return Rollout(
        prompt_ids=_cat_padded(cols[0], pad_id, left=True),
        prompt_mask=_cat_padded(cols[1], 0, left=True),
        response_ids=_cat_padded(cols[2], pad_id, left=False),
        response_mask=_cat_padded(cols[3], 0, left=False),
        logprobs=_cat_padded(cols[4], 0.0, left=False),
        finished=torch.cat(cols[5], 0),
    )
