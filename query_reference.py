"""The reference behind the Query-KL term (method.md §3): whose prompt log-probs the policy's are
compared with, KL(pi_theta(q) || pi_ref(q)) estimated by k3 over the prompt tokens.

Chosen by --qkl-ref:
- "cache" (the paper): every training prompt scored once by the initial policy before RL
  (query_cache.py); no reference model is needed, and the paper's query weights read the same
  cached NLLs.
- "live" (what the released code means to do, AlibabaResearch/ERPO on ROLL): the reference model's
  forward over the step's prompts, every step. train.py's reference forward scores [prompt |
  response] rows anyway (for Policy-KL); its prompt slice is this reference, so the live reference
  costs no forward of its own when Policy-KL is measured, and one reference forward per step when it
  is not. Both are the initial policy, so they give the same Query-KL up to rounding (a test).
- "released-zeros" (what the released code computes, method.md §3): its reference worker masks the
  prompt tokens' log-probs to 0, so the published Query-KL is k3 against zeros, min(e^NLL - NLL - 1,
  10) per prompt token: a clamped "make the prompt likely" loss, not an anchor. Not the paper's method.
- "ema" and "refresh": a Query-KL anchor that moves with the policy (TRL's sync_ref_model, verl's
  moving references): a per-prompt exponential average of the policy's prompt log-probs, or the
  policy itself re-scored over the training set every --qkl-ref-every steps.

A new reference is a subclass and a line in REFERENCES: it maps a step's `PromptBatch` to
reference log-probs of the same shape; may run its own forward of the current policy over training
prompts (`Context.score_prompts`, timed as the phase qkl_ref); may declare options of its own
(`OPTIONS`, rows as train.py's; one given on the command line for another reference is an error);
may keep state, which the checkpoint saves and --resume restores (`state_dict` / `load_state_dict`,
one slot of state.pt); and may update itself after each step (`after_step`). The metric `query_kl`
always measures the drift from the initial policy: a reference that is not the initial policy
(`initial_policy = False`) leaves the monitor on the reference model's prompt forward, or on the
cache when no reference model is loaded.
"""

from dataclasses import dataclass
from typing import Callable

import torch

import logprobs
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
    prompt_ids: torch.Tensor | None = None  # (B, P) the rows' left-padded prompt tokens


class QueryReference:
    """The interface: `prompt_logp` is the only method an RL step needs."""
    needs_model = False                # a reference model must be loaded (its prompt forward)
    initial_policy = True              # it is the initial policy: the query_kl monitor can use it
    OPTIONS: list = []                 # its own options, rows as train.OPTIONS (names start qkl_ref_)

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
    """What the released code means: the reference model's forward over this step's prompts."""
    needs_model = True

    def prompt_logp(self, batch):
        return batch.model_prompt


class ReleasedZerosReference(QueryReference):
    """What the released code computes (method.md §3): ROLL's reference worker passes the response
    mask as the attention mask and multiplies its log-probs by it, so the prompt tokens' reference
    log-probs are 0. k3 against 0 is min(e^NLL_t - NLL_t - 1, 10) per prompt token, NLL_t the
    policy's own; its gradient raises every prompt token's likelihood. Not the paper's method."""
    initial_policy = False

    def prompt_logp(self, batch):
        return torch.zeros_like(batch.policy_prompt)


class TableReference(QueryReference):
    """A reference held as a table of per-prompt log-probs (the shape of the cache), starting at the
    initial policy's; subclasses move it. Its table is its state: --resume continues it exactly."""
    initial_policy = False

    def __init__(self, logp: list[torch.Tensor], ctx: "Context"):
        self.logp, self.ctx = [t.clone() for t in logp], ctx

    @classmethod
    def build(cls, ctx):
        return cls(ctx.cache().logp, ctx)

    def prompt_logp(self, batch):
        rows = [self.logp[i] for i in batch.prompt_idx for _ in range(batch.group_size)]
        return logprobs.right_align(rows, batch.width).to(batch.policy_prompt.device)

    def state_dict(self):
        return {"logp": self.logp}

    def load_state_dict(self, state):
        if "logp" in state:
            self.logp = [t.clone() for t in state["logp"]]


