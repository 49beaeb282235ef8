"""Checkpoints of a run folder: writing them safely, trusting them, finding a model in them.

    <out>/ckpt/        save_pretrained folder + state.pt (optimizer, scheduler, step, RNG, and the
                       "extra" state of the run's parts, e.g. the Query-KL reference's);
                       under FSDP2: dcp/ (torch.distributed.checkpoint shards), tokenizer, state.pt
    <out>/ckpt.prev/   the checked checkpoint before it (the fallback)
    <out>/hf/          FSDP2 runs: the final save's Hugging Face folder

A checkpoint is written to ckpt.tmp and renamed into place, so a run killed mid-save keeps its
previous one. The marker `loss_checked` is written at the first finite optimizer step after a
save (`mark_checked`); a run that diverges sets an unchecked latest aside (`roll_back`), and a
corrupt one (`damage`) falls back to ckpt.prev/ (`resume_point`). `find_model` +
`load_sharded_weights` let evaluate.py load any of these (a run folder, its ckpt/, sharded or not,
or an HF folder). The run folder itself (config, lock, metrics) is run_dir.py.
"""

import glob
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field

import torch

from plumbing import distributed, faults


def saved_step(ckpt) -> int | None:
    """The step of a checkpoint's state.pt, memory-mapped (a DDP run's holds the whole Adam state:
    ~60 GB at 7B, of which this reads a few bytes)."""
    try:
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False, mmap=True)
        return int(state["step"])
    except Exception:  # missing or unreadable: no checkpoint to speak of (resume says more)
        return None


def saved_extra(ckpt) -> dict:
    """The "extra" state of a checkpoint's state.pt (memory-mapped, as saved_step); {} if none."""
    try:
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False, mmap=True)
        return state.get("extra") or {}
    except Exception:
        return {}


# ----------------------------------------------------------------------------------------------
# Checkpoints


@dataclass
class TrainState:
    """What a checkpoint holds beside the weights: enough to continue bit-for-bit."""
    step: int
    opt: dict
    sched: dict
    rng: torch.Tensor
    py_rng: tuple
    extra: dict = field(default_factory=dict)  # named state of the run's parts (e.g. "query_reference")


def checkpoint_dir(out):
    return os.path.join(out, "ckpt")


def has_checkpoint(out):
    return os.path.exists(os.path.join(checkpoint_dir(out), "state.pt"))


def load_state(out) -> TrainState:
    s = torch.load(os.path.join(checkpoint_dir(out), "state.pt"), map_location="cpu", weights_only=False)
    return TrainState(step=s["step"], opt=s["opt"], sched=s["sched"], rng=s["rng"], py_rng=s["py_rng"],
                      extra=s.get("extra", {}))


def is_sharded(out) -> bool:
    """A checkpoint saved by an FSDP2 run: torch.distributed.checkpoint shards, no HF weights."""
    return os.path.isdir(os.path.join(checkpoint_dir(out), "dcp"))


def is_lora(out) -> bool:
    """The run's checkpoint holds LoRA adapters (its final export, <out>/hf, the merged model)."""
    return os.path.isfile(os.path.join(checkpoint_dir(out), "adapter_config.json"))


def model_source(out, resuming, model_path):
    """Where the weights to start from are: the HF checkpoint, or (sharded checkpoints, restored
    afterwards by `restore`) the initial model, which gives the architecture."""
    return checkpoint_dir(out) if resuming and not is_sharded(out) else model_path


