"""The Countdown task: reach a target from given numbers, each used exactly once, with + - * / and
parentheses. A second task beside math, and the worked example of adding one (README).

A row holds the usual problem and answer (a reference expression, never compared against) plus
the fields this task owns, which data/benchmarks.py keeps as JSON extras:

    {"problem": "Use the numbers 3, 5 and 2, each exactly once, ... to make 16.",
     "answer": "(3 + 5) * 2", "numbers": [3, 5, 2], "target": 16, "solution": "<think>..."}

A completion is graded on its last \\boxed{...}: the expression inside is parsed by the small
recursive-descent parser below (never Python's eval: the text comes from a model) and evaluated
exactly with Fractions. It is correct when the integers it uses are row["numbers"] as a multiset
(each exactly once) and its value is row["target"]. So `\\boxed{16}` is "wrong": it uses 16, not
3, 5 and 2. Many expressions are right for one row, which is why there is no gold-string check.

Rules the parser enforces (tests/test_countdown.py pins each):
  - binary + - * / only; `\\times`, `\\cdot`, `×` read as *, `\\div`, `÷` as /, `−` as -, and
    `\\left(` `\\right)` as parentheses;
  - no unary minus or plus: the given numbers are positive and a move combines two of them, so
    "-3 + 5" or "8 - -2" is no Countdown expression: "rejected" (the same as any other junk);
  - intermediate values may be any rationals (6 / (1 - 3 / 4) = 24, as in the 24 game); only the
    final value must equal the target. Division by zero anywhere is "rejected";
  - integers are written plainly (no leading zeros, no decimals); the box holds the expression
    alone (an equation "(3 + 5) * 2 = 16" is rejected, like any other character outside the
    grammar); at most MAX_CHARS characters and MAX_DEPTH nested parentheses, so junk costs
    microseconds.

To add a task, copy this file's shape: `read_row` checks the row's own fields when a set is
loaded (a bad file fails at start-up with its line, not mid-run; here also that the reference
answer makes the target), `score` maps (completion, whole row) to a `Scored`, and `register` at
the bottom names the task, its data sets, its outcomes and the fields that make a row its own
(a row carrying them is never graded by another task without a "task" field saying so);
tasks/__init__.py imports the module (which imports tasks.task, never the package itself: no
import cycle). The data comes from a seeded generator (data/countdown/prepare.py)
whose every row the scorer must grade 1.0 (a test).
"""

import os
from collections import Counter
from fractions import Fraction

import reward
from plumbing.errors import DataError
from tasks.task import Scored, Task, register

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(HERE), "data", "countdown")
OUTCOMES = ("correct", "wrong", "no_answer", "rejected", "error")
MAX_CHARS = 100          # the longest reference answer is ~25 chars; longer boxes are junk
MAX_DEPTH = 10           # nested parentheses; 6 numbers never need more than 5
NUMBERS_RANGE = (2, 6)   # how many numbers a row may give

# Other spellings models write for the same tokens (LaTeX, Unicode), read as the ASCII one.
_SPELLINGS = {"\\times": "*", "\\cdot": "*", "×": "*", "\\div": "/", "÷": "/", "−": "-",
              "\\left(": "(", "\\right)": ")"}
_LONGEST_FIRST = sorted(_SPELLINGS, key=len, reverse=True)


class Rejected(ValueError):
    """An expression this task does not read (junk, too long or deep, division by zero)."""


# ----------------------------------------------------------------------------- the expression

def tokenize(text: str) -> list:
    """Expression text -> tokens: ints, operators "+-*/" and "(" ")". Raises Rejected."""
    if len(text) > MAX_CHARS:
        raise Rejected(f"longer than {MAX_CHARS} characters")
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "0123456789":          # ASCII only: str.isdigit also accepts "²" and "٣"
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            if text[i] == "0" and j - i > 1:
                raise Rejected(f"leading zero in {text[i:j]!r}")
            out.append(int(text[i:j]))
            i = j
        elif c in "+-*/()":
            out.append(c)
            i += 1
        else:
            word = next((w for w in _LONGEST_FIRST if text.startswith(w, i)), None)
            after = text[i + len(word):i + len(word) + 1] if word else ""
            if word is None or word[-1].isalpha() and after.isalpha():      # \divides is not \div
                raise Rejected(f"unexpected {text[i:i + 8]!r}")
            out.append(_SPELLINGS[word])
            i += len(word)
    return out


