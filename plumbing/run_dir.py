"""The run folder: config.json, metrics.jsonl, ckpt/ (checkpoints.py), one run per folder.

    runs/erpo/
      config.json      every setting of the run
      metrics.jsonl    one JSON line per step (the source of truth for plots and tables)
      query_cache.pt   the initial policy's prompt log-probs (rl/query_reference.py)
      ckpt/            the checkpoint (checkpoints.py): HF folder or dcp/ shards + state.pt
      ckpt.prev/       the checkpoint before it (the fallback)
      hf/              FSDP2 runs: the final save's Hugging Face folder
      .lock            held (an OS lock) by the run that uses the folder

A folder holds one run: a fresh run into a folder that holds one is an error (`claim`), and
`--resume` may change only the options that do not change what the run is (`config_changes`);
`--resume` continues from ckpt/ and drops the metrics lines after its step (MetricsLog).
"""

import json
import os
import shutil
import socket

import losses
from plumbing import checkpoints, distributed, faults, options


def write_config(out, cfg: dict):
    os.makedirs(out, exist_ok=True)
    if distributed.is_main():
        write_whole(os.path.join(out, "config.json"), json.dumps(cfg, indent=2))


def write_whole(path, text):
    """Replace a file by `text` all at once (written beside it, then renamed): a full disk leaves
    the old file as it was and ends the run with one line, instead of leaving it cut short."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SystemExit(f"error: cannot write {path} ({e.strerror or e}); it is as it was") from None


def with_resume_record(out, cfg: dict, step, changed: dict, older=None) -> dict:
    """config.json of a run: its options, and under "resumed" every --resume with what it changed
    ({"at_step": 20, "changed": {"lr": [2e-4, 1e-4]}}) and the options its older config.json lacked
    ("added": {"no_signal": "step"}, older_config), so the file says how the run was made."""
    history = (read_config(out) or {}).get("resumed", []) if step is not None else []
    if step is not None:
        history = history + [{"at_step": step, "changed": {k: list(v) for k, v in changed.items()},
                              **({"added": older} if older else {})}]
    return {**cfg, "resumed": history} if history else cfg


def older_config(args, not_the_run, before: dict) -> dict:
    """--resume of a run whose config.json an older version wrote: {option: the value this run
    takes} for every option the file lacks (train.parse_args filled them: the value before the
    option existed, `before` = train.BEFORE_OPTION, else today's default), said in one line."""
    saved, now = read_config(args.out), vars(args)
    if not saved:
        return {}
    lacked = {k: now[k] for k in sorted(now) if k not in saved and k not in not_the_run}
    if lacked:
        said = ", ".join(f"{k} {short(v, 30)}{' (as before the option)' if k in before else ''}"
                         for k, v in lacked.items())
        distributed.print0(f"--resume: {args.out}/config.json (an older version's) lacks {len(lacked)} "
                           "options newer than the run; they take the values that keep how it trained where "
                           f"those differ, else today's (None: the algorithm's own): {said}")
    return lacked


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
             "wandb_id.txt", "config.json.tmp", "metrics.jsonl.tmp")


