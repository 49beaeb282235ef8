"""The sampler's KV cache: prompts run through the model's own forward into a cache preallocated for
the responses, which a decoding step then extends one token at a time.

- `slot_cache` / `SlotLayer` / `admit`: the one pass per rank (`decode_pass` below, Llama/Qwen2
  through decode.LeanStep): S slots of prompt + max_new_tokens columns each, zeroed once; `admit` prefills
  rows into free slots -- each distinct prompt once (GRPO repeats a prompt G times), written into
  its rows' slots unpadded, at columns [0, P) -- and returns their first-token logits.
- `prefill` -> `Prefilled`: the chunked loop's first forward (models LeanStep does not implement):
  the chunk's distinct prompts left-padded into a `kv_cache`, copied to the repeats, and the
  decode.HFStep that continues.
- `kv_cache` / `PreallocatedLayer`: per layer one (rows, KV heads, capacity, head dim) buffer written
  in place (transformers' DynamicCache grows by concatenation, copying the whole cache at every
  token); finished rows are compacted away.
- `kv_dtype`, `kv_budget_from_memory`, `decode_reserve`: the cache's dtype, how many positions fit
  in the free GPU memory (rollout.SampleSpec's default cap on the rows decoded at once: what fits
  beside what the rollout phase still allocates, less memory_plan.KV_MARGIN), and the pass's own
  allocations beside the cache.
- `left_pad`: token-id lists -> the left-padded (ids, mask) the model reads.

The sampler loops themselves (token choice, seeds, stopping) are rollout.py's; the refills are below.

The sampler's one pass per rank: every row of a sampler call decoded by one loop over the slots of
one KV cache (continuous batching), for the models decode.LeanStep implements (Llama/Qwen2 with
unsharded weights: decode.supports). rollout.sample calls `decode_pass`; how a token is chosen from
the logits (temperature, top-p, the per-row seeded noise) is rollout's, passed in as `choose`.

Why one pass: the KV cache holds at most --kv-budget positions, S = kv_budget // (longest prompt +
max_new_tokens) rows at once. Decoding the rows in chunks of S, each chunk until its longest row
ends, costs ceil(N / S) full-length passes (the paper's 512 rows per GPU, 128 at a time: 4 x 3,072
decode steps), although most rows end long before the limit. Here the S rows are slots: when rows
end, their slots are refilled with queued rows, so no row waits for another row's tail, and the pass
takes about (total tokens / S) + one row's length steps instead of ceil(N / S) x the longest row's.
(The other design, one batch of all N rows whose cache grows for the survivors, cannot keep N x
(prompt + max_new_tokens) under the budget while every row may still reach the limit.)

- A slot's row: its prompt in cache columns [0, P) (no left padding), its tokens after it; a token's
  position is its column. Each step writes every slot's K/V at its own column and masks the columns
  beyond it (decode.LeanStep). Cost: every slot reads the columns up to the LONGEST slot's length,
  while a chunk's rows all read their own chunk's length (its longest prompt + the steps so far). Once
  slots are refilled at different times the longest slot is near prompt + max_new_tokens most of the
  time, so a step reads up to ~(P + R) / (P + R / 2) ~ 1.6x the KV bytes of an average chunk step
  (P = 1,024, R = 3,072); at 7B x 128 slots x 4,096 columns that is ~30 GB per step against 15 GB of
  weights: the pass saves steps (~1/3 of them), not bytes per step. Reading each slot only up to its
  own length needs a varlen kernel (flash-attn's kv-cache API), not torch's SDPA. (--compile-decode's
  decode.CapturedStep reads more: the longest slot's columns rounded up to an eighth of the capacity.)
- Admission: at a check (below), free slots are refilled from the queue once >= 1/REFILL_FRACTION
  of the slots are free (or every slot is). Each refill is one prefill forward (kv_cache.admit: each
  distinct prompt once, so a group's G rows admitted together share it): refilling 1/8 at a time
  costs a forward per S/8 rows ended while slots idle for at most ~S/8 + CHECK_EVERY slot-steps.
  Once the queue is empty, finished slots are compacted away when they are a quarter of the batch,
  so the last rows' tails decode at a small batch (as the chunked loop does).
- Host reads: which slots are done is read once every CHECK_EVERY steps (`host_read`, one device sync;
  the decode steps and token choices in between read nothing back), not at every token. Finished rows
  decode on until the check, their tokens written to a scratch column and dropped.
- Seeds: the noise of row i's token t is u = hash(key_i, t) with the row's own step t (rollout's
  `_uniform`), so a seeded row's tokens do not depend on its slot, its neighbours or when it was
  admitted.
"""

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from modeling.logprobs import forward_kwargs, full_attention
from plumbing import memory_plan, time_check
from sampler import decode


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
        self.k_all, self.v_all = k_buf, v_buf  # the whole buffers; k_buf, v_buf: the slots in use
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
        """Keep slots `indices`, moved in place to the first len(indices) slots: the buffers keep
        their addresses (a captured decode step's, decode.CapturedStep)."""
        n = len(indices)
        for whole in (self.k_all, self.v_all):
            whole[:n] = whole[indices]       # (the gather copies first: overlapping rows are safe)
        self.k_buf, self.v_buf = self.k_all[:n], self.v_all[:n]


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


