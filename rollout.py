"""Rollouts: load a policy, sample G responses per prompt, and score tokens.

Used by train.py (training rollouts, the policy forward) and evaluate.py (benchmark sampling).
Works the same for the embedded ~1M-parameter Qwen2 model on CPU (fp32) and for Qwen2.5-Math-7B
on GPUs (bf16, possibly wrapped in DDP or sharded with FSDP2 `fully_shard`): prompts and every
scoring pass go through the model's normal forward; only the sampler's one-token decode steps use
decode.py's lean step over the same weights (for Llama/Qwen2; the normal forward otherwise).

Three pieces:
- `load_policy`   -> (model, tokenizer), with the transformers-5 tokenizer pitfall handled.
- `sample`        -> `Rollout`: our own KV-cache decoding loop ("kv", default) or HF `generate`
                     ("hf", a reference). Returns the sampled tokens, masks, and the log-prob of
                     each sampled token under log_softmax(logits / T) -- the same quantity the
                     training forward recomputes, so ratio pi_theta / pi_old = 1 on-policy.
- `token_logprobs`-> one forward over [prompt | response]: per-token log-probs (and entropy) on
                     logits / T in float32, chunked along the sequence so a 152k vocabulary never
                     needs several (B, L, V) float32 copies.

GRPO repeats each prompt for its G responses. Both the sampler and `score_tokens(group=G)` run a
repeated prompt through the model once and give its G rows copies of its KV cache: causal
attention makes that the same math as G full rows (`shared_prompt_scores`).

Per-row reproducible sampling (the "kv" sampler, and "hf" when seeds are given): the token of row i
at step t is drawn by inverting the CDF of softmax(z), z = logits / T (-inf outside the top-p nucleus):
    token = the first j with  sum_{k<=j} exp(z_k - max z)  >=  u * sum_k exp(z_k - max z),
    u = hash(seed_i, t) in (0, 1)
with a counter-based integer hash (2-round 32-bit avalanche mixes, computed vectorised in int64).
That is exact sampling from softmax(z) with ONE random number per row and step (Gumbel-max needs
one per vocabulary entry: (B, V) hashes and logs at every step), and because u depends only on
(seed_i, t), row i's sample depends only on seeds[i] and the model: not on the batch it shares,
the chunking, or which rank runs it. (Caveat: on GPUs the logits themselves can differ in the last bits with batch shape
and padding width; a near-tie can then flip a token. On CPU fp32 we observe bitwise-equal runs.)
Without seeds, one 62-bit seed per row is drawn from torch's global RNG, so
`torch.manual_seed(s)` makes a call reproducible -- but two ranks with the same global seed draw
the same per-row seeds: pass `seeds` in distributed runs.
"""

import inspect
import json
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

import decode
import distributed

# ----------------------------------------------------------------------------------------------
# Loading


def _default_attn_implementation(dtype) -> str:
    # flash-attn is an optional GPU extra (requirements-gpu.txt); it does not build on CPU boxes,
    # and it computes only in bf16/fp16: float32 weights (--dtype float32) get SDPA. (Float32 master
    # weights under bf16 autocast are fine: autocast hands flash-attn bf16 q/k/v.)
    mixed = dtype == torch.float32 and torch.is_autocast_enabled("cuda")
    if torch.cuda.is_available() and (dtype in (torch.bfloat16, torch.float16) or mixed):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except Exception:
            pass
    return "sdpa"


