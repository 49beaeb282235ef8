"""The reference behind the Query-KL term (method.md §3): whose prompt log-probs the policy's are
compared with, KL(pi_theta(q) || pi_ref(q)) estimated by k3 over the prompt tokens.

Chosen by --qkl-ref:
- "cache" (the paper): every training prompt scored once by the initial policy before RL
  (QueryCache, below); no reference model is needed, and the paper's query weights read the same
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
- "model" (--qkl-ref-model PATH): another model's prompt log-probs (a stronger model, an earlier
  checkpoint), scored once before RL as the cache is, then read from that table.

REFERENCES is an extension table (plumbing/extension.py, chosen by --qkl-ref): a new reference is a
QueryReference subclass, one row, added from anywhere with one call,

    extension.register(query_reference.REFERENCES, "mine", MyReference)

It maps a step's `PromptBatch` to reference log-probs of the same shape, and may declare:
`OPTIONS` (its own options, rows as train.py's; given for another reference, an error); `needs`
("model": the reference model is loaded and its prompt forward is `PromptBatch.model_prompt`;
"prompt_ids": the Context carries the training prompts, their tokenizer and the run's device, to
score them with a model of its own); state, which the checkpoint saves and --resume restores
(`state_dict` / `load_state_dict`, one slot of state.pt); `after_step`, a hook after each update.
`Context.score_prompts` runs a forward of the current policy over the training prompts (timed as
the phase qkl_ref). The metric `query_kl` always measures the drift from the initial policy: a
reference that is not the initial policy (`initial_policy = False`) leaves the monitor on the
reference model's prompt forward, or on the cache when no reference model is loaded.

The cache (`QueryCache`, the second half of this file): per-token log-probs of every training prompt
under the reference (= initial) policy, computed once before RL. With it, ERPO needs no reference model:
Query-KL compares the policy's prompt log-probs (from the training forward) against this cache, and
the paper's query weights read the cached prompt NLLs (method.md §4).

Saved as query_cache.pt in the run folder with a `meta` record of what it was built from; a
resumed run must reuse it (its policy is no longer the reference). A fresh run first looks in a
shared folder (--query-cache-dir, default ~/.cache/erpo/query_cache) for a cache with the very same
meta -- the weights' fingerprint, the prompts, template, temperature, precision, wrapper, world
size, prompts per forward (the padding) and library versions: everything that changes a single bit
of it -- and builds (and shares) one only if there is none. So the second run of a command starts
training at once.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from modeling import logprobs, models
from plumbing import checkpoints, distributed, extension, faults, run_dir
from sampler import kv_cache


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
    doc = ""                           # one line, for --help
    needs: frozenset = frozenset()     # "model": a reference model is loaded (PromptBatch.model_prompt);
    #                                    "prompt_ids": Context's prompts, tokenizer and device are set
    initial_policy = True              # it is the initial policy: the query_kl monitor can use it
    OPTIONS: list = []                 # its own options, rows as train.OPTIONS (names start qkl_ref_)
    needs_model = False                # "model" in needs (set from `needs`; the older spelling, kept)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("needs_model"):                            # a subclass in the older spelling
            cls.needs = frozenset(cls.needs) | {"model"}
        cls.needs = frozenset(cls.needs)
        cls.needs_model = "model" in cls.needs

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
    doc = "the initial policy's prompt log-probs, cached before RL (the paper)"

    def __init__(self, cache: "QueryCache"):
        self.cache = cache

    @classmethod
    def build(cls, ctx):
        return cls(ctx.cache())

    def prompt_logp(self, batch):
        ref = self.cache.ref_logp(batch.prompt_idx, batch.group_size, batch.width)
        return ref.to(batch.policy_prompt.device)


class LiveReference(QueryReference):
    """What the released code means: the reference model's forward over this step's prompts."""
    doc = "the reference model's forward over each step's prompts (what the released code means)"
    needs = frozenset({"model"})

    def prompt_logp(self, batch):
        return batch.model_prompt


class ReleasedZerosReference(QueryReference):
    """What the released code computes (method.md §3): ROLL's reference worker passes the response
    mask as the attention mask and multiplies its log-probs by it, so the prompt tokens' reference
    log-probs are 0. k3 against 0 is min(e^NLL_t - NLL_t - 1, 10) per prompt token, NLL_t the
    policy's own; its gradient raises every prompt token's likelihood. Not the paper's method."""
    doc = "zeros: k3 against log-prob 0 (what the released code computes; not the paper's method)"
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
    doc = "an anchor that moves: each sampled prompt's log-probs averaged toward the policy's"
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
    doc = "an anchor that moves: the policy's prompt log-probs, re-scored every --qkl-ref-every steps"
    OPTIONS = [("qkl_ref_every", 50, "--qkl-ref refresh: RL steps between refreshes of the anchor "
                "(the policy's prompt log-probs over the training set)", ">=1")]

    def after_step(self, batch):
        if (batch.step + 1) % self.ctx.args.qkl_ref_every == 0:
            self.logp = self.ctx.score_prompts()


