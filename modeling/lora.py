"""LoRA for the policy (--lora-rank r; peft): rank-r adapters on its linear layers train, the rest
of the weights stay frozen. What changes in the RL step:

- the reference model is the frozen base itself, the adapters switched off (`Base`): no second copy
  of the weights, where GRPO's Policy-KL (or its measurement) needs one;
- rollouts decode a merged copy (`merged`: W + (alpha / r) B A in every adapted layer, a fresh
  model, so the sampler's lean decode step and its one pass apply); a copy of the weights per RL
  step, as FSDP2's gathered decoding copy is;
- checkpoints hold the adapters and their optimizer state only (peft's save_pretrained), a resumed
  run loads the base from --model and the adapters from the checkpoint (`load_adapters`);
- the exported model (--export, and <out>/hf at the final save) is merged: a plain Hugging Face
  folder evaluate.py loads.
Works in one process and under DDP; FSDP2 with LoRA is refused (sharding frozen and trainable
weights in one unit is not wired here). The query cache and paper weights are unchanged: at step 0
the adapters add nothing (B = 0), so the policy is the base.
"""

import copy
import os
from contextlib import contextmanager

import torch

from plumbing import distributed

ADAPTER_FILE = "adapter_model.safetensors"


def wrap(model, rank: int, alpha: float, dropout: float = 0.0, targets: str = "all-linear"):
    """The model with rank-`rank` LoRA adapters on `targets` (peft's "all-linear": every linear
    layer but the output head), only they trainable; adapters initialised so that B A = 0."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("error: --lora-rank needs peft (pip install peft)") from None

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                        target_modules=target_modules(targets))
    return get_peft_model(model, config)


def target_modules(targets: str):
    """--lora-targets as peft takes it: "all-linear", or the names between its commas with spaces
    stripped ("q_proj, v_proj" is q_proj and v_proj; peft would look for a module " v_proj")."""
    targets = targets.strip()
    return targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]


def unmatched_targets(model, targets: str) -> str | None:
    """Why --lora-targets cannot adapt `model` (a name no module of it has: peft matches a target to
    a module whose name is it or ends in "." + it), or None; checked before --out is claimed."""
    targets = target_modules(targets)
    if targets == "all-linear":
        return None
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    return (f"--lora-targets {','.join(missing)}: no module of the model is named so; its linear layers are "
            f"{', '.join(linear)} (or give all-linear)")


def peft_model(model):
    """The peft model inside `model` (unwrapped from DDP), or None for a model without adapters."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "disable_adapter") and hasattr(inner, "get_base_model") else None


def is_lora(model) -> bool:
    return peft_model(model) is not None


def trainable(model) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)


class Base(torch.nn.Module):
    """The frozen base of a LoRA policy as a model of its own: every forward runs with the adapters
    switched off, so it is the initial policy. The reference model of a LoRA run."""

    def __init__(self, policy):
        super().__init__()
        self._policy = [policy]                   # (a list: not a submodule of this one)

    @property
    def peft(self):
        return peft_model(self._policy[0])

    @property
    def config(self):
        return self.peft.get_base_model().config

    def get_output_embeddings(self):                   # (logprobs' fused float32 lm_head reads it)
        return self.peft.get_base_model().get_output_embeddings()

    def forward(self, *args, **kwargs):
        with torch.no_grad(), self.peft.disable_adapter():
            return self.peft.get_base_model()(*args, **kwargs)


def merged(policy, dtype=None):
    """A fresh plain model with the adapters merged into its weights, in `dtype` (None: as they
    are), for decoding and export; the policy itself is untouched (merging in place and back would
    round the frozen float32 weights a little at every step)."""
    model = copy.deepcopy(peft_model(policy)).merge_and_unload()
    model.requires_grad_(False)
    return model if dtype is None else model.to(dtype)


@contextmanager
def decoding_copy(policy, dtype=None):
    """train.rollouts' model to decode with, freed on exit (before scoring needs the memory): a LoRA
    policy's `merged` copy (the sampler's lean step then applies), else distributed.gathered's."""
    if not is_lora(policy):
        with distributed.gathered(policy, dtype) as model:
            yield model
        return
    model = merged(policy, dtype)
    try:
        yield model
    finally:
        del model


def merge_adapters(model, folder):
    """A plain model: `model` (the run's initial model) with the adapters of a LoRA run's checkpoint
    folder merged into its weights (evaluate.py / analysis.py on a LoRA run's ckpt/). A folder whose
    adapters do not fit the model: SystemExit with one line."""
    try:
        from peft import PeftModel
    except ImportError:
        raise SystemExit("error: a LoRA checkpoint needs peft to load (pip install peft)") from None
    try:
        return PeftModel.from_pretrained(model, folder).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise SystemExit(f"error: {folder}: its LoRA adapters do not load onto the run's initial model: "
                         f"{why}") from None


def load_adapters(policy, folder):
    """The adapters (and only they) of a checkpoint folder saved by peft's save_pretrained."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, ADAPTER_FILE), device=str(next(policy.parameters()).device))
    set_peft_model_state_dict(peft_model(policy), weights)
