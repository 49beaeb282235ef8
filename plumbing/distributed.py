"""torchrun plumbing: process group, DDP / FSDP2 wrapping, cross-rank reductions.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python train.py` is world size 1 and every
helper here is then a no-op, so the training script reads the same either way. The distributed
engine is PyTorch's own (DDP, or FSDP2's `fully_shard`); nothing here re-implements one.
"""

import contextlib
import gc
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(device="auto", fsdp=False, timeout_min=120.0) -> Dist:
    """Join the process group torchrun describes: gloo on CPU, nccl on GPU ("auto": CUDA when
    available, one GPU per local rank). A plain `python` process (world size 1) gets a group of
    one only where FSDP2 needs one (`fully_shard` shards over a device mesh): otherwise --fsdp
    would silently train unsharded. timeout_min: how long a rank waits at a collective before the
    job is aborted; NCCL's default of 10 minutes fires while ranks wait for one that evaluates a
    long held-out set or writes a 30 GB export."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device not in ("auto", "cuda") and not str(device).startswith("cuda"):
        device = torch.device(device)
    elif torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend, timeout = "nccl" if device.type == "cuda" else "gloo", timedelta(minutes=timeout_min)
    if world > 1:
        dist.init_process_group(backend, timeout=timeout)
    elif fsdp and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(rank, world, device)


def teardown():
    """Free what still uses the process group, then leave it together. The models, optimizers and
    FSDP2 states of a finished run sit in reference cycles: left to Python's last collection at
    interpreter exit, they are destroyed after the group is gone, and a gloo rank could abort there
    ("terminate called without an active exception", SIGABRT after the run's last line: seen in CI).
    The barrier: a rank that destroys the group while another still has collectives in flight can
    abort the job too."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def strided_share(n) -> tuple[list[int], int]:
    """Indices range(n) of this rank (rank, rank + W, ...), padded with repeats to the busiest
    rank's count, so every rank makes the same number of forwards (FSDP2 forwards are
    collectives); -> (indices, how many are real)."""
    rank, world = rank_world()
    mine = list(range(rank, n, world))
    n_mine = len(mine)
    return mine + [mine[-1] if mine else 0] * (-(-n // world) - n_mine), n_mine


def is_main() -> bool:
    """Rank 0 (or the only process): the one that prints and writes files."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*a, **kw):
    if is_main():
        print(*a, **{"flush": True, **kw})


def barrier():
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# Reductions (identity on one process)


def all_sum(x: torch.Tensor, op=None) -> torch.Tensor:
    """Reduce a tensor over ranks (sum by default). nccl reduces only CUDA tensors, so CPU
    scalars make a round trip."""
    if not dist.is_initialized():
        return x
    y = x.detach().clone().to("cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(y, op=op or dist.ReduceOp.SUM)
    return y.to(x.device)


def all_sums(values: dict) -> dict[str, float]:
    """{name: a number, or a tensor (summed first)} -> {name: its sum over ranks}: one collective
    for all of them, in float64."""
    t = torch.tensor([float(v.sum()) if torch.is_tensor(v) else float(v) for v in values.values()],
                     dtype=torch.float64)
    return dict(zip(values, all_sum(t).tolist()))


def all_max(x: torch.Tensor) -> torch.Tensor:
    return all_sum(x, dist.ReduceOp.MAX) if dist.is_initialized() else x


def all_finite(values) -> bool:
    """Every value finite on every rank: the ranks agree before anyone skips a step."""
    bad = float(not all(math.isfinite(v) for v in values))
    return all_max(torch.tensor(bad)).item() == 0


def read_scalars(values: dict, finite=()) -> dict[str, float] | None:
    """{name: a 0-d tensor or number} -> {name: float}, or None where a value named in `finite` is
    not finite on some rank: an optimizer step's one host read after backward (its loss statistics
    and grad norm), so the micro-batch loop never waits on the device."""
    host = {k: float(v) for k, v in values.items()}
    return host if all_finite([host[k] for k in finite]) else None


def all_gather_list(items: list) -> list:
    """Concatenate per-rank Python lists in rank order."""
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


# ----------------------------------------------------------------------------------------------
# Wrapping the policy


def wrap_model(model, device, fsdp=False, bf16=False, grad_ckpt=False, trainable=True, mesh=None):
    """DDP (a full replica per rank), or FSDP2 (`fully_shard` each decoder layer, then the root:
    parameters, gradients and Adam state sharded across ranks, what 7B/32B models need).
    grad_ckpt: activation checkpointing of every decoder layer (recompute in backward instead of
    storing each layer's activations), applied before sharding. A model that is not trained (the
    reference) is sharded like the policy under FSDP2 and left as it is otherwise (no DDP). A model
    sharded already (models.load_policy(shard=...)) is returned as it is. mesh: FSDP2's device
    mesh (default: all ranks); DDP's gradients are views into its reduction buckets, not a
    second copy of them."""
    if is_fsdp(model):
        return model
    if grad_ckpt:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing, checkpoint_wrapper)
        layers = set(model.model.layers)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: m in layers)
    if not dist.is_initialized() or (not trainable and not fsdp):
        return model
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kw = ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
              if bf16 else {})
        kw |= {"mesh": mesh} if mesh is not None else {}
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        return fully_shard(model, **kw)
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def sharder(fsdp, device, bf16, grad_ckpt=False, trainable=True):
    """wrap_model as a function for models.load_policy(shard=...), which then builds the model on
    the meta device and loads only this rank's shards; None (a plain load) without FSDP2."""
    if not (fsdp and dist.is_initialized()):
        return None
    return lambda model: wrap_model(model, device, True, bf16, grad_ckpt, trainable)


def uses_bf16(dtype_name, device) -> bool:
    """float32 master weights, bf16 compute (see precision): --dtype bf16-mixed, or auto on CUDA."""
    return dtype_name == "bf16-mixed" or (dtype_name == "auto" and device.type == "cuda")


def unwrap(model):
    """The module inside a DDP wrapper (FSDP2 modules are the model itself)."""
    return getattr(model, "module", model)


def reshard(model):
    """After forwards outside training (no grad), put every FSDP2 module back to sharded. FSDP2
    keeps the root's parameters unsharded after a forward; with no backward to reshard them, the
    next optimizer step would update the shards and leave those gathered copies stale (seen on 2
    CPU processes: a different update from step 1's second optimizer step on). No-op otherwise."""
    if is_fsdp(model):
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def is_fsdp(model) -> bool:
    return type(model).__name__.startswith("FSDP")


def gathered(model, dtype=None):
    """A context giving the model to decode with: the (DDP-unwrapped) model itself, or under FSDP2
    a gathered copy (gathered_copy)."""
    return gathered_copy(model, dtype) if is_fsdp(model) else contextlib.nullcontext(unwrap(model))


@contextmanager
def gathered_copy(model, dtype=None):
    """A model to decode with. Under FSDP2, whose forward all-gathers every layer's parameters,
    decoding through the sharded model would re-gather the whole model once per generated token:
    instead the weights are gathered ONCE, tensor by tensor, into a plain copy on every rank (in
    `dtype`, e.g. bf16 on GPU; at most one full float32 tensor in flight), each rank decodes its own
    rows with no collective per token, and the copy is freed on exit."""
    from torch.distributed.fsdp import FSDPModule
    cls = next(b for b in type(model).__bases__ if not issubclass(b, FSDPModule))  # e.g. Qwen2ForCausalLM
    shards = model.state_dict()                                 # DTensor shards: nothing gathered yet
    device = next(iter(shards.values())).device
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype or default)              # allocate the copy in its final dtype
        with torch.device(device):
            copy = cls(model.config)
    finally:
        torch.set_default_dtype(default)
    target = copy.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in shards.items():                          # same order on every rank: collectives
            target[name].copy_(t.full_tensor() if hasattr(t, "full_tensor") else t)
    copy.generation_config = model.generation_config
    try:
        yield copy.eval().requires_grad_(False)
    finally:
        del copy, target


@contextmanager
def grad_sync(model, sync):
    """Gradient accumulation: DDP skips the cross-rank gradient reduction on all but the last
    micro-batch (no_sync: its replica's gradient is full-size anyway). FSDP2 reduces every
    micro-batch: skipping it (set_requires_gradient_sync(False)) would keep each parameter's
    UNSHARDED float32 gradient until the synced micro-batch, a whole model's gradient per GPU
    (~28 GiB at 7B) where the sharded one is 1/world of it. One reduce-scatter per micro-batch is
    the price."""
    if sync or not dist.is_initialized() or not hasattr(model, "no_sync"):
        yield
    else:
        with model.no_sync():
            yield


def full_state(model, opt=None):
    """Full (unsharded, CPU) model and optimizer state dicts -- a collective under FSDP2, where
    each rank holds only shards; the plain state dicts otherwise."""
    if not is_fsdp(model):
        return unwrap(model).state_dict(), (opt.state_dict() if opt is not None else None)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=o), (get_optimizer_state_dict(model, opt, options=o)
                                                    if opt is not None else None)


def load_optimizer_state(model, opt, state):
    """A full optimizer state dict -> this rank's optimizer (its shards under FSDP2)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state)


def precision(name, device):
    """-> (parameter dtype, autocast context factory). "bf16-mixed": float32 master weights (updates
    of lr ~1e-6 vanish in bf16 weights) with bf16 autocast; "auto": that on CUDA, plain float32 on
    CPU (a CPU without native bf16 dot products, e.g. before AVX512-BF16/AMX, runs bf16 slower)."""
    from contextlib import nullcontext
    if uses_bf16(name, device):
        if device.type == "cpu":
            # bf16 matmuls on CPU go through oneDNN, which caches a compiled kernel per shape (1,024
            # by default): with every micro-batch and decoding step a new shape, that cache alone
            # grew the process by ~0.1 GB per RL step. 16 keeps the speed (0 costs ~25%).
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
        return torch.float32, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return (torch.float32 if name == "auto" else getattr(torch, name)), nullcontext