class ModelReference(TableReference):
    """Another model's prompt log-probs (--qkl-ref-model PATH, an HF folder with the policy's
    tokenizer: a stronger model, an earlier checkpoint): loaded as the policy is, it scores every
    training prompt once before RL, as the initial policy scores the cache (and shared like it, by
    its weights' fingerprint, in --query-cache-dir), and is freed; each step reads that table. Fixed
    for the run: its state is the fingerprint, which --resume checks (it scores the prompts again)."""
    doc = "another model's prompt log-probs (--qkl-ref-model PATH), scored once before RL"
    needs = frozenset({"prompt_ids"})
    OPTIONS = [("qkl_ref_model", None, "--qkl-ref model: the HF folder whose prompt log-probs are the "
                "Query-KL reference (a stronger model, an earlier checkpoint; the policy's tokenizer)")]

    def __init__(self, table: "QueryCache", ctx: "Context"):
        super().__init__(table.logp, ctx)
        self.meta = table.meta

    @classmethod
    def build(cls, ctx):
        if not ctx.args.qkl_ref_model:
            raise SystemExit("error: --qkl-ref model needs --qkl-ref-model PATH: the model folder whose "
                             "prompt log-probs are the Query-KL reference")
        return cls(score_with_model(ctx.args.qkl_ref_model, ctx), ctx)

    def state_dict(self):
        return {"model": self.meta["model"], "weights": self.meta["weights"]}

    def load_state_dict(self, state):
        if state.get("weights") not in (None, self.meta["weights"]):
            raise SystemExit(f"error: --resume: --qkl-ref-model {self.meta['model']} no longer holds the "
                             "weights the run started with (their fingerprint differs): put that model "
                             "back, or start a new run (another --out)")


class ContextError(RuntimeError):
    """A reference needs what the run did not put into its Context (rl/run_setup.py passes it)."""


@dataclass
class Context:
    """What building a reference may use (the run fills it in: rl/run_setup.py, via for_run)."""
    cache: Callable                    # () -> query_reference.QueryCache: the initial policy's, once
    args: object = None                # the run's options (a reference's own among them)
    score_prompts: Callable | None = None  # () -> the current policy's prompt log-probs over the
    #                                       training set, as the cache holds them (timed: qkl_ref)
    # what a reference that needs "prompt_ids" scores them with a model of its own by:
    dist: object = None                # distributed.Dist: the run's device and world
    prompt_ids: list | None = None     # the training prompts' token ids (PromptSet.ids)
    tokenizer: object = None           # the policy's tokenizer (its pad token; its vocabulary)

    def need(self, name: str):
        """The field `name`, or ContextError where the run left it unset."""
        value = getattr(self, name)
        if value is None:
            raise ContextError(f"query_reference.Context.{name} is not set: the run must pass it to "
                               "query_reference.for_run (rl/run_setup.py)")
        return value


# --qkl-ref name -> QueryReference class: an extension table (plumbing/extension.py). A new reference
# is a row: extension.register(REFERENCES, "mine", MyReference); --qkl-ref's choices are this dict.
REFERENCES = extension.declare("qkl_ref", {
    "cache": CachedReference, "live": LiveReference, "released-zeros": ReleasedZerosReference,
    "ema": EmaReference, "refresh": RefreshReference, "model": ModelReference})


def reference_options() -> list:
    """Every registered reference's own options (rows as train.OPTIONS)."""
    return extension.own_options(REFERENCES)


