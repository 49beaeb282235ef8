"""What protects a run from its own steps, out of the RL step's way: a non-finite optimizer step is
not applied (and --max-bad-steps of them in a row end the run), a step that applied nothing has its
weights checked by their norm, and the latest checkpoint is trusted once its weights gave a finite
loss (docs/reliability.md). train.py calls `finite_step`, `bad_step` and `no_step`; the checkpoint
keeps `start_norm`."""

import math
from dataclasses import dataclass

import torch

from plumbing import checkpoints, distributed

# A run's weights move by a few percent at most; an update that destroys them (--lr 1e6: weights of
# ~1e6, norm x1e7) or a non-finite weight is a divergence, found by the norm where no loss is computed.
DIVERGED_NORM_GROWTH = 100


@dataclass
class StepGuard:
    out: str                            # the run folder (its checkpoints)
    max_bad_steps: int                  # --max-bad-steps
    start_norm: float | None = None     # the weights' norm where the run started (weights_diverged)
    ckpt_checked: bool = True           # the latest checkpoint's weights have given a finite loss
    bad_streak: int = 0                 # optimizer steps skipped in a row (non-finite loss or gradient)
    bad_at: int | None = None           # the LR schedule's count of applied steps at the last skipped one
    idle_streak: int = 0                # RL steps in a row that applied no optimizer step

    def finite_step(self):
        """An RL step applied an optimizer step, its loss and gradient finite on every rank: the
        latest checkpoint, whose weights gave that loss, is trusted, and the idle streak ends."""
        self.idle_streak = 0
        if not self.ckpt_checked:
            checkpoints.mark_checked(self.out)
            self.ckpt_checked = True

    def bad_step(self, opt, sched):
        """An optimizer step whose loss or gradient is not finite is not applied; --max-bad-steps of
        them in a row end the run (checkpoints.diverged sets the checkpoint of the diverged weights
        aside). In a row: the schedule (sched.last_epoch, its count of applied steps) has not moved
        since the last one."""
        opt.zero_grad(set_to_none=True)                                  # the weights stay as they were
        self.bad_streak = self.bad_streak + 1 if self.bad_at == sched.last_epoch else 1
        self.bad_at = sched.last_epoch
        if self.bad_streak >= self.max_bad_steps:
            raise SystemExit(checkpoints.diverged(self.out, self.bad_streak, checked=self.ckpt_checked))

    def no_step(self, step, policy):
        """An RL step that applied no optimizer step (no signal, --no-signal skip; or non-finite):
        no loss says whether the weights are sound, so their norm does (weights_diverged); a run
        whose every step is skipped never shows a divergence otherwise."""
        self.idle_streak += 1
        why = weights_diverged(policy, self.start_norm)
        if why:
            why = (f"the policy diverged by step {step + 1}: {why} (the step applied no optimizer step, "
                   "whose loss would have shown it)")
            raise SystemExit(checkpoints.diverged(self.out, 0, checked=self.ckpt_checked, why=why))

    def saved(self):
        """A checkpoint was written: trusted once its weights give a finite loss."""
        self.ckpt_checked = False


def weight_norm(model) -> float:
    """The L2 norm of all of the policy's parameters (FSDP2: over every rank's shards), on the host;
    inf or nan where a weight is not finite (or the norm is beyond float32)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    sq = torch.stack([torch.linalg.vector_norm(p.detach()).double() ** 2 for p in local]).sum()
    sharded = distributed.is_fsdp(model)
    return float(distributed.all_sum(sq) if sharded else sq) ** 0.5


def weights_diverged(model, start) -> str | None:
    """Why the weights have diverged (non-finite, or a norm DIVERGED_NORM_GROWTH times `start`'s,
    the norm where the run started), or None."""
    now = weight_norm(model)
    if not math.isfinite(now):
        return "a weight is not finite"
    if start and now > DIVERGED_NORM_GROWTH * start:
        return (f"the weights' norm is {now:.3g}, {now / start:.3g} times the {start:.3g} the run started "
                f"from (more than {DIVERGED_NORM_GROWTH} times)")
    return None
