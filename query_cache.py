"""The Query-KL reference (method.md §3): per-token log-probs of every training prompt under the
reference (= initial) policy, computed once before RL. With it, ERPO needs no reference model:
Query-KL compares the policy's prompt log-probs (from the training forward) against this cache, and
the paper's query weights read the cached prompt NLLs (method.md §4).

Saved as query_cache.pt in the run folder with a `meta` record of what it was built from; a
resumed run must reuse it (its policy is no longer the reference), a fresh run always rebuilds.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

import distributed
import faults
import rollout


@dataclass
class QueryCache:
    logp: list[torch.Tensor]   # per prompt: (T_i - 1,) float32 log p_ref(x_t | x_<t), t = 2..T_i
    nll: torch.Tensor          # (N,) s_i = -l_ref(q_i), the reference NLL of the whole prompt
    nll_mean: float            # its mean over the training set (the paper weights' s-bar)

    @classmethod
    def from_logp(cls, logp):
        nll = torch.stack([-x.sum() for x in logp])
        return cls(logp, nll, nll.mean().item())

    def ref_logp(self, prompt_idx, group_size, width) -> torch.Tensor:
        """(len(prompt_idx) * G, width) reference prompt log-probs, right-aligned like the
        prompt slice of rollout.Packed (each prompt repeated for its G responses)."""
        return rollout.right_align([self.logp[i] for i in prompt_idx for _ in range(group_size)], width)


def cache_meta(model_path, data_path, template, temperature, prompt_ids) -> dict:
    """What a cache depends on; a resumed run checks it matches."""
    return {"model": model_path, "data": data_path, "template": template, "temperature": temperature,
            "n": len(prompt_ids), "prompts_sha1": hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()}


@torch.no_grad()
def build(model, prompt_ids, pad_id, temperature, device, batch=64) -> list[torch.Tensor]:
    """-> list over prompts of 1-D float32 tensors: log p_ref(x_t | x_<t) for t = 2..T. Each rank
    scores a strided share, then the shares are gathered."""
    mine, _ = distributed.strided_share(len(prompt_ids))  # repeats only overwrite a cache entry alike
    out = []
    for s in tqdm(range(0, len(mine), batch), desc="query-KL reference cache", disable=not distributed.is_main(),
                  leave=False):
        rows = [prompt_ids[i] for i in mine[s:s + batch]]
        ids, mask = rollout.left_pad(rows, pad_id, device)
        logp, _ = rollout.token_logprobs(model, ids, mask, temperature)  # (b, P-1)
        P = ids.shape[1]
        out += [(mine[s + i], logp[i, P - len(r):].float().cpu()) for i, r in enumerate(rows)]
        faults.point("query-cache")
    distributed.reshard(model)  # the cache is built through the training wrapper (FSDP2): see reshard
    cache = [None] * len(prompt_ids)
    for i, t in distributed.all_gather_list(out):
        cache[i] = t
    return cache


def load_or_build(path, meta, model, prompt_ids, pad_id, temperature, device, batch, resuming) -> QueryCache:
    if resuming:
        if not os.path.exists(path):
            raise SystemExit(f"error: resuming but {path} is missing; the reference cache must come "
                             "from the initial model, so start a fresh run")
        saved = torch.load(path)
        if saved["meta"] != meta:
            raise SystemExit(f"error: {path} was built for {saved['meta']}, this run is {meta}; "
                             "use a fresh --out or delete the cache")
        return QueryCache.from_logp(saved["logp"])
    logp = build(distributed.unwrap(model), prompt_ids, pad_id, temperature, device, batch)
    if distributed.is_main():  # written whole, then renamed: a kill never leaves half a cache
        torch.save({"meta": meta, "logp": logp}, path + ".tmp")
        os.replace(path + ".tmp", path)
    return QueryCache.from_logp(logp)
