"""The host-side plan of an RL step's forwards: which rows go into which micro-batch, at what
trimmed width, and the global counts every loss term is divided by.

Made once per step from the rollout's host lengths (logprobs.Packed.lengths), so the forward loops
of train.py read nothing back from the device until the step's scalars; that is also what lets
memory_measure run the same loops on fake tensors. Every rank runs as many micro-batches as the
rank with the most (FSDP2 gathers the weights once per forward, a collective).
"""

from dataclasses import dataclass

import torch

import logprobs
import losses
from plumbing import batching, distributed


@dataclass
class UpdatePlan:
    """One optimizer step: its micro-batches and the global counts its loss is divided by."""
    micro_batches: list[logprobs.MicroBatch]
    num_tokens: float                   # valid response tokens of the update batch, all ranks (>= 1)
    num_seqs: float                     # valid rows of the update batch, all ranks (0: DAPO filler only)
    num_signal: float                   # of those, rows of a group whose rewards differ (0: no signal)

    def takes_step(self, no_signal: str) -> bool:
        """An update batch in which every group's rewards are equal (every advantage 0), or of DAPO
        filler only, takes no optimizer step unless no_signal is "step" (--no-signal; method.md
        §8.6): its loss would be the KL terms alone, whose gradient is ~0 near the reference, and
        AdamW would normalise that into a full lr-sized step in every weight. Skipped, the moments,
        weight decay and the LR schedule wait too. Filler only: nothing in the loss, never a step."""
        return self.num_seqs > 0 and (self.num_signal > 0 or no_signal == "step")


@dataclass
class StepPlan:
    """Every host-side decision of a step's forwards."""
    old: list[logprobs.MicroBatch]      # no-grad pi_old forwards: the rows after the on-policy ones
    fresh: list[logprobs.MicroBatch]    # the on-policy rows, which the first update forward scores as pi_old
    ref: list[logprobs.MicroBatch]      # reference forwards, all rows (none without a reference)
    updates: list[UpdatePlan]           # one per update batch (each PPO epoch repeats them)
    group: int                          # G where each prompt runs once for its G rows, else 1


def micro_batches(args, packed: logprobs.Packed, rows: range) -> list[logprobs.MicroBatch]:
    """Rows as micro-batches, longest first: <= --micro-batch rows, <= --micro-tokens padded
    tokens, whole groups if prompts are shared, as many on every rank."""
    lengths, group = [packed.lengths[i] for i in rows], batching.prompt_group(args)

    def plan(count=0):
        return batching.microbatch_plan(lengths, args.micro_batch, args.micro_tokens, count, group)
    most = int(distributed.all_max(torch.tensor(len(plan()))))
    return [packed.micro_batch([rows.start + i for i in mb]) for mb in plan(most)]


def plan_step(args, packed: logprobs.Packed, valid: list[float], update_rows: list[slice], fresh: slice,
              has_ref: bool, rewards: torch.Tensor | None = None) -> StepPlan:
    """The step's plan from the host lengths and validity of its rows: one collective for the
    global counts, one per forward loop (the most micro-batches any rank runs), one host read
    (do a group's rows share their prompt?). fresh: the on-policy rows (train.on_policy_rows);
    rewards: (B,) as they enter the advantages, for UpdatePlan.num_signal (None: every row counts)."""
    B, G = len(packed.lengths), args.group_size
    signal = [True] * B if rewards is None else \
        losses.nonconstant_groups(rewards, G).repeat_interleave(G).tolist()     # the group's rewards differ
    local = {}
    for u, rows in enumerate(update_rows):
        lengths, ok = packed.lengths[rows], valid[rows]
        local[f"tokens{u}"] = sum(r * v for (_, r), v in zip(lengths, ok))   # valid response tokens
        local[f"seqs{u}"] = sum(ok)
        local[f"signal{u}"] = sum(v for v, s in zip(ok, signal[rows]) if s)
    counts = distributed.all_sums(local)
    updates = [UpdatePlan(micro_batches(args, packed, range(rows.start, rows.stop)),
                          max(1.0, counts[f"tokens{u}"]), counts[f"seqs{u}"], counts[f"signal{u}"])
               for u, rows in enumerate(update_rows)]
    group = batching.prompt_group(args)
    group = group if group > 1 and logprobs.shares_prompts(packed, G) else 1
    return StepPlan(old=micro_batches(args, packed, range(fresh.stop, B)),
                    fresh=micro_batches(args, packed, range(fresh.start, fresh.stop)),
                    ref=micro_batches(args, packed, range(B)) if has_ref else [],
                    updates=updates, group=group)
