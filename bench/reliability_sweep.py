"""The reliability sweep of issue #20: every fault and bad input the issue names, and more, tried
the way a user would try them -- real `python train.py / evaluate.py / analysis.py` processes on
the tiny embedded model (data/tinymath/warmstart), tiny sizes -- each checked mechanically.

    python bench/reliability_sweep.py                     # every case: 10-17 min on 2 CPU cores (--jobs 2)
    python bench/reliability_sweep.py --list              # the cases: name, script, what each checks
    python bench/reliability_sweep.py --only resume-new-lr lr-1e6-then-lower-lr
    python bench/reliability_sweep.py --keep              # keep the temporary folder to look at

Every case expects one of four outcomes:
  refused      a non-zero exit, no traceback, the last stderr line one `error:` line (the script's own
               or argparse's), and the files it must protect (a run's ckpt/ and metrics.jsonl,
               evaluate's --out) byte-identical before and after, or --out not created
  works        exit 0 and a stated postcondition (metrics has steps 0..4, the new lr is the one
               logged, samples.jsonl holds the expected count, ...)
  interrupted  SIGINT / SIGTERM while it runs: exit 130 / 143 with one line, the checkpoint of the
               last step saved; the command a user runs next (--resume, the same command) finishes
  recovered    after a fault (a truncated checkpoint, a kill mid-save, a divergence) the next command
               says how it recovered (fallback, rollback) and finishes the run
Cases share one finished 4-step run (copied into each case's folder), one finished 2-step LoRA run
(made by the first case that needs it) and one Query-KL cache. The table is printed and written to
bench/results/reliability_sweep.md; the exit status is 1 if any case fails. Only the full-disk
cases patch anything, in a prelude run before the script in the same process: torch.save raises in
one folder (FULL_DISK), or open() for writing does (FULL_DISK_FILES), as on a full disk.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
WARM = ROOT / "data" / "tinymath" / "warmstart"
TRAIN = ROOT / "data" / "tinymath" / "train.jsonl"
RESULTS = ROOT / "bench" / "results" / "reliability_sweep.md"
TIMEOUT = 300                       # seconds any one command may take
TRAIN_ROWS = 64                     # rows of the tiny world's training set the runs use

# A case's argv is a template: {c} is its own folder, {data} the 64-row training file, {warm} the
# warm-start model, {cache} the shared Query-KL cache folder, {ro} a folder nobody may write.
# train.py's tiny sizes (2 optimizer steps per RL step, a checkpoint and an evaluation every 2 steps).
# --no-signal step: every optimizer step is taken whatever the groups' rewards (the faults meet a step).
SMALL = ["--no-signal", "step", "--model", "{warm}", "--train-data", "{data}", "--rollout-batch", "8", "--update-batch", "4",
         "--group-size", "4", "--micro-batch", "8", "--max-new-tokens", "24", "--eval-data", "tiny-test",
         "--eval-limit", "4", "--eval-every", "2", "--save-every", "2", "--query-cache-dir", "{cache}"]
# evaluate.py's: 2 problems x 2 samples at one temperature.
EVAL = ["--benchmarks", "tiny-test", "--limit", "2", "--n", "2", "--max-new-tokens", "16",
        "--temperatures", "1.0", "--no-progress"]
# An error line: "error: ..." (train.py) or "<script>.py: error: ..." (argparse, evaluate, analysis).
ERROR_LINE = re.compile(r"^([\w.-]+\.py: )?error: \S")


def train(out="{c}/run", steps=4, *extra):
    """train.py's argv: the tiny sizes, `steps` RL steps into `out`, then `extra`."""
    return [*SMALL, "--out", out, "--steps", str(steps), *extra]


def evaluate(model="{warm}", out="{c}/eval", *extra):
    return ["--model", model, *EVAL, "--out", out, *extra]


# ----------------------------------------------------------------------------------------------
# Running a command


@dataclass
class Proc:
    """A finished command: what the table and the checks read."""
    cmd: str
    code: int
    out: str
    err: str

    def last_err_line(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""

    def tail(self, n=15) -> str:
        """The last n lines of its output (stdout, then stderr), a progress bar's updates as lines."""
        lines = (self.out + "\n" + self.err).replace("\r", "\n").splitlines()
        return "\n".join([ln for ln in lines if ln.strip()][-n:])


# torch.save raising in one folder as it does on a full disk (the "full query-cache disk" case)
FULL_DISK = """
import os, torch
_save, _full = torch.save, os.environ["SWEEP_FULL_DIR"]
def _save_or_full(obj, f, *a, **k):
    if str(f).startswith(_full):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 512 vs 448")
    return _save(obj, f, *a, **k)
torch.save = _save_or_full
"""
# Runs a prelude, then the script as `python script.py argv` would.
WITH_PRELUDE = ("import os, runpy, sys; exec(os.environ['SWEEP_PRELUDE']); sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")


def pass_signals_on():
    """Children take SIGINT and SIGTERM as from a terminal. A shell starts a background job with
    SIGINT ignored, and an ignored signal stays ignored across exec; one with a handler is reset to
    the default. (Not in a preexec_fn: that is unsafe with the threads of --jobs.)"""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class Env:
    """What a case works in: its own folder, and what the sweep shares."""
    dir: Path
    sweep: "Sweep"
    name: str
    script: str                                     # the case's script: what run_script runs
    procs: list = field(default_factory=list)      # (Popen, stdout path, stderr path, cmd)
    background: list = field(default_factory=list)  # processes a setup left running
    last: Proc | None = None                        # the latest finished command

    def fill(self, text: str) -> str:
        s = self.sweep
        return text.format(c=self.dir, data=s.data, warm=WARM, cache=s.cache, ro=s.readonly or "")

    def path(self, rel: str) -> Path:
        return Path(self.fill(rel)) if "{" in rel else self.dir / rel

    def start(self, script, argv, env=None, prelude=None) -> subprocess.Popen:
        """Start `python script argv` in the repository, its output to files (polled by the signal cases)."""
        n = len(self.procs)
        out, err = (self.sweep.root / "logs" / f"{self.name}.{n}.{ext}" for ext in ("out", "err"))
        full = {k: v for k, v in os.environ.items() if k != "ERPO_FAULT"}   # failpoints: only where asked
        full.update({k: self.fill(v) for k, v in (env or {}).items()})
        full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        args = [self.fill(a) for a in argv]
        cmd = [sys.executable, script, *args]
        if prelude:
            full["SWEEP_PRELUDE"] = prelude
            cmd = [sys.executable, "-c", WITH_PRELUDE, script, *args]
        with open(out, "w") as fo, open(err, "w") as fe:
            p = subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=fo, stderr=fe)
        self.procs.append((p, out, err, " ".join([script, *args])))
        return p

    def finish(self, p: subprocess.Popen, timeout=TIMEOUT) -> Proc:
        late = ""
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            late = f"\n(still running after {timeout} s: killed)"
        _, out, err, cmd = next(x for x in self.procs if x[0] is p)
        text = out.read_text(errors="replace"), err.read_text(errors="replace") + late
        self.last = Proc(cmd, p.returncode, *text)
        return self.last

    def run(self, script, argv, env=None, prelude=None) -> Proc:
        return self.finish(self.start(script, argv, env, prelude))

    def run_script(self, argv, env=None, prelude=None) -> Proc:
        """Run the case's own script."""
        return self.run(self.script, argv, env, prelude)

    def stdout(self) -> str:
        """What the case's latest process has printed so far."""
        return self.procs[-1][1].read_text(errors="replace") if self.procs else ""

    def stop_background(self):
        for p in self.background:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for(cond: Callable[[], bool], p: subprocess.Popen, timeout=120.0) -> bool:
    """Poll `cond` until it holds (True), or the process ends or time runs out (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        if p.poll() is not None:
            return False
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------------------------
# What is on disk: the checks read files, never the project's code


def digest(path: Path) -> dict | None:
    """{relative path: sha256} of every file under `path` (a file: its own), None if missing.
    The run folder's .lock is left out: any command that takes the lock rewrites it."""
    if not path.exists():
        return None
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def changed(rel, before: dict | None, after: dict | None) -> str:
    """Which files under `rel` a command changed, created or removed, in a few words."""
    before, after = before or {}, after or {}
    diff = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return f"{rel} changed: {', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''}"


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def metrics(run: Path) -> list[dict]:
    return read_jsonl(run / "metrics.jsonl")


def saved_step(ckpt: Path) -> int | None:
    """The step of a checkpoint's state.pt, None if there is none (or it does not load)."""
    import torch
    try:
        return int(torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)["step"])
    except Exception:
        return None


def complete_lines(path: Path) -> int:
    try:
        return sum(1 for ln in path.read_text().splitlines(keepends=True) if ln.endswith("\n"))
    except FileNotFoundError:
        return 0


# Postconditions: env -> None (holds) or why not, in a few words. Built by these factories.
Check = Callable[[Env], "str | None"]


def all_of(*checks: Check) -> Check:
    def check(env):
        return next((why for why in (c(env) for c in checks) if why), None)
    return check


def steps_are(want, run="run") -> Check:
    """metrics.jsonl holds exactly these steps, each once, in order."""
    def check(env):
        got = [m.get("step") for m in metrics(env.path(run))]
        return None if got == list(want) else f"metrics steps {got}, expected {list(want)}"
    return check


def ckpt_at(step, ckpt="run/ckpt") -> Check:
    def check(env):
        got = saved_step(env.path(ckpt))
        return None if got == step else f"{ckpt} holds step {got}, expected {step}"
    return check


def exists(rel, yes=True) -> Check:
    def check(env):
        there = env.path(rel).exists()
        return None if there == yes else f"{rel} {'missing' if yes else 'exists'}"
    return check


def samples(count, out="eval") -> Check:
    """samples.jsonl holds `count` records, no two of the same sample."""
    def check(env):
        rows = read_jsonl(env.path(out) / "samples.jsonl")
        keys = {(r["model"], r["benchmark"], str(r["id"]), r["temperature"], r["sample"]) for r in rows}
        ok = len(rows) == count and len(keys) == count
        return None if ok else f"{len(rows)} samples ({len(keys)} distinct), expected {count}"
    return check


def metric(key, want: dict, run="run") -> Check:
    """metrics.jsonl's `key` at these steps: {step: value}."""
    def check(env):
        got = {m["step"]: m.get(key) for m in metrics(env.path(run)) if m.get("step") in want}
        return None if got == want else f"{key} at steps {got}, expected {want}"
    return check


# ----------------------------------------------------------------------------------------------
# The four expectations


@dataclass
class Then:
    """The command a user runs next (the resume, the corrected command): it must work."""
    argv: list[str]
    says: str = ""                      # in its output
    post: Check | None = None
    setup: Callable[[Env], None] | None = None  # what the user does first (repairs a file)


@dataclass
class Refused:
    """A non-zero exit, no traceback, one error line last; nothing it must protect touched."""
    says: str                           # in the one error line (placeholders filled in)
    protect: tuple = ()                 # paths that must be byte-identical after
    absent: tuple = ()                  # paths that must not exist after (--out not created)
    then: Then | None = None            # the corrected command then works
    after: Check | None = None          # e.g. the run that held the folder finished unharmed
    kind = "refused"


@dataclass
class Works:
    """Exit 0, no traceback, and the postcondition."""
    says: str = ""                      # in stdout or stderr
    post: Check | None = None
    kind = "works"


@dataclass
class Interrupted:
    """Signalled while it runs: exit 128 + signum with one line; then the next command works."""
    signals: tuple                      # sent in order (0.05 s apart) once `ready` holds
    ready: Check                        # None: now is the moment
    code: int                           # 130 or 143
    says: str                           # in the last stderr line
    then: Then                          # the resume or the rerun
    post: Check | None = None           # right after the interrupt (the checkpoint saved)
    kind = "interrupted"


@dataclass
class Recovered:
    """After the fault (set up, or met by a first command), the command recovers and finishes."""
    says: str                           # the recovery message of the case's command
    post: Check | None = None
    fault: list[str] | None = None      # argv of the command that meets the fault first
    fault_env: dict | None = None       # e.g. ERPO_FAULT=ckpt-rename:1
    fault_code: int | None = None       # its exit status (-9: a failpoint's SIGKILL)
    fault_says: str = ""                # in its last stderr line
    fault_post: Check | None = None
    kind = "recovered"


