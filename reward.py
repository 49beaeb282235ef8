"""
reward.py: the answer verifier behind every reward and every accuracy number.

One function decides whether a model's final answer equals the gold answer, for two very different
worlds: the tiny synthetic arithmetic world (gold answers are plain integers like "58") and real
math benchmarks (MATH500, AIME, AMC: fractions, intervals, tuples, matrices, degrees, text).

The pipeline for one completion, cheapest step first:

    completion --extract_boxed--> pred --guards--> normalize(pred) == normalize(gold)?  -> correct
                                                   both plain numbers? compare exactly  -> decided
                                                   otherwise: math-verify (time-bounded) -> decided

Only the last step is slow (sympy), so the common case (integer answers) never touches it. When it
is needed it goes through plumbing/mathverify_pool.py, which runs math-verify in forked worker processes
under a hard per-answer time limit (DEFAULT_TIMEOUT) that also holds off the main thread;
score_batch verifies identical (pred, gold) pairs only once. Cheap guards (length, nesting depth)
reject junk before it gets there. Timeouts, rejections and parse failures grade as incorrect and
are counted, never raised.

The same code reads the gold side: gold_answer turns a raw dataset value (27.0, "025", ["$3$"],
"4.5e33") into the answer text the grader compares against, so data/benchmarks.py has no
normaliser or \\boxed{} extractor of its own.

Public API: extract_boxed, normalize, gold_answer, grade, grade_completions (the outcomes
tasks/math.py scores by), has_format, score, score_batch, warmup, shutdown (the last two start
and stop the math-verify pool), DEFAULT_TIMEOUT.
"""

import json
import math
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from plumbing import mathverify_pool

DEFAULT_TIMEOUT = 1.0       # seconds of math-verify time per answer before it counts as "timeout"
MAX_ANSWER_CHARS = 300      # longest real gold answer in MATH500 is 53 chars; longer preds are junk
MAX_NESTING = 20            # deepest ({[ nesting allowed in a pred; real answers stay under ~6

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
    for last in _BOX_RE.finditer(text):   # noqa: B007 -- finditer is linear; we only keep the last match
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
# gold answers: raw dataset values -> the text the grader compares against

_E_NOTATION_RE = re.compile(r"([+-]?\d+(?:\.\d+)?)[eE]([+-]?\d+)")   # Minerva "4.5e33"


def gold_answer(value) -> str:
    """The gold answer as the grader reads it: a raw dataset value (None, int, float, str, or a
    flat list/tuple of those) as answer text. 27.0 / "27.0" -> "27"; "025" -> "25"; ["$3$"] -> "3";
    ["1", "2"] -> "1, 2"; "$x$" -> "x"; "4.5e33" -> "4.5 \\times 10^{33}" (math-verify misreads
    e-notation). Anything else (units, intervals, "58,500") is returned stripped, for grade().
    A value the grader cannot read (a dict, a bool, a nested list, nan or inf) raises ValueError:
    its text ("{'value': 3}", "True", "nan") matches no boxed answer, so every response would
    score 0 and the row would be dead weight for a whole run."""
    if isinstance(value, (list, tuple)):   # OlympiadBench final_answer: one element, or several
        nested = [part for part in value if isinstance(part, (list, tuple, dict))]
        if nested:
            raise ValueError(_unreadable_gold(value, f"a list holding a {type(nested[0]).__name__}"))
        return ", ".join(p for p in map(gold_answer, value) if p)
    what = _unreadable_kind(value)
    if what:
        raise ValueError(_unreadable_gold(value, what))
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    # a float goes through its repr: 27.0 -> "27", 4.5e33 -> "4.5e+33" -> "4.5 \\times 10^{33}"
    # (str(int(4.5e33)) would print float noise in the low digits)
    text = (repr(value) if isinstance(value, float) else str(value)).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    number = _canonical_number(text)
    if _INT_RE.fullmatch(number):   # whole numbers only: "66.450" keeps the precision it states
        text = number               # (grade() canonicalises both sides anyway)
    m = _E_NOTATION_RE.fullmatch(text)
    if m:
        text = f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}"
    return text


def _unreadable_kind(value):
    """What a raw gold value is when the grader cannot read it ("a bool", "a dict", ...), else None."""
    if isinstance(value, bool):    # before int: True is an int, and would be graded as "True"
        return "a bool"
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite float"
    if value is None or isinstance(value, (str, int, float)):
        return None
    return f"a {type(value).__name__}"


