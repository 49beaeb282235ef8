"""What an evaluation folder (evaluate.py --out) holds, and when a command may add samples to it.

- samples.jsonl (SAMPLES_FILE): one record per sample, appended as the sweep goes; a torchrun sweep
  killed before its merge also leaves samples.rank<r>.jsonl (`sample_files`, `recorded_models`,
  `kept_samples`).
- config.json, the folder's resume key: the settings that change what a sample is
  (`sample_settings`: GENERATION_KEYS, the dtype resolved by `sampling_dtype`) and a fingerprint
  of each model's weight and definition files (`weights_fingerprint`: every byte hashed, no model
  loaded).
  `check_config` refuses a command whose key differs from the one the folder's samples were made
  under; `write_config` writes the key whole.
- each sample record names the version of its benchmark row (`row_digest`): `check_rows` refuses
  a command whose rows changed since (an edited gold answer).
- `not_an_eval_folder`: an --out that holds anything else (a training run, a model) is refused
  before anything is written.
"""

import glob
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

from plumbing import checkpoints, run_dir

SAMPLES_FILE = "samples.jsonl"
# Settings that change what a sample is: a resumed run must use the same ones (and the same weights:
# weights_fingerprint). dtype is the one the models sample in, "auto" resolved.
GENERATION_KEYS = ["template", "max_new_tokens", "top_p", "seed", "sampler", "seed_scheme", "dtype", "task"]
# Keys a config.json of an older evaluate.py may lack (any value then matches); any other missing
# key is a difference (a folder without "seed_scheme" was sampled with the SHA-256 seeds).
NEWER_KEYS = {"dtype", "task"}
# How per-sample seeds are made; a folder sampled under another scheme (before: SHA-256 keys) must
# not be resumed with new samples mixed in.
SEED_SCHEME = "rollout.row_seed"
# A model's weights are told apart, without loading them, by a SHA-256 of every byte of every weight
# file: a few reads spread over a file miss a tensor edited in place (they read 15 of the tiny
# model's 50 tensors). Cost, measured here (2-core EPYC, files in the page cache): ~1.5 GB/s per
# core, the files hashed in parallel (hashlib releases the GIL): 1.6 GB in 4 files took 1.05 s on
# one core, 0.55 s on two. A 7B bf16 checkpoint (15 GB in 4 files): ~10 s on one core, ~3 s on
# four, plus the disk read if it is not cached; against hours of sampling. The prefix names the
# scheme: a bare 16-hex fingerprint is an older evaluate.py's (16 reads of 256 bytes per file),
# checked the way it was made (_sampled_fingerprint).
FINGERPRINT_SCHEME = "sha256:"
HASH_CHUNK = 8 << 20
# Beside its weights, what makes a model folder sample what it samples, hashed the same way (a few
# KB): its architecture, its generation config (the end-of-sequence ids), its tokenizer and chat
# template (the prompt).
DEFINITION_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "vocab.*", "merges.txt", "spiece.model",
                    "adapter_config.json")                             # (a LoRA checkpoint's adapters)
FINGERPRINT_READS = 16
FINGERPRINT_READ_BYTES = 256
# The safetensors format's own limit on its JSON header: a longer "header" means a corrupt file.
SAFETENSORS_MAX_HEADER = 100_000_000
# What evaluate.py writes into --out: a folder that holds anything else and no resume key of its own
# (a training run, a model folder) is not an evaluation folder, and is refused (not_an_eval_folder).
EVAL_FILES = {"config.json", "config.json.tmp", SAMPLES_FILE, "summary.json", "results.md",
              "accuracy_vs_temperature.png"}


def sampling_dtype(dtype, device) -> str:
    """The dtype the models sample in: --dtype, or for "auto" models.load_policy's choice
    (bfloat16 on CUDA, float32 otherwise). It is passed to the loader resolved, so the resume key
    names the dtype the samples were really made in."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def sample_settings(args, device) -> dict:
    """The GENERATION_KEYS of this command: what every sample of one folder is made under."""
    derived = {"seed_scheme": SEED_SCHEME, "dtype": sampling_dtype(args.dtype, device)}
    return {k: derived[k] if k in derived else getattr(args, k) for k in GENERATION_KEYS}



def model_files(src: checkpoints.ModelSource) -> list[str]:
    """The files a --model's samples depend on: its weight files, then its definition files."""
    if not os.path.isdir(src.model):
        return weight_files(src)
    folders = [src.model, *([src.adapters] if src.adapters else [])]      # (a LoRA checkpoint's too)
    defs = {p for f in folders for pattern in DEFINITION_FILES for p in glob.glob(os.path.join(f, pattern))}
    return weight_files(src) + sorted(p for p in defs if os.path.isfile(p))


