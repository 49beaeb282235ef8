"""The repo's own functions behind the exercises' signatures (labs/exercises.py): what
`python -m pytest labs/grade.py --impl repo` grades, so that the lab's tests are known to pass on
the real implementation (tests/test_labs.py checks it) and to fail on the stubs."""

import losses
from labs import reweighting


def group_advantages(rewards, group_size, eps=1e-6):
    return losses.group_advantages(rewards, group_size, "grpo", eps)


def k3(logp, ref_logp):
    return losses.policy_kl(logp, ref_logp, "k3")


def query_kl(logp, ref_logp, mask):
    return losses.query_kl(logp, ref_logp, mask, "k3")


def query_weights(nll, mean_nll=None, clip=None):
    return losses.query_weights(nll, mean_nll, clip)


def ppo_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    return losses.ppo_loss(logp, old_logp, advantages, eps_low, eps_high, dual_clip)


def grpo_prompt_weight(p, group_size, eps=1e-6):
    r = reweighting.binary_group(round(p * group_size), group_size)
    return reweighting.read_weight(r, losses.group_advantages(r, group_size, "grpo", eps))