def _unreadable_gold(value, what):
    """The message of an unreadable gold value, showing it as the data file writes it."""
    shown = json.dumps(value, ensure_ascii=False, default=repr)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return (f"the answer is {what} ({shown}), which the grader cannot read "
            "(give it as text or a number; several answers as a flat list of those)")


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
# math-verify: the time-bounded pool lives in plumbing/mathverify_pool.py

def warmup():
    """Start the math-verify pool now (~1-3 s) instead of at the first non-trivial answer."""
    mathverify_pool.warmup()


def shutdown():
    """Stop the math-verify pool (also done automatically at exit)."""
    mathverify_pool.shutdown()


# -----------------------------------------------------------------------------
# grading

def _grade_fast(pred, gold):
    """(is_correct, outcome) decided without math-verify, or None if math-verify is needed.
    outcome: "correct" | "wrong" | "rejected"."""
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
    """grade_completions' outcome per (pred, gold), and whether it needed math-verify, which verifies
    identical pairs (common within a GRPO group) once, distinct ones in parallel."""
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
    verdicts = mathverify_pool.verify_many(list(slow), timeout) if slow else []
    for idxs, (equal, status) in zip(slow.values(), verdicts):
        for i in idxs:
            outcomes[i] = status if status != "ok" else ("correct" if equal else "wrong")
    return outcomes, used_mv


def grade(pred: str, gold: str) -> bool:
    """True iff the predicted answer equals the gold answer (strings, numbers, then math-verify)."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise ValueError(f"expected two str, got {type(pred).__name__}, {type(gold).__name__}")
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


def grade_completions(completions: list[str], answers: list[str],
                      timeout: float = DEFAULT_TIMEOUT) -> tuple[list[str], int]:
    """The outcome of each completion's last boxed answer against its gold answer ("correct",
    "wrong", "no_answer", "rejected", "timeout" or "error") and how many needed math-verify."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    bad = [type(a).__name__ for a in answers if not isinstance(a, str)]
    if bad:                                                  # (extract_boxed checks the completions)
        raise ValueError(f"gold answers must be str, got {bad[0]}")
    preds = [extract_boxed(c) for c in completions]
    try:
        outcomes, used_mv = _grade_many(preds, answers, timeout)
    except Exception as e:   # a reward bug must not kill a training run; it shows up as "error"
        print(f"[reward] grading failed: {e!r}", file=sys.stderr)
        outcomes, used_mv = ["error"] * len(preds), [False] * len(preds)
    return outcomes, sum(used_mv)


@dataclass(frozen=True)
class Scored:
    """One completion's score (tasks.Task's scorers return it)."""
    reward: float                      # what enters the advantages (before --reward's format bonus)
    outcome: str                       # "correct" counts as accurate; every outcome is counted by name


def grade_rows(completions: list[str], rows: list[dict], timeout: float = DEFAULT_TIMEOUT):
    """The math task's scorer (tasks/math.py): each completion against its row's "answer", all at
    once (grade_completions) -> ([Scored], {"math_verify": completions that needed the slow path})."""
    outcomes, math_verify = grade_completions(completions, [r["answer"] for r in rows], timeout)
    return [Scored(float(o == "correct"), o) for o in outcomes], {"math_verify": math_verify}


def score_batch(completions: list[str], answers: list[str], *, format_reward: bool = False,
                timeout: float = DEFAULT_TIMEOUT) -> tuple[list[float], dict]:
    """Rewards for many completions plus outcome counts for logging:
    correct + wrong + no_answer + rejected + timeout + error == total; math_verify = completions
    that needed the slow path; format_ok = completions with the <think>...</think>...\\boxed format."""
    outcomes, math_verify = grade_completions(completions, answers, timeout)
    fmts = [format_reward and has_format(c) for c in completions]
    rewards = [(0.9 * (o == "correct") + 0.1 * f) if format_reward else float(o == "correct")
               for o, f in zip(outcomes, fmts)]
    stats = dict(total=len(completions), correct=0, wrong=0, no_answer=0, rejected=0, timeout=0,
                 error=0, math_verify=math_verify, format_ok=sum(fmts))
    for o in outcomes:
        stats[o] += 1
    return rewards, stats
