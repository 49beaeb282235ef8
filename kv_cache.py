"""The sampler's KV cache: the prompts of one sampler call run through the model's own forward
into a cache preallocated for the responses, which decode.py's step then extends one token at a time.

- `prefill` -> `Prefilled`: each distinct prompt once (GRPO repeats a prompt G times), its cache rows
  copied to the repeats, each row's first-token logits and the decode.stepper that continues.
- `kv_cache` / `PreallocatedLayer`: per layer one (rows, KV heads, capacity, head dim) buffer written
  in place (transformers' DynamicCache grows by concatenation, copying the whole cache at every
  token); finished rows are compacted away.
- `kv_dtype`, `kv_budget_from_memory`: the cache's dtype, and how many positions fit in the free GPU
  memory (rollout.SampleSpec's default cap on rows per sampler call).
- `left_pad`: token-id lists -> the left-padded (ids, mask) the model reads.

The sampler loop itself (token choice, seeds, stopping) is rollout.py, which imports this module.
"""

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

import decode
from logprobs import forward_kwargs, full_attention


@dataclass
class Prefilled:
    """The prompts of a sampler chunk run through the model: a KV cache with room for the
    responses, each row's next-token logits, and the decoding step that continues from there."""
    ids: torch.LongTensor               # (B, P) left-padded prompts, every row (copies included)
    mask: torch.LongTensor              # (B, P)
    pos: torch.LongTensor               # (B, P) positions (left pads shift nothing)
    logits: torch.FloatTensor           # (B, V) float32 logits of each row's first response token
    step: object                        # decode.stepper: (tok, pos) (B,) -> next (B, V) logits


def prefill(model, prompts, pad_id, max_new_tokens) -> Prefilled:
    """The sampler's first forward: each distinct prompt once (GRPO repeats a prompt G times) into
    a preallocated cache of prompt + max_new_tokens positions, then the cache rows copied to the
    prompt's repeats."""
    dev = next(model.parameters()).device
    distinct, copy_of = _distinct(prompts)
    ids, mask = left_pad(distinct, pad_id, dev)  # (U, P): as wide as all of `prompts`
    cache_kw, has_keep = forward_kwargs(model)
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


def kv_cache(config, capacity, dtype=None):
    """A KV cache of `capacity` positions per row in `dtype` (None: the first write's), preallocated
    at the first write and then written in place: transformers' DynamicCache grows by
    concatenation, copying the whole cache at every generated token. Models with sliding-window or
    other non-full-attention layers get a DynamicCache."""
    if not full_attention(config):
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
        self.v_buf = value_states.new_empty(B, H, self.capacity, value_states.shape[-1],
                                            dtype=self.dtype or key_states.dtype)
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


def kv_budget_from_memory(config, dtype, fraction=0.4, reserve_bytes=0) -> int:
    """KV-cache positions that fit in `fraction` of the free GPU memory, less `reserve_bytes` still
    to be allocated: each position holds K and V of every layer, num_key_value_heads x head_dim
    values each, in `dtype` (the cache's: kv_dtype)."""
    free = max(0, torch.cuda.mem_get_info()[0] - reserve_bytes)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return int(fraction * free // per_position)


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


def _distinct(prompts):
    """-> (the distinct prompts in first-seen order, for each prompt the index of its copy there).
    GRPO's G responses per prompt repeat each prompt G times: prefilling it once is G x less work."""
    index = {}
    copy_of = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], copy_of
