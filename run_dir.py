"""The run folder: config.json, metrics.jsonl, ckpt/ (HF model + tokenizer + training state).

    runs/erpo/
      config.json      every setting of the run
      metrics.jsonl    one JSON line per step (the source of truth for plots and tables)
      query_cache.pt   the Query-KL reference (query_cache.py)
      ckpt/            save_pretrained folder + state.pt (optimizer, scheduler, step, RNG);
                       under FSDP2: dcp/ (torch.distributed.checkpoint shards), tokenizer, state.pt
      ckpt.prev/       the checkpoint before it (the fallback: see "Checkpoints" below)
      hf/              FSDP2 runs: the final save's Hugging Face folder
      .lock            held (an OS lock) by the run that uses the folder

A folder holds one run: a fresh run into a folder that holds one is an error (`claim`), and
`--resume` may change only the options that do not change what the run is (`config_changes`).
A checkpoint is written to ckpt.tmp and renamed into place, so a run killed mid-save keeps its
previous one; `--resume` continues from ckpt/ and drops the metrics lines after its step.
`find_model` + `load_sharded_weights` let evaluate.py load any of these (a run folder, its ckpt/,
sharded or not, or an HF folder).
"""

import glob
import json
import os
import random
import shutil
import socket
import warnings
from dataclasses import dataclass

import torch

import distributed
import faults


def write_config(out, cfg: dict):
    os.makedirs(out, exist_ok=True)
    if distributed.is_main():
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def with_resume_record(out, cfg: dict, step, changed: dict) -> dict:
    """config.json of a run: its options, and under "resumed" every --resume with what it changed
    ({"at_step": 20, "changed": {"lr": [2e-4, 1e-4]}}), so the file says how the run was made."""
    history = (read_config(out) or {}).get("resumed", []) if step is not None else []
    if step is not None:
        history = history + [{"at_step": step, "changed": {k: list(v) for k, v in changed.items()}}]
    return {**cfg, "resumed": history} if history else cfg