def inert_options(chosen: str, given: set) -> set:
    """The options of other references than `chosen` among `given` (an error on the command line)."""
    return extension.inert_options(REFERENCES, chosen, given)


def monitor_logp(reference: QueryReference, loss_ref: torch.Tensor, batch: PromptBatch,
                 cache: "QueryCache | None") -> torch.Tensor:
    """The initial policy's prompt log-probs for the query_kl monitor: the loss's reference when it
    is the initial policy, else the reference model's forward, else the cache."""
    if reference.initial_policy:
        return loss_ref
    if batch.model_prompt is not None:
        return batch.model_prompt
    return CachedReference(cache).prompt_logp(batch)


def for_run(name: str, cache, weights: str, has_model: bool, state, args=None, score_prompts=None, *,
            dist=None, prompt_ids=None, tokenizer=None) -> tuple[QueryReference, object]:
    """The run's reference (--qkl-ref `name`) and the Query-KL cache if anything needs it: the
    reference itself, the paper's query weights (`weights` "paper": its NLLs), or the query_kl
    monitor of a reference that is not the initial policy when no reference model is loaded
    (`has_model`). cache: () -> query_reference.QueryCache, built or loaded on the first call. state:
    the checkpoint's (checkpoints.TrainState) on --resume, whose "query_reference" it restores.
    The rest: Context's, for references with options, forwards or models of their own."""
    built = []

    def once():
        if not built:
            built.append(cache())
        return built[0]
    ctx = Context(once, args, score_prompts, dist=dist, prompt_ids=prompt_ids, tokenizer=tokenizer)
    reference = REFERENCES[name].build(ctx)
    if weights == "paper" or (not reference.initial_policy and not has_model):
        once()
    if state is not None:
        reference.load_state_dict(state.extra.get("query_reference", {}))
    return reference, built[0] if built else None


def score_with_model(path: str, ctx: Context) -> "QueryCache":
    """The training prompts' log-probs under the model in `path` (ModelReference's table): its
    tokenizer checked against the policy's, loaded as the policy is (dtype, device, attention,
    sharding), scored under the run's autocast in forwards of --micro-batch prompts, as the cache is;
    shared in --query-cache-dir by its meta (the weights' fingerprint among it); then freed."""
    a, d, prompt_ids, tokenizer = ctx.args, ctx.need("dist"), ctx.need("prompt_ids"), ctx.need("tokenizer")
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):   # (else a hub id)
        raise SystemExit(f"error: --qkl-ref-model {path}: model folder not found")
    same_vocabulary(path, tokenizer, a.model)
    model = load_like_policy(path, a, d, f"--qkl-ref-model {path}")
    meta = cache_meta(path, a.train_data, a.template, a.temperature, prompt_ids,
                      weights=weights_fingerprint(model), numerics=numerics_of(a, d, model),
                      batch=a.micro_batch)
    with distributed.precision(a.dtype, d.device)[1]():                  # the training forward's numerics
        logp = shared_or_built(meta, model, prompt_ids, tokenizer.pad_token_id, a.temperature, d.device,
                               a.query_cache_dir)
    del model
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    distributed.print0(f"query-KL reference: {len(logp)} prompts scored by --qkl-ref-model {path}")
    return QueryCache.from_logp(logp, meta)


def same_vocabulary(path: str, tokenizer, policy_path: str):
    """SystemExit with one line unless the tokenizer in `path` maps every token as the policy's does
    (Query-KL compares the two models' log-probs of the same token ids)."""
    try:
        theirs = models.load_tokenizer(path).get_vocab()
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --qkl-ref-model {path}: {_first_line(e)}") from None
    mine = tokenizer.get_vocab()
    if theirs != mine:
        differ = len(set(theirs.items()) ^ set(mine.items()))
        raise SystemExit(f"error: --qkl-ref-model {path}: its tokenizer is not the policy's (--model "
                         f"{policy_path}; {len(theirs)} against {len(mine)} tokens, {differ} entries "
                         "differ): Query-KL compares the log-probs of the same token ids")


# ----------------------------------------------------------------------------------------------
# The cache of the initial policy's prompt log-probs (--qkl-ref cache, the paper's weights, the monitor)