def _sdpa_float32(module, query, key, value, attention_mask, **kw):
    """transformers' SDPA attention computed in float32 even under bf16 autocast. On this CPU
    (AVX512-BF16) torch's fused attention is slow in bf16, its backward most: forward + backward of
    a 64 x 150-token micro-batch of the tiny model took 0.66 s with bf16 SDPA, 0.40 s with this,
    0.61 s all in float32, while the projections around it gain from bf16. Float32 SDPA also keeps
    the fused kernel's memory (no L x L probabilities saved, as eager attention would)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        out, w = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kw)
    return out.to(query.dtype), w


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("sdpa_float32", _sdpa_float32)
    AttentionMaskInterface.register("sdpa_float32", sdpa_mask)  # else padding would not be masked


_register_attention()


def load_tokenizer(path):
    """The tokenizer of a model folder or hub id, with a pad token and left padding (see
    load_policy), or OSError / ValueError with a message naming the folder.

    transformers 5.x: AutoTokenizer in a folder with a Qwen2 config.json returns Qwen2Tokenizer
    and silently replaces a custom tokenizer's normalizer/pre-tokenizer (method.md §9). A tokenizer
    saved as a plain PreTrainedTokenizerFast is therefore loaded as exactly that; anything else
    (e.g. Qwen2.5-Math's own Qwen2Tokenizer) goes through AutoTokenizer. In a folder without any
    tokenizer file AutoTokenizer builds an empty one (every prompt encodes to no tokens) instead of
    failing: such a folder is refused here."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # What a saved tokenizer is made of: the fast one's file, or a slow one's vocabulary.
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in vocab_files):
        raise OSError(f"{path} holds no tokenizer (none of {', '.join(vocab_files)}): copy the "
                      "tokenizer files of the model it was trained from into it")
    tok_json = os.path.join(str(path), "tokenizer.json")
    cfg_json = os.path.join(str(path), "tokenizer_config.json")
    try:
        cls = None
        if os.path.isfile(tok_json) and os.path.isfile(cfg_json):
            with open(cfg_json) as f:
                cls = json.load(f).get("tokenizer_class")
        # transformers 5.x saves a PreTrainedTokenizerFast (an alias) as "TokenizersBackend".
        if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError:
        raise                           # transformers' own message (no such folder or hub id)
    except Exception as e:              # a truncated tokenizer.json: JSON's or the tokenizers library's error
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read the tokenizer in {path}: {why}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(path, *, device="cpu", dtype=None, attn_implementation=None, shard=None):
    """Load (model, tokenizer) from a HF folder (or hub id on machines that have the hub).

    device: a torch device, or "auto" (CUDA when available).
    dtype: bfloat16 on CUDA devices, float32 otherwise, unless given ("auto" = not given).
    attn_implementation: "flash_attention_2" when CUDA is available and flash_attn imports, else
    "sdpa", unless given. The tokenizer (load_tokenizer) gets a pad token (eos if missing) and
    left padding, which is what batched decoding needs; it is loaded first, so a folder without
    one fails in a second, not after the weights are read.
    shard: a function that shards a model in place (FSDP2's fully_shard, distributed.wrap_model);
    then the model is built on the meta device, sharded, and each rank reads only its shard of each
    tensor from the safetensors files: no rank ever holds the whole model.
    Bad folders raise OSError or ValueError (train.py and evaluate.py turn them into one line).
    """
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype == "auto":
        dtype = None
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if attn_implementation is None:
        attn_implementation = _default_attn_implementation(dtype) if device.type == "cuda" else "sdpa"
    tokenizer = load_tokenizer(path)
    if shard is not None:
        model = _load_sharded(path, device, dtype, attn_implementation, shard)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation).to(device)
    return model, tokenizer


