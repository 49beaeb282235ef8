"""Tests for reward.py and plumbing/mathverify_pool.py: extraction (linear time), normalization,
equivalence, benchmark self-consistency, adversarial inputs bounded by a guard or the pool's timeout
(also off the main thread), the pool's server, its outcomes and fork safety, the format reward and
score_batch counts. No test times itself against a clock: bench/bench_grader_timing.py has the seconds."""

import ast
import json
import os
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reward  # noqa: E402
from plumbing import mathverify_pool  # noqa: E402
from reward import extract_boxed, grade, normalize, score, score_batch  # noqa: E402

# the shared benchmark files beside the checkout (../shared), as on CI; tests skip without them
BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "benchmarks")


# -----------------------------------------------------------------------------
# extraction

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{a^{b_{c}}+\{1\}}", r"a^{b_{c}}+\{1\}"),                    # nested + escaped braces
    (r"first \boxed{3} then \boxed{4}", "4"),                           # last box wins
    (r"we get $\boxed 5$ apples", "5"),                                 # space form
    (r"\fbox{x+1} is it", "x+1"),
    (r"or $\framebox{204}$ minutes", "204"),
    (r"\boxed{1} and a truncated \boxed{2", None),                      # last box never closed
    ("<think> 5 * 7 = 35 . 23 + 35 = 58 </think> Mia has \\boxed{58} apples.", "58"),
    ("no box here, the answer is 7", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


class _CountingRegex:
    """A compiled regex whose finditer counts the characters it is asked to scan (len(text) - pos)
    and the matches it hands back: extract_boxed's work is these scans (the regexes are literals
    and single tokens, linear in what they scan) and one Python step per match."""

    def __init__(self, regex, counter):
        self.regex, self.counter = regex, counter

    def finditer(self, text, pos=0):
        self.counter["scanned"] += len(text) - pos
        for m in self.regex.finditer(text, pos):
            self.counter["matches"] += 1
            yield m


# Adversarial texts of about n characters, by kind (the sizes of the old time-bound test at n = 100,000).
ADVERSARIAL_TEXT = {
    "unclosed box": lambda n: "\\boxed{" + "{" * n,
    "boxes never closed": lambda n: "\\boxed{" * (n // 7) + "}" * 5,
    "braces, no box": lambda n: "{" * (n // 2) + "}" * (n // 2),
    "one deep box": lambda n: "\\boxed{" + "{" * (n // 2) + "}" * (n // 2 + 1),
    "many boxes": lambda n: "\\boxed{1}" * (n // 9),
}
N = 100_000


@pytest.mark.parametrize("kind", ADVERSARIAL_TEXT)
def test_extract_boxed_is_linear_on_adversarial_text(kind, monkeypatch):
    """Linear time, counted rather than timed: the regex scans read each character at most twice
    (a box search, then one brace match from the last box; a brace match per box would read
    ~len(text)^2 / 2), and the Python loop over their matches takes at most one step per character.
    (Its seconds, at n and 4n characters: bench/bench_grader_timing.py.)"""
    counter = {"scanned": 0, "matches": 0}
    monkeypatch.setattr(reward, "_BOX_RE", _CountingRegex(reward._BOX_RE, counter))
    monkeypatch.setattr(reward, "_BRACE_TOKEN_RE", _CountingRegex(reward._BRACE_TOKEN_RE, counter))
    text = ADVERSARIAL_TEXT[kind](N)
    extract_boxed(text)
    assert 0 < counter["scanned"] <= 2 * len(text) and counter["matches"] <= len(text)


def test_extract_boxed_on_adversarial_text_reads_the_last_box():
    assert extract_boxed(ADVERSARIAL_TEXT["one deep box"](N)) == "{" * (N // 2) + "}" * (N // 2)
    assert extract_boxed(ADVERSARIAL_TEXT["unclosed box"](N)) is None
    assert extract_boxed(ADVERSARIAL_TEXT["many boxes"](N)) == "1"


# -----------------------------------------------------------------------------
# normalization and grading

@pytest.mark.parametrize("raw, expected", [
    ("025", "25"), ("27.0", "27"), ("-0.50", "-0.5"), ("1,000", "1000"), ("1,2", "1,2"),
    (r"\$32,\!348", "32348"), (r"\dfrac12", r"\frac{1}{2}"), (r"\tfrac{3}{4}", r"\frac{3}{4}"),
    (r"30^\circ", "30"), (r"30^{\circ}", "30"), (r"\text{Monday}", "Monday"), (r"5\text{ cm}", "5"),
    (r"864 \mbox{ inches}^2", "864"), (r"\textbf{(113) }", "113"), ("104.", "104"), ("x = 5", "5"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"), (r"10\%", "10"), ("$-7$", "-7"),
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


EQUIVALENT = [  # (pred, gold)
    ("25", "025"), ("27.0", "27"), ("1/2", r"\frac{1}{2}"), (r"\dfrac12", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"), (r"\frac{-1}{2}", "-0.5"), ("1000", "1,000"), (r"30", r"30^\circ"),
    (r"\text{Monday}", "Monday"), (r"\text{(C)}", "C"), ("0.333333", r"\frac13"),
    ("4.5e33", r"4.5\times10^{33}"),
    ("[1, 2)", "[1,2)"), (r"(-\infty, 0]", r"(-\infty,0]"), ("(3, -1)", "(3,-1)"),
    (r"\left( \frac{3}{2}, -13 \right)", r"(\frac32,-13)"),
    (r"2\sqrt{2}", r"\sqrt{8}"),                                            # needs math-verify
    (r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"),
    ("-2,1", "1,-2"), ("3+2x", "y = 2x + 3"), (r"\{3, 1\}", r"\{1,3\}"),
]
NOT_EQUIVALENT = [
    ("(1,2)", "(2,1)"), ("1/2", "2"), ("0.33", r"\frac{1}{3}"), ("25.000001", "25"), ("12", "1,2"),
    ("[1,2)", "[1,2]"), (r"\text{Tuesday}", r"\text{Monday}"), ("31", r"30^\circ"),
    (r"\begin{pmatrix}1&2\\3&5\end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"),
    ("", "0"), ("58", "85"), ("-5", "5"),
]


@pytest.fixture
def patient_timeout(monkeypatch):
    # a loaded 2-core CI box must not turn a slow-but-correct verification into a timeout here;
    # the 1 s bound itself is tested by the adversarial tests below
    monkeypatch.setattr(reward, "DEFAULT_TIMEOUT", 10.0)


@pytest.mark.parametrize("pred, gold", EQUIVALENT)
def test_grade_equivalent(pred, gold, patient_timeout):
    assert grade(pred, gold)


@pytest.mark.parametrize("pred, gold", NOT_EQUIVALENT)
def test_grade_not_equivalent(pred, gold, patient_timeout):
    assert not grade(pred, gold)


def test_importing_reward_does_not_import_sympy():
    code = "import sys, reward; assert 'sympy' not in sys.modules and 'math_verify' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_pool_is_beneath_reward():
    # the pool is a mechanism reward.py uses, it knows nothing about grading
    code = ("import sys; from plumbing import mathverify_pool; "
            "assert 'reward' not in sys.modules and 'sympy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("path", ["reward.py", "plumbing/mathverify_pool.py"])
def test_functions_are_short(path):
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= 60]
    assert not long, long


def test_integer_fast_path_never_starts_math_verify(monkeypatch):
    """Integer answers are graded by string and number comparisons alone: the pool is asked about
    no pair and never started (its timings: bench/bench_grader_timing.py)."""
    reward.shutdown()
    asked = []
    verify_many = mathverify_pool.verify_many
    monkeypatch.setattr(mathverify_pool, "verify_many", lambda pairs, timeout: asked.append(list(pairs))
                        or verify_many(pairs, timeout))
    golds = [str(17 * i + 3) for i in range(256)]
    comps = [f"<think> {g} </think> Mia has \\boxed{{{g if i % 3 else int(g) + 1}}} apples."
             for i, g in enumerate(golds)]
    rewards, stats = score_batch(comps, golds, format_reward=True)
    assert mathverify_pool._server is None and stats["math_verify"] == 0 and not any(asked)
    assert stats["correct"] == sum(1 for i in range(256) if i % 3) and stats["format_ok"] == 256


# -----------------------------------------------------------------------------
# real benchmarks: gold vs itself must grade right, gold vs another problem's gold must grade wrong

@pytest.mark.parametrize("name", ["math500", "aime2024", "amc22_23", "amc23"])
def test_benchmark_self_consistency(name):
    path = os.path.join(BENCH_DIR, f"{name}.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    golds = [str(r["answer"]) for r in rows]
    n = len(golds)
    # own answer, boxed; and the worked solution itself (its LAST box is the answer)
    r_ans, _ = score_batch([f"\\boxed{{{g}}}" for g in golds], golds)
    sols = [(r["solution"], g) for r, g in zip(rows, golds) if r.get("solution")]
    r_sol, _ = score_batch([s for s, _ in sols], [g for _, g in sols])
    # derangement: each problem paired with the next problem's answer (skip equal golds)
    pairs = [(i, (i + 1) % n) for i in range(n) if normalize(golds[i]) != normalize(golds[(i + 1) % n])]
    r_mix, _ = score_batch([f"\\boxed{{{golds[i]}}}" for i, _ in pairs], [golds[j] for _, j in pairs])
    acc_ans = sum(r_ans) / n
    acc_sol = sum(r_sol) / len(sols) if sols else float("nan")
    wrong_mix = 1 - sum(r_mix) / len(pairs)
    print(f"\n{name}: own answer correct {100 * acc_ans:.1f}% of {n}; own solution correct "
          f"{100 * acc_sol:.1f}% of {len(sols)}; other problem's answer wrong {100 * wrong_mix:.1f}% "
          f"of {len(pairs)}")
    assert acc_ans >= 0.99
    assert not sols or acc_sol >= 0.99
    assert wrong_mix >= 0.99


# -----------------------------------------------------------------------------
# adversarial inputs: bounded time, score 0, also off the main thread

ADVERSARIAL = {
    "power tower": r"\boxed{9^{9^{9^{9^{9}}}}}",            # reaches math-verify, must time out
    "huge power": r"\boxed{10^{10^{10}}}",
    "factorial": r"\boxed{1000000!}",
    "100KB braces": "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",
    "unclosed braces": "\\boxed{" + "{" * 100_000,
    "3000 parens": "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "2000 sqrt": "\\boxed{" + "\\sqrt{" * 2000 + "2" + "}" * 2000 + "}",
    "nested parens under length cap": "\\boxed{" + "(" * 100 + "1" + ")" * 100 + "}",
    "100k digits": "\\boxed{" + "9" * 100_000 + "}",
    "many boxes": "\\boxed{1}" * 20_000,
}


# What each adversarial input ends as. Those that reach math-verify are stopped by the pool's
# per-answer timeout ("timeout"; a fast machine may finish a factorial: then "wrong"); the power
# tower can finish nowhere. The rest never reach math-verify: the guards reject them.
BOUNDED = {"power tower": ("timeout",), "huge power": ("timeout", "wrong"), "factorial": ("timeout", "wrong"),
           "100KB braces": ("rejected",), "unclosed braces": ("no_answer",), "3000 parens": ("rejected",),
           "2000 sqrt": ("rejected",), "nested parens under length cap": ("rejected",),
           "100k digits": ("rejected",), "many boxes": ("wrong",)}
REACH_MATH_VERIFY = {"power tower", "huge power", "factorial"}
WATCHDOG = 300      # seconds: only stops a hung test, never what a test asserts


def _run_in_thread(fn):
    out = {}
    th = threading.Thread(target=lambda: out.update(value=fn()))
    th.start()
    th.join(timeout=WATCHDOG)
    assert not th.is_alive(), "hung"
    return out.get("value")


def test_adversarial_inputs_are_bounded_off_main_thread():
    """Off the main thread (math-verify's own signal.alarm timeouts do not work there), every
    adversarial input scores 0 with the outcome that bounds it: the pool's "timeout" for those that
    reach math-verify, a guard's rejection for the rest (bench/bench_grader_timing.py: the seconds)."""
    reward.warmup()
    assert set(BOUNDED) == set(ADVERSARIAL)
    for name, completion in ADVERSARIAL.items():
        (outcome,), mv = _run_in_thread(lambda c=completion: reward.grade_completions([c], ["2"]))
        assert outcome in BOUNDED[name] and mv == (name in REACH_MATH_VERIFY), (name, outcome, mv)
        assert _run_in_thread(lambda completion=completion: score(completion, "2")) == 0.0, name
    # and math-verify really answers off the main thread (not a silent 0 from a signal failure)
    assert _run_in_thread(lambda: score(r"\boxed{2\sqrt{2}}", r"\sqrt{8}")) == 1.0


def test_pool_outcomes_and_server_command():
    mathverify_pool.warmup()
    args = mathverify_pool._server.args
    assert args[1:3] == [os.path.join(ROOT, "plumbing", "mathverify_pool.py"), "--server"]
    pairs = [(r"\sqrt{8}", r"2\sqrt{2}"), ("2", r"9^{9^{9^{9^{9}}}}"), (r"\sqrt{3}", r"\sqrt{2}"),
             ("x", ""), (r"(x+1)^2", "x^2+2x+1")]   # "": nothing to parse
    # the power tower is stopped by its 1 s bound ("timeout"), the others answered
    got = mathverify_pool.verify_many(pairs, timeout=1.0)
    assert got == [(True, "ok"), (False, "timeout"), (False, "ok"), (False, "error"), (True, "ok")]
    assert mathverify_pool.verify_many([], timeout=1.0) == []


def test_pool_after_fork_child_uses_its_own_server():
    mathverify_pool.warmup()
    parent_server = mathverify_pool._server
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # child: must not touch the parent's pipes; gets a server of its own
        try:
            fresh = mathverify_pool._server is None
            res = mathverify_pool.verify_many([(r"\sqrt{8}", r"2\sqrt{2}")], timeout=10.0)
            mine = mathverify_pool._server is not None and mathverify_pool._server is not parent_server
            mathverify_pool.shutdown()
            os.write(wfd, json.dumps([fresh, res, mine]).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        out = f.read()
    os.waitpid(pid, 0)
    assert json.loads(out) == [True, [[True, "ok"]], True]
    # the parent's server survived the child's shutdown and still answers
    assert mathverify_pool._server is parent_server and parent_server.poll() is None
    assert mathverify_pool.verify_many([("(x+1)^2", "x^2+2x+1")], timeout=10.0) == [(True, "ok")]


def test_concurrent_threads_get_right_answers(patient_timeout):
    cases = [(r"2\sqrt{2}", r"\sqrt{8}", True), ("(1,2)", "(2,1)", False),
             ("x^2+2x+1", "(x+1)^2", True), (r"\sqrt{3}", r"\sqrt{2}", False)] * 2
    results = [None] * len(cases)

    def work(k):
        results[k] = grade(cases[k][0], cases[k][1])
    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(cases))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=WATCHDOG)
    assert not any(th.is_alive() for th in threads)
    assert results == [c[2] for c in cases]


# -----------------------------------------------------------------------------
# format reward and batch counts

def test_score_with_format_reward():
    good, bad = "<think> 5 * 7 = 35 . 23 + 35 = 58 </think> Mia has \\boxed{58} apples.", "\\boxed{58}"
    assert score(good, "58", format_reward=True) == pytest.approx(1.0)
    assert score(bad, "58", format_reward=True) == pytest.approx(0.9)          # right, no think
    assert score(good, "57", format_reward=True) == pytest.approx(0.1)         # format only
    assert score("58", "58", format_reward=True) == 0.0                        # neither
    assert score("<think> \\boxed{58} </think> so 58", "58", format_reward=True) == pytest.approx(0.9)
    assert score(good, "58") == 1.0 and score(good, "57") == 0.0


def test_score_batch_counts():
    comps = ["\\boxed{58}", "\\boxed{058}", "\\boxed{59}", "58", "\\boxed{" + "1" * 1000 + "}",
             r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{2\sqrt{2}}"]
    answers = ["58", "58", "58", "58", "58", "58", r"\sqrt{8}"]
    rewards, stats = score_batch(comps, answers, timeout=1.0)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert (stats["correct"], stats["wrong"], stats["no_answer"], stats["rejected"], stats["timeout"]) \
        == (3, 1, 1, 1, 1)
    assert stats["math_verify"] == 2 and stats["error"] == 0 and stats["total"] == 7
    with pytest.raises(ValueError):
        score_batch(["\\boxed{1}"], [])
