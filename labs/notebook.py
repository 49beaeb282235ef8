# %% [markdown]
# # One ERPO step, and the PPO clip you never see on-policy
#
# A script of cells (`# %%`): `python labs/notebook.py` runs it top to bottom (well under 2 minutes
# on a laptop CPU); VS Code and Jupytext open it as a notebook. It drives the repo's own functions on
# the tiny world's warm start (data/tinymath/warmstart, 0.9M parameters), the way train.py's RL step
# does (docs/walkthrough.md traces that step inside train.py):
#
# 1. sample G responses to each of a few prompts (`rollout.sample`), grade them (`tasks.score_rows`);
# 2. group advantages (`losses.group_advantages`) and the paper's query weights (`losses.query_weights`);
# 3. pi_old and the reference (`logprobs.score_tokens`, no gradient);
# 4. TWO optimizer steps on the SAME rollout with ERPO's loss (`losses.rl_loss`). The first is
#    on-policy: pi_theta = pi_old, every ratio is exactly 1 and nothing can clip. The second is not:
#    the first step moved pi_theta, so the ratios r = pi_theta / pi_old spread, and PPO's clip
#    (method.md §8.3) cuts the gradient of some tokens. We list which, and why.
#
# Settings are train.py's defaults (lr 2e-4, eps 0.2 / 0.3, dual-clip 3, up to 96 new tokens) on a
# smaller batch. Where train.py's second optimizer step of an RL step trains OTHER rows (clip_frac
# ~0.2% there), this one trains the same rows again, as a second PPO epoch would: more of them clip.

# %%
import copy
import json
import os
import sys
from dataclasses import dataclass

import torch

ROOT = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) if "__file__" in globals()
        else os.path.dirname(os.getcwd()) if os.path.basename(os.getcwd()) == "labs" else os.getcwd())
sys.path.insert(0, ROOT)
from modeling import logprobs  # noqa: E402  (the repo's modules, from its root)
import losses  # noqa: E402
from modeling import models  # noqa: E402
from rl import query_reference  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from rl.experience import step_indices  # noqa: E402

MODEL = os.path.join(ROOT, "data", "tinymath", "warmstart")
ALGO = losses.ALGOS["erpo"]     # PG(A * w) + alpha * Query-KL; eps_low 0.2, eps_high 0.3, dual-clip c = 3
PROBLEMS = 64                   # this lab's training set: the first 64 tiny problems (s-bar: their mean)
PROMPTS, G = 8, 8               # one batch: 8 prompts x 8 responses
MAX_NEW_TOKENS, TEMPERATURE = 96, 1.0
LR, SEED = 2e-4, 0
torch.set_num_threads(1)        # one thread: the same numbers on every run of one machine
torch.manual_seed(SEED)

# %% [markdown]
# ## The policy, its frozen reference, and the reference's view of every training prompt
# ERPO's Query-KL compares the policy's prompt log-probs with the INITIAL model's (method.md §3), and
# the paper's query weights use the initial model's NLL s_i of each prompt and its mean s-bar over
# the training set (method.md §4): both come from one pass of the reference over the prompts
# (`query_reference.build`, what `--qkl-ref cache` builds before RL).

# %%
policy, tokenizer = models.load_policy(MODEL)
reference = copy.deepcopy(policy).eval().requires_grad_(False)
data = tasks.prompt_set("tiny-train", tokenizer, "plain", "math", training=True, limit=PROBLEMS)
prompt_logp = query_reference.build(reference, data.ids, tokenizer.pad_token_id, TEMPERATURE, "cpu")
cache = query_reference.QueryCache.from_logp(prompt_logp)   # per prompt: log-probs, NLL s_i; s-bar
print(f"{sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters; {len(data)} problems, prompt "
      f"NLL s_i from {cache.nll.min():.1f} to {cache.nll.max():.1f} nats, s-bar = {cache.nll_mean:.2f}")

# %% [markdown]
# ## 1. Rollouts and rewards
# Each row is seeded by (seed, step, prompt, sample) as in train.py, so the batch is the same on
# every run.

# %%
idx = step_indices(len(data), 0, PROMPTS, SEED)                  # the prompts of RL step 0
rows = [data.rows[i] for i in idx for _ in range(G)]             # G consecutive rows per prompt
ro = rollout.sample(policy, [data.ids[i] for i in idx for _ in range(G)], max_new_tokens=MAX_NEW_TOKENS,
                    eos_ids=rollout.eos_token_ids(policy, tokenizer), pad_id=tokenizer.pad_token_id,
                    temperature=TEMPERATURE, seeds=[rollout.row_seed(SEED, 0, 0, i, j) for i in idx
                                                    for j in range(G)])
texts = rollout.decode_responses(tokenizer, ro)
scores, correct, _ = tasks.score_rows(texts, rows)
rewards = torch.tensor(scores)
print(f"{len(rows)} responses, {ro.response_mask.sum()} tokens, accuracy {rewards.mean():.2f}")
print(f"prompt #{idx[0]}: {data.rows[idx[0]]['problem']!r}, gold answer {data.rows[idx[0]]['answer']}")
for j in range(3):
    print(f"  response {j} (reward {scores[j]:.0f}): {texts[j]!r}")