def _load_sharded(path, device, dtype, attn_implementation, shard):
    """Meta-device model -> shard() -> materialise each rank's shards -> fill them tensor by tensor
    from the (memory-mapped) safetensors files, each rank keeping only its slice."""
    import glob

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not os.path.isdir(path):  # a hub id, on machines that have the hub
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model = shard(model)
    model.to_empty(device=device)
    for parent in list(model.modules()):  # non-persistent buffers (RoPE inv_freq) were never materialised
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, name, type(child)(config=child.config).to(device))
    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    p = params.get(name)  # (absent: e.g. the lm_head of a tied model)
                    if p is None:
                        continue
                    full = f.get_tensor(name).to(device=device, dtype=p.dtype)
                    if isinstance(p, DTensor):  # every rank has the file: no communication
                        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                        p = p.to_local()
                    p.copy_(full)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model


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
    batch_size: int | None = None      # rows per sampler call, at most
    weights_dtype: torch.dtype | None = None  # of the gathered decoding copy of a sharded policy
    kv_budget: int = 0                 # KV-cache positions per sampler call (rows x (prompt + new)); 0 = no cap

    @classmethod
    def make(cls, model, tokenizer, max_new_tokens, sampler, batch_size, kv_budget, bf16, opt=None):
        """The spec of a training run: stop ids from the model and tokenizer; on CUDA a kv_budget
        of 0 means a share of the free GPU memory (kv_budget_from_memory), on CPU no cap. The
        free memory is measured now, before the optimizer `opt` has its Adam state (allocated at
        its first step) and before bf16 autocast has cast the float32 weights once (it keeps
        those copies for the region): both are set aside first."""
        if kv_budget == 0 and next(model.parameters()).is_cuda:
            local = sum(_local(p).numel() for p in model.parameters())
            adam = 2 * 4 * local if opt is not None and not opt.state else 0
            casts = 2 * local if bf16 and not any(hasattr(p, "to_local") for p in model.parameters()) else 0
            kv_budget = kv_budget_from_memory(model.config, torch.bfloat16 if bf16 else next(model.parameters()).dtype,
                                              reserve_bytes=adam + casts)
        return cls(max_new_tokens, eos_token_ids(model, tokenizer), tokenizer.pad_token_id, sampler, batch_size,
                   torch.bfloat16 if bf16 else None, kv_budget)

    def rows_per_call(self, longest_prompt) -> int | None:
        """Rows decoded at once: batch_size, capped so rows x (prompt + new tokens) <= kv_budget."""
        if not self.kv_budget:
            return self.batch_size
        fit = max(1, self.kv_budget // (longest_prompt + self.max_new_tokens))
        return min(fit, self.batch_size) if self.batch_size else fit


def _local(p):
    """This rank's part of a parameter (its shard under FSDP2)."""
    return p.to_local() if hasattr(p, "to_local") else p


def kv_budget_from_memory(config, dtype, fraction=0.4, reserve_bytes=0) -> int:
    """KV-cache positions that fit in `fraction` of the free GPU memory, less `reserve_bytes` still
    to be allocated: each position holds K and V of every layer, num_key_value_heads x head_dim
    values each, in `dtype` (the cache's: kv_dtype)."""
    free = max(0, torch.cuda.mem_get_info()[0] - reserve_bytes)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return int(fraction * free // per_position)


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


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward and the width of their trimmed layout (Packed.trimmed): decided on the
    host from Packed.lengths, so a micro-batch loop reads nothing back from the device."""
    rows: torch.Tensor                 # (n,) row indices into the Packed
    prompt_len: int                    # the rows' longest prompt (the trimmed layout's P, >= 1)
    response_len: int                  # their longest response (>= 1)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)


@dataclass
class Packed:
    """A rollout row is [left-padded prompt | right-padded response], width P + R. One forward
    over it gives both the response log-probs (policy loss) and the prompt log-probs (Query-KL,
    method.md §3). Position j of a token_logprobs output scores token j+1, so the prompt slice
    [:, :P-1] scores the prompt tokens after the first one (prompt_tok_mask needs the previous
    token to be a real prompt token too) and the response slice is [:, P-1:]."""
    input_ids: torch.LongTensor        # (B, P+R)
    attention_mask: torch.LongTensor   # (B, P+R)
    prompt_tok_mask: torch.LongTensor  # (B, P-1)
    P: int
    lengths: list[tuple[int, int]] | None = None  # host copy: (prompt, response) tokens of each row

    def rows(self, sl) -> "Packed":
        lengths = None if self.lengths is None else self.lengths[sl]
        return Packed(self.input_ids[sl], self.attention_mask[sl], self.prompt_tok_mask[sl], self.P, lengths)

    def micro_batch(self, rows: list[int]) -> MicroBatch:
        """Rows as a MicroBatch, its widths from the host lengths."""
        return MicroBatch(torch.tensor(rows, device=self.input_ids.device),
                          max(1, max(self.lengths[i][0] for i in rows)), max(1, max(self.lengths[i][1] for i in rows)))

    def trimmed(self, mb) -> tuple["Packed", slice, slice]:
        """The rows of a MicroBatch (or an index tensor: widths then read from the mask) without the
        columns that are padding in all of them (a shorter forward), and which columns of the
        full-width (B, P-1) prompt and (B, R) response score arrays the trimmed rows' scores cover.
        Positions come from the attention mask, so a row's scores do not depend on how much
        padding surrounds it."""
        if not isinstance(mb, MicroBatch):
            mask = self.attention_mask[mb]
            mb = MicroBatch(mb, max(1, int(mask[:, :self.P].sum(1).max())), max(1, int(mask[:, self.P:].sum(1).max())))
        idx, p, r = mb.rows, mb.prompt_len, mb.response_len
        mask = self.attention_mask[idx]
        cols = slice(self.P - p, self.P + r)
        return (Packed(self.input_ids[idx][:, cols], mask[:, cols], self.prompt_tok_mask[idx][:, self.P - p:self.P - 1], p),
                slice(self.P - p, self.P - 1), slice(0, r))


@dataclass
class TokenScores:
    response: torch.Tensor             # (B, R) log p of each response token (on logits / T)
    prompt: torch.Tensor               # (B, P-1) log p of prompt tokens 2..P (mask: prompt_tok_mask)
    entropy: torch.Tensor | None       # (B, R) entropy of each response position, or None


def score_tokens(model, packed: Packed, temperature, with_entropy=False, group=1, checked=False) -> TokenScores:
    """One forward over [prompt | response] -> response and prompt log-probs (and entropy).
    group = G > 1: the rows come in consecutive groups of G that repeat one prompt (GRPO's G
    responses), and each prompt runs once (shared_prompt_scores), unless a group's prompts differ or
    the model has sliding-window layers (whose cache keeps only a window of the prompt). checked:
    the caller has verified shares_prompts already (a host read; train.py does it once per step)."""
    if group > 1 and _full_attention(distributed.unwrap(model).config) and (checked or shares_prompts(packed, group)):
        return shared_prompt_scores(model, packed, temperature, with_entropy, group)
    logp, ent = token_logprobs(model, packed.input_ids, packed.attention_mask, temperature, with_entropy)
    P = packed.P
    return TokenScores(logp[:, P - 1:], logp[:, :P - 1], None if ent is None else ent[:, P - 1:])


def shares_prompts(packed: Packed, G) -> bool:
    """Rows come in consecutive groups of G with the same (left-padded) prompt tokens."""
    B, P = packed.input_ids.shape[0], packed.P
    if B % G:
        return False
    ids = packed.input_ids[:, :P].view(B // G, G, P)
    return bool((ids == ids[:, :1]).all())


def shared_prompt_scores(model, packed: Packed, temperature, with_entropy, G) -> TokenScores:
    """score_tokens for groups of G rows with one prompt each: the U = B / G prompts run through the
    model once, filling a KV cache; copied G times, it serves the responses' forward. Causal
    attention makes this the same math as B full rows (a prompt's states never see its response),
    for (U P + B R) / (B (P + R)) of the work: half of it here (short prompts, short answers), less
    where responses dwarf prompts. Gradients flow through both forwards (the cache copies sum
    theirs back into the prompt's). The prompt pass uses the unwrapped module: DDP sees the one
    forward per backward it expects, and its gradient hooks still fire once per parameter."""
    ids, mask, P = packed.input_ids, packed.attention_mask, packed.P
    B = ids.shape[0]
    first = torch.arange(0, B, G, device=ids.device)                   # (U,) one row per group
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)                      # (B, P+R) as in token_logprobs
    inner = distributed.unwrap(model)
    cache_kw, _ = _forward_kwargs(inner)
    cache = DynamicCache(config=inner.config)
    plogits = inner(input_ids=ids[first, :P], attention_mask=mask[first, :P], position_ids=pos[first, :P],
                    use_cache=True, **{cache_kw: cache}).logits        # (U, P, V)
    cache.batch_repeat_interleave(G)                                    # (B, Hkv, P, D) per layer
    rlogits = model(input_ids=ids[:, P:], attention_mask=mask, position_ids=pos[:, P:],
                    use_cache=True, **{cache_kw: cache}).logits        # (B, R, V)
    chunk = _logprob_chunk(B, rlogits.shape[-1])
    prompt, _ = _TokenLogprob.apply(plogits, ids[first, 1:P], float(temperature), chunk, False)  # (unsliced: see _TokenLogprob)
    # Response token 0 is scored by the prompt's last position, tokens 1.. by the responses' own.
    logits = torch.cat([plogits[:, -1:].repeat_interleave(G, 0), rlogits[:, :-1]], 1)  # (B, R, V)
    response, ent = _TokenLogprob.apply(logits, ids[:, P:], float(temperature), chunk, bool(with_entropy))
    return TokenScores(response, prompt.repeat_interleave(G, 0), ent)


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


def right_align(seqs: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack 1-D tensors right-aligned into (B, width) (zeros on the left), matching the
    left-padded prompt layout (e.g. cached prompt log-probs next to Packed's prompt slice)."""
    out = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        s = s[-width:] if len(s) > width else s
        if len(s):
            out[i, width - len(s):] = s
    return out


_FNV_OFFSET, _FNV_PRIME, _M64 = 1469598103934665603, 1099511628211, 0xFFFFFFFFFFFFFFFF


def row_seed(*parts) -> int:
    """A 62-bit sampling seed named by its parts (FNV-1a over 64-bit words), the same on every
    rank and in every process: training rollouts seed a row by (seed, step, round, prompt,
    sample), evaluate.py a sample by (salt, benchmark, problem id, temperature, index). A str part
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


def _uniform(keys, step: int) -> torch.DoubleTensor:
    """(B,) float64 u in (0, 1): u_i = hash(key_i, step), a pure function of the row's key."""
    k = _mix32(keys ^ _mix32(torch.full_like(keys, (step * 0x9E3779B9 + 0x85EBCA6B) & _M32)))
    return (_mix32(k ^ 0x1B873593).to(torch.float64) + 0.5) * 2.0**-32


def _nucleus_mask(z, top_p: float) -> torch.BoolTensor:
    """(B, V) True on the top-p nucleus of softmax(z): the most likely tokens until their mass
    reaches top_p (the token that crosses top_p is kept; at least one token always)."""
    sz, si = z.sort(dim=-1, descending=True)
    p = sz.softmax(-1)
    keep = (p.cumsum(-1) - p) < top_p  # mass strictly before this token < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, si, keep)


def _choose(logits, temperature: float, top_p: float, keys, step: int):
    """logits (B, V) float32 -> (tokens (B,), logprobs (B,) float32 under log_softmax(logits/T)).
    T == 0 is greedy and reports log-probs at T = 1. Sampling inverts the CDF at u = hash(key, step)."""
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


def _forward_kwargs(model) -> tuple[str, bool]:
    """(name of the cache kwarg, whether logits_to_keep is supported). transformers 5.24 renamed
    past_key_values -> cache (the old name warns until 5.40)."""
    params = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    return cache_kw, "logits_to_keep" in params


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


def _distinct(prompts):
    """-> (the distinct prompts in first-seen order, for each prompt the index of its copy there).
    GRPO's G responses per prompt repeat each prompt G times: prefilling it once is G x less work."""
    index = {}
    copy_of = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], copy_of


def left_pad(prompts, pad_id, device):
    """Token-id lists -> (ids, mask) (B, P), left-padded so every row's last token is at P-1."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _full_attention(config) -> bool:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return all(t == "full_attention" for t in types) and not getattr(config, "use_sliding_window", False)


def kv_cache(config, capacity, dtype=None):
    """A KV cache of `capacity` positions per row in `dtype` (None: the first write's), preallocated
    at the first write and then written in place: transformers' DynamicCache grows by
    concatenation, copying the whole cache at every generated token. Models with sliding-window or
    other non-full-attention layers get a DynamicCache."""
    if not _full_attention(config):
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(capacity, dtype) for _ in range(config.num_hidden_layers)])


class PreallocatedLayer(DynamicLayer):
    """One layer's K and V in (B, heads, capacity, head_dim) buffers written in place; `keys` and
    `values` are views of the filled part. Row compaction (batch_select_indices) copies only the
    kept rows."""

    def __init__(self, capacity, dtype=None):
        super().__init__()
        self.capacity, self.length, self.dtype = capacity, 0, dtype

    def lazy_initialization(self, key_states, value_states):
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.k_buf = key_states.new_empty(B, H, self.capacity, D, dtype=self.dtype or key_states.dtype)
        self.v_buf = value_states.new_empty(B, H, self.capacity, value_states.shape[-1], dtype=self.dtype or key_states.dtype)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self.k_buf[:, :, self.length:end] = key_states
        self.v_buf[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self):
        return self.length

    def batch_select_indices(self, indices):
        if self.is_initialized:
            self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
            self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]


@dataclass
class Prefilled:
    """The prompts of a sampler chunk run through the model: a KV cache with room for the
    responses, each row's next-token logits, and the decoding step that continues from there."""
    ids: torch.LongTensor               # (B, P) left-padded prompts, every row (copies included)
    mask: torch.LongTensor              # (B, P)
    pos: torch.LongTensor               # (B, P) positions (left pads shift nothing)
    logits: torch.FloatTensor           # (B, V) float32 logits of each row's first response token
    step: object                        # decode.stepper: (tok, pos) (B,) -> next (B, V) logits


def kv_dtype(model) -> torch.dtype:
    """The KV cache's dtype: the compute dtype. Under bf16 autocast on CUDA that is bf16 (the
    prefill would leave float32 keys: RoPE multiplies by float32 tables), half the bytes of
    float32; on CPU under autocast float32 (LeanStep's attention is faster in float32 there, and
    memory is no concern); otherwise the weights' dtype."""
    p = next(model.parameters())
    dev = p.device.type
    if torch.is_autocast_enabled(dev):  # (fake tensors stand for a GPU's: memory_measure)
        return torch.get_autocast_dtype(dev) if dev == "cuda" or is_fake(p) else torch.float32
    return p.dtype


def prefill(model, prompts, pad_id, max_new_tokens) -> Prefilled:
    """The sampler's first forward: each distinct prompt once (GRPO repeats a prompt G times) into
    a preallocated cache of prompt + max_new_tokens positions, then the cache rows copied to the
    prompt's repeats."""
    dev = next(model.parameters()).device
    distinct, copy_of = _distinct(prompts)
    ids, mask = left_pad(distinct, pad_id, dev)  # (U, P): as wide as all of `prompts`
    cache_kw, has_keep = _forward_kwargs(model)
    keep = {"logits_to_keep": 1} if has_keep else {}
    cache = kv_cache(model.config, capacity=ids.shape[1] + max_new_tokens, dtype=kv_dtype(model))
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # (U, P) explicit positions: left pads shift nothing
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **{cache_kw: cache}, **keep)
    logits = out.logits[:, -1].float()  # only the last position is upcast
    del out
    if len(distinct) < len(prompts):  # a group's G rows share its prompt's cache rows, as copies
        copy_of = torch.tensor(copy_of, device=dev)
        ids, mask, pos, logits = ids[copy_of], mask[copy_of], pos[copy_of], logits[copy_of]
        cache.batch_select_indices(copy_of)
    return Prefilled(ids, mask, pos, logits, decode.stepper(model, cache, mask, cache_kw, keep))


def _sample_kv(model, prompts, keys, *, max_new_tokens, eos, pad_id, temperature, top_p,
               lockstep, progress):
    """Our KV-cache decoding loop for one left-padded chunk: the prompts through the HF forward
    into a preallocated cache (prefill), then one decode.stepper step per token. Finished rows are
    dropped from the batch (and cache) once they are a quarter of it, so long tails decode at small batch."""
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
    width = 0
    for t in steps:
        tok, lp = _choose(logits, temperature, top_p, keys[active], t)
        alive = ~done[active]
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        resp[active, t] = tok
        lps[active, t] = torch.where(alive, lp, torch.zeros_like(lp))
        rmask[active, t] = alive.long()
        done[active] = done[active] | (alive & torch.isin(tok, eos))
        width = t + 1
        if t == max_new_tokens - 1:
            break
        n_alive = int((~done[active]).sum())  # one host sync per step
        if not (_any_across_ranks(n_alive > 0, dev) if lockstep else n_alive > 0):
            break
        if 0 < n_alive <= 0.75 * active.numel():
            # Compact: drop finished rows from batch, positions, the step's mask and every cache layer.
            sel = (~done[active]).nonzero().squeeze(1)
            active, next_pos, tok = active[sel], next_pos[sel], tok[sel]
            step.select(sel)
        logits = step(tok, next_pos)
        next_pos = next_pos + 1
    return ids, mask, resp[:, :width], rmask[:, :width], lps[:, :width], done


def _sample_hf(model, prompts, keys, *, max_new_tokens, eos, pad_id, temperature, top_p,
               lockstep, seeded):
    """Reference sampler through model.generate. With seeds, sampling is done by a logits
    processor that makes the same draw as "kv" (temperature, top-p, inverse CDF at the row's
    uniform) followed by greedy choice, so both samplers draw identical tokens; without seeds, HF's own sampling."""
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
    """`sample` with the decoding settings of a SampleSpec."""
    return sample(model, prompts, max_new_tokens=spec.max_new_tokens, eos_ids=spec.eos_ids, pad_id=spec.pad_id,
                  temperature=temperature, top_p=top_p, seeds=seeds, sampler=spec.sampler,
                  batch_size=spec.rows_per_call(max(map(len, prompts))))


@torch.no_grad()
def sample(model, prompts, *, max_new_tokens, eos_ids, pad_id, temperature=1.0, top_p=1.0,
           seeds=None, sampler="kv", batch_size=None, progress=False, lockstep=None) -> Rollout:
    """Sample one response per prompt (repeat prompts G times for G samples each).

    prompts: list of token-id lists (no padding). eos_ids: int or list of ints. temperature 0 is
    greedy. top_p: nucleus filtering (1.0 = off); note the returned logprobs are NOT renormalised
    over the nucleus -- they are log_softmax(logits / T), what the training forward recomputes.
    seeds: one int per row (see the module docstring), or None for torch's global RNG.
    sampler: "kv" (own KV-cache loop, default) or "hf" (model.generate; keeps every step's
    logits in memory, a reference for tests and benchmarks). batch_size: decode rows in chunks
    of this many. lockstep: keep ranks in step (auto: True for FSDP2-sharded models in a
    multi-rank process group); then every rank must call sample() with the same batch_size.
    Returns a Rollout on the model's device.
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
        kw = dict(max_new_tokens=max_new_tokens, eos=eos, pad_id=pad_id, temperature=temperature,
                  top_p=top_p, lockstep=lockstep)
        if sampler == "kv":
            res = _sample_kv(m, chunk, ck, progress=progress, **kw)
        else:
            res = _sample_hf(m, chunk, ck, seeded=seeded, **kw)
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


# ----------------------------------------------------------------------------------------------
# Scoring: per-token log-probs (and entropy) of given sequences


class _TokenLogprob(torch.autograd.Function):
    """logp[b, l] = log_softmax(logits[b, l] / T)[targets[b, l]] in float32, plus the entropy of
    that distribution (no grad). Chunked along l in forward AND backward, saving only the
    (model-dtype) logits and the (B, L) log-normalisers, so no (B, L, V) float32 copy is ever
    held: backward recomputes softmax per chunk (d logp / d logits = (onehot - softmax) / T).
    targets (B, L) may be shorter than logits (B, L', V): positions >= L are not scored. That lets
    a caller pass the model's logits unsliced: the backward of a slice logits[:, :-1] would
    allocate a second zero-filled (B, L', V) gradient next to this one."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy):
        B, L = targets.shape
        logp = torch.empty((B, L), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            z = logits[:, s:e].float() / temperature  # (B, c, V) float32
            lse_c = torch.logsumexp(z, -1)
            lse[:, s:e] = lse_c
            logp[:, s:e] = z.gather(-1, targets[:, s:e, None]).squeeze(-1) - lse_c
            if with_entropy:  # H = lse - sum_j p_j z_j
                ent[:, s:e] = lse_c - (torch.exp(z - lse_c[..., None]) * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        if with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse = ctx.saved_tensors
        T, chunk, L = ctx.temperature, ctx.chunk, targets.shape[1]
        grad = torch.empty_like(logits)
        grad[:, L:].zero_()                     # unscored positions
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            z = logits[:, s:e].float() / T
            g = g_logp[:, s:e, None]  # (B, c, 1)
            gl = -torch.exp(z - lse[:, s:e, None]) * g
            gl.scatter_add_(-1, targets[:, s:e, None], g)
            grad[:, s:e] = (gl / T).to(grad.dtype)
        return grad, None, None, None, None


def _logprob_chunk(B, V, elems=2**26) -> int:
    """Positions per log-softmax chunk so that a (B, chunk, V) float32 block has <= elems elements."""
    return max(1, elems // max(1, B * V))


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=False,
                   chunk_elems=2**26):
    """One forward over prompt+response (left padding allowed).

    input_ids, attention_mask: (B, L). Returns (logp, entropy), each (B, L-1) float32, with
    logp[:, j] = log p(input_ids[:, j+1] | input_ids[:, :j+1]) under softmax(logits / T), and
    entropy[:, j] the entropy of that distribution (None unless with_entropy; never has grad).
    Positions whose target is padding carry garbage: mask them with attention_mask[:, 1:].
    Gradients flow through logp (wrap in torch.no_grad() when not needed). chunk_elems bounds the
    float32 working set (B * chunk * V elements) of the log-softmax.
    """
    if temperature <= 0:
        raise ValueError(f"token_logprobs needs temperature > 0, got {temperature}")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (B, L); got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("need sequences of length >= 2 to score any token")
    pos = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                   use_cache=False).logits  # (B, L, V) in the model dtype; the last scores nothing
    chunk = _logprob_chunk(logits.shape[0], logits.shape[2], chunk_elems)
    return _TokenLogprob.apply(logits, input_ids[:, 1:], float(temperature), chunk,
                               bool(with_entropy))