def weight_files(src: checkpoints.ModelSource) -> list[str]:
    """The files a --model's weights are read from: an FSDP2 checkpoint's dcp/ folder (its
    .metadata and shards), or an HF folder's *.safetensors / pytorch_model*.bin (a LoRA checkpoint:
    its initial model's and its adapters'); none for a hub id."""
    if src.dcp:
        names = [os.path.join(src.dcp, name) for name in os.listdir(src.dcp)]
        return sorted(p for p in names if os.path.isfile(p))
    if not os.path.isdir(src.model):
        return []
    patterns = ("*.safetensors", "pytorch_model*.bin")
    folders = [src.model, *([src.adapters] if src.adapters else [])]
    return sorted(p for f in folders for pattern in patterns for p in glob.glob(os.path.join(f, pattern)))


def file_fingerprint(path) -> bytes:
    """SHA-256 of one file's name and every byte of it, read HASH_CHUNK at a time."""
    h = hashlib.sha256(f"{os.path.basename(path)}:".encode())
    buf = bytearray(HASH_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.digest()


def weights_fingerprint(src: checkpoints.ModelSource) -> str:
    """A fingerprint of the model a --model stands for, from every byte of its weight files and of
    its definition files (model_files; no model is loaded): a checkpoint retrained, replaced or
    edited in place at the same path (its weights, its config, its tokenizer or chat template) gets
    another one. A hub id is its own fingerprint (the hub's copy is not read)."""
    if not weight_files(src):
        return f"hub:{src.model}"
    files = model_files(src)
    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_fingerprint, files))
    return FINGERPRINT_SCHEME + hashlib.sha256(b"".join(digests)).hexdigest()[:16]


