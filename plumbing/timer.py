"""Where an RL step's time (and GPU memory) goes: wall seconds per phase (verl logs the same as
timing_s/*), and on CUDA each phase's memory.

    t = Phases(device)
    with t("gen"): ...                  # sampling
    with t("reward"): ...               # grading
    m.update(t.metrics())               # {"time_gen": s, "time_reward": s, ...}; the clock restarts

Phases may repeat within a step (DAPO resampling rounds); their times add up. On CUDA the queue is
synchronised at each phase boundary, so kernels are charged to the phase that launched them (the
sync costs little next to a phase, which is at least one whole forward pass).

On CUDA each phase also records, in GiB, the most of any rank (metrics() reduces over ranks):
  mem_alloc_<phase>     the allocator's peak of live tensors in the phase (max_memory_allocated)
  mem_reserved_<phase>  its peak of memory held, cached blocks and fragmentation included
  mem_used_<phase>      the driver's used memory at the phase's end (total - free: the CUDA context,
                        NCCL's buffers, other processes too) -- what no fake-tensor measurement sees
These are what --dry-run's plan (plumbing/memory_plan.py) predicts from the code, measured in a run.
"""

import time
from contextlib import contextmanager

import torch

from plumbing import distributed

GIB = 2.0**30
MEMORY = ("alloc", "reserved", "used")


class Phases:
    def __init__(self, device, cuda=torch.cuda):
        self.is_cuda = torch.device(device).type == "cuda"
        self.cuda = cuda                                # (a stand-in in the tests)
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}             # "mem_<kind>_<phase>" -> GiB, this rank

    def _sync(self):
        if self.is_cuda:
            self.cuda.synchronize()

    @contextmanager
    def __call__(self, name):
        self._sync()
        if self.is_cuda:
            self.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if self.is_cuda:
                self._record_memory(name)

    def _record_memory(self, name):
        free, total = self.cuda.mem_get_info()
        now = {"alloc": self.cuda.max_memory_allocated(), "reserved": self.cuda.max_memory_reserved(),
               "used": total - free}
        for kind, b in now.items():                    # a repeated phase: its largest
            key = f"mem_{kind}_{name}"
            self.memory[key] = max(self.memory.get(key, 0.0), b / GIB)

    def metrics(self) -> dict[str, float]:
        """{"time_<phase>": seconds} since the last call (and on CUDA {"mem_<kind>_<phase>": GiB}, the
        most of any rank: a collective, so every rank calls it), then start afresh."""
        out = {f"time_{k}": v for k, v in self.seconds.items()}
        if self.memory:                                 # one collective for all of them
            keys = sorted(self.memory)
            most = distributed.all_max(torch.tensor([self.memory[k] for k in keys], dtype=torch.float64))
            out.update(zip(keys, most.tolist()))
        self.seconds, self.memory = {}, {}
        return out
