"""The lab's exercises: write these six functions, then grade them.

    python -m pytest -q labs/grade.py              # grades this file
    python -m pytest -q labs/grade.py --impl repo  # the same tests on the repo's own functions (all pass)

Each stub gives its signature, its equation and the docs/method.md section that derives it. The
tests use the hand-value cases of tests/loss_cases.py (the ones tests/test_losses.py checks the
repo's losses.py against) and an exact toy categorical for the KL direction. Use torch only; do not
import losses.py (that is the answer). Conventions as in losses.py: B sequences,
T tokens, G responses per prompt on consecutive rows; log-probs are of the tokens actually there.
"""

import torch  # noqa: F401  (for your implementation)


def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO's group-relative advantage (method.md §8.2). rewards (B,), B = n_groups * G -> (B,).

    Rows [k*G, (k+1)*G) are the G responses to prompt k. Within each group:

        A_i = (R_i - mean R) / (std R + eps),   std R = sqrt(sum_j (R_j - mean R)^2 / (G - 1))

    (the unbiased std, with Bessel's G - 1, as torch.std's default, verl and EasyR1).

    A group whose rewards are all equal gets EXACTLY 0 on every row: set it explicitly, because
    round-off in R - mean (rewards like 0.1 or 0.9 are not exact in float) divided by a ~0 std gives
    values that are small but not 0. Return float32.
    """
    raise NotImplementedError("group_advantages: write me (labs/exercises.py)")


def k3(logp, ref_logp):
    """The k3 estimator of KL(pi_theta || pi_ref), per token (method.md §8.1). Same shape as logp.

    The tokens were sampled from pi_theta; logp = log pi_theta(token), ref_logp = log pi_ref(token).

        log r = log pi_ref - log pi_theta        (this order: the other one estimates something else)
        k3 = r - 1 - log r                        (>= 0, unbiased: E_{pi_theta}[k3] = KL(pi_theta || pi_ref))

    The gradient must flow through logp (it is used as a loss term).
    """
    raise NotImplementedError("k3: write me (labs/exercises.py)")


def query_kl(logp, ref_logp, mask):
    """ERPO's per-prompt Query-KL (method.md §3). (B, T) each -> (B,).

    logp / ref_logp: log-probs of the PROMPT tokens under the policy / the reference model; mask: 1 on
    the prompt tokens that count (every one after the first: nothing predicts the first), 0 elsewhere
    (padding: finite junk that must not leak into the result).

        QueryKL_b = sum_t mask_bt * k3(logp_bt, ref_logp_bt) / sum_t mask_bt

    A row whose mask is all 0 gives 0 (divide by max(sum_t mask, 1)).
    """
    raise NotImplementedError("query_kl: write me (labs/exercises.py)")


def query_weights(nll, mean_nll=None, clip=None):
    """Query weights (method.md §4). nll (N,) -> (N,), with NO gradient (they only scale advantages).

        w_i = s_bar / s_i,   then clamped to [clip[0], clip[1]] when clip is given

    s_i = nll[i] is a query's negative log-likelihood (>= 0); s_bar = mean_nll, or the mean of nll
    when mean_nll is None. The paper's version: s_i from the reference model, s_bar over the whole
    training set, clip = (0, 2): w_i = clip(s_bar / s_i, 0, 2). A typical query (low NLL) weighs more.
    A negative NLL is a caller's mistake (a log-likelihood passed by accident): raise ValueError
    with "log-likelihood" in its message. Guard the division with nll.clamp_min(1e-8).
    """
    raise NotImplementedError("query_weights: write me (labs/exercises.py)")


def ppo_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.3, dual_clip=3.0):
    """PPO's clipped surrogate with dual-clip, per token (method.md §8.3).

    logp (with grad), old_logp: (B, T) log-probs of the sampled tokens under pi_theta / pi_old;
    advantages (B,) (the same for every token of a row) or (B, T).

        r = exp(logp - old_logp)
        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        where A < 0 and dual_clip = c is not None:  loss = min(loss, c |A|)

    Returns (loss (B, T), clipped (B, T) bool): clipped is True where a clip decided the loss (the
    clipped term, or the dual-clip bound, was the one taken), i.e. where the gradient is 0.
    """
    raise NotImplementedError("ppo_loss: write me (labs/exercises.py)")


def grpo_prompt_weight(p, group_size, eps=1e-6):
    """GRPO's implicit per-prompt weight (docs/teaching.md, part D; method.md §8.2). -> float.

    A prompt with G = group_size binary rewards, K of them 1, has success rate p = K / G. Every
    response's GRPO advantage (your group_advantages) is then A_i = c * (R_i - p) with ONE number c
    for the whole group: the group's policy-gradient term is c * sum_i (R_i - p) grad log pi(o_i),
    REINFORCE with the group-mean baseline scaled by c. Derive c as a function of p and G: write
    the group's std (Bessel's, as in group_advantages) with p alone, using R_i^2 = R_i.

    A group with p = 0 or p = 1 has no signal: return 0.0 there (its advantages are exactly 0).
    """
    raise NotImplementedError("grpo_prompt_weight: write me (labs/exercises.py)")