def _safetensors_header_size(f, size) -> int:
    """Bytes before the tensor data of a safetensors file: its 8-byte little-endian length, then
    the JSON header of that length. 0 for a file too short or too corrupt to hold one."""
    if size < 8:
        return 0
    (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length if length <= min(size - 8, SAFETENSORS_MAX_HEADER) else 0


def _sampled_fingerprint(src: checkpoints.ModelSource) -> str:
    """An older evaluate.py's fingerprint: each file's name, size, safetensors header and 16 reads
    of 256 bytes spread over its data. Only to check a folder it made; new folders get the full one."""
    h = hashlib.sha256()
    for path in weight_files(src):
        size = os.path.getsize(path)
        one = hashlib.sha256(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            start = _safetensors_header_size(f, size) if path.endswith(".safetensors") else 0
            f.seek(0)
            one.update(f.read(start))
            last = max(size - start - FINGERPRINT_READ_BYTES, 0)       # the offset of the last read
            for i in range(FINGERPRINT_READS):
                f.seek(start + last * i // (FINGERPRINT_READS - 1))
                one.update(f.read(FINGERPRINT_READ_BYTES))
        h.update(one.digest())
    return h.hexdigest()[:16]


def same_weights(recorded, fingerprint, src: checkpoints.ModelSource | None = None) -> bool:
    """Were a folder's samples of a model made from the weights of `fingerprint`? `recorded`: the
    folder's fingerprint of it (None: an older config.json without fingerprints, any matches); an
    older evaluate.py's sampled one is checked against `src` the way it was made."""
    if recorded is None or recorded == fingerprint:
        return True
    is_sampled = ":" not in recorded and src is not None and weight_files(src)
    return bool(is_sampled) and recorded == _sampled_fingerprint(src)


def sample_files(out_dir) -> list[str]:
    """samples.jsonl, then the per-rank files of a torchrun sweep not merged yet (killed)."""
    shards = sorted(glob.glob(os.path.join(out_dir, "samples.rank*.jsonl")))
    return [os.path.join(out_dir, SAMPLES_FILE), *shards]


def recorded_models(out_dir) -> set:
    """The model keys that have samples in out_dir."""
    return {r["model"] for path in sample_files(out_dir) for r in run_dir.read_jsonl(path)}


def read_config(out_dir) -> dict | None:
    """The resume key an output folder was sampled under: {} when it has none yet, None when its
    config.json cannot be read (evaluate.py writes it whole: someone edited it)."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def _setting_name(key):
    """How a user sets a GENERATION_KEYS entry (the seed scheme is the code's, not a flag)."""
    return "the seed scheme" if key == "seed_scheme" else "--" + key.replace("_", "-")


def check_config(out_dir, settings, fingerprints, ignore=(), sources=None):
    """The resume key: ValueError (one line, naming what differs) when out_dir already holds
    samples made under other settings, or samples of one of `fingerprints`' model keys from other
    weights. Only samples on disk make a folder refuse: a command that stopped before writing one
    (a crash while loading, a prompt too long) leaves nothing a corrected command has to match.
    Read only, so every rank of a torchrun sweep checks and all stop together. A config.json of an
    older evaluate.py (no dtype, no fingerprints: NEWER_KEYS) accepts any value of what it does not
    hold; `ignore`: settings not compared (evaluate.main: --dtype auto where nothing is left to sample);
    `sources`: {model key: checkpoints.ModelSource}, to check an older evaluate.py's fingerprints."""
    before = read_config(out_dir)
    recorded = recorded_models(out_dir) if before != {} else set()
    if not recorded:
        return
    if before is None:
        raise ValueError(f"{out_dir}/config.json, the settings its samples were made under, cannot be read; "
                         "use another --out")
    compared = [k for k in GENERATION_KEYS if k not in ignore and (k in before or k not in NEWER_KEYS)]
    changed = [k for k in compared if before.get(k) != settings[k]]
    if changed:
        diffs = ", ".join(f"{_setting_name(k)} {before.get(k)} (now {settings[k]})" for k in changed)
        raise ValueError(f"{out_dir} holds samples made with other settings: {diffs}; use another --out")
    known = before.get("models", {})
    stale = [key for key, fp in fingerprints.items()
             if key in recorded and not same_weights(known.get(key), fp, (sources or {}).get(key))]
    if stale:
        raise ValueError(f"{out_dir} holds samples of {stale[0]} made from other weights (its weight, config "
                         "or tokenizer files changed since: retrained?); use another --out, or another "
                         "--labels name")


def write_config(out_dir, settings, fingerprints):
    """config.json = this command's settings and fingerprints (kept: those of models it does not
    evaluate). Written whole or not at all (a kill mid-write must not leave it unreadable)."""
    path = os.path.join(out_dir, "config.json")
    known = (read_config(out_dir) or {}).get("models", {})
    config = {**settings, "models": {**known, **fingerprints}}
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(path + ".tmp", path)


def row_digest(row: dict) -> str:
    """The version of a benchmark row a sample was made and graded from: a digest of the whole row
    as loaded (problem, gold answer, a task's own fields), stored in each sample record."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_rows(out_dir, benches: dict):
    """ValueError (one line) when out_dir holds samples of a problem of `benches` ({label: rows})
    made from another version of its row: its file was edited since (a corrected gold answer).
    Refused rather than re-graded: a sample is its prompt's and a grade its row's, and from a
    record alone one cannot tell an edited answer (re-gradable) from an edited problem (a sample of
    another prompt); refusing rewrites nothing, so no sample is lost, and every rank checks the same
    files read-only, so all stop together. Records of an older evaluate.py (no digest) are checked by
    the gold answer they stored."""
    current = {(b, str(r["id"])): r for b, rows in benches.items() for r in rows}
    for path in sample_files(out_dir):
        for rec in run_dir.read_jsonl(path):
            row = current.get((rec.get("benchmark"), str(rec.get("id"))))
            if row is None:
                continue
            same = rec["row"] == row_digest(row) if "row" in rec else rec.get("answer") == row["answer"]
            if not same:
                raise ValueError(f"{out_dir} holds samples of {rec['benchmark']} problem {rec['id']} made "
                                 "from another version of its row (the file changed since: an edited gold "
                                 "answer or problem?); use another --out")


def _some(names, shown=3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _is_resume_key(config) -> bool:
    """A config.json evaluate.py wrote (an older one's too): settings of GENERATION_KEYS and models."""
    keys = set(config) if isinstance(config, dict) else set()
    return keys <= {*GENERATION_KEYS, "models"} and {"template", "max_new_tokens"} <= keys


def not_an_eval_folder(out) -> str | None:
    """Why `out` may not be evaluate.py's --out, or None: a missing or empty folder, or one with the
    resume key evaluate.py writes (the user's own files beside it stay). A training run (its
    config.json would be replaced: it could no longer resume), a config.json of anything else (a
    model folder), samples without their resume key, or a folder of other files is refused."""
    if not os.path.isdir(out) or not os.listdir(out):
        return None
    config = read_config(out)
    run = [f for f in run_dir.RUN_FILES if f != "config.json" and os.path.exists(os.path.join(out, f))]
    if run or isinstance(config, dict) and "algo" in config:          # (checked first: a run is never
        what = run_dir.what_run_is_here(out)                           # written into, whatever its config)
        return (f"--out {out} holds a training run ({what}): evaluate.py would replace its config.json; "
                f"give the evaluation a folder of its own (e.g. --out {os.path.join(out, 'eval')})")
    if _is_resume_key(config):
        return None
    if config != {}:
        return (f"--out {out} holds a config.json that is not evaluate.py's resume key (" +
                ("it cannot be read" if config is None else f"its keys: {_some(sorted(config))}") +
                "); use another --out")
    other = sorted(f for f in os.listdir(out) if f not in EVAL_FILES and not f.startswith("samples.rank"))
    if other:
        return (f"--out {out} holds files evaluate.py does not write ({_some(other)}); "
                "use a new or empty folder")
    if any(os.path.isfile(p) for p in sample_files(out)):
        return f"--out {out} holds samples but not the config.json they were made under; use another --out"
    return None


def kept_samples(out_dir) -> str:
    """What an interrupted sweep leaves behind, and how to go on (all of it is on disk: every
    finished chunk was flushed)."""
    paths = [p for p in sample_files(out_dir) if os.path.isfile(p)] or [os.path.join(out_dir, SAMPLES_FILE)]
    count = sum(len(run_dir.read_jsonl(p)) for p in paths)
    where = paths[0] if len(paths) == 1 else os.path.join(out_dir, "samples*.jsonl")
    return f"{count} samples are in {where}; rerun the same command to continue"