def kv_bytes_per_position(config, dtype) -> int:
    """One cache position: K and V of every layer, num_key_value_heads x head_dim values each, in
    `dtype` (the cache's: kv_dtype)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def kv_budget_from_memory(config, dtype, reserve_bytes=0) -> int:
    """KV-cache positions that fit in the free GPU memory now, less `reserve_bytes` the rollout
    phase will still allocate beside the cache, less memory_plan.KV_MARGIN of the card: the rule
    the dry-run's plan uses too (memory_plan.kv_positions_that_fit)."""
    torch.cuda.empty_cache()            # the allocator's cached free blocks count as free: released first
    free, card = torch.cuda.mem_get_info()
    per = kv_bytes_per_position(config, dtype)
    n = memory_plan.kv_positions_that_fit(free, card, reserve_bytes, per)
    time_check.BUDGET.update(positions=n, gib=n * per / 2 ** 30, free_gib=free / 2 ** 30)  # (logged per step)
    return n


# Bytes per (slot, vocabulary entry) of one decode step's logits beside the cache: the float32
# logits (and the bf16 lm_head output they are upcast from) and rollout._choose's temporaries --
# z = logits / T, the nucleus's sorted values, int64 indices, softmax and cumsum, the CDF.
LOGIT_BYTES = 32


def decode_reserve(config, compute_bytes, rows) -> dict[str, int]:
    """What the one pass allocates beside its cache, by name: one prefill forward's working set
    (at most PREFILL_TOKENS distinct prompt tokens through one layer's MLP and attention) and the
    logits of one decode step of `rows` slots (LOGIT_BYTES each per vocabulary entry)."""
    h, inter = config.hidden_size, config.intermediate_size
    return {"prefill": PREFILL_TOKENS * (3 * inter + 4 * h) * compute_bytes,
            "logits": rows * config.vocab_size * LOGIT_BYTES}


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


# ----------------------------------------------------------------------------------------------
# The one pass per rank: every row of a sampler call decoded over the slots of one KV cache

CHECK_EVERY = 8        # decode steps between host reads of which slots are done
REFILL_FRACTION = 8    # refill once >= 1/8 of the slots are free
COMPACT_FRACTION = 4   # with nothing queued, drop finished slots once they are >= 1/4 of them


def supports(model, lockstep: bool) -> bool:
    """The one pass needs LeanStep's model and a rank that may stop on its own (FSDP2-sharded
    models decode in lockstep, in rollout's chunked loop)."""
    return not lockstep and decode.supports(model)


def host_read(done: torch.BoolTensor) -> list[bool]:
    """The loop's one read of device values (a sync on a GPU): which slots are done."""
    return done.tolist()


@dataclass
class Slots:
    """Each slot's state on the device, (S,) each."""
    row: torch.LongTensor              # the row it decodes
    pos: torch.LongTensor              # its next K/V column = the position of its last chosen token
    t: torch.LongTensor                # the row's step: which of its response tokens is chosen next
    done: torch.BoolTensor             # the row has ended (EOS or max_new_tokens): decodes on, ignored

    def set(self, idx, **values):
        for name, v in values.items():
            getattr(self, name)[idx] = v

    def select(self, idx):
        for name in ("row", "pos", "t", "done"):
            setattr(self, name, getattr(self, name)[idx])