@dataclass
class Case:
    name: str
    script: str                         # train.py, evaluate.py or analysis.py
    checks: str                         # what it checks, one line
    argv: list[str]
    expect: Refused | Works | Interrupted | Recovered
    setup: Callable[[Env], None] | None = None
    prelude: str | None = None          # python run before the script (the full-disk case only)
    env: dict | None = None
    uses_base: bool = False             # its setup copies the shared finished run

    def short(self) -> str:
        """The commands it runs, in order ("; "), each without the tiny sizes every case of its
        script shares; paths relative to the case folder or the repository, shared ones by name."""
        e, parts = self.expect, []
        if isinstance(e, Recovered) and e.fault:
            env = " ".join(f"{k}={v}" for k, v in (e.fault_env or {}).items())
            parts.append(f"{env} {self.short_one(e.fault)}".strip())
        main = self.short_one(self.argv)
        if isinstance(e, Interrupted):
            main += " <" + ", ".join(signal.Signals(s).name for s in e.signals) + ">"
        parts.append(main)
        then = getattr(e, "then", None)
        if then:
            parts.append(self.short_one(then.argv))
        return "; ".join(parts)

    def short_one(self, argv) -> str:
        shared = {"train.py": SMALL, "evaluate.py": EVAL[:-1]}.get(self.script, [])
        pairs = set(zip(shared[::2], shared[1::2]))
        kept, k = [], 0
        while k < len(argv):
            if tuple(argv[k:k + 2]) in pairs:
                k += 2
                continue
            if argv[k] != "--no-progress":
                kept.append(argv[k])
            k += 1
        text = " ".join([self.script, *kept]).replace("{c}/", "").replace(f"{ROOT}/", "")
        return re.sub(r"\{(\w+)\}", r"\1", text)


@dataclass
class Outcome:
    case: Case
    passed: bool | None                 # None: skipped
    why: str                            # one line
    codes: list = field(default_factory=list)
    seconds: float = 0.0
    commands: list = field(default_factory=list)    # every command it ran, placeholders filled in
    tail: str = ""                                  # the last command's output tail, if it failed


class Fail(Exception):
    """A check that does not hold: its message is the table's reason."""


def need(ok, why):
    if not ok:
        raise Fail(why)


def no_traceback(p: Proc):
    need("Traceback" not in p.err, f"traceback: {p.last_err_line()[:120]}")


def works(env, p: Proc, says="", post=None):
    no_traceback(p)
    need(p.code == 0, f"exit {p.code}: {p.last_err_line()[:120]}")
    says = env.fill(says)
    need(says in p.out + p.err, f"did not say {says!r}")
    why = post(env) if post else None
    need(why is None, why)


def run_then(env, then: Then, codes):
    if then.setup:
        then.setup(env)
    p = env.run_script(then.argv)
    codes.append(p.code)
    works(env, p, then.says, then.post)


def check_refused(env, case, e: Refused, codes):
    before = {rel: digest(env.path(rel)) for rel in e.protect}
    p = env.run_script(case.argv, case.env, case.prelude)
    codes.append(p.code)
    no_traceback(p)
    need(p.code > 0, f"exit {p.code}, expected a refusal")
    line = p.last_err_line()
    need(ERROR_LINE.match(line), f"last line is not an error line: {line[:120]!r}")
    need(env.fill(e.says) in line, f"said {line[:160]!r}")
    for rel in e.protect:
        need(digest(env.path(rel)) == before[rel], changed(rel, before[rel], digest(env.path(rel))))
    for rel in e.absent:
        need(not env.path(rel).exists(), f"{rel} was created")
    if e.after:
        why = e.after(env)
        need(why is None, why)
    if e.then:
        run_then(env, e.then, codes)


def check_works(env, case, e: Works, codes):
    p = env.run_script(case.argv, case.env, case.prelude)
    codes.append(p.code)
    works(env, p, e.says, e.post)


def check_interrupted(env, case, e: Interrupted, codes):
    p = env.start(case.script, case.argv, case.env, case.prelude)
    need(wait_for(lambda: e.ready(env) is None, p), "the moment to signal never came (the command ended)")
    for k, sig in enumerate(e.signals):
        time.sleep(0.05 if k else 0)
        p.send_signal(sig)
    done = env.finish(p)
    codes.append(done.code)
    no_traceback(done)
    line = done.last_err_line()
    # A process the signal itself ended (-signum) has the status a shell reports as 128 + signum,
    # the same as an exit(128 + signum); it still owes the one line.
    need(done.code in (e.code, -(e.code - 128)), f"exit {done.code}, expected {e.code}: {line[:120]}")
    if done.code < 0 and "interrupted" not in line:
        raise Fail(f"ended by the signal's default action (exit {done.code}), without a line")
    need(env.fill(e.says) in line, f"said {line[:160]!r}")
    why = e.post(env) if e.post else None
    need(why is None, why)
    run_then(env, e.then, codes)


def check_recovered(env, case, e: Recovered, codes):
    if e.fault:
        f = env.run_script(e.fault, e.fault_env)
        codes.append(f.code)
        no_traceback(f)
        need(f.code == e.fault_code, f"the faulty command: exit {f.code}, expected {e.fault_code}")
        line = f.last_err_line()
        need(env.fill(e.fault_says) in line, f"the faulty command said {line[:160]!r}")
        why = e.fault_post(env) if e.fault_post else None
        need(why is None, why)
    p = env.run_script(case.argv, case.env, case.prelude)
    codes.append(p.code)
    works(env, p, e.says, e.post)


CHECKERS = {"refused": check_refused, "works": check_works, "interrupted": check_interrupted,
            "recovered": check_recovered}


# ----------------------------------------------------------------------------------------------
# Set-ups: what a case's folder holds before its command


def copy_base(env):
    shutil.copytree(env.sweep.base, env.dir / "run", symlinks=True)


def rows():
    with open(TRAIN) as f:
        return [json.loads(next(f)) for _ in range(TRAIN_ROWS)]