def what_run_is_here(out) -> str | None:
    """A short description of the run `out` holds ("a checkpoint at step 20, metrics up to step
    21"), or None when it holds none (missing, empty, or only files a run does not write)."""
    if not os.path.isdir(out):
        return None
    found = []
    for ckpt in (checkpoints.checkpoint_dir(out), checkpoints.checkpoint_dir(out) + ".prev"):
        step = checkpoints.saved_step(ckpt)
        if step is not None:
            found.append(f"a checkpoint at step {step} ({os.path.basename(ckpt)}/)")
            break
    steps = [r.get("step", 0) for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    if steps:
        found.append(f"metrics up to step {max(steps)}")
    if not found and any(os.path.exists(os.path.join(out, f)) for f in RUN_FILES):
        found.append("the files of a run that stopped before its first step")
    return ", ".join(found) or None


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

        path, parent, f = os.path.join(self.out, ".lock"), _existing_parent(self.out), None
        had_lock = os.path.exists(path)
        try:
            os.makedirs(self.out, exist_ok=True)
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                return f"{self.out} is in use by another run ({holder}); wait for it, or use another --out"
            f.seek(0), f.truncate(), f.write(f"pid {os.getpid()} on {socket.gethostname()}\n"), f.flush()
        except OSError as e:                        # a full disk: what it made goes, the folder too
            if f is not None:
                f.close()
            if not had_lock and os.path.exists(path):
                os.remove(path)
            remove_empty_folders(self.out, parent)
            return f"cannot write {self.out} ({e.strerror or e})"
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


def remove_empty_folders(path, stop):
    """Remove `path` and the folders above it up to `stop` (not included) while they are empty:
    the folders a command made before a write failed."""
    path, stop = os.path.abspath(path), os.path.abspath(stop)
    while path != stop and path.startswith(stop + os.sep):
        try:
            os.rmdir(path)
        except OSError:
            return
        path = os.path.dirname(path)


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


def refusal(out, *, resume, overwrite, export=None, log="jsonl", reads=None) -> str | None:
    """Why a run may not start in `out` (read-only: main asks before loading anything, and again
    under the lock): not a writable folder, a fresh run over a run without --overwrite, an --export
    folder that cannot be written or overlaps a run folder (export_overlap), --log's package
    missing, a file the run reads (`reads`: {flag: path}) among what --overwrite removes.
    Everything here is asked before `claim`, which with --overwrite removes the run that is there."""
    why = check_writable(out)
    here = None if why or resume or overwrite else what_run_is_here(out)
    if here:
        why = (f"{out} holds a run ({here}); continue it with --resume, choose another --out, "
               "or replace it with --overwrite")
    return why or (export and (check_writable(export, "--export") or export_overlap(export, out))) or \
        missing_package(log) or read_refusal(reads or {}, out, overwrite)


def read_refusal(reads: dict, out, overwrite) -> str | None:
    """Why an input the run reads ({flag: path}, e.g. --qkl-ref-model) would be gone when read: it is
    among the run files --overwrite removes first (issue #50: <out>/ckpt as the reference)."""
    for flag, path in reads.items():
        rel = os.path.relpath(os.path.realpath(path), os.path.realpath(out)) if path else ".."
        if overwrite and not rel.startswith("..") and rel.split(os.sep)[0] in RUN_FILES:
            return (f"{flag} {path} is in the run that --overwrite would remove from {out} before reading "
                    "it: copy it out of the run folder first, or train into another --out")
    return None


def holds_a_run(folder) -> bool:
    """Whether `folder` is a run's: metrics, a checkpoint, a Query-KL cache, or a config.json that is
    a run's (its --algo), not a model's (an --export folder has one, which may be written again)."""
    if any(os.path.exists(os.path.join(folder, f)) for f in ("metrics.jsonl", "ckpt", "ckpt.prev",
                                                            "query_cache.pt")):
        return True
    config = read_config(folder) if os.path.isfile(os.path.join(folder, "config.json")) else None
    return isinstance(config, dict) and "algo" in config


def export_overlap(export, out) -> str | None:
    """Why --export may not be `export`: it is a run folder (the run's own --out, or another run's) or
    inside a run's own files (<run>/hf, <run>/ckpt: RUN_FILES), which the model's config.json and
    weights would overwrite (a run's config.json replaced: --resume refused). <out>/final is fine."""
    target, own = os.path.realpath(export), os.path.realpath(out)
    below, folder = None, target            # `below`: the path component under `folder` toward target
    while True:
        if (folder == own or holds_a_run(folder)) and (below is None or below in RUN_FILES):
            which = "--out" if folder == own else \
                f"the run folder {folder} ({what_run_is_here(folder) or 'a run config.json'})"
            inside = "is" if os.path.join(folder, below or "") in (target, folder + os.sep) else "is inside"
            where = f"is {which}" if below is None else f"{inside} {below}/ of {which}"
            return (f"--export {export} {where}, whose files the export would overwrite (a run's "
                    "config.json: --resume is then refused): choose a folder outside it, e.g. beside it")
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        below, folder = os.path.basename(folder), parent


MIRROR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}   # --log: the package Mirror imports


