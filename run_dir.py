"""The run folder: config.json, metrics.jsonl, ckpt/ (HF model + tokenizer + training state).

    runs/erpo/
      config.json      every setting of the run
      metrics.jsonl    one JSON line per step (the source of truth for plots and tables)
      query_cache.pt   the Query-KL reference (query_cache.py)
      ckpt/            save_pretrained folder + state.pt (optimizer, scheduler, step, RNG)

A checkpoint is written to ckpt.tmp and renamed into place, so a run killed mid-save keeps its
previous one; `--resume` continues from ckpt/ and drops the metrics lines after its step.
"""

import json
import os
import random
import shutil
from dataclasses import dataclass

import torch

import distributed


def write_config(out, cfg: dict):
    os.makedirs(out, exist_ok=True)
    if distributed.is_main():
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


# ----------------------------------------------------------------------------------------------
# metrics.jsonl


class MetricsLog:
    """Append-mode JSONL logger (rank 0 writes; other ranks hold a no-op). On resume, lines after
    the checkpoint's step are dropped (they will be recomputed), everything before is kept; a
    fresh run moves an older file aside instead of mixing with it."""

    def __init__(self, out, start_step):
        self.path = os.path.join(out, "metrics.jsonl")
        self.f = None
        if not distributed.is_main():
            return
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if _step_of(ln) is not None and _step_of(ln) <= start_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif start_step == 0 and os.path.exists(self.path):
            os.replace(self.path, self.path + ".old")
        self.f = open(self.path, "a")

    def __call__(self, m: dict):
        if self.f is not None:
            self.f.write(json.dumps(m) + "\n")
            self.f.flush()


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


def restore_rng(state: TrainState):
    torch.set_rng_state(state.rng)
    random.setstate(state.py_rng)


def save_checkpoint(out, model, tokenizer, opt, sched, step):
    """HF folder (save_pretrained, safetensors) + optimizer/scheduler/step/RNG state. Every rank
    joins (gathering the full state is a collective under FSDP2); rank 0 writes."""
    model_sd, opt_sd = distributed.full_state(model, opt)
    if distributed.is_main():
        _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step)
    distributed.barrier()


def _write_checkpoint(out, model, model_sd, opt_sd, tokenizer, sched, step):
    tmp, final = os.path.join(out, "ckpt.tmp"), checkpoint_dir(out)
    for leftover in (tmp, final + ".old"):  # from a run killed mid-save
        shutil.rmtree(leftover, ignore_errors=True)
    distributed.unwrap(model).save_pretrained(tmp, state_dict=model_sd)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "opt": opt_sd, "sched": sched.state_dict(),
                "rng": torch.get_rng_state(), "py_rng": random.getstate()}, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def export(model, tokenizer, path):
    """A loadable Hugging Face folder of the current weights (every rank joins under FSDP2)."""
    if not path:
        return
    model_sd, _ = distributed.full_state(model)
    if distributed.is_main():
        distributed.unwrap(model).save_pretrained(path, state_dict=model_sd)
        tokenizer.save_pretrained(path)


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