def write_jsonl(path: Path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def train_file_with(name, i, **fields):
    """A set-up: {c}/<name>, the 64 training rows with row i's fields replaced."""
    def setup(env):
        rs = rows()
        rs[i] = {**rs[i], **fields}
        write_jsonl(env.dir / name, rs)
    return setup


def write_text(name, text):
    def setup(env):
        (env.dir / name).write_text(text)
    return setup


def both(*setups):
    def setup(env):
        for s in setups:
            s(env)
    return setup


def bare_model(env):
    """A model folder without tokenizer files (weights and configs only)."""
    (env.dir / "bare").mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(WARM / f, env.dir / "bare" / f)


def cut_config(env):
    """config.json cut short, as a kill while it is written leaves it."""
    path = env.dir / "run" / "config.json"
    path.write_text(path.read_text()[:300])


def remove(rel):
    def setup(env):
        env.path(rel).unlink()
    return setup


def empty_folder(env):
    (env.dir / "empty").mkdir()


def truncate(*rels):
    def setup(env):
        for rel in rels:
            path = env.path(rel)
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return setup


def chat_rows(env):
    """The 64 training rows as chats of one user message each (verl-style prompts)."""
    write_jsonl(env.dir / "chat.jsonl", [{**r, "problem": [{"role": "user", "content": r["problem"]}]}
                                         for r in rows()])


def evaluated(model="{warm}", *extra):
    """A set-up: a finished evaluate.py sweep of `model` in {c}/eval."""
    def setup(env):
        p = env.run("evaluate.py", ["--model", model, *EVAL, "--out", "{c}/eval", *extra])
        need(p.code == 0 and samples(4)(env) is None, f"set-up sweep failed: {p.last_err_line()[:120]}")
    return setup


def retrain_ckpt(env):
    """What retraining does to a checkpoint folder: other weights at the same path (step 2's)."""
    run = env.dir / "run"
    shutil.copy(run / "ckpt.prev" / "model.safetensors", run / "ckpt" / "model.safetensors")


def broken_copy_of_warm(env):
    shutil.copytree(WARM, env.dir / "model")
    truncate("model/model.safetensors")(env)


def repair_model(env):
    shutil.copy(WARM / "model.safetensors", env.dir / "model" / "model.safetensors")


HOLDER = train("{c}/run", 60, "--eval-every", "0", "--save-every", "10")   # ~25 s: it outlasts the case


def running_run(env):
    """Another train.py training in {c}/run (it holds the folder's lock) while the case's command runs."""
    p = env.start("train.py", HOLDER)
    env.background.append(p)
    ok = wait_for(lambda: any("reward" in m for m in metrics(env.dir / "run")), p)
    need(ok, "set-up: the first run did not start training")


def first_run_unharmed(env):
    """The run that held the folder, stopped with Ctrl-C now, saved its own step and config."""
    p = env.background[0]
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    done = env.finish(p)
    if done.code != 130:
        return f"the first run: exit {done.code} (130 expected after its Ctrl-C): {done.last_err_line()[:90]}"
    cfg = json.loads((env.dir / "run" / "config.json").read_text())
    steps = [m["step"] for m in metrics(env.dir / "run")]
    if cfg.get("seed") != 0 or cfg.get("steps") != 60:
        return "the first run's config.json was rewritten by the second"
    if steps != list(range(1, len(steps) + 1)):
        return f"the first run's metrics are mixed: steps {steps}"
    return ckpt_at(steps[-1])(env)


def readonly_required(env):
    need(env.sweep.readonly, "skip: no folder this user cannot write (root, and /proc/sys writable)")


# ----------------------------------------------------------------------------------------------
# Postconditions of the longer cases


def in_training(env) -> str | None:
    """Ready to signal: the run has logged its third training step (no save there: the signal
    lands in step 4, or in the moment before its start)."""
    return None if sum("reward" in m for m in metrics(env.dir / "run")) >= 3 else "not yet"


def saved_where_it_stopped(env) -> str | None:
    """The interrupt's checkpoint is the last logged step (nothing trained is lost)."""
    steps = [m["step"] for m in metrics(env.dir / "run")]
    return ckpt_at(steps[-1] if steps else None)(env)


def learns_after_rollback(env) -> str | None:
    """Steps 5, 6 at the new lr, nothing skipped, finite, entropy not that of the uniform distribution."""
    ms = {m["step"]: m for m in metrics(env.dir / "run")}
    bad = [s for s in (5, 6) if ms.get(s, {}).get("skipped_steps") != 0 or ms[s].get("grad_norm") is None]
    if bad:
        return f"skipped or non-finite optimizer steps at {bad}"
    if not ms[6]["entropy"] < max(1.0, 3 * ms[4]["entropy"]):
        return f"entropy {ms[6]['entropy']:.2f} at step 6 (the uniform distribution's is ~6.5): not learning"
    return None


def optimizer_lr(value, ckpt="run/ckpt") -> Check:
    def check(env):
        import torch
        state = torch.load(env.path(ckpt) / "state.pt", map_location="cpu", weights_only=False)
        lrs = {g["lr"] for g in state["opt"]["param_groups"]}
        return None if lrs == {value} else f"the optimizer's lr is {lrs}, expected {value}"
    return check


def resume_recorded(env) -> str | None:
    resumed = json.loads((env.dir / "run" / "config.json").read_text()).get("resumed", [])
    return None if resumed and resumed[-1]["at_step"] == 4 else f"config.json's resumed record: {resumed}"


def same_prompts_as_base(env) -> str | None:
    """The chat run's Query-KL cache (the prompt log-probs) equals the plain-text base run's."""
    import torch
    a = torch.load(env.dir / "run" / "query_cache.pt", weights_only=False)["logp"]
    b = torch.load(env.sweep.base / "query_cache.pt", weights_only=False)["logp"]
    same = len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    return None if same else "the chat prompts are not the plain-text prompts"


CLIP_STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac")


def clip_stats_logged(env) -> str | None:
    ms = [m for m in metrics(env.dir / "run") if "reward" in m]
    missing = [k for k in CLIP_STATS if k not in ms[-1]]
    return f"metrics lack {missing}" if missing else None


def no_tmp_left(env) -> str | None:
    left = list((env.dir / "shared").rglob("*.tmp*")) if (env.dir / "shared").exists() else []
    return f"left {left[0].name}" if left else None


def killed_between_renames(env) -> str | None:
    if (env.dir / "run" / "ckpt").exists():
        return "ckpt/ exists: the failpoint did not fire between the renames"
    return ckpt_at(2, "run/ckpt.prev")(env)


def nll_pairs(count) -> Check:
    def check(env):
        got = len(read_jsonl(env.dir / "nll" / "nll_pairs.jsonl"))
        return None if got == count else f"{got} NLL pairs, expected {count}"
    return check


# ----------------------------------------------------------------------------------------------
# The cases: first those the issue names, then our own

# evaluate.py's interruptible sweep: 10 problems x 2 samples (x 2 temperatures), 2 rows per chunk
LONG_EVAL = ["--model", "{warm}", "--benchmarks", "tiny-test", "--limit", "10", "--n", "2",
             "--max-new-tokens", "16", "--batch-size", "2", "--no-progress", "--out", "{c}/eval"]


def sampling(env) -> str | None:
    """Ready to signal: the sweep's first chunk of samples is on disk."""
    return None if complete_lines(env.dir / "eval" / "samples.jsonl") else "not yet"


def evaluating(env) -> str | None:
    """Ready to signal: train.py has its Query-KL cache (the base run's, reused), so it is in the
    step-0 evaluation (200 problems: about a second)."""
    return None if "query-KL reference cache" in env.stdout() else "not yet"


def resumed_to(steps, *extra) -> Then:
    """`--resume` of a case's run with its own sizes: it finishes, every step logged once."""
    return Then(train("{c}/run", steps, *extra, "--resume"), "resumed from",
                all_of(steps_are(range(steps + 1)), ckpt_at(steps)))


BLANK_HELDOUT = '{"problem": "1+1", "answer": "2"}\n{"problem": " \\n\\t", "answer": "3"}\n'
BOOL_HELDOUT = '{"problem": "1+1", "answer": "2"}\n{"problem": "Is 7 prime?", "answer": true}\n'
SYSTEM_AND_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
INTERRUPTIBLE = ("--save-every", "5", "--eval-every", "4")   # step 4, where the signal stops it: no save

ISSUE_TRAIN = [
    Case("base-run", "train.py", "the shared 4-step run: checkpoints at 4 and 2, every clip statistic logged",
         train(),
         Works(post=all_of(steps_are(range(5)), ckpt_at(4), ckpt_at(2, "run/ckpt.prev"), clip_stats_logged))),
    Case("fresh-over-run", "train.py", "a fresh run into a folder holding a run leaves it untouched",
         train(),
         Refused("{c}/run holds a run (a checkpoint at step 4 (ckpt/), metrics up to step 4); continue it "
                 "with --resume", protect=("run",)),
         copy_base, uses_base=True),
    Case("overwrite", "train.py", "--overwrite replaces the run (its files only; the user's stay)",
         train("{c}/run", 1, "--eval-every", "0", "--overwrite"),
         Works("--overwrite: removed the run that was in",
               all_of(steps_are([1]), ckpt_at(1), exists("run/ckpt.prev", False), exists("run/notes.txt"))),
         both(copy_base, write_text("run/notes.txt", "the user's own file")), uses_base=True),
    Case("second-process", "train.py", "a second train.py (--overwrite) on a folder in use is refused",
         train("{c}/run", 2, "--seed", "1", "--overwrite"),
         Refused("{c}/run is in use by another run (pid", after=first_run_unharmed),
         running_run),
    Case("resume-new-algo", "train.py", "--resume with another --algo is refused, nothing rewritten",
         train("{c}/run", 4, "--resume", "--algo", "grpo"),
         Refused("error: --resume: --algo 'erpo' -> 'grpo'", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-new-alpha", "train.py", "--resume with another loss knob is refused",
         train("{c}/run", 4, "--resume", "--alpha", "0.05"),
         Refused("--resume: --alpha 0.01 -> 0.05", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-new-sizes", "train.py", "--resume with another seed and group size is refused",
         train("{c}/run", 4, "--resume", "--seed", "1", "--group-size", "2"),
         Refused("--resume: --group-size 4 -> 2; --seed 0 -> 1", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-new-lr", "train.py", "--resume and only --out: the run's config; the new lr reaches Adam",
         ["--out", "{c}/run", "--resume", "--steps", "6", "--lr", "1e-4", "--micro-batch", "4"],
         Works("--resume: from step 4: lr 0.0002 -> 0.0001, micro_batch 8 -> 4, steps 4 -> 6",
               all_of(steps_are(range(7)), metric("lr", {4: 2e-4, 5: 1e-4, 6: 1e-4}), ckpt_at(6),
                      optimizer_lr(1e-4), resume_recorded)),
         copy_base, uses_base=True),
    Case("lr-1e6-then-lower-lr", "train.py", "--lr 1e6 stops naming the last good step; --lr 1e-4 learns",
         ["--out", "{c}/run", "--resume", "--steps", "6", "--lr", "1e-4"],
         Recovered("--resume: from step 4: lr 1000000.0 -> 0.0001",
                   all_of(steps_are(range(7)), metric("lr", {5: 1e-4, 6: 1e-4}), learns_after_rollback,
                          ckpt_at(6)),
                   fault=["--out", "{c}/run", "--resume", "--steps", "8", "--lr", "1e6", "--save-every", "1"],
                   fault_code=1,
                   fault_says="error: 3 optimizer steps in a row had a non-finite loss or gradient "
                              "(--max-bad-steps); --resume continues from step 4 ({c}/run/ckpt/)",
                   fault_post=all_of(ckpt_at(4), ckpt_at(5, "run/ckpt.diverged"))),
         copy_base, uses_base=True),
    Case("sigint-mid-run", "train.py", "Ctrl-C saves the step it stops at, exit 130; --resume finishes",
         train("{c}/run", 8, *INTERRUPTIBLE),
         Interrupted((signal.SIGINT,), in_training, 130, "interrupted (SIGINT): saved the checkpoint",
                     resumed_to(8, *INTERRUPTIBLE), saved_where_it_stopped)),
    Case("sigterm-mid-run", "train.py", "SIGTERM saves the step it stops at, exit 143; --resume finishes",
         train("{c}/run", 8, *INTERRUPTIBLE),
         Interrupted((signal.SIGTERM,), in_training, 143, "interrupted (SIGTERM): saved the checkpoint",
                     resumed_to(8, *INTERRUPTIBLE), saved_where_it_stopped)),
    Case("corrupt-safetensors", "train.py", "a truncated ckpt/model.safetensors: --resume falls back",
         train("{c}/run", 4, "--resume"),
         Recovered("continuing from the checkpoint before it, step 2",
                   all_of(steps_are(range(5)), ckpt_at(4), exists("run/ckpt.corrupt"))),
         both(copy_base, truncate("run/ckpt/model.safetensors")), uses_base=True),
    Case("corrupt-state", "train.py", "a truncated ckpt/state.pt: --resume falls back to ckpt.prev",
         train("{c}/run", 4, "--resume"),
         Recovered("{c}/run/ckpt is corrupt (state.pt: ", all_of(steps_are(range(5)), ckpt_at(4))),
         both(copy_base, truncate("run/ckpt/state.pt")), uses_base=True),
    Case("full-cache-disk", "train.py", "a full --query-cache-dir disk (torch.save raises): the run goes on",
         train("{c}/run", 1, "--eval-every", "0", "--save-every", "0", "--query-cache-dir", "{c}/shared"),
         Works("query-KL reference cache: not shared ([enforce fail", all_of(steps_are([1]), no_tmp_left)),
         prelude=FULL_DISK, env={"SWEEP_FULL_DIR": "{c}/shared"}),
    Case("no-tokenizer", "train.py", "a model folder without tokenizer files: one line, --out not created",
         train("{c}/run", 2, "--model", "{c}/bare"),
         Refused("{c}/bare holds no tokenizer", absent=("run",)),
         bare_model),
    Case("out-is-file", "train.py", "--out a file: one line, the file untouched",
         train("{c}/afile"),
         Refused("--out {c}/afile is a file, not a folder", protect=("afile",)),
         write_text("afile", "a file\n")),
    Case("out-read-only", "train.py", "--out in a folder that cannot be written: one line",
         train("{ro}/run"),
         Refused("is not writable", absent=("{ro}/run",)),
         readonly_required),
    Case("alpha-nan", "train.py", "--alpha nan (the Query-KL term silently off) is refused",
         train("{c}/run", 2, "--alpha", "nan"),
         Refused("argument --alpha: expected a finite number, got 'nan'", absent=("run",))),
    Case("lr-inf", "train.py", "--lr inf is refused",
         train("{c}/run", 2, "--lr", "inf"),
         Refused("argument --lr: expected a finite number, got 'inf'", absent=("run",))),
    Case("dict-answer", "train.py", "a dict answer (reward always 0) names its file and line",
         train("{c}/run", 2, "--train-data", "{c}/dict.jsonl"),
         Refused("{c}/dict.jsonl:3: the answer is a dict", absent=("run",)),
         train_file_with("dict.jsonl", 2, answer={"value": 3})),
    Case("bool-answer", "train.py", "a bool answer in a held-out set names its file and line",
         train("{c}/run", 2, "--eval-data", "{c}/bool.jsonl"),
         Refused("{c}/bool.jsonl:2: the answer is a bool (true)", absent=("run",)),
         write_text("bool.jsonl", BOOL_HELDOUT)),
    Case("chat-several-turns", "train.py", "a chat problem of system + user messages is refused",
         train("{c}/run", 2, "--train-data", "{c}/chat2.jsonl"),
         Refused("{c}/chat2.jsonl:2: the problem is a chat of 2 messages", absent=("run",)),
         train_file_with("chat2.jsonl", 1, problem=SYSTEM_AND_USER)),
    Case("chat-one-user", "train.py", "problems as chats of one user message train on the plain-text prompts",
         train("{c}/run", 1, "--train-data", "{c}/chat.jsonl", "--eval-every", "0", "--save-every", "0"),
         Works(post=all_of(steps_are([1]), same_prompts_as_base)),
         chat_rows, uses_base=True),
    Case("blank-problem-heldout", "train.py", "a whitespace held-out problem names its file and line",
         train("{c}/run", 2, "--eval-data", "{c}/blank.jsonl"),
         Refused("{c}/blank.jsonl:2: no problem: 'problem' is empty or whitespace", absent=("run",)),
         write_text("blank.jsonl", BLANK_HELDOUT)),
    Case("blank-problem-strict", "train.py", "a whitespace training problem under --strict-data is refused",
         train("{c}/run", 2, "--train-data", "{c}/blank.jsonl", "--strict-data"),
         Refused("{c}/blank.jsonl:4: no problem: 'problem' is empty or whitespace", absent=("run",)),
         train_file_with("blank.jsonl", 3, problem=" \n\t")),
    Case("top-p-1.5", "train.py", "--top-p 1.5 is refused",
         train("{c}/run", 2, "--top-p", "1.5"),
         Refused("argument --top-p: must be (0,1], got 1.5", absent=("run",))),
    Case("group-size-1", "train.py", "--group-size 1 (every advantage 0) is refused",
         train("{c}/run", 2, "--group-size", "1"),
         Refused("argument --group-size: must be >=2, got 1", absent=("run",))),
]

ISSUE_EVALUATE = [
    Case("eval-limit-neg", "evaluate.py", "--limit -1 (graded 499 of 500) is refused",
         evaluate("{warm}", "{c}/eval", "--limit", "-1"),
         Refused("--limit must be >= 1", absent=("eval",))),
    Case("eval-top-p-then-fixed", "evaluate.py", "--top-p 1.5 refused, --out not made; the fixed one works",
         evaluate("{warm}", "{c}/eval", "--top-p", "1.5"),
         Refused("--top-p must be in (0, 1], got 1.5", absent=("eval",),
                 then=Then(evaluate("{warm}", "{c}/eval"), post=samples(4)))),
    Case("eval-temperatures-nan", "evaluate.py", "--temperatures nan is refused",
         evaluate("{warm}", "{c}/eval", "--temperatures", "nan"),
         Refused("--temperatures must be finite and >= 0, got [nan]", absent=("eval",))),
    Case("eval-batch-size-0", "evaluate.py", "--batch-size 0 is refused",
         evaluate("{warm}", "{c}/eval", "--batch-size", "0"),
         Refused("--batch-size must be >= 1, got 0", absent=("eval",))),
    Case("eval-labels-twice", "evaluate.py", "--labels a a (the second model never ran) is refused",
         ["--model", "{warm}", "{warm}", "--labels", "a", "a", *EVAL, "--out", "{c}/eval"],
         Refused("--labels gives two models the name 'a'", absent=("eval",))),
    Case("eval-no-tokenizer", "evaluate.py", "a model folder without a tokenizer: one line, --out not made",
         evaluate("{c}/bare"),
         Refused("{c}/bare holds no tokenizer", absent=("eval",)),
         bare_model),
    Case("eval-retrained", "evaluate.py", "a rerun after the checkpoint at its path was retrained: refused",
         evaluate("{c}/run/ckpt"),
         Refused("made from other weights", protect=("eval",)),
         both(copy_base, evaluated("{c}/run/ckpt"), retrain_ckpt), uses_base=True),
    Case("eval-other-dtype", "evaluate.py", "a resumed sweep in another --dtype is refused; the same: all in",
         evaluate("{warm}", "{c}/eval", "--dtype", "bfloat16"),
         Refused("--dtype float32 (now bfloat16)", protect=("eval",),
                 then=Then(evaluate("{warm}", "{c}/eval", "--dtype", "float32"), "all samples already in",
                           samples(4))),
         evaluated()),
    Case("eval-ctrl-c", "evaluate.py", "Ctrl-C mid-sweep: exit 130, one line; the same command finishes",
         [*LONG_EVAL, "--temperatures", "0.7", "1.0"],
         Interrupted((signal.SIGINT,), sampling, 130, "evaluate.py: interrupted (SIGINT): ",
                     Then([*LONG_EVAL, "--temperatures", "0.7", "1.0"], post=samples(40)))),
]

ISSUE_ANALYSIS = [
    Case("nll-no-model", "analysis.py", "nll with a --model folder holding no model: one line",
         ["nll", "--model", "{c}/empty", "--limit", "1", "--no-progress", "--out", "{c}/nll"],
         Refused("{c}/empty is neither a model folder", absent=("nll",)),
         empty_folder),
]

OWN = [
    Case("resume-no-checkpoint", "train.py", "--resume on a folder with no run starts afresh, saying so",
         train("{c}/run", 2, "--resume"),
         Works("no complete checkpoint in", all_of(steps_are(range(3)), ckpt_at(2)))),
    Case("killed-mid-save", "train.py", "a kill between a save's two renames: --resume restores ckpt.prev",
         train("{c}/run", 4, "--resume"),
         Recovered("was missing and {c}/run/ckpt.prev complete", all_of(steps_are(range(5)), ckpt_at(4)),
                   fault=train(), fault_env={"ERPO_FAULT": "ckpt-rename:1"}, fault_code=-9,
                   fault_post=killed_between_renames)),
    Case("corrupt-both", "train.py", "ckpt/ and ckpt.prev/ both corrupt: --resume refuses, moves nothing",
         train("{c}/run", 4, "--resume"),
         Refused("no intact checkpoint before it", protect=("run",)),
         both(copy_base, truncate("run/ckpt/state.pt", "run/ckpt.prev/state.pt")), uses_base=True),
    Case("second-ctrl-c", "train.py", "Ctrl-C twice stops at once, exit 130; the checkpoint on disk resumes",
         train("{c}/run", 8),
         Interrupted((signal.SIGINT, signal.SIGINT), in_training, 130, "interrupted (SIGINT): stopped now",
                     resumed_to(8))),
    Case("sigint-in-step0-eval", "train.py", "Ctrl-C in the step-0 evaluation: exit 130, one line; --resume",
         train("{c}/run", 2, "--eval-limit", "200"),
         Interrupted((signal.SIGINT,), evaluating, 130, "interrupted (SIGINT): stopped now, without saving",
                     Then(train("{c}/run", 2, "--resume"), post=steps_are(range(3)))),
         uses_base=True),
    Case("sigterm-in-step0-eval", "train.py", "SIGTERM in the step-0 evaluation: exit 143, one line; resume",
         train("{c}/run", 2, "--eval-limit", "200"),
         Interrupted((signal.SIGTERM,), evaluating, 143, "interrupted (SIGTERM)",
                     Then(train("{c}/run", 2, "--resume"), post=steps_are(range(3)))),
         uses_base=True),
    Case("resume-config-unreadable", "train.py", "--resume of a run whose config.json is cut short: refused",
         ["--out", "{c}/run", "--resume", "--model", "{warm}", "--train-data", "{data}", "--steps", "5",
          "--eval-every", "0", "--query-cache-dir", "{cache}"],
         Refused("config.json is missing or unreadable", protect=("run/ckpt", "run/metrics.jsonl")),
         both(copy_base, cut_config), uses_base=True),
    Case("resume-no-query-cache", "train.py", "--resume of a run without query_cache.pt: one line, no change",
         train("{c}/run", 6, "--resume"),
         Refused("query_cache.pt is missing", protect=("run",)),
         both(copy_base, remove("run/query_cache.pt")), uses_base=True),
    Case("export-to-file", "train.py", "--export a file: one line before training, not a traceback after it",
         train("{c}/run", 1, "--eval-every", "0", "--export", "{c}/afile"),
         Refused("--export", protect=("afile",), absent=("run",)),
         write_text("afile", "a file\n")),
    Case("config-unknown-key", "train.py", "--config with an unknown key is refused",
         ["--config", "{c}/c.json", *train("{c}/run", 2)],
         Refused("unknown keys ['stepz']", absent=("run",)),
         write_text("c.json", '{"stepz": 3}')),
    Case("config-bad-json", "train.py", "--config that is not JSON names its line",
         ["--config", "{c}/c.json", *train("{c}/run", 2)],
         Refused("{c}/c.json:2: not valid JSON", absent=("run",)),
         write_text("c.json", '{"steps": 3,\n "lr": }')),
    Case("eval-data-missing", "train.py", "--eval-data a missing file: one line, --out not created",
         train("{c}/run", 2, "--eval-data", "{c}/nope.jsonl"),
         Refused("{c}/nope.jsonl: file not found", absent=("run",))),
    Case("sft-resume", "train.py", "--algo sft --resume (SFT keeps no training state) is refused",
         ["--algo", "sft", "--out", "{c}/run", "--resume"],
         Refused("the SFT warm start does not resume", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-and-overwrite", "train.py", "--resume --overwrite together is refused",
         train("{c}/run", 4, "--resume", "--overwrite"),
         Refused("--resume continues the run in --out, --overwrite replaces it", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-new-data", "train.py", "--resume with another --train-data is refused",
         train("{c}/run", 4, "--resume", "--train-data", str(TRAIN)),
         Refused("--resume: --train-data", protect=("run",)),
         copy_base, uses_base=True),
    Case("resume-steps-before", "train.py", "--resume --steps 2 of a run at step 4 (did nothing, exit 0) is refused",
         train("{c}/run", 2, "--resume"),
         Refused("--steps 2 is before the checkpoint's step 4", protect=("run",)),
         copy_base, uses_base=True),
    Case("sizes-indivisible", "train.py", "--rollout-batch not a multiple of --update-batch is refused",
         train("{c}/run", 2, "--rollout-batch", "6"),
         Refused("--rollout-batch 6 must be a multiple of --update-batch 4", absent=("run",))),
    Case("model-empty-folder", "train.py", "--model an empty folder: one line, --out not created",
         train("{c}/run", 2, "--model", "{c}/empty"),
         Refused("cannot load model", absent=("run",)),
         empty_folder),
    Case("blank-problem-train", "train.py", "a whitespace training problem is skipped and named; it trains",
         train("{c}/run", 1, "--train-data", "{c}/blank.jsonl", "--eval-every", "0", "--save-every", "0"),
         Works("skipped 1 of 64 rows without a problem or an answer ({c}/blank.jsonl:4", steps_are([1])),
         train_file_with("blank.jsonl", 3, problem=" \n\t")),
    Case("eval-k-above-n", "evaluate.py", "--k larger than --n is refused",
         evaluate("{warm}", "{c}/eval", "--k", "4"),
         Refused("--k values must be in 1..n=2, got [4]", absent=("eval",))),
    Case("eval-one-model-missing", "evaluate.py", "two models, one path missing: refused before any sample",
         ["--model", "{warm}", "{c}/nope", *EVAL, "--out", "{c}/eval"],
         Refused("model path not found: {c}/nope", absent=("eval",))),
    Case("eval-out-is-file", "evaluate.py", "--out a file: one line, the file untouched",
         evaluate("{warm}", "{c}/afile"),
         Refused("--out {c}/afile is a file, not a folder", protect=("afile",)),
         write_text("afile", "a file\n")),
    Case("eval-out-read-only", "evaluate.py", "--out in a folder that cannot be written: one line",
         evaluate("{warm}", "{ro}/eval"),
         Refused("cannot be made", absent=("{ro}/eval",)),
         readonly_required),
    Case("eval-broken-then-repaired", "evaluate.py", "truncated weights: one line; repaired, the --out works",
         evaluate("{c}/model"),
         Refused("cannot load model", then=Then(evaluate("{c}/model"), post=samples(4), setup=repair_model)),
         broken_copy_of_warm),
    Case("eval-run-folder", "evaluate.py", "a run folder as --model means its checkpoint",
         evaluate("{c}/run"),
         Works(post=samples(4)),
         copy_base, uses_base=True),
    Case("eval-sigterm", "evaluate.py", "SIGTERM mid-sweep: exit 143, one line; the same command finishes",
         [*LONG_EVAL, "--temperatures", "1.0"],
         Interrupted((signal.SIGTERM,), sampling, 143, "evaluate.py: interrupted (SIGTERM): ",
                     Then([*LONG_EVAL, "--temperatures", "1.0"], post=samples(20)))),
    Case("runs-no-metrics", "analysis.py", "runs on a folder without metrics.jsonl: one line",
         ["runs", "{c}/empty", "--out", "{c}/plots"],
         Refused("no metrics.jsonl in {c}/empty", absent=("plots",)),
         empty_folder),
    Case("runs-missing-folder", "analysis.py", "runs on a folder that does not exist: one line",
         ["runs", "{c}/nope", "--out", "{c}/plots"],
         Refused("no metrics.jsonl in {c}/nope", absent=("plots",))),
    Case("runs-of-a-run", "analysis.py", "runs on a finished run writes both plots",
         ["runs", "{c}/run", "--out", "{c}/plots"],
         Works("mean train - held-out accuracy gap",
               all_of(exists("plots/kl.png"), exists("plots/train_eval_gap.png"))),
         copy_base, uses_base=True),
    Case("nll-top-p", "analysis.py", "nll --top-p 1.5 is refused, --out not made",
         ["nll", "--model", "{warm}", "--limit", "1", "--top-p", "1.5", "--no-progress", "--out", "{c}/nll"],
         Refused("--top-p must be in (0, 1], got 1.5", absent=("nll",))),
    Case("nll-no-tokenizer", "analysis.py", "nll with a model folder without tokenizer files: one line",
         ["nll", "--model", "{c}/bare", "--limit", "1", "--no-progress", "--out", "{c}/nll"],
         Refused("{c}/bare holds no tokenizer", absent=("nll",)),
         bare_model),
    Case("nll-out-is-file", "analysis.py", "nll --out a file: one line before sampling, the file untouched",
         ["nll", "--model", "{warm}", "--limit", "1", "--no-progress", "--out", "{c}/afile"],
         Refused("--out {c}/afile is a file, not a folder", protect=("afile",)),
         write_text("afile", "a file\n")),
    Case("nll-works", "analysis.py", "nll on 2 problems writes 2 pairs",
         ["nll", "--model", "{warm}", "--limit", "2", "--max-new-tokens", "16", "--no-progress",
          "--out", "{c}/nll"],
         Works("Pearson r(query NLL, response NLL)", nll_pairs(2))),
]

# Issue #31's fuzz findings on evaluate.py, its folders and the rows of a task's file.
COUNTDOWN_TRAIN = ROOT / "data" / "countdown" / "train.jsonl"
MINE = [{"problem": "What is 2+3?", "answer": "5"}, {"problem": "What is 2*4?", "answer": "8"}]


def countdown_rows(n=TRAIN_ROWS):
    with open(COUNTDOWN_TRAIN) as f:
        return [json.loads(next(f)) for _ in range(n)]


def countdown_file(name, edit=None, task_field=False):
    """A set-up: {c}/<name>, Countdown rows of one's own (no "task" field unless task_field): a blank
    line after the first row, the third row's problem blank (a training set skips it), and `edit`
    ({row index: fields}) applied."""
    def setup(env):
        rs = countdown_rows()
        rs[2] = {**rs[2], "problem": " "}
        for i, fields in (edit or {}).items():
            rs[i] = {**rs[i], **fields}
        lines = [json.dumps({**r, **({"task": "countdown"} if task_field else {})}) for r in rs]
        (env.dir / name).write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    return setup


def flip_a_weight(rel):
    """A set-up: one byte in the middle of the tensor model.layers.0.mlp.down_proj.weight of
    <rel>/model.safetensors flipped in place (size, names and header unchanged)."""
    import struct

    def setup(env):
        path = env.path(rel) / "model.safetensors"
        with open(path, "r+b") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            start, end = json.loads(f.read(length))["model.layers.0.mlp.down_proj.weight"]["data_offsets"]
            f.seek(8 + length + (start + end) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x40]))
    return setup


def copy_of_warm(env):
    shutil.copytree(WARM, env.dir / "model")


def evaluated_mine(env):
    """A finished sweep of {c}/mine.jsonl (2 problems of one's own) in {c}/eval, then its second gold
    answer edited."""
    write_jsonl(env.dir / "mine.jsonl", MINE)
    p = env.run("evaluate.py", evaluate("{warm}", "{c}/eval", "--benchmarks", "{c}/mine.jsonl"))
    need(p.code == 0 and samples(4)(env) is None, f"set-up sweep failed: {p.last_err_line()[:120]}")
    write_jsonl(env.dir / "mine.jsonl", [MINE[0], {**MINE[1], "answer": "9"}])


def run_resumes_unharmed(env) -> str | None:
    """The run whose folder was given as --out still resumes: its config.json is the run's."""
    cfg = json.loads((env.dir / "run" / "config.json").read_text())
    return None if cfg.get("algo") == "erpo" and "models" not in cfg else "the run's config.json was replaced"


CD_EVAL = ("--benchmarks", "{c}/cd.jsonl", "--limit", "2")
FUZZ_EVALUATE = [
    Case("eval-out-is-a-run", "evaluate.py", "--out a training run's folder (its config.json replaced) is refused",
         evaluate("{c}/run", "{c}/run"),
         Refused("--out {c}/run holds a training run (a checkpoint at step 4", protect=("run",),
                 after=run_resumes_unharmed,
                 then=Then(evaluate("{c}/run", "{c}/run/eval"), post=samples(4, "run/eval"))),
         copy_base, uses_base=True),
    Case("eval-out-is-a-model", "evaluate.py", "--out a model folder (its config.json) is refused",
         evaluate("{warm}", "{c}/model"),
         Refused("--out {c}/model holds a config.json that is not evaluate.py's resume key", protect=("model",)),
         copy_of_warm),
    Case("eval-weights-edited", "evaluate.py", "a rerun after one tensor was edited in place is refused",
         evaluate("{c}/model"),
         Refused("made from other weights", protect=("eval",)),
         both(copy_of_warm, evaluated("{c}/model"), flip_a_weight("model"))),
    Case("eval-gold-edited", "evaluate.py", "a rerun after a local benchmark's gold answer was edited is refused",
         evaluate("{warm}", "{c}/eval", "--benchmarks", "{c}/mine.jsonl"),
         Refused("holds samples of mine problem 1 made from another version of its row", protect=("eval",)),
         evaluated_mine),
    Case("eval-countdown-rows-as-math", "evaluate.py", "Countdown rows with no task field, no --task: refused",
         evaluate("{warm}", "{c}/eval", *CD_EVAL),
         Refused("{c}/cd.jsonl:1: the row has countdown's fields (numbers, target) but no \"task\" field, so it "
                 "would be graded as math; pass --task countdown", absent=("eval",),
                 then=Then(evaluate("{warm}", "{c}/eval", *CD_EVAL, "--task", "countdown"), post=samples(4))),
         countdown_file("cd.jsonl")),
    Case("countdown-rows-as-math", "train.py", "Countdown training rows with no task field, no --task: refused",
         train("{c}/run", 1, "--train-data", "{c}/cd.jsonl"),
         Refused("{c}/cd.jsonl:1: the row has countdown's fields", absent=("run",)),
         countdown_file("cd.jsonl")),
    Case("countdown-target-mismatch", "train.py", "a Countdown row whose answer misses its target: its file line",
         train("{c}/run", 1, "--task", "countdown", "--train-data", "{c}/cd.jsonl"),
         Refused("{c}/cd.jsonl:6: the answer ", absent=("run",)),
         countdown_file("cd.jsonl", {4: {"target": 1000}}, task_field=True)),
    Case("countdown-bad-numbers-line", "train.py", "a malformed Countdown row is named by its file line",
         train("{c}/run", 1, "--task", "countdown", "--train-data", "{c}/cd.jsonl"),
         Refused("{c}/cd.jsonl:8: \"numbers\" must be positive integers", absent=("run",)),
         countdown_file("cd.jsonl", {6: {"numbers": [3, -1]}})),
]


# ----------------------------------------------------------------------------------------------
# Issue #31's fuzz findings on train.py: each a clear one-line refusal (nothing lost) or correct behaviour

CONFIGS = ROOT / "configs"
# Sends the process SIGINT while train.py imports torch: a Ctrl-C in its first seconds.
INTERRUPT_IMPORT = """
import builtins, os, signal
_import = builtins.__import__
def _interrupting(name, *a, **k):
    if name == "torch":
        builtins.__import__ = _import
        os.kill(os.getpid(), signal.SIGINT)
    return _import(name, *a, **k)
builtins.__import__ = _interrupting
"""
# The command runs from another folder (SWEEP_CWD), as `cd there && python <repo>/train.py ...`.
CHDIR = """
import os, sys
sys.argv[1] = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(sys.argv[1]))
os.chdir(os.environ["SWEEP_CWD"])
"""
FILE_SIZE_LIMIT = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2 ** 20, 2 * 2 ** 20))"


def no_wandb(env):
    import importlib.util
    need(importlib.util.find_spec("wandb") is None, "skip: wandb is installed (the case needs it missing)")


def drop_last_line(rel):
    def setup(env):
        path = env.path(rel)
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    return setup


def empty(rel):
    def setup(env):
        env.path(rel).write_bytes(b"")
    return setup


def forget_cache_record(env):
    """The checkpoint as an older version saved it: no record of what its Query-KL cache was built from."""
    import torch
    path = env.dir / "run" / "ckpt" / "state.pt"
    state = torch.load(path, weights_only=False)
    state["extra"].pop("query_cache", None)
    torch.save(state, path)


def training_rows(name, n):
    def setup(env):
        write_jsonl(env.dir / name, rows()[:n])
    return setup


def logged(key, run="run") -> Check:
    def check(env):
        return None if all(key in m for m in metrics(env.path(run)) if "reward" in m) else f"{key} not logged"
    return check


def error_line_without(text) -> Check:
    def check(env):
        line = env.last.last_err_line()
        return f"the error line says {text!r}: {line[:120]}" if text in line else None
    return check


def short_error_line(most) -> Check:
    """The error line is one short line (its case-folder paths aside), no dict dumped."""
    def check(env):
        line = env.last.last_err_line().replace(str(env.dir), "")
        return None if len(line) <= most and "{" not in line else f"a {len(line)}-character error line"
    return check


def relative_train_data_run(env):
    """{c}/a/run: a 2-step run made in {c}/a with `--train-data train.jsonl`; {c}/b/train.jsonl holds
    other problems (the same relative path names another file from there)."""
    (env.dir / "a").mkdir(), (env.dir / "b").mkdir()
    write_jsonl(env.dir / "a" / "train.jsonl", rows())
    with open(TRAIN) as f:
        write_jsonl(env.dir / "b" / "train.jsonl", [json.loads(ln) for ln in f.readlines()[100:100 + TRAIN_ROWS]])
    argv = ["train.jsonl" if a == "{data}" else a for a in train("{c}/a/run", 2)]
    p = env.run("train.py", argv, env={"SWEEP_CWD": "{c}/a"}, prelude=CHDIR)
    need(p.code == 0, f"set-up run failed: {p.last_err_line()[:120]}")


def as_an_older_version_wrote_it(env):
    """config.json's --train-data relative, as runs recorded it before paths were made absolute."""
    path = env.dir / "a" / "run" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "train_data": "train.jsonl"}, indent=2))