def restore(state: TrainState | None, model, opt, sched, out):
    """Optimizer (its shards under FSDP2), scheduler and RNG state of a checkpoint (None: nothing);
    for a sharded checkpoint also the weights, resharded to this run's world size."""
    if state is None:
        return
    if is_sharded(out):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt)  # this run's layout; DCP reshards the saved one into it
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(checkpoint_dir(out), "dcp"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    else:
        distributed.load_optimizer_state(model, opt, state.opt)
    sched.load_state_dict(state.sched)
    torch.set_rng_state(state.rng)
    random.setstate(state.py_rng)
    distributed.print0(f"resumed from {checkpoint_dir(out)} at step {state.step}")


def save_checkpoint(out, model, tokenizer, opt, sched, step, final=False, export_dtype=None, bf16=False,
                    extra=None):
    """Under FSDP2: each rank writes its own shards (torch.distributed.checkpoint), nothing is
    gathered, and the final save also exports a HF folder to <out>/hf (in `export_dtype`, see
    `export`); otherwise a HF folder (save_pretrained) of the float32 master weights with the
    optimizer state. Both with the scheduler/step/RNG state, written to ckpt.tmp and renamed into
    place; the checkpoint it replaces becomes ckpt.prev/ if it was checked (see `mark_checked`).
    At most two checkpoints on disk at any moment, a kill mid-save included (`make_room`): at 7B
    ~91.5 GB each (float32 weights + Adam state). extra: {name: state} of other parts of the run
    (rank 0's), given back as TrainState.extra.
    A write that fails (a full disk, `ulimit -f`) ends the run with one line on every rank: the
    checkpoint before it is untouched (the new one goes to ckpt.tmp, removed again)."""
    tmp = os.path.join(out, "ckpt.tmp")
    if distributed.is_main():
        for leftover in (tmp, checkpoint_dir(out) + ".drop"):  # from a run killed mid-save
            shutil.rmtree(leftover, ignore_errors=True)
        make_room(out)
    distributed.barrier()
    if final and distributed.is_fsdp(model):
        try:
            export(model, tokenizer, os.path.join(out, "hf"), export_dtype, bf16=bf16, record=True)
        except SystemExit as e:                          # (every rank: export's one line, and what is kept)
            raise SystemExit(f"{e.code}; {kept_note(out)}") from None
    failed = None
    try:
        if distributed.is_fsdp(model):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
            model_sd = opt_sd = None
        else:
            model_sd, opt_sd = distributed.full_state(model, opt)
        if distributed.is_main():
            _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step, extra or {})
    except write_errors() as e:
        if distributed.is_main():                        # what it wrote goes: it may have filled the disk
            shutil.rmtree(tmp, ignore_errors=True)
        failed = (f"error: cannot save the checkpoint of step {step} in {out} ({write_error(e)}); "
                  + kept_note(out))
    failed = next((f for f in distributed.all_gather_list([failed]) if f), None)  # every rank stops
    if failed:
        raise SystemExit(failed)


def make_room(out):
    """Before a save writes ckpt.tmp, the checkpoint it will replace goes, so that no more than two
    copies are ever on disk (three of 91.5 GB at 7B would need 275 GB). A checked ckpt/ will become
    the fallback, so the ckpt.prev/ before it goes; an unchecked ckpt/ (no optimizer step was applied
    since it was saved: it holds the weights this save writes) goes itself, and ckpt.prev/ stays the
    fallback. A kill while ckpt.tmp is written leaves one trusted checkpoint either way."""
    final, prev = checkpoint_dir(out), checkpoint_dir(out) + ".prev"
    if not os.path.exists(final):
        return
    if is_checked(out):
        shutil.rmtree(prev, ignore_errors=True)
    else:
        os.replace(final, final + ".drop")
        shutil.rmtree(final + ".drop", ignore_errors=True)


def kept_note(out) -> str:
    """What a failed save leaves: ckpt/, or (make_room removed an unchecked one) ckpt.prev/, which
    --resume puts back (recover_checkpoint)."""
    ckpt = checkpoint_dir(out)
    if not has_checkpoint(out) and saved_step(ckpt + ".prev") is not None:
        ckpt += ".prev"
    before = saved_step(ckpt)
    if before is None:
        return "there is no checkpoint before it: run again once the disk takes one"
    return (f"the checkpoint of step {before} ({ckpt}/) is intact: --resume continues from it once the disk "
            "takes one")


