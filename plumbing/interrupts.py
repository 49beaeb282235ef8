"""Ctrl-C and SIGTERM stop a run at a step boundary, with a checkpoint, instead of mid-step.

    with interrupts.deferred() as stop:        # installs the handlers, restores them on exit
        for step in ...:
            ...one whole step...
            if stop.requested():               # one collective: every rank stops at the same step
                save(...)
                raise stop.exit("saved the checkpoint of step N ...")   # its one line, status 128 + signum

A signal only sets a flag; the loop looks at it between steps. Under torchrun the ranks agree
(an all-reduce of the flag), so a signal that reaches one rank (a scheduler pre-empting one node,
a `kill` of one process) stops them all at the same step. A second Ctrl-C stops at once (no
save), as a user pressing it twice expects. The exit status is 128 + the signal's number (130
for SIGINT, 143 for SIGTERM), what a shell reports for a process the signal ended, so a job
script can tell "interrupted, resumable" from "failed".

Outside such a block (set-up, the step-0 evaluation, evaluate.py's sweep), `exit_when_interrupted`
makes both signals end the process at once with one line and the same exit status.

torchrun forwards SIGTERM/SIGINT to its workers and SIGKILLs them 30 s later unless told to wait
longer (`torchrun --shutdown-timeout 900 ...`): a 7B step plus its save takes minutes.
"""

import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch

from plumbing import distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    def __init__(self):
        self.signum = 0                 # the first signal received (0: none)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt     # the second Ctrl-C: stop now, no save
        self.signum = self.signum or signum
        if distributed.is_main():       # os.write: a print() here could re-enter one in progress
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint "
                        "(Ctrl-C again: stop now, without one)\n".encode())

    def requested(self) -> bool:
        """Has any rank been signalled? Every rank must call it at the same point (a collective)."""
        self.signum = int(distributed.all_max(torch.tensor(float(self.signum))).item())
        return self.signum != 0

    def exit(self, message) -> SystemExit:
        """Print the one line (rank 0) and return the exit to raise: status 128 + signum."""
        distributed.print0(f"interrupted ({signal.Signals(self.signum).name}): {message}", file=sys.stderr)
        return SystemExit(128 + self.signum)


@contextmanager
def deferred():
    """Within the block, SIGINT/SIGTERM set a flag instead of ending the process."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():   # signals reach the main thread only
        yield flag
        return
    previous = {s: signal.signal(s, flag._handle) for s in SIGNALS}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Interrupted(BaseException):
    """SIGTERM as an exception, as Python makes SIGINT a KeyboardInterrupt; a BaseException like
    it, so that no `except Exception` on the way (the grader's) takes it for a failed sample."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def exit_when_interrupted(report, script=None):
    """Ctrl-C or SIGTERM (a scheduler's pre-emption) inside the block, outside a `deferred` one: one
    line on stderr, `[<script>: ]interrupted (SIGINT): <report()>`, and exit status 128 + the signal
    (130, 143), what a shell reports for a process a signal ended; no traceback. report() says
    what is kept."""
    main_thread = threading.current_thread() is threading.main_thread()   # (signals: main thread only)

    def on_sigterm(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if main_thread:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if main_thread:                                       # a second Ctrl-C must not cut the report short
            for s in previous:
                signal.signal(s, signal.SIG_IGN)
        if distributed.is_main():
            prefix = f"{script}: " if script else ""
            print(f"{prefix}interrupted ({signal.Signals(signum).name}): {report()}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        if main_thread:
            for s, handler in previous.items():
                if handler is not None:                       # (None: a handler not set from Python)
                    signal.signal(s, handler)