GRPO_KNOBS = '{"kl": "k3", "beta": 0.01, "alpha": 0, "weights": "none"}'
ONE_STEP = ("--eval-every", "0", "--save-every", "0")
CKPT_FILES = ("run/ckpt/state.pt", "run/ckpt/model.safetensors")      # (a resumed step marks ckpt/ checked)

FUZZ_TRAIN = [
    Case("overwrite-log-no-package", "train.py", "--overwrite --log wandb without wandb: refused before the "
         "old run is removed",
         train("{c}/run", 4, "--overwrite", "--log", "wandb"),
         Refused("--log wandb needs the wandb package", protect=("run",)),
         both(no_wandb, copy_base), uses_base=True),
    Case("config-grpo-knobs-as-erpo", "train.py", "a config spelling out GRPO's knobs, run --algo erpo: refused; "
         "the suggested fix runs",
         ["--config", "{c}/grpo.json", "--algo", "erpo", *train("{c}/run", 1, *ONE_STEP)],
         Refused("sets loss knobs of another algorithm (it names no algorithm, this run is --algo erpo): "
                 "alpha 0 (erpo: 0.01), beta 0.01 (erpo: 0), kl k3 (erpo: none)", absent=("run",),
                 then=Then(["--config", "{c}/grpo.json", "--algo", "erpo", "--alpha", "0", "--beta", "0.01",
                            "--kl", "k3", "--weights", "none", *train("{c}/run", 1, *ONE_STEP)],
                           post=all_of(steps_are([1]), logged("loss_policy_kl")))),
         write_text("grpo.json", GRPO_KNOBS)),
    Case("released-config-as-grpo", "train.py", "the released config, run --algo grpo (alpha 0.01, code weights "
         "kept): refused",
         ["--config", str(CONFIGS / "released_qwen25_7b.json"), "--algo", "grpo", "--out", "{c}/run"],
         Refused("alpha 0.01 (grpo: 0)", absent=("run",))),
    Case("eval-data-is-train-data", "train.py", "--eval-data the training file (training accuracy): refused",
         train("{c}/run", 1, "--eval-data", "{data}"),
         Refused("is the training file", absent=("run",))),
    Case("eval-data-training-rows", "train.py", "--eval-data a file of training problems first: refused",
         train("{c}/run", 1, "--eval-data", "{c}/held.jsonl", "tiny-test"),
         Refused("{c}/held.jsonl holds only training problems", absent=("run",)),
         training_rows("held.jsonl", 10)),
    Case("grpo-qkl-ref-live", "train.py", "--algo grpo --qkl-ref live (nothing reads it): refused",
         train("{c}/run", 1, "--algo", "grpo", "--qkl-ref", "live"),
         Refused("--qkl-ref live cannot act on --algo grpo", absent=("run",))),
    Case("resume-lost-metrics-line", "train.py", "metrics.jsonl without its last line: --resume says so, goes on",
         train("{c}/run", 6, "--resume"),
         Works("has no line for step 4", all_of(steps_are([0, 1, 2, 3, 5, 6]), ckpt_at(6))),
         both(copy_base, drop_last_line("run/metrics.jsonl")), uses_base=True),
    Case("dry-run-ddp", "train.py", "--dry-run of the tiny default (DDP) plans and measures",
         ["--dry-run"],
         Works("measured: fake tensors on 8 rank(s)")),
    Case("dry-run-7b-ddp", "train.py", "--dry-run of the paper's 7B config without FSDP2 plans and measures",
         ["--config", str(CONFIGS / "paper_qwen7b.json"), "--fsdp", "false", "--dry-run"],
         Works("measured: fake tensors on 8 rank(s)")),
    Case("dry-run-huge-batch", "train.py", "--dry-run --rollout-batch 1e8: the plan, not 128 GB of host masks",
         ["--dry-run", "--rollout-batch", "100000000"],
         Works("not measured: its worst-case rollout")),
    Case("dry-run-huge-length", "train.py", "--dry-run --max-new-tokens 1e7: the plan, not a MemoryError",
         ["--dry-run", "--max-new-tokens", "10000000"],
         Works("not measured: its worst-case rollout")),
    Case("dry-run-gpus-indivisible", "train.py", "--dry-run --plan-gpus 64 (16 update prompts): refused",
         ["--dry-run", "--plan-gpus", "64"],
         Refused("--update-batch 16 must be divisible by the world size 64")),
    Case("train-truncated-model", "train.py", "a truncated model.safetensors: one line, --out not created",
         train("{c}/run", 1, "--model", "{c}/model"),
         Refused("cannot load model", absent=("run",)),
         broken_copy_of_warm),
    Case("resume-empty-query-cache", "train.py", "an empty query_cache.pt: --resume rebuilds it bit for bit",
         train("{c}/run", 6, "--resume", "--query-cache-dir", ""),
         Recovered("query_cache.pt was unreadable (", all_of(steps_are(range(7)), ckpt_at(6), same_prompts_as_base)),
         both(copy_base, empty("run/query_cache.pt")), uses_base=True),
    Case("resume-cut-cache-no-record", "train.py", "a cut query_cache.pt, no record to rebuild it exactly: "
         "one line, nothing changed",
         train("{c}/run", 6, "--resume"),
         Refused("cannot be rebuilt exactly: the checkpoint does not record", protect=("run",)),
         both(copy_base, truncate("run/query_cache.pt"), forget_cache_record), uses_base=True),
    Case("save-disk-full", "train.py", "a full disk at a save: one line, the checkpoint before it kept; resumes",
         train("{c}/run", 6, "--resume"),
         Refused("cannot save the checkpoint of step 6", protect=CKPT_FILES, then=resumed_to(6)),
         copy_base, prelude=FULL_DISK, env={"SWEEP_FULL_DIR": "{c}/run/ckpt.tmp"}, uses_base=True),
    Case("save-file-size-limit", "train.py", "`ulimit -f` below a checkpoint: one line, the one before kept",
         train("{c}/run", 6, "--resume"),
         Refused("File too large", protect=CKPT_FILES, then=resumed_to(6)),
         copy_base, prelude=FILE_SIZE_LIMIT, uses_base=True),
    Case("ctrl-c-in-imports", "train.py", "Ctrl-C while train.py imports: exit 130, one line, nothing written",
         train("{c}/run", 1, *ONE_STEP),
         Interrupted((), lambda env: None, 130, "interrupted (SIGINT): stopped while starting, nothing written",
                     Then(train("{c}/run", 1, *ONE_STEP), post=steps_are([1])), post=exists("run", False)),
         prelude=INTERRUPT_IMPORT),
    Case("alpha-inf-no-advice", "train.py", "--alpha inf: refused without advice to give 1e9",
         train("{c}/run", 1, "--alpha", "inf"),
         Refused("argument --alpha: expected a finite number, got 'inf'", absent=("run",),
                 after=error_line_without("1e9"))),
    Case("eval-temperatures-inf", "train.py", "--eval-temperatures inf: refused without advice to give 1e9",
         train("{c}/run", 1, "--eval-temperatures", "inf"),
         Refused("argument --eval-temperatures: expected a finite number", absent=("run",),
                 after=error_line_without("1e9"))),
    Case("steps-0-save-every-1", "train.py", "--steps 0 --save-every 1: the summary says why no checkpoint",
         train("{c}/run", 0, "--save-every", "1"),
         Works("no checkpoint (no step was trained)")),
    Case("resume-from-elsewhere", "train.py", "--resume from a folder where the relative --train-data names "
         "another file: the run's own file",
         ["--out", "{c}/a/run", "--resume", "--steps", "3"],
         Works("resumed from", all_of(steps_are(range(4), "a/run"), ckpt_at(3, "a/run/ckpt"))),
         relative_train_data_run, prelude=CHDIR, env={"SWEEP_CWD": "{c}/b"}),
    Case("resume-old-relative-elsewhere", "train.py", "an older run's relative --train-data, resumed from elsewhere: "
         "one short line",
         ["--out", "{c}/a/run", "--resume", "--steps", "3"],
         Refused("was built from other prompts or settings (data ", protect=("a/run",),
                 after=short_error_line(300)),
         both(relative_train_data_run, as_an_older_version_wrote_it), prelude=CHDIR, env={"SWEEP_CWD": "{c}/b"}),
]

