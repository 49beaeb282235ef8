"""How OpenMP's threads wait, set by the entry scripts before torch loads (torch-free on purpose).

OpenMP's threads spin between parallel regions, and a step of a small model is thousands of short
ones: beside another busy process the spinning threads hold the cores the working one waits for (a
tiny-world step 3.3x as long as on free cores). A short spin, then sleep: as fast on free cores,
2.3x beside a busy process (bench/bench_threads.py; docs/speed.md).
"""

SPIN = "3000"   # GOMP_SPINCOUNT: libgomp's own is 300,000 (bench/bench_threads.py compares them)


def short_spin(environ) -> dict:
    """{"GOMP_SPINCOUNT": SPIN}, or {} where the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins):
    what an entry script adds to os.environ first, since it acts only before torch (libgomp) loads."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": SPIN}