@dataclass
class QueryCache:
    logp: list[torch.Tensor]   # per prompt: (T_i - 1,) float32 log p_ref(x_t | x_<t), t = 2..T_i
    nll: torch.Tensor          # (N,) s_i = -l_ref(q_i), the reference NLL of the whole prompt
    nll_mean: float            # its mean over the training set (the paper weights' s-bar)
    meta: dict | None = None   # what it was built from (cache_meta); checkpoints keep it (`resumed`)

    @classmethod
    def from_logp(cls, logp, meta=None):
        nll = torch.stack([-x.sum() for x in logp])
        return cls(logp, nll, nll.mean().item(), meta)

    def ref_logp(self, prompt_idx, group_size, width) -> torch.Tensor:
        """(len(prompt_idx) * G, width) reference prompt log-probs, right-aligned like the
        prompt slice of logprobs.Packed (each prompt repeated for its G responses)."""
        out = torch.zeros(len(prompt_idx) * group_size, width)           # zeros on the left: padding
        for k, i in enumerate(prompt_idx):
            r = self.logp[i][max(0, len(self.logp[i]) - width):]
            out[k * group_size:(k + 1) * group_size, width - len(r):] = r
        return out


def cache_meta(model_path, data_path, template, temperature, prompt_ids, *, weights, numerics, batch) -> dict:
    """What a cache depends on: a resumed run checks it matches; a fresh run reuses a shared cache
    whose meta equals it (paths aside: the same weights and prompts from elsewhere are the same).
    `batch`: the prompts per forward of `build` (--micro-batch), which set each forward's padding and
    shapes, so the last bits of the log-probs."""
    import transformers

    return {"model": model_path, "data": data_path, "template": template, "temperature": temperature,
            "n": len(prompt_ids), "prompts_sha1": hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest(),
            "weights": weights, "numerics": numerics, "batch": batch,
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"}


def weights_fingerprint(model) -> str:
    """blake2b of every parameter and buffer (name, dtype, shape, bytes) as loaded: this rank's shards
    under FSDP2, the digests of all ranks combined. Costs one read of the weights (7B: seconds). The
    names are the model's own, whatever wraps it (DDP's "module.", activation checkpointing's)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        name = name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
        t = t.detach()
        t = t.to_local() if hasattr(t, "to_local") else t               # DTensor: this rank's shard
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hashlib.blake2b("".join(distributed.all_gather_list([h.hexdigest()])).encode(),
                           digest_size=16).hexdigest()


def _shared_path(shared_dir, meta) -> str:
    key = {k: v for k, v in meta.items() if k not in ("model", "data")}
    return os.path.join(os.path.expanduser(shared_dir),
                        hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".pt")


def _save(obj, path):
    """Written whole, then renamed: a kill never leaves half a cache."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):       # a failed write (a full disk) leaves no partial file behind
            os.remove(tmp)


def _load_shared(path):
    """A shared cache another run wrote, or None where it cannot be read (then it is rebuilt)."""
    try:
        return torch.load(path)
    except Exception as e:  # a truncated or foreign file: torch raises anything from EOFError to RuntimeError
        distributed.print0(f"query-KL reference cache: {path} unreadable ({type(e).__name__}), rebuilding it")
        return None


@torch.no_grad()
def build(model, prompt_ids, pad_id, temperature, device, batch=64) -> list[torch.Tensor]:
    """-> list over prompts of 1-D float32 tensors: log p_ref(x_t | x_<t) for t = 2..T. Each rank
    scores a strided share, then the shares are gathered."""
    mine, _ = distributed.strided_share(len(prompt_ids))  # repeats only overwrite a cache entry alike
    out = []
    for s in tqdm(range(0, len(mine), batch), desc="query-KL reference cache",
                  disable=not distributed.is_main(), leave=False):
        rows = [prompt_ids[i] for i in mine[s:s + batch]]
        ids, mask = kv_cache.left_pad(rows, pad_id, device)
        logp, _ = logprobs.token_logprobs(model, ids, mask, temperature)  # (b, P-1)
        P = ids.shape[1]
        out += [(mine[s + i], logp[i, P - len(r):].float().cpu()) for i, r in enumerate(rows)]
        faults.point("query-cache")
    distributed.reshard(model)  # the cache is built through the training wrapper (FSDP2): see reshard
    cache = [None] * len(prompt_ids)
    for i, t in distributed.all_gather_list(out):
        cache[i] = t
    return cache


def cache_for_run(a, d, policy, prompt_ids, pad_id, resuming) -> QueryCache:
    """train.py's cache (options `a`, distributed.Dist `d`, the wrapped policy): the run folder's
    on --resume (`resumed`); else a shared one with the same meta (--query-cache-dir); else built,
    and shared."""
    numerics = numerics_of(a, d, policy)
    path = os.path.join(a.out, "query_cache.pt")
    if resuming:
        meta = cache_meta(a.model, a.train_data, a.template, a.temperature, prompt_ids, weights=None,
                          numerics=numerics, batch=a.micro_batch)
        return resumed(path, meta, a, d, prompt_ids, pad_id)
    meta = cache_meta(a.model, a.train_data, a.template, a.temperature, prompt_ids,
                      weights=weights_fingerprint(policy), numerics=numerics, batch=a.micro_batch)
    return load_or_build(path, meta, policy, prompt_ids, pad_id, a.temperature, d.device, a.query_cache_dir)


def numerics_of(a, d, model) -> str:
    """What of the run sets the last bits of a cache's log-probs: device, precision, attention kernel,
    wrapper, world size (cache_meta's `numerics`)."""
    return (f"{d.device.type} {a.dtype} {distributed.unwrap(model).config._attn_implementation} "
            f"{'fsdp' if a.fsdp else 'ddp'} world {d.world}")


def resumed(path, meta, a, d, prompt_ids, pad_id) -> QueryCache:
    """The run folder's cache on --resume (its policy is no longer the reference, so the file is the
    reference). What is cached must match this run (`meta`: its prompts, template, temperature); how
    it was computed may not (the weights are trained by now, and a run may resume at another world
    size, --micro-batch or library version). An unreadable file (empty, truncated) is rebuilt where
    that gives it back bit for bit (`rebuild_exactly`), else one line."""
    if not os.path.exists(path):
        raise SystemExit(f"error: resuming but {path} is missing; the reference cache must come "
                         "from the initial model: put the file back, or start a new run (another --out)")
    try:
        saved = torch.load(path)
        saved_meta, logp = saved["meta"], saved["logp"]
    except Exception as e:  # an empty or cut file: torch raises anything from EOFError to RuntimeError
        rebuilt = rebuild_exactly(path, _first_line(e), meta, a, d, prompt_ids, pad_id)
        saved_meta, logp = rebuilt.meta, rebuilt.logp
    differ = ["the prompts differ" if k == "prompts_sha1" else f"{k} {run_dir.short(v, 40)} -> "
              f"{run_dir.short(meta.get(k), 40)}" for k, v in saved_meta.items()
              if k not in ("weights", "numerics", "batch", "versions")
              and not run_dir.same_value(v, meta.get(k))]
    if differ:
        raise SystemExit(f"error: --resume: {path} was built from other prompts or settings "
                         f"({'; '.join(differ)}); resume from the folder the run was started in, with its "
                         "options (config.json), or start a new run (another --out)")
    return QueryCache.from_logp(logp, saved_meta)


def rebuild_exactly(path, why, meta, a, d, prompt_ids, pad_id) -> QueryCache:
    """Rebuild an unreadable cache of a run from its initial model (--model), where the checkpoint
    records what it was built from (its meta, saved with every checkpoint) and this process gives
    the same bits: the same prompts, template, temperature and numerics, and a model whose weights
    have the recorded fingerprint, scored in forwards of the recorded number of prompts (a resumed
    run's --micro-batch may differ). -> the cache (its meta: the recorded one); SystemExit with one
    line otherwise."""
    recorded = checkpoints.saved_extra(checkpoints.checkpoint_dir(a.out)).get("query_cache")

    def refuse(reason):
        raise SystemExit(f"error: --resume: {path} is unreadable ({why}) and cannot be rebuilt exactly: "
                         f"{reason}; put the file back, or start a new run (another --out)")
    if not recorded or "batch" not in recorded:
        refuse("the checkpoint does not record what it was built from (saved by an older version)")
    keys = ("prompts_sha1", "n", "template", "temperature", "numerics", "versions")
    differ = [f"{k} {run_dir.short(recorded.get(k), 40)} -> {run_dir.short(meta.get(k), 40)}" for k in keys
              if recorded.get(k) != meta.get(k)]
    if differ:
        refuse(f"it was built with other settings ({'; '.join(differ)})")
    initial = initial_policy(a, d, refuse)
    if weights_fingerprint(initial) != recorded["weights"]:
        refuse(f"the initial model {a.model} does not have the weights it was built from")
    cache = load_or_build(path, recorded, initial, prompt_ids, pad_id, a.temperature, d.device,
                          a.query_cache_dir)
    distributed.print0(f"--resume: {path} was unreadable ({why}): rebuilt it from the initial model "
                       f"{a.model} (the same weights, prompts and numerics as when the run built it)")
    return cache


def initial_policy(a, d, refuse):
    """The run's initial model, loaded as train.py loads a policy (sharded under FSDP2)."""
    try:
        return load_like_policy(a.model, a, d)
    except SystemExit as e:
        refuse(f"its initial model does not load ({str(e.code).removeprefix('error: ')})")


def load_like_policy(path, a, d, who=None):
    """The model in `path`, loaded as train.py loads the policy (options `a`, distributed.Dist `d`): its
    dtype, device and attention kernel, sharded under FSDP2; in eval mode. A folder that is missing or
    does not load: SystemExit with one line (naming the option `who`, where given)."""
    bf16 = distributed.uses_bf16(a.dtype, d.device)
    dtype, _ = distributed.precision(a.dtype, d.device)
    shard = distributed.sharder(a.fsdp, d.device, bf16)
    try:
        model, _ = models.load_for_training(path, d.device, dtype, shard, bf16)
    except SystemExit as e:
        if who is None:
            raise
        raise SystemExit(f"error: {who}: {str(e.code).removeprefix('error: ')}") from None
    return model.eval()


def _first_line(e) -> str:
    """An exception's type and the start of its first line (torch's run on for a paragraph)."""
    text = (str(e).splitlines() or [""])[0].split(". ")[0]
    return f"{type(e).__name__}: {text[:80]}" if text else f"{type(e).__name__} (an empty file?)"


def load_or_build(path, meta, model, prompt_ids, pad_id, temperature, device, shared_dir="") -> QueryCache:
    """A fresh run's cache (or one `rebuild_exactly` makes): a shared one with the same meta, else
    built (in forwards of meta["batch"] prompts) and shared; written to `path`."""
    logp = shared_or_built(meta, model, prompt_ids, pad_id, temperature, device, shared_dir)
    failed = None
    if distributed.is_main():
        try:
            _save({"meta": meta, "logp": logp}, path)
        except (OSError, RuntimeError) as e:
            failed = f"error: cannot write {path}: {str(e).splitlines()[0]} (a full disk?)"
    failed = distributed.all_gather_list([failed])[0]                  # every rank stops, not only rank 0
    if failed:
        raise SystemExit(failed)
    return QueryCache.from_logp(logp, meta)


def shared_or_built(meta, model, prompt_ids, pad_id, temperature, device,
                    shared_dir="") -> list[torch.Tensor]:
    """The prompts' log-probs under `model`: a shared cache's with the same meta (paths aside) in
    `shared_dir`, else built (in forwards of meta["batch"] prompts) and shared there."""
    shared = _shared_path(shared_dir, meta) if shared_dir else None
    found = _load_shared(shared) if shared and os.path.exists(shared) else None
    if found is not None and {k: v for k, v in found["meta"].items() if k not in ("model", "data")} == \
            {k: v for k, v in meta.items() if k not in ("model", "data")}:
        distributed.print0(f"query-KL reference cache: reused {shared}")
        return found["logp"]
    logp = build(distributed.unwrap(model), prompt_ids, pad_id, temperature, device, meta["batch"])
    if shared and distributed.is_main():
        try:
            _save({"meta": meta, "logp": logp}, shared)
        # a read-only or full disk (torch.save raises RuntimeError then) is no reason to stop a run
        except (OSError, RuntimeError) as e:
            distributed.print0(f"query-KL reference cache: not shared ({str(e).splitlines()[0]})")
    return logp
