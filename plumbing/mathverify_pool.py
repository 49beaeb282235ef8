"""
mathverify_pool.py: math-verify behind a hard per-answer time limit, callable from anywhere.

reward.py decides most answers with string and exact-number comparisons; the rest (2\\sqrt{2} vs
\\sqrt{8}, intervals, matrices) need math-verify, i.e. sympy, which is slow and can be made to run
for minutes. This module runs it in a persistent *server* subprocess that has math_verify imported;
the server forks a few *runner* children (min(4, CPUs); REWARD_MV_WORKERS overrides) that do the
actual parse/verify in parallel. It knows nothing about grading and never imports reward.py.

math-verify's own timeouts use signal.alarm, which silently fails (or raises ValueError) outside
the main thread, i.e. inside a DataLoader, a thread pool or under torchrun, and a power tower like
9^{9^{9^{9^9}}} makes sympy compute for minutes. So we disable those timeouts and bound time
ourselves: if a runner does not answer within `timeout` seconds the server SIGKILLs it and forks a
fresh one (a few ms, nothing is re-imported), so one bad answer costs at most `timeout` seconds.
Timeouts, crashes and parse failures come back as outcomes, never as exceptions.

Why a plain subprocess and not multiprocessing: multiprocessing refuses to start children from
daemonic processes (DataLoader workers are daemonic), and "spawn" re-imports the caller's __main__
(a train.py without a main guard would run again). `python plumbing/mathverify_pool.py --server N` has
neither problem. The server dies on stdin EOF, so it never outlives its parent; its runners die
with it (PR_SET_PDEATHSIG), even when stuck inside sympy.

Safety: model text never reaches eval/exec. math-verify's ExprExtractionConfig goes through
sympy.parse_expr, which calls eval(); we only use LatexExtractionConfig (an ANTLR parser).

Public API:
    verify_many(pairs, timeout) -> [(is_equal, outcome)]   pairs = [(gold, pred)], both LaTeX str;
                                   outcome "ok" | "timeout" | "error"; never raises
    warmup()                       start the server now (~1-3 s) rather than at the first request
    shutdown()                     stop the server and its runners (also done at exit)
"""

import atexit
import collections
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

STARTUP_TIMEOUT = 120.0     # importing sympy + math_verify takes ~1 s here; generous for slow CI
_SERVER_SLACK = 2.0         # extra parent-side wait on top of `timeout` before the server is presumed hung
_MAX_INFLIGHT = 64          # requests written ahead of replies (keeps both pipes far from full)
_RUNNER_MEMORY_CAP = 4 << 30   # bytes of address space per runner: 10^{10^{10}} -> MemoryError, not swap


