"""The grader's seconds, which tests/test_reward.py does not assert (a test that times itself fails
on a busy machine): what each adversarial answer costs against the per-answer timeout, the integer
fast path against the same answers sent to math-verify, and extract_boxed on adversarial text at
n and 4n characters (linear: 4x).

    python bench/bench_grader_timing.py [--timeout 1.0] [--chars 100000]
"""

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import reward  # noqa: E402
from plumbing import mathverify_pool  # noqa: E402
from test_reward import ADVERSARIAL, ADVERSARIAL_TEXT  # noqa: E402


def seconds(fn, repeats=1):
    """The fastest of `repeats` calls of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def adversarial(timeout):
    """Each adversarial answer graded off the main thread (as a training run's grading is)."""
    reward.warmup()
    print(f"adversarial answers, graded off the main thread (the per-answer bound: {timeout:g} s)")
    for name, completion in ADVERSARIAL.items():
        out = {}
        th = threading.Thread(target=lambda c=completion, out=out: out.update(
            o=reward.grade_completions([c], ["2"], timeout)[0][0]))
        dt = seconds(lambda th=th: (th.start(), th.join()))
        print(f"  {name:32s} {dt:7.3f} s  {out['o']}")


def fast_path():
    golds = [str(17 * i + 3) for i in range(256)]
    comps = [f"<think> {g} </think> Mia has \\boxed{{{g if i % 3 else int(g) + 1}}} apples."
             for i, g in enumerate(golds)]
    fast = seconds(lambda: reward.score_batch(comps, golds, format_reward=True), repeats=5)
    pairs = [(g, reward.extract_boxed(c)) for g, c in zip(golds, comps)]
    slow = seconds(lambda: mathverify_pool.verify_many(pairs, timeout=10.0))
    print(f"256 integer answers: fast path {fast * 1e3:.2f} ms, the same pairs through math-verify "
          f"{slow * 1e3:.0f} ms ({slow / fast:.0f}x)")


def extraction(chars):
    print(f"extract_boxed on adversarial text, {chars // 4:,} vs {chars:,} characters (linear: 4x)")
    for kind, make in ADVERSARIAL_TEXT.items():
        small, big = make(chars // 4), make(chars)
        a = seconds(lambda text=small: reward.extract_boxed(text), repeats=5)
        b = seconds(lambda text=big: reward.extract_boxed(text), repeats=5)
        print(f"  {kind:20s} {a * 1e3:8.3f} ms {b * 1e3:8.3f} ms  {b / a:5.1f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=reward.DEFAULT_TIMEOUT, help="seconds per answer")
    p.add_argument("--chars", type=int, default=100_000, help="the larger adversarial text's length")
    args = p.parse_args(argv)
    adversarial(args.timeout)
    fast_path()
    extraction(args.chars)
    reward.shutdown()


if __name__ == "__main__":
    main()
