"""
reward.py: the answer verifier behind every reward and every accuracy number.

One function decides whether a model's final answer equals the gold answer, for two very different
worlds: the tiny synthetic arithmetic world (gold answers are plain integers like "58") and real
math benchmarks (MATH500, AIME, AMC: fractions, intervals, tuples, matrices, degrees, text).

The pipeline for one completion, cheapest step first:

    completion --extract_boxed--> pred --guards--> normalize(pred) == normalize(gold)?  -> correct
                                                   both plain numbers? compare exactly  -> decided
                                                   otherwise: math-verify in a worker   -> decided

Only the last step is slow (sympy), so the common case (integer answers) never touches it. When it
is needed it runs in a persistent *server* subprocess that has math_verify imported; the server
forks a few *runner* children (min(4, CPUs); REWARD_MV_WORKERS overrides) that do the actual
parse/verify in parallel, and score_batch verifies identical (pred, gold) pairs only once.

math-verify's own timeouts use signal.alarm, which silently fails (or raises ValueError) outside
the main thread, i.e. inside a DataLoader, a thread pool or under torchrun, and a power tower like
9^{9^{9^{9^9}}} makes sympy compute for minutes. So we disable those timeouts and bound time
ourselves: if a runner does not answer within `timeout` seconds the server SIGKILLs it and forks a
fresh one (a few ms, nothing is re-imported), so one bad answer costs at most `timeout` seconds.
Cheap guards (length, nesting depth) reject junk before it gets there. Timeouts, rejections and
parse failures grade as incorrect and are counted, never raised.

Why a plain subprocess and not multiprocessing: multiprocessing refuses to start children from
daemonic processes (DataLoader workers are daemonic), and "spawn" re-imports the caller's __main__
(a train.py without a main guard would run again). `python reward.py --math-verify-server` has
neither problem. The server dies on stdin EOF, so it never outlives its parent.

Safety: model text never reaches eval/exec. math-verify's ExprExtractionConfig goes through
sympy.parse_expr, which calls eval(); we only use LatexExtractionConfig (an ANTLR parser).

Public API: extract_boxed, normalize, grade, score, score_batch (plus warmup, shutdown).
"""

import atexit
import collections
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from functools import lru_cache

DEFAULT_TIMEOUT = 1.0       # seconds of math-verify time per answer before it counts as "timeout"
MAX_ANSWER_CHARS = 300      # longest real gold answer in MATH500 is 53 chars; longer preds are junk
MAX_NESTING = 20            # deepest ({[ nesting allowed in a pred; real answers stay under ~6
STARTUP_TIMEOUT = 120.0     # importing sympy + math_verify takes ~1 s here; generous for slow CI
_SERVER_SLACK = 2.0         # extra parent-side wait on top of `timeout` before the server is presumed hung

# -----------------------------------------------------------------------------
# extraction

# \boxed, \fbox, \framebox, but not e.g. \boxedx (a different command name)
_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![a-zA-Z])")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)   # escaped char (\{, \}, \\) or a bare brace
_SPACE_ARG_RE = re.compile(r"[^\s$]+")                  # "\boxed 5$" -> "5": up to whitespace or $


def _match_brace(text, open_idx):
    """Index of the '}' closing the '{' at open_idx, or -1. Linear time: one regex scan."""
    depth = 0
    for m in _BRACE_TOKEN_RE.finditer(text, open_idx):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return -1


def extract_boxed(text: str) -> str | None:
    """Content of the LAST \\boxed{...} / \\fbox{...} / \\framebox{...} (nested braces ok), or of
    the space form "\\boxed 5". None if there is no box or the last one is never closed (a
    truncated generation has no final answer). Linear time in len(text)."""
    if not isinstance(text, str):
        raise ValueError(f"extract_boxed expects a str, got {type(text).__name__}")
    last = None
    for last in _BOX_RE.finditer(text):   # finditer is linear; we only keep the last match
        pass
    if last is None:
        return None
    i = last.end()
    j = i
    n = len(text)
    while j < n and text[j].isspace():
        j += 1
    if last.group() == "\\framebox":    # \framebox[width][pos]{...}: skip optional args
        while j < n and text[j] == "[":
            k = text.find("]", j)
            if k < 0:
                return None
            j = k + 1
        while j < n and text[j].isspace():
            j += 1
    if j < n and text[j] == "{":
        k = _match_brace(text, j)
        return None if k < 0 else text[j + 1:k].strip()
    m = _SPACE_ARG_RE.match(text, j)      # "\boxed 5" (or "\boxed5"): one whitespace-free token
    return m.group() if m else None