def missing_package(mirror) -> str | None:
    """Why `Mirror(mirror)` would fail to import its package, or None (looked up, not imported)."""
    import importlib.util

    package = MIRROR_PACKAGES.get(mirror)
    if package and importlib.util.find_spec(package) is None:
        return f"--log {mirror} needs the {package} package (pip install {package})"
    return None


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


def resume_changes(args, algo, state, may_change: set, not_the_run: set) -> dict:
    """--resume against the run's config.json (whose values the options not given took, in
    train.parse_args): {option: (saved, new)} of the options given another value that may change
    (`may_change`: train.RESUME_MAY_CHANGE); a change of any other option or resolved loss knob
    (`not_the_run` aside: how a command runs, not what) is an error, before anything is loaded.
    `state`: the checkpoint's (checkpoints.TrainState), None for a fresh run."""
    if state is None:                                                    # from scratch: every option applies
        return {}
    if args.steps < state.step:
        raise SystemExit(f"error: --resume: --steps {args.steps} is before the checkpoint's step "
                         f"{state.step}: a resumed run continues to a later step (or the same: nothing to "
                         "do)")
    saved = read_config(args.out)
    if saved is None:
        raise SystemExit(f"error: --resume: {args.out}/config.json is missing or unreadable, so nothing says "
                         "which run the checkpoint belongs to; restore it (or start a new run)")
    now, knobs = vars(args), {name for name, *_ in options.algo_knobs()}
    fixed = config_changes(saved, now, sorted(set(now) - may_change - not_the_run - knobs))
    if algo is not None and not fixed and "algo" in saved:               # the knobs as the loss resolves them
        before = losses.make_algo(saved["algo"], **{k: saved.get(k) for k in knobs})
        fixed = config_changes(vars(before), vars(algo), knobs)
    if fixed:
        what = "; ".join(f"--{k.replace('_', '-')} {short(old)} -> {short(new)}"
                         for k, (old, new) in fixed.items())
        raise SystemExit(f"error: --resume: {what}: the run in {args.out} was made with the first "
                         "(config.json), and these options fix what a run is; resume with its values, or "
                         "start a new run (another --out)")
    changed = config_changes(saved, now, sorted(may_change))
    if changed:
        distributed.print0("--resume: from step {}: ".format(state.step) +
                           ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
                           + horizon_note(args, changed))
    return changed


def horizon_note(args, changed) -> str:
    """What a change of --steps does to a decaying LR schedule whose horizon is --steps (optimizer.py)."""
    decays = getattr(args, "lr_schedule", "constant") != "constant"
    if "steps" not in changed or not decays or args.lr_decay_steps:
        return ""
    old, new = changed["steps"]
    return (f" (the {args.lr_schedule} LR schedule's horizon follows --steps: it decays over {new} steps, "
            f"not {old}, from here on)")


def short(value, most=60) -> str:
    """repr(value), its middle cut out if longer than `most` characters (an error stays one short line)."""
    text = repr(value)
    return text if len(text) <= most else f"{text[:most // 2 - 2]}...{text[-(most // 2 - 1):]}"


def config_changes(saved: dict, now: dict, keys) -> dict:
    """{key: (saved value, new value)} for the `keys` whose value differs (a key the saved config
    lacks, an option newer than the run, is not compared). Paths that name the same file are equal."""
    out = {}
    for k in keys:
        if k in saved and not same_value(saved[k], now.get(k)):
            out[k] = (saved[k], now.get(k))
    return out