def read_config(out) -> dict | None:
    try:
        with open(os.path.join(out, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# One run per folder: never silently overwritten, never two processes at once

# What a run writes into its folder (--overwrite removes these and nothing else: a folder may hold
# the user's own files, e.g. evaluate.py's results of the run).
RUN_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.old", "query_cache.pt", "ckpt", "ckpt.tmp",
             "ckpt.prev", "ckpt.drop", "ckpt.old", "ckpt.diverged", "ckpt.corrupt", "hf", "tensorboard",
             "wandb_id.txt")


def what_run_is_here(out) -> str | None:
    """A short description of the run `out` holds ("a checkpoint at step 20, metrics up to step
    21"), or None when it holds none (missing, empty, or only files a run does not write)."""
    if not os.path.isdir(out):
        return None
    found = []
    for ckpt in (checkpoint_dir(out), checkpoint_dir(out) + ".prev"):
        step = _saved_step(ckpt)
        if step is not None:
            found.append(f"a checkpoint at step {step} ({os.path.basename(ckpt)}/)")
            break
    steps = [r.get("step", 0) for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    if steps:
        found.append(f"metrics up to step {max(steps)}")
    if not found and any(os.path.exists(os.path.join(out, f)) for f in RUN_FILES):
        found.append("the files of a run that stopped before its first step")
    return ", ".join(found) or None


def _saved_step(ckpt) -> int | None:
    """The step of a checkpoint's state.pt, memory-mapped (a DDP run's holds the whole Adam state:
    ~60 GB at 7B, of which this reads a few bytes)."""
    try:
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False, mmap=True)
        return int(state["step"])
    except Exception:  # missing or unreadable: no checkpoint to speak of (resume says more)
        return None


class RunLock:
    """An OS lock on <out>/.lock (flock), held by rank 0 while the run uses the folder. A killed
    process's lock goes with it (the kernel drops it), so a stale lock file never blocks a resume.
    (On network file systems flock may be local to one machine: run one job per folder.)"""

    def __init__(self, out):
        self.out, self.f = out, None

    def acquire(self) -> str | None:
        """Take the lock (idempotent); -> None, or why it cannot be taken (one line)."""
        if self.f is not None or not distributed.is_main():
            return None
        import fcntl

        os.makedirs(self.out, exist_ok=True)
        f = open(os.path.join(self.out, ".lock"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return f"{self.out} is in use by another run ({holder}); wait for it, or use another --out"
        f.seek(0), f.truncate(), f.write(f"pid {os.getpid()} on {socket.gethostname()}\n"), f.flush()
        self.f = f
        return None

    def release(self):
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def check_writable(out, flag="--out") -> str | None:
    """Why `out` cannot be a folder this run writes (a file, not writable), or None."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"{flag} {out} is a file, not a folder"
    parent = out if os.path.isdir(out) else _existing_parent(out)
    if not os.path.isdir(parent):
        return f"{flag} {out}: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {out}: {parent} is not writable"
    return None


def _existing_parent(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def refusal(out, *, resume, overwrite) -> str | None:
    """Why a run may not start in `out` (read-only: main asks before loading anything, and again
    under the lock): not a writable folder, or a fresh run over a run without --overwrite."""
    why = check_writable(out)
    here = None if why or resume or overwrite else what_run_is_here(out)
    if here:
        why = (f"{out} holds a run ({here}); continue it with --resume, choose another --out, "
               "or replace it with --overwrite")
    return why


def claim(out, lock: RunLock, *, resume, overwrite) -> None:
    """Before a run writes anything to `out`: take the lock, check `refusal` again under it, and
    with --overwrite remove the run that is there (its files only). Rank 0 decides; every rank
    exits with the one line."""
    why = None
    if distributed.is_main():
        why = check_writable(out) or lock.acquire() or refusal(out, resume=resume, overwrite=overwrite)
        here = None if why or resume or not overwrite else what_run_is_here(out)
        if here:
            for name in RUN_FILES:
                path = os.path.join(out, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
            print(f"--overwrite: removed the run that was in {out} ({here})", flush=True)
    why = distributed.all_gather_list([why])[0]
    if why:
        lock.release()
        raise SystemExit(f"error: {why}")


def config_changes(saved: dict, now: dict, keys) -> dict:
    """{key: (saved value, new value)} for the `keys` whose value differs (a key the saved config
    lacks, an option newer than the run, is not compared). Paths that name the same file are equal."""
    out = {}
    for k in keys:
        if k in saved and not _same(saved[k], now.get(k)):
            out[k] = (saved[k], now.get(k))
    return out


def _same(a, b) -> bool:
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
        all(_same(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# metrics.jsonl


class MetricsLog:
    """Append-mode JSONL logger (rank 0 writes; other ranks hold a no-op). On resume, lines after
    the checkpoint's step are dropped (they will be recomputed), everything before is kept; a
    fresh run moves an older file aside instead of mixing with it. `mirror` ("tensorboard" or
    "wandb") also sends every numeric value there; metrics.jsonl stays the source of truth."""

    def __init__(self, out, start_step, mirror="jsonl", config=None):
        self.path = os.path.join(out, "metrics.jsonl")
        self.f, self.mirror = None, None
        if not distributed.is_main():
            return
        if mirror != "jsonl":  # first, so a missing package fails before anything is moved
            self.mirror = Mirror(mirror, out, config or {}, start_step)
        os.makedirs(out, exist_ok=True)
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if _step_of(ln) is not None and _step_of(ln) <= start_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif start_step == 0 and os.path.exists(self.path):
            os.replace(self.path, self.path + ".old")
        self.f = open(self.path, "a")

    def __call__(self, m: dict):
        if self.f is None:
            return
        line = json.dumps(m) + "\n"
        faults.point("metrics-write", before=lambda: (self.f.write(line[:len(line) // 2]), self.f.flush()))
        self.f.write(line)
        self.f.flush()
        if self.mirror:
            self.mirror.log(m)

    def close(self):
        if self.f is not None:
            self.f.close()
        if self.mirror:
            self.mirror.close()


class Mirror:
    """TensorBoard (torch.utils.tensorboard) or Weights & Biases, imported only when asked for.
    On resume, TensorBoard drops the killed run's events after the checkpoint (purge_step) and W&B
    continues the same run (its id is kept in the run folder); a fresh run starts clean."""

    def __init__(self, kind, out, config, start_step):
        self.kind = kind
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                logdir = os.path.join(out, "tensorboard")
                if start_step == 0:
                    shutil.rmtree(logdir, ignore_errors=True)
                self.w = SummaryWriter(log_dir=logdir, purge_step=start_step + 1 if start_step else None)
                self.w.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "))
            else:
                import wandb
                self.w = wandb.init(project=os.environ.get("WANDB_PROJECT", "erpo"), dir=out, config=config,
                                    name=os.path.basename(os.path.normpath(out)), id=_wandb_id(out, start_step),
                                    resume="allow")
        except ImportError as e:
            raise SystemExit(f"error: --log {kind} needs the {e.name} package (pip install {kind})") from None

    def log(self, m):
        step = m.get("step", 0)
        scalars = {k: v for k, v in m.items() if k != "step" and isinstance(v, (int, float))}
        if self.kind == "tensorboard":
            for k, v in scalars.items():
                self.w.add_scalar(k, v, step)
            self.w.flush()
        else:
            self.w.log(scalars, step=step)

    def close(self):
        (self.w.close if self.kind == "tensorboard" else self.w.finish)()


def _wandb_id(out, start_step):
    """A new W&B run id for a fresh run, the saved one on resume."""
    path = os.path.join(out, "wandb_id.txt")
    if start_step == 0 or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(os.urandom(6).hex())
    with open(path) as f:
        return f.read().strip()


def _step_of(line):
    """The step of a metrics line, or None for a blank or half-written (killed mid-write) line."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return None


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


def checkpoint_dir(out):
    return os.path.join(out, "ckpt")


def has_checkpoint(out):
    return os.path.exists(os.path.join(checkpoint_dir(out), "state.pt"))


def load_state(out) -> TrainState:
    s = torch.load(os.path.join(checkpoint_dir(out), "state.pt"), map_location="cpu", weights_only=False)
    return TrainState(step=s["step"], opt=s["opt"], sched=s["sched"], rng=s["rng"], py_rng=s["py_rng"])


def is_sharded(out) -> bool:
    """A checkpoint saved by an FSDP2 run: torch.distributed.checkpoint shards, no HF weights."""
    return os.path.isdir(os.path.join(checkpoint_dir(out), "dcp"))


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


def save_checkpoint(out, model, tokenizer, opt, sched, step, final=False, export_dtype=None, bf16=False):
    """Under FSDP2: each rank writes its own shards (torch.distributed.checkpoint), nothing is
    gathered, and the final save also exports a HF folder to <out>/hf (in `export_dtype`, see
    `export`); otherwise a HF folder (save_pretrained) of the float32 master weights with the
    optimizer state. Both with the scheduler/step/RNG state, written to ckpt.tmp and renamed into
    place; the checkpoint it replaces becomes ckpt.prev/ if it was checked (see `mark_checked`).
    Two checkpoints on disk: at 7B without FSDP2, ~90 GB each (float32 weights + Adam state)."""
    if final and distributed.is_fsdp(model):
        export(model, tokenizer, os.path.join(out, "hf"), export_dtype, bf16=bf16)
    tmp = os.path.join(out, "ckpt.tmp")
    if distributed.is_main():
        for leftover in (tmp, checkpoint_dir(out) + ".drop"):  # from a run killed mid-save
            shutil.rmtree(leftover, ignore_errors=True)
    distributed.barrier()
    if distributed.is_fsdp(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp"))
        model_sd = opt_sd = None
    else:
        model_sd, opt_sd = distributed.full_state(model, opt)
    if distributed.is_main():
        _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step)
    distributed.barrier()


def _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step):
    tmp, final, prev = os.path.join(out, "ckpt.tmp"), checkpoint_dir(out), checkpoint_dir(out) + ".prev"
    if model_sd is not None:
        distributed.unwrap(model).save_pretrained(tmp, state_dict=model_sd)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "opt": opt_sd, "sched": sched.state_dict(),
                "rng": torch.get_rng_state(), "py_rng": random.getstate()}, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        if is_checked(out):         # it has given a finite loss: it becomes the fallback
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(final, prev)
        else:                       # never checked: the fallback stays the (checked) one before it
            shutil.rmtree(final + ".drop", ignore_errors=True)
            os.replace(final, final + ".drop")
        faults.point("ckpt-rename")  # the window recover_checkpoint() closes
    os.replace(tmp, final)
    shutil.rmtree(final + ".drop", ignore_errors=True)


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
    return _saved_step(final)


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
                  f"checkpoint before it, step {_saved_step(final)}", flush=True)
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