# -----------------------------------------------------------------------------
# normalization (pure string rewriting; both sides go through it, then compare with ==)

_UNITS = {
    "cm", "centimeter", "centimeters", "m", "meter", "meters", "km", "kilometer", "kilometers",
    "mm", "millimeter", "millimeters", "in", "inch", "inches", "ft", "foot", "feet", "yd", "yard",
    "yards", "mi", "mile", "miles", "mph", "unit", "units", "sq", "square", "cubic", "degree",
    "degrees", "radian", "radians", "dollar", "dollars", "cent", "cents", "second", "seconds",
    "sec", "minute", "minutes", "min", "hour", "hours", "hr", "hrs", "day", "days", "week", "weeks",
    "month", "months", "year", "years", "g", "gram", "grams", "kg", "kilogram", "kilograms",
    "pound", "pounds", "lb", "lbs", "ounce", "ounces", "oz", "liter", "liters", "l", "ml",
    "gallon", "gallons", "cup", "cups", "percent", "points", "point",
}
_TEXT_CMD = r"\\(?:text|textrm|textbf|textit|textnormal|mbox|mathrm|mathbf|mathit|boldsymbol|bm|operatorname)"
# a trailing unit in \text{...}: "5\text{ cm}", "864 \mbox{ inches}^2"
_TRAILING_TEXT_UNIT_RE = re.compile(_TEXT_CMD + r"\{\s*([a-zA-Z. ]+?)\s*\}(?:\^\{?[23]\}?)?\s*$")
_PLAIN_PREFIX_RE = re.compile(r"\s*[+-]?(?:\d[\d,.]*|\\[dt]?frac\{\d+\}\{\d+\})\s*$")  # "7", "1,000"
_TEXT_RE = re.compile(_TEXT_CMD + r"\s*\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"\^\{?\\circ\}?|°|\\degree(?![a-zA-Z])")
# spacing and sizing commands; a matrix row break \\ is matched first so it is kept intact
_SPACING_RE = re.compile(r"\\\\|\\[!,;:> ]|\\(?:q?quad|displaystyle|left|right|[bB]igg?[lr]?)(?![a-zA-Z])\.?")
_FRAC_DIGITS_RE = [  # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}
    (re.compile(r"\\frac(\d)(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac(\d)\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\{([^{}]*)\}(\d)"), r"\\frac{\1}{\2}"),
]
_SQRT_DIGIT_RE = re.compile(r"\\sqrt(\d)")                     # \sqrt2 -> \sqrt{2} (LaTeX takes one token)
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,000 and 11,111,111,100, not 1,2
_LHS_RE = re.compile(r"^[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?(?:=|\\in(?![a-zA-Z]))")   # "x=5", "x\in[-2,7]"
_BARE_UNIT_RE = re.compile(r"^([+-]?[\d.]+)([a-zA-Z]{2,})(?:\^\{?[23]\}?)?$")  # "5cm" -> "5"
_INT_RE = re.compile(r"[+-]?\d+")
_DEC_RE = re.compile(r"([+-]?)(\d*)\.(\d*)")


def _strip_outer_parens(s):
    """'(113)' -> '113', '(C)' -> 'C'. Only when one pair wraps everything and there is no comma
    inside, so tuples and intervals like (1,2) keep their brackets."""
    if len(s) >= 2 and s[0] == "(" and s[-1] == ")" and "," not in s:
        depth = 0
        for i, c in enumerate(s):
            depth += (c == "(") - (c == ")")
            if depth == 0 and i < len(s) - 1:
                return s  # "(a)(b)": the first paren closes early
        return s[1:-1]
    return s


def _canonical_number(s):
    """'025' -> '25', '27.0' -> '27', '.50' -> '0.5', '+3' -> '3'. String ops only, no floats."""
    if _INT_RE.fullmatch(s):
        sign = "-" if s[0] == "-" else ""
        digits = s.lstrip("+-").lstrip("0") or "0"
        return digits if digits == "0" else sign + digits
    m = _DEC_RE.fullmatch(s)
    if m and (m.group(2) or m.group(3)):
        sign, ip, fp = m.groups()
        ip, fp = ip.lstrip("0") or "0", fp.rstrip("0")
        if ip == "0" and not fp:
            return "0"
        return sign.replace("+", "") + ip + ("." + fp if fp else "")
    return s


def _normalize(s):
    s = s.strip()
    s = s.replace("\n", " ").replace("\\$", "").replace("$", "")
    if s.startswith("\\(") and s.endswith("\\)") or s.startswith("\\[") and s.endswith("\\]"):
        s = s[2:-2]
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else "", s)  # \left( \! \, ...
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("^{\\prime}", "'").replace("\\%", "").replace("%", "")
    s = _DEGREE_RE.sub("", s)                               # 30^\circ -> 30
    m = _TRAILING_TEXT_UNIT_RE.search(s)                    # 5\text{ cm} -> 5, 7\text{ apples} -> 7
    if m and m.start() > 0 and (
            all(w.lower() in _UNITS for w in m.group(1).replace(".", "").split())
            or s[m.start(1) - 1].isspace() and _PLAIN_PREFIX_RE.match(s[:m.start()])):
        s = s[:m.start()]
    for _ in range(4):                                      # unwrap \text{...}, inner first
        s, k = _TEXT_RE.subn(r"\1", s)
        if not k:
            break
    s = "".join(s.split())                                  # whitespace is never meaningful here
    s = s.rstrip(".")                                       # "104." (sentence end)
    m = _BARE_UNIT_RE.match(s)                              # "5.4cents" -> "5.4"
    if m and m.group(2).lower() in _UNITS:
        s = m.group(1)
    m = _LHS_RE.match(s)                                    # x=5 -> 5, but keep a=1,b=2
    if m and "=" not in s[m.end():]:
        s = s[m.end():]
    for rx, rep in _FRAC_DIGITS_RE:
        s = rx.sub(rep, s)
    s = _SQRT_DIGIT_RE.sub(r"\\sqrt{\1}", s)
    s = _strip_outer_parens(s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return _canonical_number(s)


@lru_cache(maxsize=16384)
def _normalize_cached(s):
    return _normalize(s)


def normalize(ans: str) -> str:
    """Canonical string form of an answer, for exact-match comparison. Cheap and conservative:
    two answers that normalize equal are equal; unequal strings may still be equal math."""
    if not isinstance(ans, str):
        raise ValueError(f"normalize expects a str, got {type(ans).__name__}")
    if ans.isascii() and ans.isdigit() and (ans[0] != "0" or ans == "0"):
        return ans   # already canonical: the synthetic world's answers, and most model outputs
    return _normalize_cached(ans) if len(ans) <= 2 * MAX_ANSWER_CHARS else _normalize(ans)


# -----------------------------------------------------------------------------
# plain numbers: decided exactly in-process, no sympy

_NUM_SLASH_RE = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_NUM_FRAC_RE = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}")
_NUM_SCI_RE = re.compile(
    r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(?:\\times|\\cdot|\*)10\^(?:\{([+-]?\d+)\}|(\d)))")