def write_errors() -> tuple:
    """What a failed write raises (a full disk, `ulimit -f`): OSError (ENOSPC, EFBIG), torch.save's
    RuntimeError, safetensors' SafetensorError, and torch.distributed.checkpoint's
    CheckpointException (a BaseException, raised on every rank)."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    return OSError, RuntimeError, SafetensorError, CheckpointException


def write_error(e) -> str:
    """A failed write's cause in a few words (a CheckpointException's is its last line); where the
    writer does not say (torch.save: "unexpected pos ..."), what usually causes it."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    why = (lines[-1] if type(e).__name__ == "CheckpointException" else lines[0])[:160]
    return why if "os error" in why else f"{why}: a full disk, or a file size limit (ulimit -f)?"


def _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step, extra):
    tmp, final, prev = os.path.join(out, "ckpt.tmp"), checkpoint_dir(out), checkpoint_dir(out) + ".prev"
    if model_sd is not None:
        distributed.unwrap(model).save_pretrained(tmp, state_dict=model_sd)
    faults.point("ckpt-write")
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "opt": opt_sd, "sched": sched.state_dict(),
                "rng": torch.get_rng_state(), "py_rng": random.getstate(), "extra": extra},
               os.path.join(tmp, "state.pt"))
    if os.path.exists(final):       # checked (make_room removed an unchecked one): the fallback
        os.replace(final, prev)
        faults.point("ckpt-rename")  # the window recover_checkpoint() closes
    os.replace(tmp, final)


# A checkpoint is trusted once the weights it holds have given a finite loss: the first finite
# optimizer step after the save (`mark_checked`). Until then the one before it is kept as
# ckpt.prev, and a run that diverges before that step sets the unchecked one aside (`roll_back`):
# with --lr 1e6 a step's loss is still finite (it is computed before the update), its update
# writes weights of ~1e6, and only the next step's loss says so.
CHECKED = "loss_checked"


def is_checked(out) -> bool:
    return os.path.exists(os.path.join(checkpoint_dir(out), CHECKED))


def mark_checked(out):
    """The latest checkpoint's weights have given a finite loss (rank 0 writes the marker)."""
    if distributed.is_main() and has_checkpoint(out):
        with open(os.path.join(checkpoint_dir(out), CHECKED), "w") as f:
            f.write("its weights have given a finite loss\n")


def diverged(out, streak, checked, why=None) -> str:
    """The error that ends a run whose last `streak` (--max-bad-steps) optimizer steps had a
    non-finite loss or gradient (or whose weights diverged: `why`). A checkpoint saved since the
    last finite loss (not `checked`) holds the weights that diverged, so it is set aside
    (roll_back) and --resume continues from the one before it."""
    step, ckpt = roll_back(out), checkpoint_dir(out)
    where = (f"--resume continues from step {step} ({ckpt}/)" if step is not None else
             "--resume starts from the initial model (no checkpoint before the divergence)")
    aside = "" if checked else f" (the checkpoint saved after it diverged: {ckpt}.diverged/)"
    why = why or f"{streak} optimizer steps in a row had a non-finite loss or gradient (--max-bad-steps)"
    return f"error: {why}; {where}{aside}; resume with a lower --lr"


def roll_back(out) -> int | None:
    """After a divergence: an unchecked latest checkpoint goes to ckpt.diverged/ and the one
    before it (ckpt.prev/) becomes ckpt/ again. -> the step --resume now continues from (None:
    no checkpoint before the divergence; --resume starts from the initial model)."""
    final, prev = checkpoint_dir(out), checkpoint_dir(out) + ".prev"
    if distributed.is_main() and has_checkpoint(out) and not is_checked(out):
        shutil.rmtree(final + ".diverged", ignore_errors=True)
        os.replace(final, final + ".diverged")
        if os.path.exists(os.path.join(prev, "state.pt")):
            os.replace(prev, final)
    distributed.barrier()
    return saved_step(final)