@dataclass
class Decoded:
    """What the pass wrote, per row (N rows; column max_new_tokens is the scratch column)."""
    tokens: torch.LongTensor           # (N, R + 1) pad_id where no token
    mask: torch.LongTensor             # (N, R + 1) 1 on the row's tokens, its final EOS included
    logprobs: torch.FloatTensor        # (N, R + 1) of the chosen tokens; 0 elsewhere
    finished: torch.BoolTensor         # (N,) ended with an EOS
    steps: int = 0                     # tokens chosen per slot (the pass's length; decode steps + 1)

    @classmethod
    def empty(cls, N, R, pad_id, device):
        return cls(torch.full((N, R + 1), pad_id, dtype=torch.long, device=device),
                   torch.zeros((N, R + 1), dtype=torch.long, device=device),
                   torch.zeros((N, R + 1), dtype=torch.float32, device=device),
                   torch.zeros(N, dtype=torch.bool, device=device))

    def record(self, s: Slots, tok, lp, eos, limit: int):
        """Write each live slot's token at its row's step t (ended rows: at the scratch column
        `limit`, dropped), then mark the rows that end here: an EOS, or their limit-th token."""
        alive = ~s.done
        at = s.row * (limit + 1) + torch.where(alive, s.t, limit)          # (row, column) in a flat view
        self.tokens.view(-1).index_copy_(0, at, tok)
        self.logprobs.view(-1).index_copy_(0, at, lp)
        self.mask.view(-1).index_fill_(0, at, 1)
        hit = alive & torch.isin(tok, eos)
        self.finished[s.row] |= hit
        s.done |= hit | (s.t >= limit - 1)
        s.t = (s.t + 1).clamp_(max=limit)


def decode_pass(model, prompts, keys, choose, *, slots, max_new_tokens, eos, pad_id,
                progress=False, compile_decode=False) -> Decoded:
    """Decode every row of `prompts` in one pass over `slots` slots of prompt + max_new_tokens
    columns (the longest prompt's). keys: (N,) the rows' noise keys; choose(logits, keys, t) ->
    (tokens, float32 log-probs), (S,) each, t each slot's step. compile_decode: the step through
    torch.compile (decode.CapturedStep; True: inductor, or a backend's name). -> Decoded, on the
    model's device."""
    dev, N, R = next(model.parameters()).device, len(prompts), max_new_tokens
    S, C = min(slots or N, N), max(map(len, prompts)) + R
    cache = slot_cache(model, S, C)
    record = time_check.Pass(N, S, C, _cache_bytes(cache), bool(compile_decode))   # what this rank got
    time_check.PASSES.append(record)
    step = decode.CapturedStep(model, cache, "inductor" if compile_decode is True else compile_decode) \
        if compile_decode else decode.LeanStep(model, cache)
    out, z = Decoded.empty(N, R, pad_id, dev), torch.zeros(S, dtype=torch.long, device=dev)
    s = Slots(z.clone(), z.clone(), z.clone(), torch.zeros(S, dtype=torch.bool, device=dev))
    pos = [0] * S                                           # s.pos on the host: the columns a step reads
    logits, queued, last_admit = _refill(model, step, s, pos, prompts, list(range(S)), 0, pad_id), S, 0
    bar = _progress(N, S, progress)
    while True:
        tok, lp = choose(logits, keys[s.row], s.t)
        logits = None                                         # (not held through the next step)
        out.record(s, tok, lp, eos, R)
        out.steps += 1
        if queued == N and out.steps - last_admit >= R:       # every row has reached its limit
            break
        free = []
        if out.steps % CHECK_EVERY == 0:
            free = [i for i, d in enumerate(host_read(s.done)) if d]
            if queued == N and len(free) == len(pos):
                break
            if queued == N and len(free) >= len(pos) / COMPACT_FRACTION:
                tok, pos = _compact(step, s, tok, pos, free, bool(compile_decode))
            free = free[:N - queued] if len(free) >= max(1, len(pos) // REFILL_FRACTION) else []
        logits = step(tok, s.pos, max(pos) + 1)
        s.pos, pos = (s.pos + 1).clamp_(max=C - 1), [min(p + 1, C - 1) for p in pos]
        if free:
            logits[free] = _refill(model, step, s, pos, prompts, free, queued, pad_id)
            queued, last_admit = queued + len(free), out.steps
            bar.update(len(free))
    bar.close()
    record.steps, record.fell_back = out.steps, bool(compile_decode) and bool(decode.FELL_BACK)
    return out



def _cache_bytes(cache) -> int:
    """The slot cache's K and V buffers, every layer (a test's stand-in cache: none)."""
    return sum(b.numel() * b.element_size() for c in getattr(cache, "layers", ()) for b in (c.k_all, c.v_all))

def _refill(model, step, s: Slots, pos: list[int], prompts, free: list[int], first: int, pad_id):
    """Admit rows first, first + 1, ... into the `free` slots: their prompts prefilled into the
    slots, their state reset. -> (len(free), V) their first-token logits."""
    rows = list(range(first, first + len(free)))
    for i, r in zip(free, rows):
        pos[i] = len(prompts[r])
    dev = s.row.device
    s.set(torch.tensor(free, device=dev), row=torch.tensor(rows, device=dev),
          pos=torch.tensor([pos[i] for i in free], device=dev), t=0, done=False)
    return admit(model, step.cache, [prompts[r] for r in rows], free, pad_id)


def _compact(step, s: Slots, tok, pos: list[int], free: list[int], bucketed=False):
    """Drop the finished slots (`free`) from the batch and the cache (bucketed: some kept, so that
    a power of two of slots is left, decode.bucket_rows). -> (tok, pos) of the slots kept."""
    gone = set(free)
    keep = [i for i in range(len(pos)) if i not in gone]
    if bucketed:                                          # a CapturedStep's: shapes change rarely
        keep += free[:decode.bucket_rows(len(keep), len(pos)) - len(keep)]
    if len(keep) == len(pos):
        return tok, pos
    idx = torch.tensor(keep, device=tok.device)
    step.select(idx)
    s.select(idx)
    return tok[idx], [pos[i] for i in keep]


class _NoBar:
    n = 0

    def update(self, k):
        self.n += k

    def close(self):
        pass


def _progress(total, first, show):
    """Rows admitted so far, of `total`."""
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=first, desc="sample", leave=False)


