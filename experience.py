"""One RL step's experience: this rank's prompts, G responses to each from the rollout policy,
graded by their tasks, and (DAPO) more sampling rounds where groups carry no signal (`collect` ->
Collected); then, once train.py has scored the rows, the rollout policy's and the reference's
log-probs (OldScores) and everything the PPO update reads (UpdateBatch).

train.rl_step calls `collect` once per step, on the decoding copy of the policy
(distributed.gathered). What a row is worth is its task's business (tasks.score_rows, which sees
the whole row); what enters the advantages here is that reward, plus DAPO's overlong penalty.
"""

from dataclasses import dataclass, replace

import torch

import logprobs
import losses
import rollout
import tasks
from data.prompts import step_indices
from plumbing import batching, distributed
from plumbing.distributed import all_sum


@dataclass
class Collected:
    """This rank's share of one RL step's rollouts: rows of a group are consecutive."""
    ro: rollout.Rollout
    rewards: torch.Tensor               # (B,) the rewards that enter the advantages
    valid: torch.Tensor                 # (B,) 0 where a row carries no loss: trained_rows
    prompt_idx: list[int]               # (B / G,) training-set index of each group's prompt
    first_rewards: torch.Tensor         # the first sampling round's rewards and accuracies:
    first_acc: torch.Tensor             # what reward / train_acc report
    info: dict                          # grader outcome counts, zero_var_frac, resampling


def my_prompts(run, step, round_=0) -> list[int]:
    """Training-set indices of this rank's prompts of an RL step (a sampling round of it): a
    function of (seed, step, round), so a resumed run samples what the uninterrupted one would."""
    args = run.args
    order = step_indices(len(run.data), step if round_ == 0 else step * 7919 + round_, args.rollout_batch,
                         args.seed + round_)
    return batching.rank_share(order, run.dist.rank, run.dist.world, args.rollout_batch, args.update_batch)


def sample_and_score(run, decoder, prompt_idx, step, round_) -> rollout.Graded:
    """G responses per prompt (consecutive rows), each graded by its row's task against the whole
    row; DAPO's overlong penalty enters the rewards, not the accuracies."""
    args, G = run.args, run.args.group_size
    with run.timer("gen"):
        seeds = [rollout.row_seed(args.seed, step, round_, i, j) for i in prompt_idx for j in range(G)]
        ro = rollout.sample_with(decoder, [run.data.ids[i] for i in prompt_idx for _ in range(G)], run.spec,
                                 temperature=args.temperature, top_p=args.top_p, seeds=seeds)
    with run.timer("reward"):
        rows = [run.data.rows[i] for i in prompt_idx for _ in range(G)]
        scores, correct, counts = tasks.score_rows(rollout.decode_responses(run.tokenizer, ro), rows,
                                                   format_reward=args.reward == "acc+format")
    rewards = torch.tensor(scores)
    if run.algo.overlong:
        L = args.max_new_tokens
        rewards += losses.overlong_penalty(ro.response_mask.sum(1).float(), L, run.algo.overlong_cache_len(L))
    acc, counts["new_turn"] = torch.tensor(correct).float(), rollout.new_turns(run.tokenizer, ro)
    return rollout.Graded(ro, rewards, acc, prompt_idx, counts, keep=losses.nonconstant_groups(acc, G))


def collect(run, decoder, step) -> Collected:
    """Sample and grade this rank's prompts. DAPO's dynamic sampling then drops groups whose
    accuracies are all equal and samples more prompts (at most --max-resample-rounds extra rounds)
    until this rank's share is full; unfilled slots become zero-weight filler groups, so every rank
    still runs the same number of micro-batches (DDP and FSDP2 need that)."""
    G, mine = run.args.group_size, my_prompts(run, step)
    first = sample_and_score(run, decoder, mine, step, 0)
    info = {"zero_var_frac": 1 - first.keep.float().mean().item(), "resample_rounds": 0, **first.counts}
    if not run.algo.dynamic_sampling:
        everyone = trained_rows(torch.ones(len(mine) * G), first.ro, run.algo)
        return Collected(first.ro, first.rewards, everyone, mine, first.rewards, first.acc, info)
    rounds, have = [first], int(first.keep.sum())
    for r in range(1, run.args.max_resample_rounds + 1):
        if all_sum(torch.tensor(float(have < len(mine)))).item() == 0:  # every rank full (they
            break                                                      # sample together: FSDP2)
        rounds.append(sample_and_score(run, decoder, my_prompts(run, step, r), step, r))
        have += int(rounds[-1].keep.sum())
        info["resample_rounds"] = r
    kept = rollout.fill_groups(rounds, len(mine), G, run.tokenizer.pad_token_id)
    info["kept_groups"] = int(kept.valid.sum()) // G
    valid = trained_rows(kept.valid, kept.ro, run.algo)
    return Collected(kept.ro, kept.rewards, valid, kept.prompt_idx, first.rewards, first.acc, info)


