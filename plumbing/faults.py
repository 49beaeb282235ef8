"""Failpoints: named places where the fault tests kill the process, to prove a run survives it.

    ERPO_FAULT=ckpt-rename python train.py ...      # SIGKILL between the two checkpoint renames
    ERPO_FAULT=mid-step:3 python train.py ...       # ... the 3rd time a step reaches its update

Points: query-cache (inside the Query-KL cache build), mid-step (after a backward, before the
optimizer step), ckpt-write (the new checkpoint's weights written to ckpt.tmp, the rest not yet),
ckpt-rename (between moving the old checkpoint aside and the new one in), metrics-write (half of
a metrics line written). Unset, which is always the case outside the
tests, `point` is one environment lookup. SIGKILL, not an exception: nothing gets to clean up,
as with the OOM killer or a pre-empted node.
"""

import os
import signal

_hits: dict = {}
ARMED = bool(os.environ.get("ERPO_FAULT"))   # read once: the fault tests set it before a run starts


def point(name, before=None):
    """Kill this process here if ERPO_FAULT names this point (and this is its k-th pass);
    `before` runs first (e.g. to write half a line)."""
    spec = os.environ.get("ERPO_FAULT")
    if not spec:
        return
    want, _, k = spec.partition(":")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(k or 1):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