def _read_line(fd, buf, deadline):
    """Next b'\\n'-terminated line from fd before `deadline` (time.monotonic), using poll so it
    works from any thread and never blocks past the deadline. None on timeout; b'' on EOF."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        k = buf.find(b"\n")
        if k >= 0:
            line = bytes(buf[:k])
            del buf[:k + 1]
            return line
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if poller.poll(None if remaining == float("inf") else max(1, int(remaining * 1000))):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buf += chunk


# -----------------------------------------------------------------------------
# parent side. One server per process, guarded by a lock so any thread may call. Requests carry
# an id; the server answers them in any order (it runs several runners).

_lock = threading.Lock()
_server = None           # subprocess.Popen of `python plumbing/mathverify_pool.py --server N`
_server_owner = None     # pid that started it (a fork()ed child must not share its pipes)
_rbuf = bytearray()      # bytes read from the server not yet consumed as a line
_start_failed_at = None  # time.monotonic() of the last failed start: retry at most once a minute


def _num_runners():
    """Parallel math-verify runners: REWARD_MV_WORKERS, else min(4, usable CPUs)."""
    if os.environ.get("REWARD_MV_WORKERS"):
        return max(1, int(os.environ["REWARD_MV_WORKERS"]))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _kill_server(graceful=False):
    global _server
    proc, _server = _server, None
    _rbuf.clear()
    if proc is None or _server_owner != os.getpid():
        return   # a fork()ed child never kills its parent's server
    try:
        if graceful:   # EOF on stdin: the server SIGKILLs its runners, then exits
            proc.stdin.close()
            proc.wait(timeout=2)
    except Exception:
        pass
    try:
        proc.kill()
        proc.wait(timeout=5)
    except Exception:
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except Exception:
            pass


def _ensure_server():
    """True if a live server is ready for requests (starting one if needed; ~1-3 s)."""
    global _server, _server_owner, _start_failed_at
    if _server is not None and _server_owner == os.getpid() and _server.poll() is None:
        return True
    _kill_server()
    if _start_failed_at is not None and time.monotonic() - _start_failed_at < 60:
        return False   # math-verify missing or broken: don't pay a failed start per batch
    cmd = [sys.executable, os.path.abspath(__file__), "--server", str(_num_runners())]
    try:
        _server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        _server_owner = os.getpid()
        line = _read_line(_server.stdout.fileno(), _rbuf, time.monotonic() + STARTUP_TIMEOUT)
    except OSError as e:
        line = repr(e).encode()
    if line != b"ready":
        _kill_server()
        _start_failed_at = time.monotonic()
        print(f"[mathverify_pool] math-verify server failed to start (got {line!r}); is "
              f"math-verify installed for {sys.executable}? Such answers grade as errors.",
              file=sys.stderr)
        return False
    return True


def _exchange(pairs, todo, timeout, results):
    """Send pairs[k] for k in todo, fill results[k]. Returns the indices still unanswered because
    the server died (to retry once on a fresh server)."""
    fd = _server.stdout.fileno()
    sent, inflight = 0, set()
    deadline = time.monotonic() + timeout + _SERVER_SLACK
    while sent < len(todo) or inflight:
        try:
            while sent < len(todo) and len(inflight) < _MAX_INFLIGHT:
                k = todo[sent]
                gold, pred = pairs[k]
                msg = json.dumps({"id": k, "gold": gold, "pred": pred, "timeout": timeout})
                _server.stdin.write(msg.encode() + b"\n")
                inflight.add(k)
                sent += 1
            _server.stdin.flush()
            line = _read_line(fd, _rbuf, deadline)
        except OSError:   # BrokenPipeError: the server is gone
            line = b""
        if line is None:  # no reply at all for timeout + slack: the server itself hangs
            for k in inflight:
                results[k] = (False, "timeout")
            _kill_server()
            return todo[sent:]
        if line == b"":
            _kill_server()
            return sorted(inflight) + todo[sent:]
        reply = json.loads(line)
        results[reply["id"]] = (bool(reply["equal"]), reply["outcome"])
        inflight.discard(reply["id"])
        deadline = time.monotonic() + timeout + _SERVER_SLACK  # each runner answers or dies by then
    return []


def verify_many(pairs: list[tuple[str, str]], timeout: float) -> list[tuple[bool, str]]:
    """[(gold, pred)] -> [(is_equal, outcome)], outcome "ok" | "timeout" | "error". At most
    about `timeout` seconds of math-verify per pair (runners work in parallel). Never raises."""
    results = [(False, "error")] * len(pairs)
    todo = list(range(len(pairs)))
    with _lock:
        for _attempt in range(2):   # one retry on a fresh server if the server died mid-batch
            if not todo or not _ensure_server():
                break
            try:
                todo = _exchange(pairs, todo, timeout, results)
            except Exception as e:   # a garbled reply: those pairs stay "error", the server goes
                print(f"[mathverify_pool] {e!r}", file=sys.stderr)
                _kill_server()
                break
    return results


def warmup():
    """Start the math-verify server now (~1-3 s) instead of at the first request."""
    with _lock:
        _ensure_server()


def shutdown():
    """Stop the math-verify server and its runners (also done automatically at exit)."""
    with _lock:
        _kill_server(graceful=True)


atexit.register(shutdown)


def _after_fork_in_child():
    # A fork()ed child (e.g. a DataLoader worker) inherits our pipes; using them would interleave
    # with the parent's requests. Forget the server (the parent owns it); start a fresh one if
    # needed. The lock is replaced too: another thread may have held it at the fork.
    global _lock, _server
    _lock = threading.Lock()
    if _server is not None:
        for f in (_server.stdin, _server.stdout):   # closes only the child's copies of the fds
            try:
                f.close()
            except Exception:
                pass
    _server = None
    _rbuf.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -----------------------------------------------------------------------------
# server side: `python plumbing/mathverify_pool.py --server N`. Reads requests on stdin, hands each to one
# of N forked runners, kills a runner that overruns its timeout. Replies go to the protocol fd.

def _wrap_latex(s):
    s = s.strip()
    return s if s.startswith("$") or s.startswith("\\boxed") else "$" + s + "$"


def _mv_verify(gold, pred):
    from math_verify import LatexExtractionConfig, parse, verify
    cfg = [LatexExtractionConfig()]   # never ExprExtractionConfig: sympy.parse_expr calls eval()
    # timeouts None: math-verify's signal.alarm timeouts break off the main thread; the server
    # bounds time instead by killing the runner
    g = parse(_wrap_latex(gold), extraction_config=cfg, parsing_timeout=None)
    p = parse(_wrap_latex(pred), extraction_config=cfg, parsing_timeout=None)
    if not g or not p:
        return False, "error"
    return bool(verify(g, p, timeout_seconds=None)), "ok"


# the pairs whose first call is much slower than later ones (lazy sympy imports/caches)
_WARMUP_PAIRS = [
    ("\\frac{1}{2}", "0.5"), ("2\\sqrt{2}", "\\sqrt{8}"), ("(x+1)^2", "x^2+2x+1"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"),
    ("\\text{Monday}", "\\text{Tuesday}"),
]


def _reply_line(rid, equal, outcome):
    return (json.dumps({"id": rid, "equal": equal, "outcome": outcome}) + "\n").encode()


def _die_with_parent():
    """Linux: have the kernel SIGKILL us when the server dies. A runner stuck inside one huge
    sympy computation never reads its pipe, so it would not notice the EOF and would run on."""
    try:
        import ctypes
        ppid = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
        if os.getppid() != ppid:   # the server died before prctl took effect
            os._exit(0)
    except Exception:
        pass


def _cap_memory():
    """Cap our address space so 10^{10^{10}} dies with MemoryError instead of swapping the box."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft > _RUNNER_MEMORY_CAP:
            resource.setrlimit(resource.RLIMIT_AS, (_RUNNER_MEMORY_CAP, hard))
    except Exception:
        pass