# %% [markdown]
# ## 2. Advantages and query weights
# GRPO's advantage compares each response with its own group: (R - mean) / (std + eps), and a group
# whose responses all got the same reward has EXACTLY 0 (no signal: method.md §8.2, §8.6). The paper's
# query weight w = clip(s-bar / s_i, 0, 2) multiplies the advantage of every response to prompt i;
# it scales the policy gradient only, never the Query-KL (method.md §4). Exercises 1 and 4.

# %%
adv = losses.group_advantages(rewards, G)                                  # (B,)
w_prompt = losses.query_weights(cache.nll[idx], mean_nll=cache.nll_mean, clip=ALGO.weight_clip)
w = w_prompt.repeat_interleave(G)                                          # (B,) each row its prompt's
print("prompt  correct  advantage of a right / wrong answer   s_i    w")
for k, i in enumerate(idx):
    r, a = rewards[k * G:(k + 1) * G], adv[k * G:(k + 1) * G]
    right = f"{a[r > 0][0]:+.3f}" if (r > 0).any() else "  -   "
    wrong = f"{a[r == 0][0]:+.3f}" if (r == 0).any() else "  -   "
    print(f"#{i:<5}  {int(r.sum())}/{G}      {right} / {wrong}                    {cache.nll[i]:5.1f}  "
          f"{w_prompt[k]:.3f}")

# %% [markdown]
# ## 3. pi_old and the reference, without gradient
# One forward over each [prompt | response] row scores the response tokens (the policy gradient)
# AND the prompt tokens (the Query-KL): `logprobs.score_tokens` (method.md §3). The sampler's own
# log-probs of its tokens are pi_old's too, computed by other kernels: equal up to round-off.

# %%
packed = ro.packed()
resp_mask = ro.response_mask.float()                       # (B, R) 1 on response tokens
prompt_mask = packed.prompt_tok_mask.float()               # (B, P-1) 1 on prompt tokens after the first
with torch.no_grad():
    old = logprobs.score_tokens(policy, packed, TEMPERATURE)
    ref = logprobs.score_tokens(reference, packed, TEMPERATURE)
qref = cache.ref_logp(idx, G, packed.P - 1)                # the reference's prompt log-probs, (B, P-1)
gap = ((old.response - ro.logprobs).abs() * resp_mask).max()
print(f"sampler vs training forward: largest |log-prob difference| {gap:.1e} (round-off)")

# %% [markdown]
# ## 4. Two optimizer steps on the same rollout
# `optimizer_step` is train.py's optimizer step in miniature: a forward with gradient, ERPO's loss
# (`losses.rl_loss`: PPO-clip on A * w, + alpha * Query-KL), clip the gradient norm to 1, one AdamW
# step. Before it steps it records what the PPO surrogate saw (`losses.ppo_surrogate`): each
# token's ratio r = pi_theta / pi_old and which clip acted. The monitors `query_kl` and `policy_kl`
# (k3, method.md §3 and §8.1) are those of the weights the forward ran on.


# %%
@dataclass
class Step:
    ratio: torch.Tensor          # (B, R) pi_theta / pi_old of each response token, before the update
    clipped: torch.Tensor        # (B, R) bool: a clip (or dual-clip) cut this token's gradient
    stats: dict                  # losses.rl_loss's statistics (clip_frac, query_kl, policy_kl, ...)


opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
denominators = dict(num_tokens=resp_mask.sum(), num_seqs=len(resp_mask), max_len=MAX_NEW_TOKENS)


def optimizer_step() -> Step:
    now = logprobs.score_tokens(policy, packed, TEMPERATURE)             # with gradient
    loss, stats = losses.rl_loss(ALGO, logp=now.response, old_logp=old.response, ref_logp=ref.response,
                                 resp_mask=resp_mask, advantages=adv, weights=w, prompt_logp=now.prompt,
                                 prompt_ref_logp=qref, prompt_mask=prompt_mask, **denominators)
    sur = losses.ppo_surrogate(now.response.detach(), old.response, adv * w, resp_mask, ALGO)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    on = resp_mask.bool()
    return Step(torch.where(on, sur.ratio, 1.0), sur.stats["clip_frac"] & on,
                {k: float(v) for k, v in stats.items()})


def describe(step, name):
    r = step.ratio[resp_mask.bool()]
    print(f"{name}: ratio min {r.min():.4f}, max {r.max():.4f}; outside [0.8, 1.3]: "
          f"{((r < 1 - ALGO.eps_low) | (r > 1 + ALGO.eps_high)).sum()} of {r.numel()} tokens; "
          f"clip_frac {step.stats['clip_frac']:.4f}; loss {step.stats['loss']:+.4f}")


