"""Whole groups dealt to ranks by length (issue #32, item 6): within each update batch, every rank
gets as many groups as before, and the most and least loaded ranks end within the longest group's
tokens of each other; the 2-process runs of tests/test_train.py reproduce one process with it."""

import random

import pytest
import torch

from rl.experience import Collected
from rl.scale_step import deal_by_length
from plumbing import batching
from rollout import Rollout


def test_the_deal_is_even_in_count_and_within_the_longest_group_in_tokens():
    rng = random.Random(0)
    for _ in range(3000):
        world, per = rng.randint(2, 8), rng.randint(1, 6)
        tokens = [rng.choice([rng.randint(1, 50), rng.randint(1, 5000)]) for _ in range(world * per)]
        dealt = batching.deal(tokens, world)
        assert sorted(i for m in dealt for i in m) == list(range(len(tokens)))   # each group once
        assert all(len(m) == per and m == sorted(m) for m in dealt)
        load = [sum(tokens[i] for i in m) for m in dealt]
        assert max(load) - min(load) <= max(tokens), (tokens, world, load)
    assert batching.deal([5, 1, 1, 5], 2) == [[0, 1], [2, 3]]               # 6 and 6
    with pytest.raises(ValueError):
        batching.deal([1, 2, 3], 2)


class FakeDist:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world


class FakeRun:
    class args:
        group_size, update_batch = 2, 4

    class tokenizer:
        pad_token_id = 0

    def __init__(self, rank):
        self.dist = FakeDist(rank, 2)


def rank_rows(rank, lengths):
    """One rank's Collected: groups of 2 rows with the given response lengths (prompts of 3)."""
    B, R = 2 * len(lengths), max(lengths)
    rmask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths for _ in range(2)])
    ro = Rollout(torch.full((B, 3), 7), torch.ones(B, 3, dtype=torch.long), rmask * (rank + 1), rmask,
                 rmask.float() * -0.5, torch.ones(B, dtype=torch.bool))
    idx = [10 * rank + k for k in range(len(lengths))]
    return Collected(ro, torch.arange(B).float() + 100 * rank, torch.ones(B), idx, torch.zeros(B), torch.zeros(B), {})


def test_deal_by_length_moves_whole_groups_within_each_update_batch(monkeypatch):
    """2 ranks, update batches of 4 prompts (2 per rank), 2 of them: rank 0 sampled all the long
    responses; after the deal each rank holds one long and one short group of each update batch, with
    their rows, rewards and tokens intact."""
    from rl import experience

    mine, sent = {0: rank_rows(0, [30, 28, 20, 22]), 1: rank_rows(1, [2, 3, 4, 1])}, {}

    class Sent(Exception):
        pass

    def send(r):                                       # what each rank contributes to the all-gather
        def record(items):
            sent[r] = items[0]
            raise Sent
        return record
    for r in (0, 1):
        monkeypatch.setattr(experience.distributed, "all_gather_list", send(r))
        with pytest.raises(Sent):
            deal_by_length(FakeRun(r), mine[r])
    monkeypatch.setattr(experience.distributed, "all_gather_list", lambda obj: [sent[0], sent[1]])
    out = {r: deal_by_length(FakeRun(r), mine[r]) for r in (0, 1)}
    # update batch 1: tokens 66, 62 (rank 0) and 10, 12 (rank 1) -> {66, 10} and {62, 12}; batch 2 alike
    assert out[0].prompt_idx == [0, 10, 3, 13] and out[1].prompt_idx == [1, 11, 2, 12]
    for r in (0, 1):
        o = out[r]
        assert o.ro.response_ids.shape[0] == 8 and o.rewards.shape == o.valid.shape == (8,)
        for k, idx in enumerate(o.prompt_idx):          # each group's rows travelled together
            src = mine[idx // 10]
            j = src.prompt_idx.index(idx)
            n = int(src.ro.response_mask[2 * j].sum())
            assert torch.equal(o.rewards[2 * k:2 * k + 2], src.rewards[2 * j:2 * j + 2])
            assert torch.equal(o.ro.response_ids[2 * k:2 * k + 2, :n], src.ro.response_ids[2 * j:2 * j + 2, :n])
            assert int(o.ro.response_mask[2 * k:2 * k + 2].sum()) == 2 * n
    assert deal_by_length(type("One", (), {"dist": FakeDist(0, 1)})(), mine[0]) is mine[0]   # one rank