_MIN_ROUNDED_DECIMALS = 6
_MAX_EXP10 = 400   # 4.5e33 fine; 1e99999 is not a plain number we build exactly


def _as_number(s):
    """(value: Fraction, decimals: int) for a normalized plain number (int, decimal, a/b,
    \\frac{a}{b}, scientific 4.5e33 or 4.5\\times10^{33}), else None. `decimals` is the number of
    digits after the point of a plain decimal (0 for everything that is exact as written)."""
    try:
        if _INT_RE.fullmatch(s):
            return Fraction(int(s)), 0
        m = _DEC_RE.fullmatch(s)
        if m and (m.group(2) or m.group(3)):
            return Fraction(s), len(m.group(3))
        m = _NUM_SLASH_RE.fullmatch(s)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2))), 0
        m = _NUM_FRAC_RE.fullmatch(s)
        if m:
            val = Fraction(int(m.group(2)), int(m.group(3)))
            return (-val if m.group(1) == "-" else val), 0
        m = _NUM_SCI_RE.fullmatch(s)
        if m:
            exp = int(next(g for g in m.groups()[1:] if g is not None))
            if abs(exp) <= _MAX_EXP10:
                return Fraction(m.group(1)) * Fraction(10) ** exp, 0
    except (ValueError, ZeroDivisionError):   # 1/0, or more digits than int() allows
        pass
    return None