def _runner_loop(rfd, wfd):
    _die_with_parent()
    _cap_memory()
    buf = bytearray()
    while True:
        line = _read_line(rfd, buf, float("inf"))
        if not line:
            os._exit(0)   # server gone
        req = json.loads(line)
        try:
            equal, outcome = _mv_verify(req["gold"], req["pred"])
        except BaseException:   # MemoryError, RecursionError, sympy bugs: all just "error"
            equal, outcome = False, "error"
        os.write(wfd, _reply_line(req["id"], equal, outcome))


def _fork_runner(close_in_child):
    to_r, from_s = os.pipe()    # server -> runner
    from_r, to_s = os.pipe()    # runner -> server
    pid = os.fork()
    if pid == 0:
        # keep only our own pipe ends: holding the parent's reply pipe or a sibling's request pipe
        # would keep them from seeing EOF when the server dies, and orphans would live forever
        for fd in [from_s, from_r, 0, *close_in_child]:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            _runner_loop(to_r, to_s)
        finally:
            os._exit(0)
    os.close(to_r)
    os.close(to_s)
    return {"pid": pid, "to": from_s, "from": from_r, "buf": bytearray(), "id": None, "deadline": 0.0}


def _kill_runner(r):
    try:
        os.kill(r["pid"], signal.SIGKILL)
    except OSError:
        pass
    os.waitpid(r["pid"], 0)
    os.close(r["to"])
    os.close(r["from"])