def trained_rows(valid, ro: rollout.Rollout, algo) -> torch.Tensor:
    """(B,) 1 where a row carries loss: not DAPO filler, and with algo.mask_truncated not cut at the
    length limit (its reward still enters its group's baseline: the advantages use every row)."""
    return valid * ro.finished.to(valid.dtype).cpu() if algo.mask_truncated else valid


@dataclass
class Group:
    """One prompt's G rows, as deal_by_length moves them between ranks (on the CPU, trimmed)."""
    ro: rollout.Rollout
    rewards: torch.Tensor               # (G,)
    valid: torch.Tensor                 # (G,)
    prompt_idx: int
    tokens: int                         # prompt + response tokens of its G rows: what scoring it costs


def deal_by_length(run, c: Collected) -> Collected:
    """Whole groups dealt to the ranks by length (batching.deal) within each update batch: the same
    groups make each optimizer step as before, on the same number of rows per rank, but no rank
    gets all the long responses. One all-gather of the step's groups; nothing on one process. The
    first sampling round's rewards (reward / train_acc) stay where they were: they are summed."""
    if run.dist.world == 1:
        return c
    world, G = run.dist.world, run.args.group_size
    ro, per = c.ro.to("cpu"), run.args.update_batch // world       # groups of an update batch, per rank
    mine = []
    for k, idx in enumerate(c.prompt_idx):
        rows = slice(k * G, (k + 1) * G)
        g = trimmed(ro.take(rows))
        tokens = int(g.prompt_mask.sum() + g.response_mask.sum())
        mine.append(Group(g, c.rewards[rows].cpu(), c.valid[rows].cpu(), idx, tokens))
    everyone = distributed.all_gather_list([mine])                     # [rank][group]
    kept = []
    for u in range(0, len(mine), per):                                 # each update batch
        pool = [g for groups in everyone for g in groups[u:u + per]]
        kept += [pool[i] for i in batching.deal([g.tokens for g in pool], world)[run.dist.rank]]
    return replace(c, ro=rollout.cat_rollouts([g.ro for g in kept], run.tokenizer.pad_token_id),
                   rewards=torch.cat([g.rewards for g in kept]), valid=torch.cat([g.valid for g in kept]),
                   prompt_idx=[g.prompt_idx for g in kept])


def trimmed(ro: rollout.Rollout) -> rollout.Rollout:
    """Rows without their all-padding columns (prompts are left-padded, responses right-padded)."""
    left = ro.prompt_ids.shape[1] - int(ro.prompt_mask.sum(1).max())   # padding columns on the left
    R = int(ro.response_mask.sum(1).max())
    return rollout.Rollout(ro.prompt_ids[:, left:], ro.prompt_mask[:, left:], ro.response_ids[:, :R],
                           ro.response_mask[:, :R], ro.logprobs[:, :R], ro.finished)


# ----------------------------------------------------------------------------------------------
# After scoring: pi_old's and the reference's log-probs of the rows, and what the update reads


@dataclass
class OldScores:
    """The rollout policy's log-probs over the rollout rows (B rows), before any update."""
    old: torch.Tensor                   # (B, R) response log-probs of the rollout policy (PPO's pi_old)
    prompt: torch.Tensor                # (B, P-1) its prompt log-probs (Query-KL monitor, code weights)
    entropy: torch.Tensor               # (B, R)
    ref: torch.Tensor | None            # (B, R) reference response log-probs, if a reference is loaded
    ref_prompt: torch.Tensor | None     # (B, P-1) and its prompt log-probs (--qkl-ref live)
    fresh: slice                        # rows whose old/prompt/entropy the first update forward fills in

    @classmethod
    def empty(cls, packed: logprobs.Packed, fresh: slice, has_ref: bool) -> "OldScores":
        B, P, R = packed.input_ids.shape[0], packed.P, packed.input_ids.shape[1] - packed.P

        def zeros(n):
            return torch.zeros(B, n, device=packed.input_ids.device)
        return cls(zeros(R), zeros(P - 1), zeros(R), zeros(R) if has_ref else None,
                   zeros(P - 1) if has_ref else None, fresh)

    def record(self, rows, prompt_cols, resp_cols, s: logprobs.TokenScores):
        """pi_old's scores of some rows (a micro-batch's, at its trimmed columns)."""
        self.old[rows, resp_cols], self.prompt[rows, prompt_cols] = s.response.detach(), s.prompt.detach()
        self.entropy[rows, resp_cols] = s.entropy


@dataclass
class UpdateBatch:
    """What the PPO update needs, per rollout row (B rows on this rank)."""
    packed: logprobs.Packed
    resp_mask: torch.Tensor             # (B, R) response tokens of valid rows
    prompt_mask: torch.Tensor           # (B, P-1) prompt tokens of valid rows
    valid: torch.Tensor                 # (B,)
    scores: OldScores                   # old, ref (B, R); the first update forward fills in rows scores.fresh
    qref: torch.Tensor                  # (B, P-1) the Query-KL reference's prompt log-probs
    adv: torch.Tensor                   # (B,)
    weights: torch.Tensor | None        # (B,) query weights
    sampler: torch.Tensor | None = None  # (B, R) the sampler's log-probs of the tokens (rollout.Rollout's)