# Issue #40's fuzz findings on options that say one thing and do another (LR schedule, inert options,
# LoRA, a task's length and tokenizer, the LoRA dry-run).
ZIPF_WARM = ROOT / "data" / "zipf" / "warmstart"
TINY_SIZES = ["--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
              "--query-cache-dir", "{cache}", "--no-signal", "step"]


def cosine_run(env):
    """{c}/run: a 2-step run of --lr-schedule cosine (its horizon: --steps), saved at its end."""
    p = env.run("train.py", train("{c}/run", 2, "--lr-schedule", "cosine", "--eval-every", "0"))
    need(p.code == 0, f"set-up run failed: {p.last_err_line()[:120]}")


def lrs_are(want: dict, run="run") -> Check:
    """metrics.jsonl's lr at these steps, to 1e-9 relative: {step: lr}."""
    def check(env):
        got = {m["step"]: m.get("lr") for m in metrics(env.path(run)) if m.get("step") in want}
        ok = set(got) == set(want) and all(abs(got[k] - v) <= 1e-9 * v for k, v in want.items())
        return None if ok else f"lr at steps {got}, expected {want}"
    return check


def config_has(key, value, run="run") -> Check:
    def check(env):
        got = json.loads((env.path(run) / "config.json").read_text()).get(key)
        return None if got == value else f"config.json's {key} is {got!r}, expected {value!r}"
    return check