def resume_point(out) -> TrainState | None:
    """--resume: the training state to continue from, or None (no checkpoint: the run starts from
    scratch, saying so). Recovers a checkpoint a kill left between the two renames of a save, and
    falls back to ckpt.prev/ where ckpt/ is corrupt (a truncated file), saying so; a corrupt
    checkpoint with nothing to fall back to is an error, not a fresh start."""
    final, prev, failed = checkpoint_dir(out), checkpoint_dir(out) + ".prev", None
    if distributed.is_main():
        if recover_checkpoint(out):
            print(f"--resume: {final} was missing and {prev} complete (a save was killed between its two "
                  "renames): continuing from it", flush=True)
        why = damage(final) if has_checkpoint(out) else None
        if why and damage(prev) is None:
            shutil.rmtree(final + ".corrupt", ignore_errors=True)
            os.replace(final, final + ".corrupt")
            os.replace(prev, final)
            print(f"--resume: {final} is corrupt ({why}; kept as {final}.corrupt): continuing from the "
                  f"checkpoint before it, step {saved_step(final)}", flush=True)
        elif why:
            failed = (f"error: --resume: {final} is corrupt ({why}) and there is no intact checkpoint "
                      "before it; start the run again (--overwrite)")
    failed = distributed.all_gather_list([failed])[0]                  # every rank stops, not only rank 0
    if failed:
        raise SystemExit(failed)
    if not has_checkpoint(out):
        distributed.print0(f"--resume: no complete checkpoint in {final}, starting from scratch")
        return None
    return load_state(out)


def recover_checkpoint(out):
    """A kill between the two renames of a save leaves no ckpt/ and a complete ckpt.prev/ (the
    latest, or the checked one before an unchecked latest): put it back. (ckpt.tmp is never
    trusted: it may be half-written.) Returns True if it did."""
    final, prev = checkpoint_dir(out), checkpoint_dir(out) + ".prev"
    if not has_checkpoint(out) and os.path.exists(os.path.join(prev, "state.pt")):
        shutil.rmtree(final, ignore_errors=True)
        os.replace(prev, final)
        return True
    return False


def damage(ckpt) -> str | None:
    """Why the checkpoint folder cannot be resumed from (state.pt unreadable, a weights file
    shorter than its header says, a missing shard), or None. Reads headers and sizes, not the
    weights."""
    try:        # memory-mapped: the archive's index and records are read and checked, not the tensors
        torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:
        return f"state.pt: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"
    for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        why = _safetensors_damage(path)
        if why:
            return f"{os.path.basename(path)}: {why}"
    if os.path.isdir(os.path.join(ckpt, "dcp")):
        return _dcp_damage(os.path.join(ckpt, "dcp"))
    patterns = ("*.safetensors", "pytorch_model*.bin")
    if not any(glob.glob(os.path.join(ckpt, pattern)) for pattern in patterns):
        return "no weights"
    return None


def _safetensors_damage(path) -> str | None:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (OSError, ValueError) as e:
        return f"unreadable header ({e})"
    if header is None:
        return f"{size} bytes, shorter than its header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return None if size >= 8 + n + end else f"{size} bytes, its header needs {8 + n + end} (truncated)"


def _dcp_damage(dcp_dir) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(dcp_dir).read_metadata()
    except Exception as e:
        return f"dcp/.metadata: {type(e).__name__}"
    for info in md.storage_data.values():
        path = os.path.join(dcp_dir, info.relative_path)
        if not os.path.exists(path) or os.path.getsize(path) < info.offset + info.length:
            return f"dcp/{info.relative_path}: missing or truncated"
    return None


EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def export(model, tokenizer, path, dtype=None, *, bf16=False, record=False):
    """A loadable Hugging Face folder of the current weights (every rank joins under FSDP2), in
    `dtype`: one of EXPORT_DTYPES or a torch.dtype. None / "auto": bfloat16 when the run computed
    in bf16 (`bf16`: distributed.uses_bf16 of the run), else the weights' own dtype (the float32
    master weights of a float32 run, e.g. the tiny world's CPU warm start). A 7B model is 15 GB in
    bfloat16, 30 GB in float32; config.json's "dtype" names the dtype of the files. A write that
    fails (a full disk) ends the process with one line on every rank. record: the run's own final
    export (<out>/hf), whose files and sizes are then written last to EXPORT_RECORD (export_damage)."""
    if not path:
        return
    target = export_dtype(dtype, bf16, next(model.parameters()).dtype)  # (a bad name: before any gather)
    model_sd, _ = distributed.full_state(model)
    failed = None
    if distributed.is_main():
        try:
            distributed.unwrap(model).save_pretrained(path, state_dict=_cast(model_sd, target))
            _set_config_dtype(path, target)
            tokenizer.save_pretrained(path)
            if record:                                  # last: its presence says the rest is complete
                files = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))
                         if os.path.isfile(os.path.join(path, n)) and n != EXPORT_RECORD}
                with open(os.path.join(path, EXPORT_RECORD), "w") as f:
                    f.write(json.dumps({"files": files}, indent=1) + "\n")
        except write_errors() as e:
            failed = f"error: cannot write the export {path} ({write_error(e)})"
    failed = distributed.all_gather_list([failed])[0]
    if failed:
        raise SystemExit(failed)


EXPORT_RECORD = "export_record.json"


def export_damage(path) -> str | None:
    """Why a run's final export (<out>/hf, written with record=True) is not complete and loadable
    (missing; no record, so its export never finished; a file missing, or of another size than
    written; a weights file shorter than its header says), or None. Reads sizes and headers only."""
    if not os.path.isdir(path):
        return "missing"
    try:
        with open(os.path.join(path, EXPORT_RECORD)) as f:
            files = dict(json.load(f)["files"])
    except FileNotFoundError:
        return f"no {EXPORT_RECORD}: its export did not finish"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{EXPORT_RECORD} unreadable"
    for name, size in files.items():
        where = os.path.join(path, name)
        if not os.path.isfile(where):
            return f"{name} missing"
        if os.path.getsize(where) != size:
            return f"{name}: {os.path.getsize(where)} bytes, {size} written"
    for where in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        why = _safetensors_damage(where)
        if why:
            return f"{os.path.basename(where)}: {why}"
    return None if _is_hf_folder(path) else "no config.json or weights"


def export_dtype(name, bf16, weights_dtype) -> torch.dtype:
    """The dtype `export` writes (see there)."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if bf16 else weights_dtype
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r}: choose from {', '.join(EXPORT_DTYPES)}")
    return getattr(torch, name)


def _cast(state_dict, dtype):
    """The state dict's floating-point tensors in `dtype`, replaced in the dict one at a time (a
    gathered float32 copy is freed as it goes: no second copy of the model; the model's own
    parameters are untouched) and on the CPU; tensors already in `dtype` are kept; tied weights stay
    one tensor (save_pretrained finds them by storage)."""
    done = {}
    for k, t in state_dict.items():
        if t.is_floating_point() and t.dtype != dtype:
            # an unconverted tensor's storage is alive (the dict holds it): its address names it
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key not in done:
                done[key] = t.detach().to(device="cpu", dtype=dtype)
            state_dict[k] = done[key]
    return state_dict


def _set_config_dtype(path, dtype):
    """save_pretrained writes the dtype of the model's parameters, not of the state dict it saves."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    name = str(dtype).removeprefix("torch.")
    if cfg.get("dtype") != name:
        cfg["dtype"] = name
        with open(cfg_path, "w") as f:
            f.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")   # as save_pretrained writes it