first = optimizer_step()
describe(first, "optimizer step 1 (on-policy) ")
second = optimizer_step()
describe(second, "optimizer step 2 (off-policy)")

# %% [markdown]
# ## 5. Which tokens clipped, and why
# loss = -min(r A, clip(r, 1 - 0.2, 1 + 0.3) A), and for A < 0 at most c |A| = 3 |A|. The min is
# pessimistic: a clip only acts where the update has ALREADY moved the token the way A wants
# (A > 0 and r > 1.3: made more likely enough; A < 0 and r < 0.8: made less likely enough), so
# PPO stops pushing it further. A token that moved the wrong way (A > 0, r < 0.8) is not clipped:
# its full gradient pulls it back. Dual-clip bounds the loss of a bad token whose ratio exploded.

# %%
A_tok = (adv * w)[:, None].expand_as(second.ratio)


def why(a, r):
    if a > 0 and r > 1 + ALGO.eps_high:
        return "A > 0, r > 1.3: the good token is already up enough"
    if a < 0 and r < 1 - ALGO.eps_low:
        return "A < 0, r < 0.8: the bad token is already down enough"
    return f"A < 0, r > c = {ALGO.dual_clip}: dual-clip bounds its loss at c|A|"


kinds = {}
for b, t in second.clipped.nonzero().tolist():
    kinds.setdefault(why(A_tok[b, t], second.ratio[b, t]), []).append((b, t))
print(f"{int(second.clipped.sum())} clipped tokens of {int(resp_mask.sum())}:")
print(" row  token         A*w      r      why")
for reason, where in kinds.items():
    for b, t in where[:4]:                                 # a few of each kind
        tok = tokenizer.decode([int(ro.response_ids[b, t])])
        print(f"{b:4d}  {tok!r:12} {A_tok[b, t]:+.3f}  {second.ratio[b, t]:6.3f}  {reason}")
    print(f"      ({len(where)} in all: {reason})")
outside = resp_mask.bool() & ((second.ratio < 1 - ALGO.eps_low) | (second.ratio > 1 + ALGO.eps_high))
free = outside & ~second.clipped
print(f"outside [0.8, 1.3] but not clipped: {int((free & (A_tok != 0)).sum())} moved against their A (the "
      f"gradient pulls them back), {int((free & (A_tok == 0)).sum())} with A = 0 (no signal: moved because "
      "the parameters are shared)")

# %% [markdown]
# ## 6. Query-KL vs Policy-KL
# Both are k3 per token against the initial model: Policy-KL over the response tokens, Query-KL
# over the prompt tokens, which no reward ever looks at. Both start at exactly 0 (policy =
# reference). ERPO puts alpha * Query-KL in its loss (Proposition 1: its gradient flows only through
# the prompt log-likelihoods, method.md §2); GRPO puts beta * Policy-KL there and leaves the prompts
# free to drift: `python -m labs.drift_pair` shows what that does over 80 steps.

# %%
with torch.no_grad():
    after = logprobs.score_tokens(policy, packed, TEMPERATURE)
# the same monitors as rl_loss's statistics: k3 clamped to [-10, 10] per token (the released code's)
final_query_kl = float(losses.query_kl(after.prompt, qref, prompt_mask, clamp=ALGO.kl_clamp).mean())
k3_response = losses.policy_kl(after.response, ref.response, clamp=ALGO.kl_clamp)
final_policy_kl = float(losses.aggregate(k3_response, resp_mask))
print("weights        query_kl    policy_kl")
print(f"initial        {first.stats['query_kl']:.2e}    {first.stats['policy_kl']:.2e}")
print(f"after step 1   {second.stats['query_kl']:.2e}    {second.stats['policy_kl']:.2e}")
print(f"after step 2   {final_query_kl:.2e}    {final_policy_kl:.2e}")
top = k3_response[resp_mask.bool()].sort(descending=True).values
print(f"Policy-KL is heavy-tailed: its 10 largest tokens hold {top[:10].sum() / top.sum():.0%} of it "
      f"(largest {top[0]:.2f}: a sampled token whose probability the update cut, pi_ref / pi_theta >> 1)")

# %%
summary = {"clip_frac": [first.stats["clip_frac"], second.stats["clip_frac"]],
           "ratio_max_abs_dev": [float((s.ratio - 1).abs().max()) for s in (first, second)],
           "clipped_tokens": [int(s.clipped.sum()) for s in (first, second)],
           "query_kl": [first.stats["query_kl"], second.stats["query_kl"], final_query_kl],
           "policy_kl": [first.stats["policy_kl"], second.stats["policy_kl"], final_policy_kl],
           "accuracy": float(rewards.mean()), "tokens": int(resp_mask.sum())}
if os.environ.get("LAB_NOTEBOOK_SUMMARY"):                 # tests/test_labs.py reads the numbers here
    with open(os.environ["LAB_NOTEBOOK_SUMMARY"], "w") as f:
        json.dump(summary, f, indent=1)