def said(pattern) -> Check:
    """The command's stdout matches `pattern` (a regular expression)."""
    def check(env):
        return None if re.search(pattern, env.last.out) else f"stdout does not match {pattern!r}"
    return check


def lora_qv_params(rank) -> int:
    """Adapter parameters of LoRA on q_proj and v_proj of the tiny warm start."""
    c = json.loads((WARM / "config.json").read_text())
    h, head = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    return c["num_hidden_layers"] * rank * ((h + q) + (h + kv))


ISSUE40_OPTIONS = [
    Case("lr-cosine-resume-longer", "train.py", "a cosine run resumed with more --steps decays over them "
         "(not lr 0), saying so",
         train("{c}/run", 4, "--lr-schedule", "cosine", "--eval-every", "0", "--resume"),
         # optimizer steps 4 and 6 of 2 x 4 = 8 (not 2 x 2 = 4: lr 0)
         Works("steps 2 -> 4 (the cosine LR schedule's horizon follows --steps: it decays over 4 steps, not 2",
               all_of(steps_are(range(1, 5)), lrs_are({3: 1e-4, 4: 1e-4 * (1 - 0.5 ** 0.5)}))),
         cosine_run),
    Case("lr-decay-before-steps", "train.py", "--lr-decay-steps 2 --steps 4 at --lr-floor 0 (steps at lr 0): "
         "refused",
         train("{c}/run", 4, "--lr-schedule", "cosine", "--lr-decay-steps", "2"),
         Refused("steps 3-4 would not train; give --lr-decay-steps 4", absent=("run",))),
    Case("lr-logged-is-used", "train.py", "the lr logged at a step is the one its optimizer used (warm-up)",
         train("{c}/run", 2, "--warmup", "8", *ONE_STEP),
         Works(post=lrs_are({1: 2e-4 / 8, 2: 2e-4 * 3 / 8}))),
    Case("lr-floor-constant", "train.py", "--lr-floor under the constant schedule (no decay): refused",
         train("{c}/run", 1, "--lr-floor", "0.1"),
         Refused("--lr-floor 0.1 cannot act under --lr-schedule constant", absent=("run",))),
    Case("lr-decay-steps-constant", "train.py", "--lr-decay-steps under the constant schedule: refused",
         train("{c}/run", 1, "--lr-decay-steps", "10"),
         Refused("--lr-decay-steps 10 cannot act under --lr-schedule constant", absent=("run",))),
    Case("lora-alpha-no-rank", "train.py", "--lora-alpha without --lora-rank (a full fine-tune): refused",
         train("{c}/run", 1, "--lora-alpha", "32"),
         Refused("--lora-alpha 32.0 cannot act without --lora-rank", absent=("run",))),
    Case("lora-targets-spaces", "train.py", "--lora-targets \"q_proj, v_proj\" adapts both (not q_proj only)",
         train("{c}/run", 1, "--lora-rank", "4", "--lora-targets", "q_proj, v_proj", *ONE_STEP),
         Works(f"LoRA rank 4: {lora_qv_params(4):,} of", steps_are([1]))),
    Case("zipf-own-model", "train.py", "--task zipf on its warm start: accepted, --max-new-tokens the task's 160",
         ["--task", "zipf", "--model", str(ZIPF_WARM), "--eval-data", "zipf-test", "--eval-limit", "4",
          *TINY_SIZES, "--out", "{c}/run", "--steps", "1", *ONE_STEP],
         Works(post=all_of(steps_are([1]), config_has("max_new_tokens", 160)))),
    Case("zipf-short-length", "train.py", "--task zipf --max-new-tokens 96 (cuts its solutions): a warning",
         ["--task", "zipf", "--model", str(ZIPF_WARM), "--max-new-tokens", "96", "--dry-run"],
         Works("warning: --max-new-tokens 96 is below the 160 tokens --task zipf's solutions need")),
    Case("zipf-math-warmstart", "train.py", "--task zipf on the math warm start (its words spelled letter by "
         "letter: reward 0): refused",
         ["--task", "zipf", "--eval-data", "zipf-test", "--eval-limit", "4", *TINY_SIZES, "--out", "{c}/run",
          "--steps", "1"],
         Refused("give --model data/zipf/warmstart", absent=("run",),
                 then=Then(["--task", "zipf", "--model", str(ZIPF_WARM), "--eval-data", "zipf-test",
                            "--eval-limit", "4", *TINY_SIZES, "--out", "{c}/run", "--steps", "1", *ONE_STEP],
                           post=steps_are([1])))),
    Case("dry-run-7b-lora", "train.py", "--dry-run --lora-rank 16 of the 7B config: a plan with adapters, far "
         "below full fine-tuning's 169 GiB",
         ["--config", str(CONFIGS / "paper_qwen7b.json"), "--fsdp", "false", "--lora-rank", "16", "--dry-run"],
         Works("LoRA rank 16 (40.4M adapter parameters train)",
               all_of(said(r"plan: peak_gib_per_gpu=(\d\d)\.\d "), said(r"6N \+ 6 x 40\.4M FLOPs per token")))),
]

# ----------------------------------------------------------------------------------------------
# Issue #40's findings (part 2): divergence under --no-signal skip, older configs, a damaged hf/,
# LoRA run folders, targets that match nothing, a full disk when the run folder is first written


def error_line_has(*texts) -> Check:
    def check(env):
        line = env.last.last_err_line()
        missing = [t for t in texts if env.fill(t) not in line]
        return f"the error line lacks {missing}: {line[:120]}" if missing else None
    return check


def learns(env) -> str | None:
    """Every logged step finite, some applied, and the entropy not the uniform distribution's."""
    ms = [m for m in metrics(env.dir / "run") if "reward" in m]
    if not any(m.get("grad_norm") is not None for m in ms) or any(m.get("skipped_steps") for m in ms):
        return "no optimizer step applied, or non-finite ones"
    return None if ms[-1]["entropy"] < 1.0 else f"entropy {ms[-1]['entropy']:.2f}: the uniform distribution's"


# --no-signal skip (the default), 64 new tokens: step 1's first update batch has a signal and its
# step at --lr 1e6 destroys the weights; every later batch scores 0 (no signal, no step, no loss)
DIVERGING = ("--no-signal", "skip", "--max-new-tokens", "64", "--lr", "1e6", "--save-every", "1")

# The options a config.json written at d5ba7a3 (2026-12-01) lacks: the issue's 18 keys
NEWER_OPTIONS = ("entropy_coef", "eval_temperatures", "lora_alpha", "lora_dropout", "lora_rank", "lora_targets",
                 "lr_decay_steps", "lr_floor", "lr_schedule", "mask_truncated", "no_signal", "plan_gpu",
                 "qkl_ref_decay", "qkl_ref_every", "sapo_tau_neg", "sapo_tau_pos", "tis_cap", "top_entropy_quantile")


def as_d5ba7a3_wrote_it(env):
    """The base run's config.json without the options added since d5ba7a3 (its --no-signal step among them)."""
    path = env.dir / "run" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k not in NEWER_OPTIONS}, indent=2))


def trained_as_before(env) -> str | None:
    cfg = json.loads((env.dir / "run" / "config.json").read_text())
    if cfg.get("no_signal") != "step" or "no_signal" not in cfg["resumed"][-1].get("added", {}):
        return f"config.json: no_signal {cfg.get('no_signal')!r}, resumed {cfg['resumed'][-1]}"
    return metric("no_signal_steps", {5: 0, 6: 0})(env)


# open() for writing raises ENOSPC under one folder, as on a full disk (folders can still be made)
FULL_DISK_FILES = """
import builtins, errno, os
_open, _full = builtins.open, os.environ["SWEEP_FULL_DIR"]
def _open_or_full(file, mode="r", *a, **k):
    if isinstance(file, (str, os.PathLike)) and os.path.abspath(os.fspath(file)).startswith(_full) \\
            and any(c in mode for c in "wax+"):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(file))
    return _open(file, mode, *a, **k)
builtins.open = _open_or_full
"""
LORA = ("--lora-rank", "4", "--eval-every", "0")         # a 2-step LoRA run: adapters in ckpt/, merged hf/


