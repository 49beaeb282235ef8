"""What an evaluation folder (evaluate.py --out) holds, and when a command may add samples to it.

- samples.jsonl (SAMPLES_FILE): one record per sample, appended as the sweep goes; a torchrun sweep
  killed before its merge also leaves samples.rank<r>.jsonl (`sample_files`, `recorded_models`,
  `kept_samples`).
- config.json, the folder's resume key: the settings that change what a sample is
  (`sample_settings`: GENERATION_KEYS, the dtype resolved by `sampling_dtype`) and a fingerprint
  of each model's weight files (`weights_fingerprint`: a few KB read, no model loaded).
  `check_config` refuses a command whose key differs from the one the folder's samples were made
  under; `write_config` writes the key whole.
"""

import glob
import hashlib
import json
import os
import struct

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
# A model's weights are told apart, without loading them, by this many reads of this many bytes
# spread evenly over the data of each weight file: retraining changes every weight, so every read
# sees the change, and 4 KiB per file costs nothing even for a 7B checkpoint.
FINGERPRINT_READS = 16
FINGERPRINT_READ_BYTES = 256
# The safetensors format's own limit on its JSON header: a longer "header" means a corrupt file.
SAFETENSORS_MAX_HEADER = 100_000_000


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


def weight_files(src: checkpoints.ModelSource) -> list[str]:
    """The files a --model's weights are read from: an FSDP2 checkpoint's dcp/ folder (its
    .metadata and shards), or an HF folder's *.safetensors / pytorch_model*.bin; none for a hub id."""
    if src.dcp:
        names = [os.path.join(src.dcp, name) for name in os.listdir(src.dcp)]
        return sorted(p for p in names if os.path.isfile(p))
    if not os.path.isdir(src.model):
        return []
    patterns = ("*.safetensors", "pytorch_model*.bin")
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(src.model, pattern)))


def _safetensors_header_size(f, size) -> int:
    """Bytes before the tensor data of a safetensors file: its 8-byte little-endian length, then
    the JSON header of that length. 0 for a file too short or too corrupt to hold one."""
    if size < 8:
        return 0
    (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length if length <= min(size - 8, SAFETENSORS_MAX_HEADER) else 0


def file_fingerprint(path) -> bytes:
    """One weight file's name, size, safetensors header (names, shapes, dtypes, offsets) and
    FINGERPRINT_READS reads spread evenly over its data, first and last bytes included."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        start = _safetensors_header_size(f, size) if path.endswith(".safetensors") else 0
        f.seek(0)
        h.update(f.read(start))
        last = max(size - start - FINGERPRINT_READ_BYTES, 0)       # the offset of the last read
        for i in range(FINGERPRINT_READS):
            f.seek(start + last * i // (FINGERPRINT_READS - 1))
            h.update(f.read(FINGERPRINT_READ_BYTES))
    return h.digest()


def weights_fingerprint(src: checkpoints.ModelSource) -> str:
    """A fingerprint of the weights a --model stands for, from a few KB of its files (no model is
    loaded): a checkpoint retrained or replaced at the same path gets another one. A hub id is its
    own fingerprint (the hub's copy is not read)."""
    files = weight_files(src)
    if not files:
        return f"hub:{src.model}"
    h = hashlib.sha256()
    for path in files:
        h.update(file_fingerprint(path))
    return h.hexdigest()[:16]


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


def check_config(out_dir, settings, fingerprints, ignore=()):
    """The resume key: ValueError (one line, naming what differs) when out_dir already holds
    samples made under other settings, or samples of one of `fingerprints`' model keys from other
    weights. Only samples on disk make a folder refuse: a command that stopped before writing one
    (a crash while loading, a prompt too long) leaves nothing a corrected command has to match.
    Read only, so every rank of a torchrun sweep checks and all stop together. A config.json of an
    older evaluate.py (no dtype, no fingerprints: NEWER_KEYS) accepts any value of what it does not
    hold; `ignore`: settings not compared (evaluate.main: --dtype auto where nothing is left to sample)."""
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
    stale = [key for key, fp in fingerprints.items() if key in recorded and known.get(key, fp) != fp]
    if stale:
        raise ValueError(f"{out_dir} holds samples of {stale[0]} made from other weights (its weight files "
                         "changed since: retrained?); use another --out, or another --labels name")


def write_config(out_dir, settings, fingerprints):
    """config.json = this command's settings and fingerprints (kept: those of models it does not
    evaluate). Written whole or not at all (a kill mid-write must not leave it unreadable)."""
    path = os.path.join(out_dir, "config.json")
    known = (read_config(out_dir) or {}).get("models", {})
    config = {**settings, "models": {**known, **fingerprints}}
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(path + ".tmp", path)


def kept_samples(out_dir) -> str:
    """What an interrupted sweep leaves behind, and how to go on (all of it is on disk: every
    finished chunk was flushed)."""
    paths = [p for p in sample_files(out_dir) if os.path.isfile(p)] or [os.path.join(out_dir, SAMPLES_FILE)]
    count = sum(len(run_dir.read_jsonl(p)) for p in paths)
    where = paths[0] if len(paths) == 1 else os.path.join(out_dir, "samples*.jsonl")
    return f"{count} samples are in {where}; rerun the same command to continue"
