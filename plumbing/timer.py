"""Where an RL step's time goes: wall seconds per phase (verl logs the same as timing_s/*).

    t = Phases(device)
    with t("gen"): ...                  # sampling
    with t("reward"): ...               # grading
    m.update(t.metrics())               # {"time_gen": s, "time_reward": s, ...}; the clock restarts

Phases may repeat within a step (DAPO resampling rounds); their times add up. On CUDA the queue is
synchronised at each phase boundary, so kernels are charged to the phase that launched them (the
sync costs little next to a phase, which is at least one whole forward pass).
"""

import time
from contextlib import contextmanager

import torch


class Phases:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = {}

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, name):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """{"time_<phase>": seconds} since the last call, then start afresh."""
        out = {f"time_{k}": v for k, v in self.seconds.items()}
        self.seconds = {}
        return out
