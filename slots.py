"""The sampler's one pass per rank: every row of a sampler call decoded by one loop over the slots of
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
  own length needs a varlen kernel (flash-attn's kv-cache API), not torch's SDPA.
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

import decode
import kv_cache

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
                progress=False) -> Decoded:
    """Decode every row of `prompts` in one pass over `slots` slots of prompt + max_new_tokens
    columns (the longest prompt's). keys: (N,) the rows' noise keys; choose(logits, keys, t) ->
    (tokens, float32 log-probs), (S,) each, t each slot's step. -> Decoded, on the model's device."""
    dev, N, R = next(model.parameters()).device, len(prompts), max_new_tokens
    S, C = min(slots or N, N), max(map(len, prompts)) + R
    step = decode.LeanStep(model, kv_cache.slot_cache(model, S, C))
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
                tok, pos = _compact(step, s, tok, pos, free)
            free = free[:N - queued] if len(free) >= max(1, len(pos) // REFILL_FRACTION) else []
        logits = step(tok, s.pos, max(pos) + 1)
        s.pos, pos = (s.pos + 1).clamp_(max=C - 1), [min(p + 1, C - 1) for p in pos]
        if free:
            logits[free] = _refill(model, step, s, pos, prompts, free, queued, pad_id)
            queued, last_admit = queued + len(free), out.steps
            bar.update(len(free))
    bar.close()
    return out


def _refill(model, step, s: Slots, pos: list[int], prompts, free: list[int], first: int, pad_id):
    """Admit rows first, first + 1, ... into the `free` slots: their prompts prefilled into the
    slots, their state reset. -> (len(free), V) their first-token logits."""
    rows = list(range(first, first + len(free)))
    for i, r in zip(free, rows):
        pos[i] = len(prompts[r])
    dev = s.row.device
    s.set(torch.tensor(free, device=dev), row=torch.tensor(rows, device=dev),
          pos=torch.tensor([pos[i] for i in free], device=dev), t=0, done=False)
    return kv_cache.admit(model, step.cache, [prompts[r] for r in rows], free, pad_id)


def _compact(step, s: Slots, tok, pos: list[int], free: list[int]):
    """Drop the finished slots (`free`) from the batch and the cache. -> (tok, pos) of the others."""
    gone = set(free)
    keep = [i for i in range(len(pos)) if i not in gone]
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