# ----------------------------------------------------------------------------------------------
# A model to evaluate: an HF folder, a run folder, or a checkpoint (sharded or not)


@dataclass
class ModelSource:
    """What a --model path means: `model` is given to models.load_policy (an HF folder or hub
    id); for the checkpoint of an FSDP2 run, that is the run's initial model (architecture,
    tokenizer, generation config) and the weights then come from the shards in `dcp`."""
    model: str
    dcp: str | None = None
    adapters: str | None = None     # a LoRA run's checkpoint: its adapters, merged into `model` on load


def _is_hf_folder(path) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        glob.glob(os.path.join(path, pattern)) for pattern in ("*.safetensors", "pytorch_model*.bin"))


def find_model(path) -> ModelSource:
    """An HF folder (config.json + weights) as it is; a run folder (runs/erpo) means its ckpt/;
    a checkpoint holding torch.distributed.checkpoint shards (ckpt/dcp/, an FSDP2 run's, final or
    not) is the initial model its run's config.json names, with these weights; a LoRA run's
    checkpoint (adapters only) is that initial model with its adapters merged. A path that is
    not a folder is left to load_policy (a hub id). Anything else: SystemExit with one line."""
    if not os.path.isdir(path) or _is_hf_folder(path):
        return ModelSource(path)
    ckpt = path if os.path.exists(os.path.join(path, "state.pt")) else checkpoint_dir(path)
    if _is_hf_folder(ckpt):
        return ModelSource(ckpt)
    if os.path.isdir(os.path.join(ckpt, "dcp")):
        return ModelSource(_initial_model(ckpt), os.path.join(ckpt, "dcp"))
    if os.path.isfile(os.path.join(ckpt, "adapter_config.json")):   # LoRA: the run's initial model + these
        return ModelSource(_initial_model(ckpt), adapters=ckpt)
    raise SystemExit(f"error: {path} is neither a model folder (config.json and *.safetensors) nor a "
                     "training checkpoint (a run folder, or its ckpt/ with state.pt)")


def _initial_model(ckpt):
    """The "model" of the run's config.json: as written (relative to where the run was started,
    tried from here and from the repository), or a hub id."""
    run = os.path.dirname(os.path.abspath(ckpt))
    cfg_path = os.path.join(run, "config.json")
    try:
        with open(cfg_path) as f:
            model = json.load(f)["model"]
    except (OSError, ValueError, KeyError):
        lora = os.path.isfile(os.path.join(ckpt, "adapter_config.json"))
        what = "LoRA adapters" if lora else "sharded weights"
        raise SystemExit(f"error: {ckpt} holds {what} only; the architecture is the initial model "
                         f"named by {cfg_path} (\"model\"), which cannot be read") from None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's (data/tinymath/...)
    for candidate in (model, os.path.join(root, model)):
        if _is_hf_folder(candidate):
            return candidate
    if os.path.isabs(model) or os.path.exists(model) or model.startswith("."):
        raise SystemExit(f"error: {ckpt}: the run's initial model {model!r} ({cfg_path}), which gives the "
                         "architecture of its sharded weights, is not a model folder from here")
    return model                                       # a hub id


def load_sharded_weights(model, dcp_dir):
    """Fill a plain (unsharded) model with the weights of an FSDP2 checkpoint, in the model's own
    dtype and device: this one process reads every shard (no process group needed, any world size
    the run had). Weights that do not fit the model: SystemExit with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():            # "torch.distributed is disabled ...": as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=dcp_dir, no_dist=True)
    except CheckpointException as e:             # a BaseException: the cause is its last line
        why = [ln for ln in str(e).splitlines() if ln.strip()][-1]
        raise SystemExit(f"error: {dcp_dir}: the checkpoint does not fit the architecture of the run's "
                         f"initial model: {why}") from None
    model.load_state_dict(state["model"])
    return model
