"""
Our math-verify pool (plumbing/mathverify_pool.py: a server subprocess that forks warm runners and SIGKILLs
one that overruns) against pebble.ProcessPool (fork context, per-task timeout), side by side:

  start-up      seconds from nothing running to the first answer
  throughput    pairs/s on ~500 realistic (gold, pred) pairs that all need math-verify
  tower batch   wall seconds for a batch of 1 power tower (hits the 1 s timeout) + 20 normal pairs
  after tower   seconds for one normal pair right after that
  5 towers      wall seconds for 5 batches of 1 tower (timeout 0.5 s) + 10 normal pairs: each
                timeout kills a worker; ideal 2.5 s if its replacement is ready at once
  daemonic      works from a daemonic process (a DataLoader worker)?
  thread        works when started from a non-main thread?

Both pools use the same worker function (mathverify_pool._mv_verify), the same number of workers
(min(4, CPUs), or REWARD_MV_WORKERS) and both warm sympy up once per worker before the first
request. Needs `pip install -r requirements-bench.txt`.

    python bench/bench_grader_pool.py
"""

import argparse
import logging
import multiprocessing
import os
import sys
import threading
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import mathverify_pool as mvp  # noqa: E402

TOWER = r"9^{9^{9^{9^{9}}}}"
NORMAL = [(r"\sqrt{8}", r"2\sqrt{2}"), ("(x+1)^2", "x^2+2x+1"), (r"\{1,3\}", r"\{3, 1\}"),
          ("1,-2", "-2,1"), (r"\frac{\sqrt{3}}{2}", r"\sin(\pi/3)")]


def realistic_pairs(n=500):
    """Answers like the grader meets after its fast paths: surds, polynomials, intervals, tuples,
    matrices, sets; about a third not equal. Distinct, so no cache makes them trivially fast."""
    out = []
    for k in range(1, n // 5 + 1):
        out += [
            (f"{k}\\sqrt{{2}}", f"\\sqrt{{{2 * k * k + (k % 3 == 0)}}}"),
            (f"(x+{k})^2", f"x^2+{2 * k}x+{k * k + (k % 4 == 0)}"),
            (f"[{k}, {k + 2})", f"[{k},{k + 2 + (k % 3 == 1)})"),
            (f"\\left( \\frac{{{k}}}{{2}}, -{k} \\right)", f"(\\frac{{{2 * k}}}{{4}},-{k + (k % 5 == 0)})"),
            (f"\\begin{{pmatrix}}{k}&1\\\\0&{k}\\end{{pmatrix}}",
             f"\\begin{{bmatrix}}{k}&1\\\\0&{k + (k % 2)}\\end{{bmatrix}}"),
        ]
    return out[:n]


# ----------------------------------------------------------------------------- pebble side

def _pebble_init():
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    for gold, pred in mvp._WARMUP_PAIRS:   # the same warm-up our server does once
        mvp._mv_verify(gold, pred)


def _pebble_task(gold, pred):
    try:
        return mvp._mv_verify(gold, pred)
    except Exception:
        return False, "error"


class Pebble:
    def __init__(self, n):
        import pebble
        self.pool = pebble.ProcessPool(max_workers=n, initializer=_pebble_init,
                                       context=multiprocessing.get_context("fork"))

    def verify_many(self, pairs, timeout):
        from concurrent.futures import TimeoutError
        futs = [self.pool.schedule(_pebble_task, args=p, timeout=timeout) for p in pairs]
        out = []
        for f in futs:
            try:
                out.append(tuple(f.result()))
            except TimeoutError:
                out.append((False, "timeout"))
            except Exception:
                out.append((False, "error"))
        return out

    def close(self):
        self.pool.stop()
        self.pool.join()


class Ours:
    def __init__(self, n):
        os.environ["REWARD_MV_WORKERS"] = str(n)
        mvp.shutdown()

    def verify_many(self, pairs, timeout):
        return mvp.verify_many(pairs, timeout)

    def close(self):
        mvp.shutdown()


# ----------------------------------------------------------------------------- measurements

def measure(make, n, pairs):
    res = {}
    t = time.perf_counter()
    pool = make(n)
    first = pool.verify_many([NORMAL[0]], 30.0)
    res["start-up s"] = time.perf_counter() - t
    assert first == [(True, "ok")], first
    t = time.perf_counter()
    got = pool.verify_many(pairs, 10.0)
    res["throughput pairs/s"] = len(pairs) / (time.perf_counter() - t)
    res["  (ok, timeout, error)"] = tuple(sum(o == k for _, o in got) for k in ("ok", "timeout", "error"))
    t = time.perf_counter()
    got = pool.verify_many([("2", TOWER)] + NORMAL * 4, 1.0)
    res["tower batch s"] = time.perf_counter() - t
    assert got[0] == (False, "timeout") and all(o == "ok" for _, o in got[1:]), got
    t = time.perf_counter()
    pool.verify_many([NORMAL[1]], 30.0)
    res["after tower s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(5):   # each kill needs a replacement worker: is it ready before the next one?
        got = pool.verify_many([("2", TOWER)] + NORMAL * 2, 0.5)
        assert got[0] == (False, "timeout") and all(o == "ok" for _, o in got[1:]), got
    res["5 towers @0.5s s"] = time.perf_counter() - t
    pool.close()
    return res


def _try(make, n, queue):
    try:
        pool = make(n)
        ok = pool.verify_many([NORMAL[0]], 30.0) == [(True, "ok")]
        pool.close()
        queue.put("yes" if ok else "wrong answer")
    except BaseException as e:
        queue.put(f"no: {type(e).__name__}: {str(e)[:60]}")


def in_daemon(make, n):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_try, args=(make, n, q), daemon=True)
    p.start()
    p.join(120)
    return q.get() if not q.empty() else "no answer"


def in_thread(make, n):
    import queue
    q = queue.Queue()
    th = threading.Thread(target=_try, args=(make, n, q))
    th.start()
    th.join(120)
    return q.get() if not q.empty() else "no answer"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=500, help="realistic (gold, pred) pairs for the throughput figure")
    args = ap.parse_args(argv)
    try:
        import pebble as _  # noqa: F401
    except ImportError:
        sys.exit("error: pebble is not installed (pip install -r requirements-bench.txt)")
    n = mvp._num_runners()
    pairs = realistic_pairs(args.pairs)
    print(f"{len(pairs)} pairs, {n} workers, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs\n")
    rows = {}
    for name, make in [("ours", Ours), ("pebble", Pebble)]:
        rows[name] = measure(make, n, pairs)
        rows[name]["daemonic"] = in_daemon(make, n)
        rows[name]["thread"] = in_thread(make, n)
    print(f"{'':24s}{'ours':>14s}{'pebble':>14s}{'pebble/ours':>14s}")
    for key in rows["ours"]:
        a, b = rows["ours"][key], rows["pebble"][key]
        if isinstance(a, float):
            print(f"{key:24s}{a:14.3f}{b:14.3f}{b / a:14.2f}")
        else:
            print(f"{key:24s}{str(a):>14s}  {b}")
    print("\nthroughput: higher is better; the others: lower is better")


if __name__ == "__main__":
    main()