class _Parser:
    """expr := term (("+" | "-") term)*;  term := atom (("*" | "/") atom)*;  atom := INT | "(" expr ")".
    Evaluates while parsing (Fractions, exact) and records the integers used."""

    def __init__(self, toks):
        self.toks, self.pos, self.used = toks, 0, []

    def peek(self):
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def take(self):
        tok = self.peek()
        self.pos += 1
        return tok

    def expr(self, depth):
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth):
        value = self.atom(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.atom(depth)
            if op == "/" and rhs == 0:
                raise Rejected("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def atom(self, depth):
        tok = self.take()
        if isinstance(tok, int):
            self.used.append(tok)
            return Fraction(tok)
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise Rejected(f"more than {MAX_DEPTH} nested parentheses")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise Rejected("unclosed parenthesis")
            return value
        # an operator here is a unary one ("-3", "2 * -3"), or two operators in a row
        raise Rejected("expected a number or '('" + (f", got {tok!r}" if tok is not None else " at the end"))


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """-> (exact value, the integers used, in order). Raises Rejected for anything unreadable."""
    parser = _Parser(tokenize(text))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise Rejected(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.used


# ----------------------------------------------------------------------------- the task

def read_row(row: dict, where: str) -> dict:
    """The row as loaded, once its numbers (2..6 positive ints) and integer target are checked, and
    its answer: an expression that uses the numbers, each once, to make the target (a row whose
    target does not match its answer would train on a problem nobody checked)."""
    numbers, target = row.get("numbers"), row.get("target")
    lo, hi = NUMBERS_RANGE
    if not isinstance(numbers, list) or not lo <= len(numbers) <= hi:
        raise DataError(f"{where}: a countdown row needs \"numbers\", a list of {lo} to {hi} positive "
                        f"integers, got {numbers!r:.60}")
    bad = [n for n in numbers if type(n) is not int or n <= 0]   # type(): True is not a number here
    if bad:
        raise DataError(f"{where}: \"numbers\" must be positive integers, got {bad[0]!r:.30} "
                        f"in {numbers!r:.60}")
    if type(target) is not int:
        raise DataError(f"{where}: a countdown row needs an integer \"target\", got {target!r:.30}")
    check_answer(row["answer"], numbers, target, where)
    return row


def check_answer(answer: str, numbers: list[int], target: int, where: str):
    """DataError naming the row unless `answer` is a Countdown expression that uses `numbers`, each
    exactly once, and makes `target`: what score() asks of a completion, asked of the row itself."""
    try:
        value, used = evaluate(answer)
    except Rejected as e:
        raise DataError(f"{where}: the answer {answer!r:.40} is no Countdown expression ({e}); it must "
                        f"use the numbers {numbers}, each once, to make the target {target}") from None
    if Counter(used) != Counter(numbers):
        raise DataError(f"{where}: the answer {answer!r:.40} uses {sorted(used)}, not the numbers "
                        f"{sorted(numbers)} (each exactly once)")
    if value != target:
        raise DataError(f"{where}: the answer {answer!r:.40} makes {value}, not the target {target}")


def score(completion: str, row: dict) -> Scored:
    """1.0 if the last boxed expression uses row["numbers"] exactly once each and equals row["target"]."""
    boxed = reward.extract_boxed(completion)
    if boxed is None:
        return Scored(0.0, "no_answer")
    try:
        value, used = evaluate(boxed)
    except Rejected:
        return Scored(0.0, "rejected")
    if Counter(used) == Counter(row["numbers"]) and value == row["target"]:
        return Scored(1.0, "correct")
    return Scored(0.0, "wrong")


TASK = register(Task(
    name="countdown",
    doc="reach the target from the given numbers, each once, with + - * / and parentheses",
    score=score,
    read_row=read_row,
    datasets={f"countdown-{s}": os.path.join(DATA, f"{s}.jsonl") for s in ("train", "test", "sft")},
    train_data="countdown-train",
    heldout=("countdown-test",),
    outcomes=OUTCOMES,
    format_ok=reward.has_format,
    fields=("numbers", "target"),
))