class EmaReference(TableReference):
    """Each prompt's reference log-probs follow the policy's: after every step in which a prompt was
    sampled, ref <- decay * ref + (1 - decay) * log pi_old (the rollout policy's prompt log-probs
    of this step, no forward of its own). A slowly moving anchor: Query-KL penalises fast drift,
    not drift itself."""
    OPTIONS = [("qkl_ref_decay", 0.99, "--qkl-ref ema: the anchor's decay per step in which a prompt "
                "is sampled (1 - decay of the way to the policy)", "(0,1)")]

    def after_step(self, batch):
        decay, G = self.ctx.args.qkl_ref_decay, batch.group_size
        for k, i in enumerate(batch.prompt_idx):
            n = len(self.logp[i])
            policy = batch.policy_prompt[k * G, batch.width - n:].detach().float().cpu()
            self.logp[i] = decay * self.logp[i] + (1.0 - decay) * policy


class RefreshReference(TableReference):
    """Every --qkl-ref-every RL steps the anchor becomes the current policy: its prompt log-probs
    over the whole training set, from a forward of its own (Context.score_prompts)."""
    OPTIONS = [("qkl_ref_every", 50, "--qkl-ref refresh: RL steps between refreshes of the anchor "
                "(the policy's prompt log-probs over the training set)", ">=1")]

    def after_step(self, batch):
        if (batch.step + 1) % self.ctx.args.qkl_ref_every == 0:
            self.logp = self.ctx.score_prompts()


@dataclass
class Context:
    """What building a reference may use."""
    cache: Callable                    # () -> query_cache.QueryCache: the initial policy's, once
    args: object = None                # the run's options (a reference's own among them)
    score_prompts: Callable | None = None  # () -> the current policy's prompt log-probs over the
    #                                       training set, as the cache holds them (timed: qkl_ref)


# --qkl-ref name -> QueryReference class. A new reference registers here, or from outside
# (REFERENCES["mine"] = MyReference: --qkl-ref's choices are this dict).
REFERENCES = {"cache": CachedReference, "live": LiveReference, "released-zeros": ReleasedZerosReference,
              "ema": EmaReference, "refresh": RefreshReference}


def reference_options() -> list:
    """Every registered reference's own options (rows as train.OPTIONS)."""
    return [row for ref in REFERENCES.values() for row in ref.OPTIONS]


def inert_options(chosen: str, given: set) -> set:
    """The options of other references than `chosen` among `given` (an error on the command line)."""
    own = {row[0] for row in REFERENCES[chosen].OPTIONS}
    return {row[0] for row in reference_options()} & given - own


def monitor_logp(reference: QueryReference, loss_ref: torch.Tensor, batch: PromptBatch,
                 cache: query_cache.QueryCache | None) -> torch.Tensor:
    """The initial policy's prompt log-probs for the query_kl monitor: the loss's reference when it
    is the initial policy, else the reference model's forward, else the cache."""
    if reference.initial_policy:
        return loss_ref
    if batch.model_prompt is not None:
        return batch.model_prompt
    return CachedReference(cache).prompt_logp(batch)


def for_run(name: str, cache, weights: str, has_model: bool, state, args=None,
            score_prompts=None) -> tuple[QueryReference, object]:
    """The run's reference (--qkl-ref `name`) and the Query-KL cache if anything needs it: the
    reference itself, the paper's query weights (`weights` "paper": its NLLs), or the query_kl
    monitor of a reference that is not the initial policy when no reference model is loaded
    (`has_model`). cache: () -> query_cache.QueryCache, built or loaded on the first call. state:
    the checkpoint's (checkpoints.TrainState) on --resume, whose "query_reference" it restores.
    args, score_prompts: Context's, for references with options or forwards of their own."""
    built = []

    def once():
        if not built:
            built.append(cache())
        return built[0]
    reference = REFERENCES[name].build(Context(once, args, score_prompts))
    if weights == "paper" or (not reference.initial_policy and not has_model):
        once()
    if state is not None:
        reference.load_state_dict(state.extra.get("query_reference", {}))
    return reference, built[0] if built else None