# ----------------------------------------------------------------------------------------------
# --kv-budget 0 on CUDA: the positions that fit beside what the rollout phase still allocates


def _local(p):
    """This rank's part of a parameter (its shard under FSDP2)."""
    return p.to_local() if hasattr(p, "to_local") else p


def kv_budget_that_fits(model, opt, bf16, batch_size, max_new_tokens) -> int:
    """--kv-budget 0 on CUDA: the KV-cache positions that fit in the free GPU memory measured now,
    less what the rollout phase will still allocate beside the cache (rollout_reserve, and the one
    pass's own kv_cache.decode_reserve: its prefill and the logits of as many slots as can be --
    batch_size, at most one per max_new_tokens + 1 positions), less memory_plan.KV_MARGIN of the
    card (kv_cache.kv_budget_from_memory)."""
    p = next(model.parameters())
    dtype = torch.bfloat16 if bf16 else p.dtype                      # the cache's: kv_cache.kv_dtype
    held = sum(rollout_reserve(model, opt, bf16).values())
    rows = kv_budget_from_memory(model.config, dtype, held) // (max_new_tokens + 1)
    rows = min(rows, batch_size) if batch_size else rows
    own = decode_reserve(model.config, 2 if bf16 else p.element_size(), rows)
    return kv_budget_from_memory(model.config, dtype, held + sum(own.values()))


def rollout_reserve(model, opt, bf16) -> dict[str, int]:
    """Bytes a training run's rollout phase holds beside the KV cache that are not allocated yet
    when the spec is made (after the policy, the reference and the Query-KL cache are), by name:
    - "adam": the optimizer `opt`'s exp_avg and exp_avg_sq (this rank's shards), allocated at its
      first step -- 0 once it has state, or without an optimizer;
    - "decoding copy": the model the sampler decodes with, made at each rollout: under FSDP2 the
      whole policy gathered (distributed.gathered, in bf16 or the default dtype), under LoRA the
      base with the adapters merged (lora.merged, in bf16 or as it is);
    - "autocast casts": otherwise, under bf16 autocast, the bf16 copies of the float32 matmul
      weights (every nn.Linear's) the decoding steps make, kept for the autocast region (the step)."""
    params = dict(model.named_parameters())
    fsdp = any(hasattr(p, "to_local") for p in params.values())
    lora = any("lora_" in n for n in params)
    out = {"adam": 0, "decoding copy": 0, "autocast casts": 0}
    if opt is not None and not opt.state:
        out["adam"] = sum(2 * _local(p).numel() * p.element_size()
                          for g in opt.param_groups for p in g["params"])
    if fsdp:
        copy_bytes = 2 if bf16 else torch.get_default_dtype().itemsize
        out["decoding copy"] = sum(p.numel() for p in params.values()) * copy_bytes
    elif lora:
        out["decoding copy"] = sum(p.numel() * (2 if bf16 else p.element_size())
                                   for n, p in params.items() if "lora_" not in n)
    elif bf16:
        out["autocast casts"] = sum(2 * p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                                    for p in m.parameters(recurse=False) if p.dtype == torch.float32)
    return out