def _numbers_equal(a, b):
    """Exact equality, except that a decimal with >= 6 digits after the point is read as a rounding
    of the other side: 0.333333 == 1/3 (as math-verify rounds), but 0.33 != 1/3 and 25.000001 != 25."""
    (x, x_dec), (y, y_dec) = a, b
    if x == y:
        return True
    k = max(x_dec, y_dec)
    return k >= _MIN_ROUNDED_DECIMALS and abs(x - y) < Fraction(1, 10**k)


_NOT_A_NUMBER_RE = re.compile(
    r"[,;=<>]|\\(?:le|ge|leq|geq|neq|ne|cup|cap|in|pm|mp|begin|infty|emptyset|varnothing)(?![a-zA-Z])")
_LATEX_CMD_RE = re.compile(r"\\[a-zA-Z]+")
_VARIABLE_RE = re.compile(r"[a-df-hj-zA-Z]")   # any letter but e and i (constants that can be numbers)


def _cannot_be_number(s):
    """True if the normalized answer is structurally not one real/complex number: a tuple, an
    interval, a set, a relation, a matrix, or an expression in a free variable like x."""
    return bool(_NOT_A_NUMBER_RE.search(s) or _VARIABLE_RE.search(_LATEX_CMD_RE.sub("", s)))


# -----------------------------------------------------------------------------
# guards: reject junk before it can reach sympy

def _nesting_depth(s):
    depth = best = 0
    for c in s:
        if c in "({[":
            depth += 1
            best = max(best, depth)
        elif c in ")}]":
            depth -= 1
    return best


def _reject_reason(pred):
    if len(pred) > MAX_ANSWER_CHARS:
        return "too long"
    if _nesting_depth(pred) > MAX_NESTING:
        return "too deeply nested"
    if pred.count("\\sqrt") + pred.count("\\frac") > MAX_NESTING:
        return "too many nested operators"
    return None


# -----------------------------------------------------------------------------
# math-verify server, parent side. One server per process, guarded by a lock so any thread may
# call. Requests carry an id; the server answers them in any order (it runs several runners).

_lock = threading.Lock()
_server = None           # subprocess.Popen of `python reward.py --math-verify-server N`
_server_owner = None     # pid that started it (a fork()ed child must not share its pipes)
_rbuf = bytearray()      # bytes read from the server not yet consumed as a line
_start_failed_at = None  # time.monotonic() of the last failed start: retry at most once a minute
_MAX_INFLIGHT = 64       # requests written ahead of replies (keeps both pipes far from full)


def _num_runners():
    """Parallel math-verify runners: REWARD_MV_WORKERS, else min(4, usable CPUs)."""
    if os.environ.get("REWARD_MV_WORKERS"):
        return max(1, int(os.environ["REWARD_MV_WORKERS"]))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(4, n))


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


def _kill_server(graceful=False):
    global _server
    proc, _server = _server, None
    _rbuf.clear()
    if proc is not None and _server_owner == os.getpid():
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
        return False
    cmd = [sys.executable, os.path.abspath(__file__), "--math-verify-server", str(_num_runners())]
    try:
        _server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        _server_owner = os.getpid()
        line = _read_line(_server.stdout.fileno(), _rbuf, time.monotonic() + STARTUP_TIMEOUT)
    except OSError as e:
        line = repr(e).encode()
    if line != b"ready":
        _kill_server()
        _start_failed_at = time.monotonic()
        print(f"[reward] math-verify server failed to start (got {line!r}); is math-verify "
              f"installed for {sys.executable}? Non-trivial answers grade as errors.", file=sys.stderr)
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


def _verify_many(pairs, timeout):
    """[(gold, pred)] -> [(is_equal, outcome)], outcome "ok" | "timeout" | "error". Never raises."""
    results = [(False, "error")] * len(pairs)
    todo = list(range(len(pairs)))
    with _lock:
        for _attempt in range(2):   # one retry on a fresh server if the server died mid-batch
            if not todo or not _ensure_server():
                break
            todo = _exchange(pairs, todo, timeout, results)
    return results


def warmup():
    """Start the math-verify server now (~1-3 s) instead of at the first non-trivial answer."""
    with _lock:
        _ensure_server()


def shutdown():
    """Stop the math-verify server and its runners (also done automatically at exit)."""
    with _lock:
        _kill_server(graceful=True)


atexit.register(shutdown)