def export(model, tokenizer, path, dtype=None, *, bf16=False):
    """A loadable Hugging Face folder of the current weights (every rank joins under FSDP2), in
    `dtype`: one of EXPORT_DTYPES or a torch.dtype. None / "auto": bfloat16 when the run computed
    in bf16 (`bf16`: distributed.uses_bf16 of the run), else the weights' own dtype (the float32
    master weights of a float32 run, e.g. the tiny world's CPU warm start). A 7B model is 15 GB in
    bfloat16, 30 GB in float32; config.json's "dtype" names the dtype of the files."""
    if not path:
        return
    target = export_dtype(dtype, bf16, next(model.parameters()).dtype)  # (a bad name: before any gather)
    model_sd, _ = distributed.full_state(model)
    if distributed.is_main():
        distributed.unwrap(model).save_pretrained(path, state_dict=_cast(model_sd, target))
        _set_config_dtype(path, target)
        tokenizer.save_pretrained(path)


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
    """What a --model path means: `model` is given to rollout.load_policy (an HF folder or hub
    id); for the checkpoint of an FSDP2 run, that is the run's initial model (architecture,
    tokenizer, generation config) and the weights then come from the shards in `dcp`."""
    model: str
    dcp: str | None = None


def _is_hf_folder(path) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        glob.glob(os.path.join(path, pattern)) for pattern in ("*.safetensors", "pytorch_model*.bin"))


