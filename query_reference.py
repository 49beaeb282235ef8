"""The reference behind the Query-KL term (method.md §3): whose prompt log-probs the policy's are
compared with, KL(pi_theta(q) || pi_ref(q)) estimated by k3 over the prompt tokens.

Two implementations, chosen by --qkl-ref:
- "cache" (the paper): every training prompt scored once by the initial policy before RL
  (query_cache.py); no reference model is needed, and the paper's query weights read the same
  cached NLLs.
- "live" (the released code, AlibabaResearch/ERPO on ROLL): the reference model's forward over the
  step's prompts, every step. train.py's reference forward scores [prompt | response] rows anyway
  (for Policy-KL); its prompt slice is this reference, so the live reference costs no forward of
  its own when Policy-KL is measured, and one reference forward per step when it is not.
Both are the initial policy, so they give the same Query-KL up to rounding (a test).

A new reference is a subclass and a line in REFERENCES: it maps a step's `PromptBatch` to
reference log-probs of the same shape, may keep state (an EMA of the policy's scores, say), which
the checkpoint saves and --resume restores (`state_dict` / `load_state_dict`, one slot of state.pt),
and may update itself after each step (`after_step`). The metric `query_kl` always measures the
drift from the initial policy: a reference that is not the initial policy (`initial_policy =
False`) leaves the monitor on the reference model's prompt forward, or on the cache when no
reference model is loaded.
"""

from dataclasses import dataclass

import torch

import query_cache


@dataclass
class PromptBatch:
    """What a reference sees of one RL step (B rows: G consecutive rows per prompt)."""
    prompt_idx: list                   # (B / G,) training-set index of each group's prompt
    group_size: int                    # G
    width: int                         # P - 1: prompt log-prob columns, right-aligned (logprobs.Packed)
    policy_prompt: torch.Tensor        # (B, P-1) the rollout policy's prompt log-probs (pi_old)
    prompt_mask: torch.Tensor          # (B, P-1) prompt tokens of valid rows
    model_prompt: torch.Tensor | None  # (B, P-1) the reference model's, this step (None: none loaded)
    step: int                          # the RL step (0-based)


class QueryReference:
    """The interface: `prompt_logp` is the only method an RL step needs."""
    needs_model = False                # a reference model must be loaded (its prompt forward)
    initial_policy = True              # it is the initial policy: the query_kl monitor can use it

    @classmethod
    def build(cls, ctx: "Context") -> "QueryReference":
        """The reference of a run (ctx: what building it may use)."""
        return cls()

    def prompt_logp(self, batch: PromptBatch) -> torch.Tensor:
        """(B, P-1) reference log-probs of each row's prompt tokens, 0 where prompt_mask is 0."""
        raise NotImplementedError

    def after_step(self, batch: PromptBatch) -> None:
        """Called once per RL step after the update (state that follows the policy)."""

    def state_dict(self) -> dict:
        """What --resume needs to continue (tensors or plain values; saved in state.pt)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class CachedReference(QueryReference):
    """The paper's: each prompt's log-probs under the initial policy, computed before RL."""

    def __init__(self, cache: query_cache.QueryCache):
        self.cache = cache

    @classmethod
    def build(cls, ctx):
        return cls(ctx.cache())

    def prompt_logp(self, batch):
        ref = self.cache.ref_logp(batch.prompt_idx, batch.group_size, batch.width)
        return ref.to(batch.policy_prompt.device)


class LiveReference(QueryReference):
    """The released code's: the reference model's forward over this step's prompts."""
    needs_model = True

    def prompt_logp(self, batch):
        return batch.model_prompt


@dataclass
class Context:
    """What building a reference may use: `cache()` loads or builds the Query-KL cache once."""
    cache: object                      # () -> query_cache.QueryCache


# --qkl-ref name -> QueryReference class. A new reference registers here, or from outside
# (REFERENCES["ema"] = EmaReference: --qkl-ref's choices are this dict).
REFERENCES = {"cache": CachedReference, "live": LiveReference}


def monitor_logp(reference: QueryReference, loss_ref: torch.Tensor, batch: PromptBatch,
                 cache: query_cache.QueryCache | None) -> torch.Tensor:
    """The initial policy's prompt log-probs for the query_kl monitor: the loss's reference when it
    is the initial policy, else the reference model's forward, else the cache."""
    if reference.initial_policy:
        return loss_ref
    if batch.model_prompt is not None:
        return batch.model_prompt
    return CachedReference(cache).prompt_logp(batch)


def for_run(name: str, cache, weights: str, has_model: bool, state) -> tuple[QueryReference, object]:
    """The run's reference (--qkl-ref `name`) and the Query-KL cache if anything needs it: the
    reference itself, the paper's query weights (`weights` "paper": its NLLs), or the query_kl
    monitor of a reference that is not the initial policy when no reference model is loaded
    (`has_model`). cache: () -> query_cache.QueryCache, built or loaded on the first call. state:
    the checkpoint's (checkpoints.TrainState) on --resume, whose "query_reference" it restores."""
    built = []

    def once():
        if not built:
            built.append(cache())
        return built[0]
    reference = REFERENCES[name].build(Context(once))
    if weights == "paper" or (not reference.initial_policy and not has_model):
        once()
    if state is not None:
        reference.load_state_dict(state.extra.get("query_reference", {}))
    return reference, built[0] if built else None
