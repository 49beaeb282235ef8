"""The sampler's KV cache: prompts run through the model's own forward into a cache preallocated for
the responses, which a decoding step then extends one token at a time.

- `slot_cache` / `SlotLayer` / `admit`: the one pass per rank (slots.py, Llama/Qwen2 through
  decode.LeanStep): S slots of prompt + max_new_tokens columns each, zeroed once; `admit` prefills
  rows into free slots -- each distinct prompt once (GRPO repeats a prompt G times), written into
  its rows' slots unpadded, at columns [0, P) -- and returns their first-token logits.
- `prefill` -> `Prefilled`: the chunked loop's first forward (models LeanStep does not implement):
  the chunk's distinct prompts left-padded into a `kv_cache`, copied to the repeats, and the
  decode.HFStep that continues.
- `kv_cache` / `PreallocatedLayer`: per layer one (rows, KV heads, capacity, head dim) buffer written
  in place (transformers' DynamicCache grows by concatenation, copying the whole cache at every
  token); finished rows are compacted away.
- `kv_dtype`, `kv_budget_from_memory`: the cache's dtype, and how many positions fit in the free GPU
  memory (rollout.SampleSpec's default cap on the rows decoded at once).
- `left_pad`: token-id lists -> the left-padded (ids, mask) the model reads.

The sampler loops themselves (token choice, seeds, stopping, refills) are rollout.py and slots.py.
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
    step: decode.HFStep                 # (tok, pos) (B,) -> next (B, V) logits


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
    return Prefilled(ids, mask, pos, logits, decode.HFStep(model, cache, mask, cache_kw, keep))


def kv_cache(config, capacity, dtype=None, slots=0, device=None):
    """A KV cache of `capacity` positions per row in `dtype` (None: the first write's), preallocated
    at the first write and then written in place: transformers' DynamicCache grows by
    concatenation, copying the whole cache at every generated token. Models with sliding-window or
    other non-full-attention layers get a DynamicCache. slots > 0: the one pass's cache instead
    (SlotLayer), `slots` rows allocated now on `device`, zeroed."""
    if slots:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, config.num_key_value_heads, capacity, head_dim)
        return Cache(layers=[SlotLayer(torch.zeros(shape, dtype=dtype, device=device),
                                       torch.zeros(shape, dtype=dtype, device=device))
                             for _ in range(config.num_hidden_layers)])
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


@dataclass
class Admission:
    """Where `admit`'s prefill forward writes: admitted row i goes to slot `slots[i]`, from row
    `src[i]` of the forward's distinct prompts, column j of the slot from column `cols[i, j]` of the
    forward's (left-padded) width W: j + W - P_i, so the prompt starts at column 0."""
    slots: torch.LongTensor              # (n,)
    src: torch.LongTensor                # (n,)
    cols: torch.LongTensor               # (n, W), clamped to W - 1 past the prompt (never read)


class SlotLayer(DynamicLayer):
    """One layer's K and V for S slots: (S, KV heads, capacity, head dim) buffers, zeroed once so
    that columns no prompt or token has reached yet hold finite values (a masked score of 0 weight
    times a NaN would still be NaN). The HF forward runs on this cache only to prefill admitted
    prompts: `update` writes them into their slots and returns the prompts' own K/V, which is all
    a fresh prompt attends to. Decoding (decode.LeanStep) writes k_buf/v_buf itself."""

    def __init__(self, k_buf, v_buf):
        super().__init__()
        self.k_buf, self.v_buf, self.capacity = k_buf, v_buf, k_buf.shape[2]
        self.device, self.is_initialized, self.admission = k_buf.device, True, None

    def update(self, key_states, value_states, *args, **kwargs):
        a = self.admission
        for buf, new in ((self.k_buf, key_states), (self.v_buf, value_states)):
            # new[src, :, cols]: (n, W, H, D) -- the advanced indices' dims come first
            buf[a.slots, :, :a.cols.shape[1]] = new[a.src[:, None], :, a.cols].transpose(1, 2).to(buf.dtype)
        return key_states, value_states

    def get_seq_length(self):
        return 0                         # every prefill starts from an empty past

    def batch_select_indices(self, indices):
        self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]


def slot_cache(model, slots: int, capacity: int) -> Cache:
    """The one pass's KV cache for `model`: `slots` rows of `capacity` columns in kv_dtype(model)."""
    return kv_cache(model.config, capacity, kv_dtype(model), slots, next(model.parameters()).device)


# The slot cache is whole while admit prefills, so a prefill forward's working set adds to it: each
# forward takes distinct prompts of at most this many (padded) tokens, one at least. One 1,024-token
# prompt's MLP activations are ~0.14 GiB at 7B widths; 16 prompts at once (a full set of 128 slots'
# rows) took 2.3 GiB, by which the measured rollout peak rose over the chunked loop's.
PREFILL_TOKENS = 1024


def admit(model, cache, prompts, slots: list[int], pad_id) -> torch.FloatTensor:
    """Prefill `prompts` into `slots` of a slot_cache: each distinct prompt once through the HF
    forward (PREFILL_TOKENS at a time), its K/V written into the slots of all its rows at columns
    [0, P). -> (n, V) float32 logits of each row's first response token."""
    distinct, copy_of = _distinct(prompts)
    groups = _prefill_groups([len(p) for p in distinct], PREFILL_TOKENS)
    logits = None
    for group in groups:
        rows = [i for i, u in enumerate(copy_of) if u in group]
        part = _prefill_slots(model, cache, [distinct[u] for u in group], [slots[i] for i in rows],
                              [copy_of[i] - group.start for i in rows], pad_id)
        if len(groups) == 1:
            return part.float()
        if logits is None:  # in the model's logits dtype until every prefill is done (bf16: exact)
            logits = part.new_empty(len(prompts), part.shape[1])
        logits[torch.tensor(rows, device=part.device)] = part
    return logits.float()


def _prefill_groups(lengths, max_tokens) -> list[range]:
    """Consecutive runs of prompts whose left-padded batch holds at most max_tokens (one at least)."""
    groups, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        width = max(width, n)
        if i > start and (i - start + 1) * width > max_tokens:
            groups.append(range(start, i))
            start, width = i, n
    return groups + [range(start, len(lengths))]


def _prefill_slots(model, cache, distinct, slots, src, pad_id) -> torch.FloatTensor:
    """One prefill forward of `distinct` prompts; row i's K/V go to slot slots[i] from prompt src[i].
    -> (len(slots), V) logits (the model's dtype), in the order of slots."""
    dev = next(model.parameters()).device
    ids, mask = left_pad(distinct, pad_id, dev)  # (U, W)
    W, src = ids.shape[1], torch.tensor(src)
    lengths = torch.tensor([len(p) for p in distinct])[src]
    cols = (torch.arange(W)[None, :] + (W - lengths)[:, None]).clamp_max(W - 1)
    adm = Admission(torch.tensor(slots).to(dev), src.to(dev), cols.to(dev))
    for layer in cache.layers:
        layer.admission = adm
    cache_kw, has_keep = forward_kwargs(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                use_cache=True, **{cache_kw: cache}, **({"logits_to_keep": 1} if has_keep else {}))
    for layer in cache.layers:
        layer.admission = None
    return out.logits[:, -1][adm.src]


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