def find_model(path) -> ModelSource:
    """An HF folder (config.json + weights) as it is; a run folder (runs/erpo) means its ckpt/;
    a checkpoint holding torch.distributed.checkpoint shards (ckpt/dcp/, an FSDP2 run's, final or
    not) is the initial model its run's config.json names, with these weights. A path that is
    not a folder is left to load_policy (a hub id). Anything else: SystemExit with one line."""
    if not os.path.isdir(path) or _is_hf_folder(path):
        return ModelSource(path)
    ckpt = path if os.path.exists(os.path.join(path, "state.pt")) else checkpoint_dir(path)
    if _is_hf_folder(ckpt):
        return ModelSource(ckpt)
    if os.path.isdir(os.path.join(ckpt, "dcp")):
        return ModelSource(_initial_model(ckpt), os.path.join(ckpt, "dcp"))
    raise SystemExit(f"error: {path} is neither a model folder (config.json and *.safetensors) nor a training "
                     "checkpoint (a run folder, or its ckpt/ with state.pt)")


def _initial_model(ckpt):
    """The "model" of the run's config.json: as written (relative to where the run was started,
    tried from here and from the repository), or a hub id."""
    run = os.path.dirname(os.path.abspath(ckpt))
    cfg_path = os.path.join(run, "config.json")
    try:
        with open(cfg_path) as f:
            model = json.load(f)["model"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"error: {ckpt} holds sharded weights only; the architecture is the initial model named "
                         f"by {cfg_path} (\"model\"), which cannot be read") from None
    for candidate in (model, os.path.join(os.path.dirname(os.path.abspath(__file__)), model)):
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
        raise SystemExit(f"error: {dcp_dir}: the checkpoint does not fit the architecture of the run's initial "
                         f"model: {why}") from None
    model.load_state_dict(state["model"])
    return model


# ----------------------------------------------------------------------------------------------
# Append-only JSONL files (metrics.jsonl, evaluate.py's samples.jsonl)


def read_jsonl(path) -> list[dict]:
    """Records of a JSONL file we append to; a half-written line (a kill mid-write) is skipped.
    A missing file has no records."""
    records = []
    if not os.path.isfile(path):
        return records
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def drop_partial_line(path):
    """Cut a half-written last line (the writer was killed mid-write) so appends start clean."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


# ----------------------------------------------------------------------------------------------
# The end of a run


def summary(out, wall_s, eval_sets=(), template="plain") -> str:
    """What changed and where things are, from metrics.jsonl (so a resumed run reports the whole
    run): held-out accuracy first -> last per set, the final KLs and entropy, and what to run next."""
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    evals = [r for r in rows if "eval_acc" in r]
    last = next((r for r in reversed(rows) if "query_kl" in r or "sft_loss" in r), {})
    lines = [f"done: {len(rows) and rows[-1].get('step', 0)} steps in {wall_s / 60:.1f} min (this process)"]
    for name in eval_sets:
        key = f"eval_acc/{name}"
        pts = [r for r in evals if key in r]
        if pts:
            lines.append(f"  held-out {name:12s} {100 * pts[0][key]:5.1f}% (step {pts[0]['step']}) -> "
                         f"{100 * pts[-1][key]:5.1f}% (step {pts[-1]['step']})")
    finals = [f"{k} {last[k]:.4g}" for k in ("query_kl", "policy_kl", "entropy", "sft_loss") if k in last]
    if finals:
        lines.append(f"  final (step {last.get('step')}): " + ", ".join(finals))
    skipped = sum(r.get("skipped_steps", 0) for r in rows)
    if skipped:
        lines.append(f"  skipped optimizer steps (non-finite loss or gradient): {skipped}")
    ckpt, saved = checkpoint_dir(out), sorted(glob.glob(os.path.join(out, "sft-*")))
    where = f", checkpoint {ckpt}/" if has_checkpoint(out) else \
        (f", SFT exports {saved[0]} ... {saved[-1]}" if saved else ", no checkpoint (--save-every 0)")
    lines += [f"  run folder {out}/ (metrics.jsonl, config.json){where}",
              "next:",
              f"  python analysis.py runs {out} --out {out}/plots        # KL and train vs held-out curves"]
    if has_checkpoint(out):
        ckpt = os.path.join(out, "hf") if is_sharded(out) else ckpt  # sharded: the final HF export
        lines.append(f"  python evaluate.py --model {ckpt} --benchmarks {' '.join(eval_sets) or 'tiny'} "
                     f"--template {template} --out {out}/eval   # the paper's protocol")
    return "\n".join(lines)