def copy_lora_run(env):
    """{c}/run: a copy of one finished 2-step LoRA run, made once for the sweep by the first case that needs it."""
    sweep = env.sweep
    with sweep.lora_lock:
        if not (sweep.root / "lora-run" / "run" / "hf").exists():
            (sweep.root / "lora-run").mkdir(exist_ok=True)
            p = env.run("train.py", train(str(sweep.root / "lora-run" / "run"), 2, *LORA))
            need(p.code == 0, f"set-up LoRA run failed: {p.last_err_line()[:120]}")
    shutil.copytree(sweep.root / "lora-run" / "run", env.dir / "run", symlinks=True)


def hf_intact(env) -> str | None:
    """run/hf: every weights file as long as its header says, and the export's record there."""
    hf = env.dir / "run" / "hf"
    if not (hf / "export_record.json").is_file():
        return "run/hf has no export_record.json"
    for path in hf.glob("*.safetensors"):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        end = max(v["data_offsets"][1] for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__")
        if len(data) < 8 + n + end:
            return f"run/hf/{path.name} is truncated"
    return None


FUZZ40 = [
    Case("lr-1e6-no-signal-skip", "train.py", "--lr 1e6 under --no-signal skip (no later step has a signal): the "
         "divergence error, not exit 0; --lr 1e-4 then learns",
         ["--out", "{c}/run", "--resume", "--steps", "4", "--lr", "1e-4"],
         Recovered("--resume: no complete checkpoint in", all_of(steps_are(range(5)), ckpt_at(4), learns),
                   fault=train("{c}/run", 4, *DIVERGING), fault_code=1,
                   fault_says="error: the policy diverged by step 2: the weights' norm is ",
                   fault_post=all_of(error_line_has("--resume starts from the initial model",
                                                    "resume with a lower --lr"),
                                     exists("run/ckpt", False), ckpt_at(1, "run/ckpt.diverged")))),
    Case("no-step-for-10-steps", "train.py", "10 RL steps in a row without an optimizer step (no signal): said "
         "in one line",
         train("{c}/run", 10, "--no-signal", "skip", "--eval-every", "0", "--save-every", "0"),
         Works("no optimizer step in 10 RL steps in a row (steps 1-10; train_acc 0.000)", steps_are(range(1, 11)))),
    Case("resume-older-config", "train.py", "--resume of a run whose config.json lacks 17 newer options: said in "
         "one line; it steps without signal, as it did (no_signal 'step', not today's 'skip')",
         ["--out", "{c}/run", "--resume", "--steps", "6"],
         Works("lacks 17 options newer than the run", all_of(steps_are(range(7)), ckpt_at(6), trained_as_before)),
         both(copy_base, as_d5ba7a3_wrote_it), uses_base=True),
    Case("lora-run-advice", "train.py", "a LoRA run's summary names what evaluate.py loads (its hf/, not ckpt/)",
         train("{c}/run", 2, *LORA),
         Works("python evaluate.py --model {c}/run/hf ", all_of(steps_are([1, 2]), hf_intact))),
    Case("eval-lora-ckpt", "evaluate.py", "a LoRA run's ckpt/ (adapters only) as --model: the initial model with "
         "its adapters merged",
         evaluate("{c}/run/ckpt"),
         Works(post=samples(4)),
         copy_lora_run),
    Case("eval-lora-run-folder", "evaluate.py", "a LoRA run's folder as --model means its checkpoint",
         evaluate("{c}/run"),
         Works(post=samples(4)),
         copy_lora_run),
    Case("nll-lora-run", "analysis.py", "nll on a LoRA run's folder writes its pairs",
         ["nll", "--model", "{c}/run", "--limit", "2", "--max-new-tokens", "16", "--no-progress", "--out", "{c}/nll"],
         Works("Pearson r(query NLL, response NLL)", nll_pairs(2)),
         copy_lora_run),
    Case("lora-hf-damaged", "train.py", "a finished LoRA run whose hf/ a full disk cut short: --resume rebuilds it "
         "from the last checkpoint",
         ["--out", "{c}/run", "--resume"],
         Recovered("{c}/run/hf is not complete (model.safetensors: ", all_of(steps_are([1, 2]), hf_intact)),
         both(copy_lora_run, truncate("run/hf/model.safetensors"))),
    Case("lora-target-missing", "train.py", "--lora-targets naming no module: one line before --out is claimed",
         train("{c}/run", 1, "--lora-rank", "4", "--lora-targets", "nonexistent_proj"),
         Refused("--lora-targets nonexistent_proj: no module of the model is named so", absent=("run",))),
    Case("full-disk-first-write", "train.py", "a full disk when the run folder is first written: one line, no "
         "folder left",
         train("{c}/a/run", 1, *ONE_STEP),
         Refused("cannot write {c}/a/run (No space left on device)", absent=("a",)),
         prelude=FULL_DISK_FILES, env={"SWEEP_FULL_DIR": "{c}/a"}),
    Case("eval-full-disk-first-write", "evaluate.py", "a full disk when --out's config.json is first written: one "
         "line, no folder left",
         evaluate("{warm}", "{c}/a/eval"),
         Refused("cannot write {c}/a/eval/config.json (No space left on device)", absent=("a",)),
         prelude=FULL_DISK_FILES, env={"SWEEP_FULL_DIR": "{c}/a"}),
]


# Issue #50's findings (the round's new fuzz sweep): data lost, silently wrong, or a traceback before


def tmp_folder(env):
    (env.dir / "tmp").mkdir()


def tmp_left_empty(env) -> str | None:
    left = sorted(os.listdir(env.dir / "tmp"))
    return f"left in TMPDIR: {left}" if left else None


def malformed_metrics(env):
    """The base run with its metrics.jsonl's third line cut and a non-object line for its fourth."""
    copy_base(env)
    path = env.dir / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2], lines[3] = lines[2][:20], "[4]"
    path.write_text("\n".join(lines) + "\n")


ISSUE50 = [
    Case("export-into-own-run", "train.py", "--export the run's own --out: refused before anything is "
         "written (it wrote the model's config.json over the run's; a plain --resume was then refused)",
         train("{c}/run", 6, "--resume", "--export", "{c}/run"),
         Refused("--export {c}/run is --out", protect=("run",)),
         copy_base, uses_base=True),
    Case("export-into-other-run", "train.py", "--export another run's folder: refused, that run untouched, "
         "--out not created",
         train("{c}/new", 1, *ONE_STEP, "--export", "{c}/run"),
         Refused("--export {c}/run is the run folder {c}/run", protect=("run",), absent=("new",)),
         copy_base, uses_base=True),
    Case("export-into-run-hf", "train.py", "--export another run's hf/: refused, that run untouched",
         train("{c}/new", 1, *ONE_STEP, "--export", "{c}/run/hf"),
         Refused("--export {c}/run/hf is hf/ of the run folder {c}/run", protect=("run",),
                 absent=("new",)),
         copy_base, uses_base=True),
    Case("export-inside-own-run", "train.py", "--export a folder of its own inside --out (<out>/final): "
         "works",
         train("{c}/run", 1, *ONE_STEP, "--export", "{c}/run/final"),
         Works(post=all_of(steps_are([1]), exists("run/final/config.json"), exists("run/config.json")))),
    Case("overwrite-reference-in-run", "train.py", "--overwrite with --qkl-ref-model <out>/ckpt: refused "
         "before the old run (and that checkpoint) is removed",
         train("{c}/run", 1, *ONE_STEP, "--overwrite", "--qkl-ref", "model", "--qkl-ref-model",
               "{c}/run/ckpt"),
         Refused("--qkl-ref-model {c}/run/ckpt is in the run that --overwrite would remove",
                 protect=("run",)),
         copy_base, uses_base=True),
    Case("entropy-coef-above-max", "train.py", "--entropy-coef 0.1 --entropy-target 0.5 (above the default "
         "--entropy-coef-max 0.05): refused, not run at 0.05 while config.json says 0.1",
         train("{c}/run", 1, *ONE_STEP, "--entropy-coef", "0.1", "--entropy-target", "0.5"),
         Refused("--entropy-coef 0.1 is above --entropy-coef-max 0.05", absent=("run",))),
    Case("entropy-coef-above-max-overwrite", "train.py", "the same over a run with --overwrite: the old run "
         "is kept",
         train("{c}/run", 1, *ONE_STEP, "--entropy-coef", "0.1", "--entropy-target", "0.5",
               "--overwrite"),
         Refused("--entropy-coef 0.1 is above --entropy-coef-max 0.05", protect=("run",)),
         copy_base, uses_base=True),
    Case("headline-jobs-0", "study/headline.py", "--jobs 0: one line, no temporary folder left",
         ["--jobs", "0", "--smoke"],
         Refused("argument --jobs: must be >= 1", after=tmp_left_empty),
         tmp_folder, env={"TMPDIR": "{c}/tmp"}),
    Case("long-run-jobs-0", "study/long_run.py", "--jobs 0: one line, no temporary folder left",
         ["--jobs", "0", "--smoke"],
         Refused("argument --jobs: must be >= 1", after=tmp_left_empty),
         tmp_folder, env={"TMPDIR": "{c}/tmp"}),
    Case("compare-malformed-line", "analysis.py", "compare over a metrics.jsonl with bad lines: a warning "
         "naming the file and line, and the verdict",
         ["compare", "{c}/run", "{c}/run"],
         Works("{c}/run/metrics.jsonl:3: not a JSON object, left out (and 1 more: line 4)"),
         malformed_metrics, uses_base=True),
]

# Issue #50's findings (part 2): one rule for an option from a flag, a --config file or an extension
# row; rows checked when loaded; empty values, absurd lengths, --plan-lengths files, the held-out
# Query-KL on --resume, pass@G, and the `next:` comparison as pasted

GRPO_ROW = "losses.AdvantageRow(losses.grpo_advantages, 'grpo, of my own'{extra})"   # + attributes


def extension_module(name, *rows):
    """A set-up: {c}/<name>.py, an --extensions module registering advantage rows: (name, the row's code)."""
    lines = ["import losses", "from plumbing import extension"]
    lines += [f"extension.register(losses.ADVANTAGES, {n!r}, {row})" for n, row in rows]
    return write_text(f"{name}.py", "\n".join(lines) + "\n")


def ran_as_pasted(env) -> str | None:
    """The `next:` comparison the run printed, run as pasted (from the repository, as the runs are)."""
    line = next((ln for ln in env.last.out.splitlines() if "python analysis.py compare" in ln), "")
    argv = line.split("#")[0].split()[2:]
    if not argv or line.strip().startswith("#"):
        return f"no command to paste: {line.strip()[:120]!r}"
    p = env.run("analysis.py", argv)
    return None if p.code == 0 and "verdict:" in p.out else f"as pasted: exit {p.code}: {p.last_err_line()[:120]}"


def beside_base(env):
    """{c}/runs/grpo: a copy of the shared run, beside the run the case trains ({c}/runs/erpo)."""
    (env.dir / "runs").mkdir()
    shutil.copytree(env.sweep.base, env.dir / "runs" / "grpo", symlinks=True)


HISTOGRAM = '{"prompt": {"histogram": {"20": 5, "30": -3}}}'


def heldout_measured(steps) -> Check:
    """eval_query_kl logged, finite and >= 0, at each of `steps`."""
    def check(env):
        got = {m["step"]: m.get("eval_query_kl") for m in metrics(env.dir / "run") if m.get("step") in steps}
        ok = set(got) == set(steps) and all(isinstance(v, float) and v >= 0 for v in got.values())
        return None if ok else f"eval_query_kl at steps {got}, expected a value at {list(steps)}"
    return check