def _after_fork_in_child():
    # A fork()ed child (e.g. a DataLoader worker) inherits our pipes; using them would interleave
    # with the parent's requests. Forget the server (the parent owns it); start a fresh one if needed.
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
# grading

def _grade_fast(pred, gold):
    """(is_correct, outcome) decided without math-verify, or None if math-verify is needed.
    outcome: "correct" | "wrong" | "rejected"."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise ValueError(f"expected two str, got {type(pred).__name__}, {type(gold).__name__}")
    pred, gold = pred.strip(), gold.strip()
    if not pred:
        return False, "wrong"
    if _reject_reason(pred):
        return False, "rejected"
    np_, ng = normalize(pred), normalize(gold)
    if np_ == ng:
        return True, "correct"
    a, b = _as_number(np_), _as_number(ng)
    if a is not None and b is not None:
        ok = _numbers_equal(a, b)
        return ok, ("correct" if ok else "wrong")
    if a is not None and _cannot_be_number(ng) or b is not None and _cannot_be_number(np_):
        return False, "wrong"   # e.g. 4 vs x^2+1 or vs (1,2): sympy would take ~0.1 s to agree
    return None


def _grade_many(preds, golds, timeout):
    """Outcome per (pred, gold): "correct" | "wrong" | "rejected" | "timeout" | "error", and
    whether math-verify was needed. Identical pairs (common within a GRPO group) are verified once."""
    outcomes, used_mv = [None] * len(preds), [False] * len(preds)
    slow = {}   # (gold, pred) -> indices needing math-verify
    for i, (pred, gold) in enumerate(zip(preds, golds)):
        if pred is None:
            outcomes[i] = "no_answer"
            continue
        fast = _grade_fast(pred, gold)
        if fast is None:
            slow.setdefault((gold.strip(), pred.strip()), []).append(i)
            used_mv[i] = True
        else:
            outcomes[i] = fast[1]
    for idxs, (equal, status) in zip(slow.values(), _verify_many(list(slow), timeout)):
        for i in idxs:
            outcomes[i] = status if status != "ok" else ("correct" if equal else "wrong")
    return outcomes, used_mv


def grade(pred: str, gold: str) -> bool:
    """True iff the predicted answer equals the gold answer (strings, numbers, then math-verify)."""
    return _grade_many([pred], [gold], DEFAULT_TIMEOUT)[0][0] == "correct"


def has_format(completion: str) -> bool:
    """EasyR1 format: '<think>...</think>' first, then a complete \\boxed{...} after it."""
    s = completion.lstrip()
    if not s.startswith("<think>"):
        return False
    end = s.find("</think>", len("<think>"))
    return end >= 0 and extract_boxed(s[end + len("</think>"):]) is not None


def score(completion: str, answer: str, *, format_reward: bool = False) -> float:
    """1.0 if the last boxed answer in `completion` equals `answer`, else 0.0. With
    format_reward: 0.9 * accuracy + 0.1 * format (the EasyR1 / ERPO reward)."""
    return score_batch([completion], [answer], format_reward=format_reward)[0][0]


def score_batch(completions: list[str], answers: list[str], *, format_reward: bool = False,
                timeout: float = DEFAULT_TIMEOUT) -> tuple[list[float], dict]:
    """Rewards for many completions plus outcome counts for logging:
    correct + wrong + no_answer + rejected + timeout + error == total; math_verify = completions
    that needed the slow path; format_ok = completions with the <think>...</think>...\\boxed format."""
    if len(completions) != len(answers):
        raise ValueError(f"score_batch: {len(completions)} completions but {len(answers)} answers")
    for c, a in zip(completions, answers):
        if not isinstance(c, str) or not isinstance(a, str):
            raise ValueError(f"score_batch expects str completions and answers, got "
                             f"{type(c).__name__} and {type(a).__name__}")
    preds = [extract_boxed(c) for c in completions]
    try:
        outcomes, used_mv = _grade_many(preds, answers, timeout)
    except Exception as e:   # a reward bug must not kill a training run; it shows up as "error"
        print(f"[reward] grading failed: {e!r}", file=sys.stderr)
        outcomes, used_mv = ["error"] * len(preds), [False] * len(preds)
    fmts = [format_reward and has_format(c) for c in completions]
    rewards = [(0.9 * (o == "correct") + 0.1 * f) if format_reward else float(o == "correct")
               for o, f in zip(outcomes, fmts)]
    stats = dict(total=len(completions), correct=0, wrong=0, no_answer=0, rejected=0, timeout=0,
                 error=0, math_verify=sum(used_mv), format_ok=sum(fmts))
    for o in outcomes:
        stats[o] += 1
    return rewards, stats


# -----------------------------------------------------------------------------
# math-verify server, child side: `python reward.py --math-verify-server N`. Reads requests on
# stdin, hands each to one of N forked runners, kills a runner that overruns its timeout.

def _wrap_latex(s):
    s = s.strip()
    return s if s.startswith("$") or s.startswith("\\boxed") else "$" + s + "$"


def _mv_verify(gold, pred):
    from math_verify import LatexExtractionConfig, parse, verify
    cfg = [LatexExtractionConfig()]   # never ExprExtractionConfig: sympy.parse_expr calls eval()
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


def _runner_loop(rfd, wfd):
    _die_with_parent()
    try:   # cap memory so 10^{10^{10}} dies with MemoryError instead of swapping the box
        import resource
        cap = 4 << 30
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft > cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except Exception:
        pass
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
        os.write(wfd, (json.dumps({"id": req["id"], "equal": equal, "outcome": outcome}) + "\n").encode())


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


def _server_main(n_runners):
    import logging
    import warnings
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the trainer; we die on EOF
    proto_fd = os.dup(1)
    os.dup2(2, 1)                                  # stray prints from sympy must not corrupt replies
    logging.disable(logging.WARNING)               # math_verify warns about disabled timeouts
    warnings.simplefilter("ignore")                # sympy deprecation noise would flood train logs
    for gold, pred in _WARMUP_PAIRS:               # import + exercise sympy's lazy paths once, here,
        _mv_verify(gold, pred)                     # so every freshly forked runner starts warm
    os.write(proto_fd, b"ready\n")

    def reply(rid, equal, outcome):
        os.write(proto_fd, (json.dumps({"id": rid, "equal": equal, "outcome": outcome}) + "\n").encode())

    runners = [None] * n_runners
    queue, inbuf = collections.deque(), bytearray()
    while True:
        # hand queued requests to idle runners (forking a fresh one where a slot is empty)
        for i in range(n_runners):
            if not queue:
                break
            if runners[i] is None:
                open_fds = [fd for r in runners if r for fd in (r["to"], r["from"])]
                runners[i] = _fork_runner([proto_fd, *open_fds])
            r = runners[i]
            if r["id"] is None:
                req = queue.popleft()
                r["id"], r["deadline"] = req["id"], time.monotonic() + float(req["timeout"])
                try:
                    os.write(r["to"], json.dumps(req).encode() + b"\n")
                except OSError:     # runner died while idle (OOM killer?): answer "error"
                    reply(req["id"], False, "error")
                    runners[i] = None
                    _kill_runner(r)
        busy = {r["from"]: r for r in runners if r and r["id"] is not None}
        poller = select.poll()
        poller.register(0, select.POLLIN | select.POLLHUP)
        for fd in busy:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        wait = min((r["deadline"] for r in busy.values()), default=None)
        wait_ms = None if wait is None else max(0, int((wait - time.monotonic()) * 1000) + 1)
        for fd, _ in poller.poll(wait_ms):
            chunk = os.read(fd, 1 << 16)
            if fd == 0:
                if not chunk:   # parent gone: nobody to answer, stop everything
                    for r in runners:
                        if r:
                            _kill_runner(r)
                    return
                inbuf += chunk
                while b"\n" in inbuf:
                    line, _, rest = bytes(inbuf).partition(b"\n")
                    inbuf[:] = rest
                    queue.append(json.loads(line))
                continue
            r = busy[fd]
            r["buf"] += chunk
            if b"\n" in r["buf"]:
                os.write(proto_fd, bytes(r["buf"]).partition(b"\n")[0] + b"\n")
                r["buf"].clear()
                r["id"] = None
            elif not chunk:     # runner died (e.g. killed by the OS): answer "error", reap it
                reply(r["id"], False, "error")
                runners[runners.index(r)] = None
                _kill_runner(r)
        now = time.monotonic()
        for i, r in enumerate(runners):   # overran its timeout: SIGKILL, answer "timeout"
            if r and r["id"] is not None and now >= r["deadline"]:
                reply(r["id"], False, "timeout")
                runners[i] = None
                _kill_runner(r)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--math-verify-server":
    _server_main(int(sys.argv[2]))