def same_value(a, b) -> bool:
    """Equal values, where paths that name the same file are equal (relative or absolute)."""
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
        all(same_value(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# metrics.jsonl


class MetricsLog:
    """Append-mode JSONL logger (rank 0 writes; other ranks hold a no-op). On resume, lines after
    the checkpoint's step are dropped (they will be recomputed), everything before is kept, and
    steps before it without a line (a file cut short or edited) are named in a warning: their
    metrics cannot be recomputed, the run goes on without them. A fresh run moves an older file
    aside instead of mixing with it. `mirror` ("tensorboard" or "wandb") also sends every numeric
    value there; metrics.jsonl stays the source of truth."""

    def __init__(self, out, start_step, mirror="jsonl", config=None):
        self.path = os.path.join(out, "metrics.jsonl")
        self.f, self.mirror = None, None
        if not distributed.is_main():
            return
        if mirror != "jsonl":  # first, so a missing package fails before anything is moved
            self.mirror = Mirror(mirror, out, config or {}, start_step)
        os.makedirs(out, exist_ok=True)
        if start_step > 0:
            keep = []
            if os.path.exists(self.path):
                with open(self.path) as f:
                    keep = [ln for ln in f if _step_of(ln) is not None and _step_of(ln) <= start_step]
                write_whole(self.path, "".join(keep))
            missing = sorted(set(range(1, start_step + 1)) - {_step_of(ln) for ln in keep})
            if missing:
                print(f"warning: --resume: {self.path} has no line for {_steps_text(missing)} (of the "
                      f"checkpoint's 1..{start_step}): their metrics are lost (not recomputed); the run "
                      f"continues from step {start_step}", flush=True)
        elif os.path.exists(self.path):
            os.replace(self.path, self.path + ".old")
        self.f = open(self.path, "a")

    def __call__(self, m: dict):
        if self.f is None:
            return
        line = json.dumps(m) + "\n"
        faults.point("metrics-write", before=lambda: (self.f.write(line[:len(line) // 2]), self.f.flush()))
        try:
            self.f.write(line)
            self.f.flush()
        except OSError as e:                                  # a full disk, `ulimit -f`
            self.close()
            raise SystemExit(f"error: cannot append step {m.get('step')} to {self.path} ({e.strerror or e}); "
                             f"{checkpoints.kept_note(os.path.dirname(self.path))}") from None
        if self.mirror:
            self.mirror.log(m)

    def close(self):
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError:                                   # (its last write failed: reported already)
                pass
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
                                    name=os.path.basename(os.path.normpath(out)),
                                    id=_wandb_id(out, start_step), resume="allow")
        except ImportError as e:                             # (train.py asks missing_package first)
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


def _steps_text(steps) -> str:
    """'step 4', 'steps 2, 3, 4' or 'steps 1, 2, ..., 40 (40 steps)'."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = ", ".join(map(str, steps)) if len(steps) <= 6 else \
        f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} steps)"
    return f"steps {shown}"


def _step_of(line):
    """The step of a metrics line, or None for a blank or half-written (killed mid-write) line."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------
# Append-only JSONL files (metrics.jsonl, evaluate.py's samples.jsonl)


def read_jsonl(path, warn=None) -> list[dict]:
    """Records of a JSONL file we append to; a half-written line (a kill mid-write) is skipped.
    A missing file has no records. `warn(message)`, where given, hears of the lines left out (not
    JSON, or JSON but not an object) in one message naming the file and their line numbers, so a
    reader's count of steps is not silently short."""
    records, bad = [], []
    if not os.path.isfile(path):
        return records
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) or (warn is None and record is not None):
                records.append(record)
            elif line.strip():
                bad.append(number)
    if bad and warn is not None:
        more = f" (and {len(bad) - 1} more: line {', '.join(map(str, bad[1:6]))}" + \
            (", ..." if len(bad) > 6 else "") + ")" if len(bad) > 1 else ""
        warn(f"{path}:{bad[0]}: not a JSON object, left out{more}")
    return records


def drop_partial_line(path):
    """Cut a half-written last line (the writer was killed mid-write) so appends start clean."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