ISSUE50_MORE = [
    Case("config-lora-alpha-no-rank", "train.py", "lora_alpha in a --config without lora_rank: refused as the "
         "flag is (it was accepted and did nothing)",
         ["--config", "{c}/c.json", *train("{c}/run", 1)],
         Refused("--config {c}/c.json: lora_alpha 32.0 cannot act without --lora-rank", absent=("run",)),
         write_text("c.json", '{"lora_alpha": 32}')),
    Case("config-qkl-ref-decay-cache", "train.py", "qkl_ref_decay in a --config under the cache reference: "
         "refused as the flag is",
         ["--config", "{c}/c.json", *train("{c}/run", 1)],
         Refused("qkl_ref_decay 0.5 cannot act", absent=("run",)),
         write_text("c.json", '{"qkl_ref_decay": 0.5}')),
    Case("config-entropy-delta-no-target", "train.py", "entropy_coef_delta in a --config without a target: "
         "refused as the flag is",
         ["--config", "{c}/c.json", *train("{c}/run", 1)],
         Refused("entropy_coef_delta 0.01 cannot act", absent=("run",)),
         write_text("c.json", '{"entropy_coef_delta": 0.01}')),
    Case("config-loss-knob-idle", "train.py", "a config of grpo's with surrogate sapo and eps_high (SAPO has no "
         "clip): refused as the flags are (it was accepted and did nothing)",
         ["--config", "{c}/c.json", *train("{c}/run", 1)],
         Refused("--config {c}/c.json: eps_high cannot act on --algo grpo as configured", absent=("run",)),
         write_text("c.json", '{"algo": "grpo", "surrogate": "sapo", "eps_high": 0.5}')),
    Case("extension-option-lr", "train.py", "an extension row's option named lr (it silently read --lr): "
         "refused, naming the row and the flag",
         ["--extensions", "{c}/mine.py", "--adv", "mine", *train("{c}/run", 1)],
         Refused("extension row 'mine' of --adv: its option 'lr' is train.py's own --lr", absent=("run",)),
         extension_module("mine", ("mine", GRPO_ROW.format(extra=", OPTIONS=(('lr', 0.5, 'its own lr'),)")))),
    Case("extension-options-clash", "train.py", "two rows declaring one option, each its own: refused, "
         "naming both",
         ["--extensions", "{c}/mine.py", *train("{c}/run", 1)],
         Refused("extension row 'b' of --adv and extension row 'a' of --adv both declare the option 'my_k'",
                 absent=("run",)),
         extension_module("mine", ("a", GRPO_ROW.format(extra=", OPTIONS=(('my_k', 1, 'a'),)")),
                          ("b", GRPO_ROW.format(extra=", OPTIONS=(('my_k', 2, 'b'),)")))),
    Case("extension-row-no-fn", "train.py", "an advantage row without its function (a traceback at step 1): "
         "refused when loaded, naming the row",
         ["--extensions", "{c}/mine.py", "--adv", "mine", *train("{c}/run", 1)],
         Refused("extension row 'mine' of --adv: it has no fn", absent=("run",)),
         extension_module("mine", ("mine", "type('Row', (), {'doc': 'no function'})()"))),
    Case("extension-option-malformed", "train.py", "a row's option that is not (name, default, help): refused "
         "when loaded, naming the row",
         ["--extensions", "{c}/mine.py", "--adv", "mine", *train("{c}/run", 1)],
         Refused("extension row 'mine' of --adv: its option ('my-k', 1) is not a row", absent=("run",)),
         extension_module("mine", ("mine", GRPO_ROW.format(extra=", OPTIONS=(('my-k', 1),)")))),
    Case("plan-lengths-negative-count", "train.py", "--plan-lengths a histogram with a negative count (planned "
         "from): refused",
         ["--dry-run", "--plan-lengths", "{c}/h.json"],
         Refused("its prompt histogram counts -3 prompts of 30 tokens"),
         write_text("h.json", HISTOGRAM)),
    Case("plan-lengths-all-zero", "train.py", "--plan-lengths a histogram of zero counts (nan): refused",
         ["--dry-run", "--plan-lengths", "{c}/h.json"],
         Refused("its prompt histogram counts no prompt"),
         write_text("h.json", '{"prompt": {"histogram": {"20": 0}}}')),
    Case("plan-lengths-run-metrics", "train.py", "--plan-lengths the tiny world's run's metrics.jsonl (every "
         "row cut: refused before): planned from",
         ["--dry-run", "--plan-lengths", "{c}/run/metrics.jsonl"],
         Works("4 steps' mean 24, 100.0% cut at 24, as two points", said(r"plan: peak_gib_per_gpu=")),
         copy_base, uses_base=True),
    Case("out-empty", "train.py", "--out '' (trained into runs/<algo>): refused",
         [*SMALL, "--out", "", "--steps", "1"],
         Refused("--out '': would train into runs/<algo>")),
    Case("eval-data-no-value", "train.py", "--eval-data with no value (evaluated nothing without a word): "
         "refused",
         train("{c}/run", 1, "--eval-data"),
         Refused("--eval-data without a value: would evaluate nothing", absent=("run",))),
    Case("dry-run-length-1e9", "train.py", "--dry-run --max-new-tokens 1e9 (22 GB of arrays, killed): the "
         "time model says it does not model it, the plan is printed",
         ["--dry-run", "--max-new-tokens", "1000000000"],
         Works("time model: not modelled: --max-prompt-len 128 + --max-new-tokens 1,000,000,000",
               said(r"plan: peak_gib_per_gpu="))),
    Case("resume-heldout-eval-later", "train.py", "--resume of a run without heldout_query_cache.pt (evaluation "
         "off at its start): held-out Query-KL measured, from the initial model",
         ["--out", "{c}/run", "--resume", "--steps", "6"],
         Works("heldout_query_cache.pt was missing: built it from the initial model",
               all_of(steps_are(range(7)), heldout_measured([6]))),
         both(copy_base, remove("run/heldout_query_cache.pt")), uses_base=True),
    Case("resume-heldout-cache-cut", "train.py", "--resume with a cut heldout_query_cache.pt ('built with other "
         "settings'): rebuilt from the initial model, measured",
         ["--out", "{c}/run", "--resume", "--steps", "6"],
         Works("heldout_query_cache.pt was unreadable", all_of(steps_are(range(7)), heldout_measured([6]))),
         both(copy_base, truncate("run/heldout_query_cache.pt")), uses_base=True),
    Case("passk-k-is-group-size", "train.py", "--adv passk --passk-k = --group-size (pass@G: no variance, no "
         "step; the message blamed equal rewards): refused",
         train("{c}/run", 1, "--adv", "passk", "--passk-k", "4"),
         Refused("--adv passk --passk-k 4 at --group-size 4: every group's advantages are 0", absent=("run",))),
    Case("next-compare-as-pasted", "train.py", "the `next:` comparison names the run beside it and works as "
         "pasted (compare OTHER_RUN failed)",
         train("{c}/runs/erpo", 1, *ONE_STEP),
         Works("python analysis.py compare {c}/runs/grpo {c}/runs/erpo", ran_as_pasted),
         beside_base, uses_base=True),
]

CASES = (ISSUE_TRAIN + ISSUE_EVALUATE + ISSUE_ANALYSIS + OWN + FUZZ_EVALUATE + FUZZ_TRAIN + ISSUE40_OPTIONS
         + FUZZ40 + ISSUE50 + ISSUE50_MORE)


# ----------------------------------------------------------------------------------------------
# The sweep


class Sweep:
    """The temporary folder, what its cases share, and running them."""

    def __init__(self, root: Path):
        self.root = root
        (root / "logs").mkdir()
        self.data = root / "train.jsonl"
        write_jsonl(self.data, rows())
        self.cache = root / "query_cache"
        self.base = root / "base-run" / "run"
        self.readonly = self._readonly_folder()
        self.lora_lock = threading.Lock()                # the shared LoRA run (copy_lora_run): made once

    def _readonly_folder(self) -> str | None:
        """A folder this user cannot write: a chmod 0500 one, or as root (who writes anywhere) one
        the kernel refuses root too (/proc/sys); None if there is none."""
        if os.geteuid() != 0:
            ro = self.root / "read-only"
            ro.mkdir(mode=0o500)
            return str(ro)
        return "/proc/sys" if not os.access("/proc/sys", os.W_OK) else None

    def run(self, case: Case) -> Outcome:
        folder = self.root / case.name
        folder.mkdir()
        env = Env(folder, self, case.name, case.script)
        codes, t0 = [], time.time()
        try:
            if case.setup:
                case.setup(env)
            CHECKERS[case.expect.kind](env, case, case.expect, codes)
            passed, why = True, "PASS"
        except Fail as e:
            skipped = str(e).startswith("skip:")
            passed, why = (None if skipped else False), str(e)
        except Exception as e:                      # a check that could not read what it expected
            passed, why = False, f"the check failed: {type(e).__name__}: {e}"
        finally:
            env.stop_background()
        why = why.replace(f"{folder}/", "").replace(f"{self.root}/", "")   # the table: no temporary paths
        tail = env.last.tail() if passed is False and env.last else ""
        return Outcome(case, passed, why, codes, time.time() - t0, [x[3] for x in env.procs], tail)


def table(outcomes) -> str:
    lines = ["| case | script | command (short) | expected | exit | result |",
             "|---|---|---|---|---|---|"]
    for o in outcomes:
        if o.passed:
            result = "PASS"
        else:
            result = ("SKIP: " if o.passed is None else "FAIL: ") + o.why.removeprefix("skip: ")
        result = result.replace("|", "\\|")
        cmd = o.case.short().replace("|", "\\|")
        exits = " -> ".join(str(c) for c in o.codes) or "-"
        expected = f"{o.case.expect.kind}: {o.case.checks}".replace("|", "\\|")
        cells = [o.case.name, o.case.script, f"`{cmd}`", expected, exits, result]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LEGEND = ("refused: a non-zero exit, no traceback, one `error:` line last, the protected files "
          "byte-identical (or --out not made); works: exit 0 and its postcondition; interrupted: exit "
          "130/143 with one line, then the resume (or rerun) finishes; recovered: after the fault, the "
          "next command says how it recovered and finishes. exit: the exit status of each command, in order.")


def report(outcomes, seconds, jobs=1) -> str:
    n = len(outcomes)
    passed = sum(o.passed is True for o in outcomes)
    failed = sum(o.passed is False for o in outcomes)
    summary = (f"`python bench/reliability_sweep.py --jobs {jobs}`: {n} cases, {passed} passed, "
               f"{failed} failed, {n - passed - failed} skipped, in {seconds:.0f} s on "
               f"{os.cpu_count()} CPU cores.")
    return f"# Reliability sweep (issue #20)\n\n{summary}\n\n{LEGEND}\n\n{table(outcomes)}\n"


def select(names) -> list[Case]:
    """The cases asked for (all by default), with the shared base run first if any copies it."""
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names or [] if n not in by_name]
    if unknown:
        raise SystemExit(f"error: unknown case(s) {unknown}; see --list")
    chosen = [by_name[n] for n in names] if names else list(CASES)
    if any(c.uses_base for c in chosen) and by_name["base-run"] not in chosen:
        chosen.insert(0, by_name["base-run"])
    return chosen


def list_cases():
    for c in CASES:
        print(f"{c.name:28s} {c.script:12s} {c.expect.kind:12s} {c.checks}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these cases (and the shared base run)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    p.add_argument("--jobs", type=int, default=2,
                   help="cases run at a time, after the base run (each case runs one process at a time; the "
                        "signal cases poll for their moment, so load does not move them)")
    p.add_argument("--write", default=str(RESULTS),
                   help="where the markdown table of a full sweep goes ('' = nowhere)")
    args = p.parse_args(argv)
    if args.jobs < 1:                              # (a ThreadPoolExecutor traceback after the base run)
        p.error(f"argument --jobs: must be >= 1 (cases at a time), got {args.jobs}")
    return args


def run_all(sweep, cases, jobs) -> list[Outcome]:
    """Every case, the shared base run first; `jobs` cases at a time after it. -> in case order."""
    def one(case):
        o = sweep.run(case)
        status = "PASS" if o.passed else ("SKIP" if o.passed is None else "FAIL")
        print(f"{status} {case.name} ({o.seconds:.1f} s){'' if o.passed else ': ' + o.why}", flush=True)
        return o

    first = [c for c in cases if c.name == "base-run"]
    done = [one(c) for c in first]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done += list(pool.map(one, [c for c in cases if c not in first]))
    return done


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        return list_cases()
    cases = select(args.only)
    pass_signals_on()
    root = Path(tempfile.mkdtemp(prefix="reliability-sweep-"))
    os.chmod(root, 0o755)
    t0 = time.time()
    try:
        outcomes = run_all(Sweep(root), cases, args.jobs)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = report(outcomes, time.time() - t0, args.jobs)
    print("\n" + text)
    for o in outcomes:
        if o.passed is False:
            print(f"\nFAIL {o.case.name}: {o.why}\n  " + "\n  ".join(o.commands) + "\n" + o.tail)
    if args.write and not args.only:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
    return 1 if any(o.passed is False for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