class _Dispatcher:
    """The server's state: N runner slots (None = empty, forked on demand), the queue of requests
    not yet handed out, and the protocol fd replies go to."""

    def __init__(self, n_runners, proto_fd):
        self.runners = [None] * n_runners
        self.queue = collections.deque()
        self.inbuf = bytearray()
        self.proto_fd = proto_fd

    def reply(self, rid, equal, outcome):
        os.write(self.proto_fd, _reply_line(rid, equal, outcome))

    def retire(self, i, outcome):
        """Answer runner i's request with `outcome`, SIGKILL it, free its slot."""
        r, self.runners[i] = self.runners[i], None
        self.reply(r["id"], False, outcome)
        _kill_runner(r)

    def dispatch(self):
        """Hand queued requests to idle runners, forking a fresh one where a slot is empty."""
        for i in range(len(self.runners)):
            if not self.queue:
                return
            if self.runners[i] is None:
                open_fds = [fd for r in self.runners if r for fd in (r["to"], r["from"])]
                self.runners[i] = _fork_runner([self.proto_fd, *open_fds])
            r = self.runners[i]
            if r["id"] is None:
                req = self.queue.popleft()
                r["id"], r["deadline"] = req["id"], time.monotonic() + float(req["timeout"])
                try:
                    os.write(r["to"], json.dumps(req).encode() + b"\n")
                except OSError:     # runner died while idle (OOM killer?): answer "error"
                    self.retire(i, "error")

    def read_requests(self, chunk):
        """Queue the complete request lines received from the parent on stdin."""
        self.inbuf += chunk
        while b"\n" in self.inbuf:
            line, _, rest = bytes(self.inbuf).partition(b"\n")
            self.inbuf[:] = rest
            self.queue.append(json.loads(line))

    def read_runner(self, i, chunk):
        """Forward runner i's reply once complete; a runner that hung up answers "error"."""
        r = self.runners[i]
        r["buf"] += chunk
        if b"\n" in r["buf"]:
            os.write(self.proto_fd, bytes(r["buf"]).partition(b"\n")[0] + b"\n")
            r["buf"].clear()
            r["id"] = None
        elif not chunk:     # runner died (e.g. killed by the OS): answer "error", reap it
            self.retire(i, "error")

    def wait_and_read(self):
        """Wait for stdin or a busy runner, at most until the earliest deadline. False once the
        parent is gone (stdin EOF)."""
        busy = {r["from"]: i for i, r in enumerate(self.runners) if r and r["id"] is not None}
        poller = select.poll()
        for fd in [0, *busy]:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        wait = min((self.runners[i]["deadline"] for i in busy.values()), default=None)
        wait_ms = None if wait is None else max(0, int((wait - time.monotonic()) * 1000) + 1)
        for fd, _ in poller.poll(wait_ms):
            chunk = os.read(fd, 1 << 16)
            if fd != 0:
                self.read_runner(busy[fd], chunk)
            elif chunk:
                self.read_requests(chunk)
            else:
                return False
        return True

    def kill_overdue(self):
        """A runner past its request's deadline: SIGKILL it and answer "timeout"."""
        now = time.monotonic()
        for i, r in enumerate(self.runners):
            if r and r["id"] is not None and now >= r["deadline"]:
                self.retire(i, "timeout")

    def close(self):
        for r in self.runners:
            if r:
                _kill_runner(r)


def _quiet_process():
    """Make this process fit to serve: returns the fd replies go to (the original stdout)."""
    import logging
    import warnings
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the trainer; we die on EOF
    proto_fd = os.dup(1)
    os.dup2(2, 1)                                  # stray prints from sympy must not corrupt replies
    logging.disable(logging.WARNING)               # math_verify warns about disabled timeouts
    warnings.simplefilter("ignore")                # sympy deprecation noise would flood train logs
    return proto_fd


def _server_main(n_runners):
    proto_fd = _quiet_process()
    for gold, pred in _WARMUP_PAIRS:   # import + exercise sympy's lazy paths once, here,
        _mv_verify(gold, pred)         # so every freshly forked runner starts warm
    os.write(proto_fd, b"ready\n")
    pool = _Dispatcher(n_runners, proto_fd)
    while True:
        pool.dispatch()
        if not pool.wait_and_read():   # parent gone: nobody to answer, stop everything
            pool.close()
            return
        pool.kill_overdue()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--server":
    _server_main(int(sys.argv[2]))
