"""The walkthrough's document (docs/walkthrough.md) and figures, from a traced step (study/walkthrough.py).

Every computed number goes through `Doc.num` (study/walkthrough_numbers.py): the text keeps a marker,
printed at 4 significant figures, so a test can parse the numbers of a committed copy at exactly the
places the regenerated document has them and compare the rest of the text character for character.
"""

import os
import re

import torch

import losses
import reward
import rollout
import tasks
# compare / fmt / last_digit / read_numbers: the document's own number API, read from here by its test
from study.walkthrough_numbers import (K3, LOGP, ROUNDING, SEQ, WEIGHT, Doc, compare, fmt,  # noqa: F401
                                       last_digit, read_numbers)

METHOD = "method.md"                   # docs/method.md, beside the document
SECTIONS = {                           # what the document cites -> the heading of docs/method.md
    "§2": "§2 Definitions",
    "§3": "Per-token k3 over prompt tokens (`losses.query_kl`)",
    "§4": "§4 Query reweighting",
    "§5": "§5 The paper's training setup",
    "§8.1": "8.1 KL estimators (`losses.policy_kl`, `losses.kl_penalized_rewards`)",
    "§8.2": "8.2 Advantages (`losses.group_advantages`)",
    "§8.3": "8.3 Policy-gradient surrogates (`losses.py`)",
    "§8.5": "8.5 Loss aggregation (`losses.aggregate`)",
}


def slug(heading) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def cite(section) -> str:
    return f"[method.md {section}]({METHOD}#{slug(SECTIONS[section])})"


def code(name, path) -> str:
    """`module.function`, linked to its file (from docs/)."""
    return f"[`{name}`](../{path})"


def short(text, n=90):
    """A response on one line of a table, as code (so `<think>` is not taken for HTML)."""
    one = text.strip().replace("\n", " ⏎ ").replace("`", "'")
    one = one if len(one) <= n else one[:n - 1] + "…"
    return "`" + one.replace("|", "\\|") + "`"


def token_text(tokenizer, i):
    s = tokenizer.decode([int(i)]).replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
    return f"`{s.replace(' ', '␣')}`" if s else "∅"


def plain_token(tokenizer, i):
    """A token as a figure's tick label."""
    return tokenizer.decode([int(i)]).replace("\n", "⏎").replace(" ", "␣") or "∅"


def correct_counts(v) -> str:
    """'1, 2, 3 and 0': each group's number of correct responses, in the batch's order."""
    n = [str(int(x)) for x in (v.t.collected.rewards.view(v.groups, v.G) > 0).sum(1)]
    return n[0] if len(n) == 1 else ", ".join(n[:-1]) + " and " + n[-1]


def cosine(a, b) -> float:
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


def rel_diff(a, b) -> float:
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------
# What the sections read from the trace


class View:
    """The traced step, indexed the way the document talks about it: group g = prompt g + 1, its
    responses are rows g*G .. g*G + G - 1."""

    def __init__(self, t, run, followed):
        self.t, self.run, self.G = t, run, run.args.group_size
        self.tok, b = run.tokenizer, t.batch
        self.P, self.groups = b.packed.P, len(t.collected.prompt_idx)
        self.texts = rollout.decode_responses(self.tok, t.collected.ro)
        self.rows = [run.data.rows[i] for i in t.collected.prompt_idx]
        self.scored = [tasks.get(r.get("task", "math")).score(text, r)
                       for r, text in zip(self.rows_per_response(), self.texts)]
        self.followed = followed
        rewards = t.collected.rewards.view(self.groups, self.G)
        correct = [i for i in range(self.G) if rewards[followed, i] > 0]
        self.followed_response = followed * self.G + (correct[0] if correct else 0)

    def rows_per_response(self):
        return [r for r in self.rows for _ in range(self.G)]

    def prompt_tokens(self, g):
        """Token ids and 0/1 mask of the followed prompt's scored tokens (the log-prob columns)."""
        row = g * self.G
        ids = self.t.batch.packed.input_ids[row, 1:self.P]
        return ids, self.t.batch.prompt_mask[row] > 0

    def response_tokens(self, row):
        return self.t.batch.packed.input_ids[row, self.P:], self.t.batch.resp_mask[row] > 0

    def seq_logp(self, logp, mask):
        return (torch.where(mask > 0, logp, 0.0)).sum(1)


# ----------------------------------------------------------------------------------------------
# The document


def render(t, run, setup) -> tuple[Doc, dict]:
    """The document, in the order of the step -> (Doc, the figures' data)."""
    d, v = Doc(), View(t, run, setup["followed"])
    intro(d, v, setup)
    batch_section(d, v)
    advantages_section(d, v)
    weights_section(d, v)
    figures = kl_section(d, v)
    loss_section(d, v)
    shares_section(d, v)
    proposition_section(d, v)
    figures.update(after_section(d, v))
    metrics_section(d, v, setup)
    return d, figures


def intro(d, v, setup):
    a, n_params = v.run.args, sum(p.numel() for p in v.run.policy.parameters())
    d("# How ERPO works, on one real RL step",
      "",
      "Every number below comes from one run of the training code. `python -m study.walkthrough` "
      f"runs the training code's own functions (`run_setup.setup_rl`, then `train.rl_step` for steps 1-"
      f"{setup['traced'] + 1}) and traces RL step {setup['traced']}: what went into each tensor, and "
      f"what came out. The step is {code('train.rl_step', 'train.py')} as it reads, the one `train.py` "
      "takes by default (the GPU configs' fast paths are options, all off here). Nothing "
      "is typed by hand, and `tests/test_walkthrough.py` regenerates this page and checks it against "
      "this copy, number by number.",
      "",
      f"The run: the tiny warm start (`data/tinymath/warmstart`, {n_params:,} parameters), "
      f"`--algo erpo --alpha {v.run.algo.alpha:g}` on the first {setup['subset']} problems of the tiny "
      f"world's training set, {a.rollout_batch} prompts x G = {a.group_size} responses per step, up to "
      f"{a.max_new_tokens} new tokens at temperature {a.temperature:g}, learning rate {a.lr:g}, seed "
      f"{a.seed}. One RL step is one optimizer step on one micro-batch of "
      f"{a.rollout_batch * a.group_size} rows, so the step's loss is the micro-batch's. Steps 1-"
      f"{setup['traced'] - 1} ran before it, so the policy has moved from the reference and both KL terms "
      "are non-zero (at step 1 the policy is the reference: they are 0 up to rounding). Seed "
      f"{a.seed} was chosen for its step-{setup['traced']} batch, whose groups have "
      f"{correct_counts(v)} of {a.group_size} responses correct. At each point we also say what GRPO "
      "does with the same batch from the same weights: one GRPO step taken from where ERPO's "
      f"{setup['traced'] - 1} steps left the policy.",
      "",
      "Notation: q a prompt (the query), o a response, G responses per prompt, R a reward, "
      "A an advantage, w a query weight, l(q) = Σ_t log p(x_t | x_<t) over the prompt's tokens after "
      "the first. Links go to the equation in [docs/method.md](method.md) and to the function "
      "that computed the number.",
      "")


def batch_section(d, v):
    t, G = v.t, v.G
    d("## 1. The batch: prompts, responses, rewards",
      "",
      f"{code('experience.collect', 'rl/experience.py')} ({cite('§5')}) picks this step's {v.groups} "
      "prompts (a function of seed and step), samples G responses to each from the rollout policy "
      f"({code('rollout.generate', 'rollout.py')}: HF generate, each token drawn at the row's own "
      "seeded uniform) and grades them with the task's verifier "
      f"({code('tasks.score_rows', 'tasks/task.py')} → `reward.py`: the last `\\boxed{{}}` against "
      "the gold answer). A response is cut at the token limit if it has not ended.",
      "")
    for g in range(v.groups):
        row, ids = v.rows[g], v.run.data.ids[t.collected.prompt_idx[g]]
        d(f"### Prompt {g + 1}: training problem #{t.collected.prompt_idx[g]}, {len(ids)} tokens, "
          f"gold answer {row['answer']}",
          "",
          "```text", v.tok.decode(ids).strip(), "```",
          "",
          "| response | text (first 90 characters) | tokens | boxed answer | grader | reward |",
          "|---|---|---|---|---|---|")
        for j in range(G):
            i = g * G + j
            n = int(t.collected.ro.response_mask[i].sum())
            cut = "" if bool(t.collected.ro.finished[i]) else " (cut)"
            boxed = reward.extract_boxed(v.texts[i])
            d(f"| {j + 1} | {short(v.texts[i])} | {n}{cut} | {'—' if boxed is None else boxed} | "
              f"{v.scored[i].outcome} | {t.collected.rewards[i]:g} |")
        d("")


def advantages_section(d, v):
    t, G = v.t, v.G
    R, A = t.collected.rewards.view(v.groups, G), t.batch.adv.view(v.groups, G)
    d("## 2. Advantages: each response against its group",
      "",
      f"GRPO's advantage ({cite('§8.2')}; {code('losses.group_advantages', 'losses.py')} via "
      f"{code('experience.advantages', 'rl/experience.py')}) compares each "
      "response with the other answers to the same prompt: A_i = (R_i − mean R) / (std R + ε), the "
      f"std unbiased (÷ (G − 1)), ε = {f'{v.run.algo.adv_eps:g}'.replace('e-0', 'e-')}. ERPO uses the "
      "same advantages; what it "
      "changes comes after.",
      "")
    silent = []
    for g in range(v.groups):
        r = R[g]
        if bool((r == r[0]).all()):
            silent.append(g + 1)
            d(f"- Prompt {g + 1}: R = ({', '.join(f'{x:g}' for x in r.tolist())}): all equal, so A = 0 "
              "for every response (set exactly: the std is 0). **No signal**: this group adds nothing "
              "to the policy gradient.")
            continue
        mean, std = r.mean(), r.std()
        parts = []
        for x in sorted(set(r.tolist()), reverse=True):
            j = r.tolist().index(x)
            parts.append(f"R = {x:g}: A = ({x:g} − {d.num(mean)}) / ({d.num(std)} + 1e-6) "
                         f"= {d.num(A[g, j])}")
        d(f"- Prompt {g + 1}: R = ({', '.join(f'{x:g}' for x in r.tolist())}), mean {d.num(mean)}, "
          f"std {d.num(std)}. " + "; ".join(parts) + ".")
    d("",
      f"{len(silent)} of {v.groups} groups {'carries' if len(silent) == 1 else 'carry'} no signal"
      + (f" (prompt{'s' * (len(silent) > 1)} {', '.join(map(str, silent))})" if silent else "") + ". "
      "A group without signal still matters: its responses still count in the loss's token mean (its "
      "denominator is every response token of the batch), and their prompts still get the Query-KL "
      "term, which does not depend on rewards. DAPO (`--algo dapo`) samples more prompts instead of "
      "keeping such groups.",
      "")


def weights_section(d, v):
    t, G, cache = v.t, v.G, v.run.cache
    d("## 3. Query weights: typical questions count more",
      "",
      f"ERPO multiplies each response's advantage by its prompt's weight ({cite('§4')}; "
      f"{code('losses.query_weights', 'losses.py')} via {code('train.query_weights', 'train.py')}): "
      f"w(q) = clip(s̄ / s(q), {v.run.algo.weight_clip[0]:g}, {v.run.algo.weight_clip[1]:g}), where "
      "s(q) = −l_ref(q) is the prompt's negative log-likelihood "
      "under the reference model, read from the Query-KL cache built before step 1 "
      f"({code('query_reference.build', 'rl/query_reference.py')}), and s̄ = {d.num(cache.nll_mean, SEQ)} its "
      f"mean over all {len(cache.nll)} training prompts. A prompt the reference finds likely (s below the "
      "mean) gets w > 1. GRPO has no weights (w = 1).",
      "",
      "| prompt | tokens | s(q) = −l_ref(q) | s̄ / s(q) | w(q) | A · w of its responses |",
      "|---|---|---|---|---|---|")
    for g in range(v.groups):
        i = t.collected.prompt_idx[g]
        s, w = cache.nll[i], t.batch.weights[g * G]
        rows = slice(g * G, (g + 1) * G)
        aw = ", ".join(d.num(x, WEIGHT) for x in t.batch.adv[rows] * t.batch.weights[rows])
        d(f"| {g + 1} | {len(v.run.data.ids[i])} | {d.num(s, SEQ)} | {d.num(cache.nll_mean / s, WEIGHT)} | "
          f"{d.num(w, WEIGHT)} | {aw} |")
    d("")


def kl_section(d, v) -> dict:
    t, b, g = v.t, v.t.batch, v.followed
    row = g * v.G
    ids, mask = v.prompt_tokens(g)
    ref, cur = b.qref[row][mask], b.scores.prompt[row][mask]
    k3 = losses.policy_kl(cur, ref, "k3", clamp=losses.K3_CLAMP)
    d("## 4. The two KL terms, token by token",
      "",
      f"**Query-KL** ({cite('§2')}, estimator {cite('§3')}; {code('losses.query_kl', 'losses.py')}) "
      f"compares how the policy and the reference score the *prompt*. For prompt {g + 1}, each token "
      "x_t after the first has log p_ref (the cache) and log p_θ (the rollout policy, i.e. the weights "
      f"before this update, scored by {code('train.score_old', 'train.py')}: the same forward of "
      f"{code('train.score', 'train.py')} that scores the responses gives the prompt's log-probs), "
      "δ = log p_ref − log p_θ and the k3 estimate e^δ − 1 − δ ≥ 0 (clamped at 10). The prompt's "
      "Query-KL is the mean over its tokens. (Tokens the model is sure of, log p near 0, show δ and "
      "k3 at float32's resolution: a log-prob is resolved to ~1e-6 and k3 to ~1e-7, so values of "
      "that size, a k3 even below 0, are rounding, not learning.)",
      "",
      "| t | token | log p_ref | log p_θ | δ | k3 |",
      "|---|---|---|---|---|---|")
    for j, (i, r, c, k) in enumerate(zip(ids[mask].tolist(), ref, cur, k3)):
        d(f"| {j + 2} | {token_text(v.tok, i)} | {d.num(r, LOGP)} | {d.num(c, LOGP)} | "
          f"{d.num(r - c, LOGP)} | {d.num(k, K3)} |")
    top = k3.argsort(descending=True)[:3].tolist()
    d("",
      f"Mean over its {int(mask.sum())} tokens: Query-KL(q) = {d.num(k3.mean(), K3)}. The largest k3 are at "
      + ", ".join(f"{token_text(v.tok, ids[mask][j])} ({d.num(k3[j], K3)})" for j in top)
      + ": the tokens that contribute most to this prompt's Query-KL (k3 grows with |δ|, faster for "
      "δ > 0: where the policy has made a token less likely than the reference did). "
      "In the loss, ERPO averages the prompts' Query-KL over the batch's rows and multiplies it by α.",
      "",
      "![k3 per token of the prompt and of one response](img/walkthrough_kl_tokens.png)",
      "")
    figures = {"prompt": ([plain_token(v.tok, i) for i in ids[mask].tolist()], k3.tolist())}
    r = v.followed_response
    rids, rmask = v.response_tokens(r)
    old, refr = b.scores.old[r][rmask], b.scores.ref[r][rmask]
    k3r = losses.policy_kl(old, refr, "k3", clamp=losses.ALGOS["grpo"].kl_clamp)
    d(f"**Policy-KL** ({cite('§8.1')}; {code('losses.policy_kl', 'losses.py')}) is GRPO's: the same "
      f"k3, over the *response* tokens, between the policy and the reference model. Response "
      f"{r - row + 1} to prompt {g + 1} (reward {t.collected.rewards[r]:g}):",
      "",
      "| t | token | log π_ref | log π_θ | δ | k3 |",
      "|---|---|---|---|---|---|")
    for j, (i, rr, c, k) in enumerate(zip(rids[rmask].tolist(), refr, old, k3r)):
        d(f"| {j + 1} | {token_text(v.tok, i)} | {d.num(rr, LOGP)} | {d.num(c, LOGP)} | "
          f"{d.num(rr - c, LOGP)} | {d.num(k, K3)} |")
    d("",
      f"Mean over its {int(rmask.sum())} tokens: {d.num(k3r.mean(), K3)}. GRPO's loss adds β = "
      f"{losses.ALGOS['grpo'].beta:g} times the mean of such k3 values over all "
      f"{int(b.resp_mask.sum())} response tokens of the batch (the `policy_kl` of the last section); "
      "ERPO's has no Policy-KL (train.py still logs it, as `policy_kl`, to compare the runs).",
      "")
    figures["response"] = ([plain_token(v.tok, i) for i in rids[rmask].tolist()], k3r.tolist())
    return figures


def loss_section(d, v):
    e, g_ = v.t.terms["erpo"], v.t.terms["grpo"]
    a, n = v.run.args, v.t.counts
    d("## 5. The loss, term by term: GRPO and ERPO on the same batch",
      "",
      f"{code('train.ppo_update', 'train.py')} takes one optimizer step per update batch (here all "
      f"{len(v.t.batch.valid)} rows), and {code('train.accumulate_gradient', 'train.py')} scores each of "
      f"its micro-batches (here one, rows {v.t.mb.start + 1}-{v.t.mb.stop}) with "
      f"{code('train.score', 'train.py')} and hands the log-probs to {code('losses.rl_loss', 'losses.py')}, "
      f"which builds the loss from three kinds of term ({cite('§8.3')}, {cite('§8.5')}): the PPO-clipped "
      f"policy gradient PG, averaged over the update batch's N = {int(n['num_tokens'])} response tokens "
      "(token mean; `ppo_update` counts them over the whole update batch, so every micro-batch divides "
      f"by the same N); GRPO's β · Policy-KL over the same tokens; ERPO's α · Query-KL, averaged over "
      f"the update batch's {int(n['num_seqs'])} rows. The weights "
      "are the rollout policy's, so every ratio r_t = π_θ(o_t)/π_old(o_t) is 1 and nothing is clipped: "
      "PG = −(1/N) Σ_i Σ_t A_i w_i r_t has the value −(1/N) Σ_i A_i w_i |o_i| and the gradient "
      "−(1/N) Σ_i A_i w_i Σ_t ∇log π_θ(o_t). Each term's gradient was taken alone (autograd), then "
      "the sum's:",
      "",
      "| algorithm | term | value | gradient norm |",
      "|---|---|---|---|")
    names = {"pg": "PG(A · w)", "query_kl": f"α · Query-KL (α = {v.run.algo.alpha:g})",
             "policy_kl": f"β · Policy-KL (β = {losses.ALGOS['grpo'].beta:g})"}
    for algo, terms in (("ERPO", e), ("GRPO", g_)):
        for n, val in terms.values.items():
            label = "PG(A)" if (algo, n) == ("GRPO", "pg") else names[n]
            d(f"| {algo} | {label} | {d.num(val, K3 * 0.01)} | {d.num(terms.grads[n].norm())} |")
        total = torch.stack(list(terms.grads.values())).sum(0)
        d(f"| {algo} | **loss** | **{d.num(sum(terms.values.values()))}** | **{d.num(total.norm())}** |")
    ge, gg = torch.stack(list(e.grads.values())).sum(0), torch.stack(list(g_.grads.values())).sum(0)
    d("",
      f"`losses.rl_loss` on the same inputs gives {d.num(e.rl_loss)} (ERPO) and {d.num(g_.rl_loss)} "
      "(GRPO): the terms add up to the loss the code trains on.",
      "",
      "How the gradients point (cosine similarity):",
      "",
      f"- ERPO's PG(A · w) and its α · Query-KL: {d.num(cosine(e.grads['pg'], e.grads['query_kl']))}; "
      f"the Query-KL gradient is {d.num(e.grads['query_kl'].norm() / e.grads['pg'].norm())} of the "
      "PG's in norm. Its gradient is Σ_t (1 − e^δ_t) ∇log p_θ(x_t) over the prompt tokens, so it "
      "is as large as the drift δ: small while the policy is near the reference.",
      f"- GRPO's PG(A) and its β · Policy-KL: {d.num(cosine(g_.grads['pg'], g_.grads['policy_kl']))}.",
      "- PG(A · w) and PG(A), what the query weights change: "
      f"{d.num(cosine(e.grads['pg'], g_.grads['pg']))}.",
      f"- ERPO's whole gradient and GRPO's: {d.num(cosine(ge, gg))}.",
      "",
      f"`--grad-clip {a.grad_clip:g}` then scales the gradient to norm ≤ {a.grad_clip:g} "
      f"(torch's `clip_grad_norm_`, in `train.ppo_update`): ERPO's {d.num(ge.norm())} "
      f"{'is scaled down' if ge.norm() > a.grad_clip else 'is left as it is'}, before AdamW's step.",
      "")


def shares_section(d, v):
    """Each prompt's part of each term of §5, and the followed prompt's Query-KL part worked out."""
    e, g_, num_seqs = v.t.terms["erpo"], v.t.terms["grpo"], int(v.t.counts["num_seqs"])
    d("Each prompt's part of each term, from the rows of its G responses (the parts add up to the "
      "terms above), and in brackets the gradient norm of that part alone (norms do not add up: the "
      "parts' gradients point in different directions):",
      "",
      "| prompt | w(q) | ERPO PG(A · w) | ERPO α · Query-KL | GRPO PG(A) | GRPO β · Policy-KL |",
      "|---|---|---|---|---|---|")

    def part(terms, name, k):
        floor = {"pg": 1e-7, "query_kl": v.run.algo.alpha * K3, "policy_kl": losses.ALGOS["grpo"].beta * K3}
        return f"{d.num(terms.shares[name][k], floor[name])} ({d.num(terms.share_norms[name][k])})"
    for k in range(v.groups):
        d(f"| {k + 1} | {d.num(v.t.batch.weights[k * v.G], WEIGHT)} | {part(e, 'pg', k)} | "
          f"{part(e, 'query_kl', k)} | {part(g_, 'pg', k)} | {part(g_, 'policy_kl', k)} |")
    f, qkl_f = v.followed, e.query_kl[v.followed]
    d("",
      "A group's PG part has the value −Σ_i A_i w_i |o_i| / N, so it is 0 when the group's responses "
      "have the same length (a group's advantages sum to 0; printed up to float32 rounding): the *value* "
      "of the PG term says little, "
      "its gradient is what moves the policy, and that comes from every group with a signal. A group "
      "without signal has no PG part at all, but it has a Query-KL part and a Policy-KL part: the "
      "regularizers act on every prompt and response, rewarded or not. Prompt "
      f"{f + 1}, followed since §1: its weight {d.num(v.t.batch.weights[f * v.G], WEIGHT)} scaled its "
      f"responses' advantages (§3); its Query-KL {d.num(qkl_f, K3)} (§4) enters once per row, so its "
      f"part of α · Query-KL is α · G · Query-KL(q) / {num_seqs} = "
      f"{v.run.algo.alpha:g} · {v.G} · {d.num(qkl_f, K3)} / {num_seqs} = "
      f"{d.num(e.shares['query_kl'][f], K3 * 0.01)}.",
      "")


def proposition_section(d, v):
    e, p = v.t.terms["erpo"], v.t.prop1
    qs, qw = p["sampled"]["query_kl"], p["swapped"]["query_kl"]
    d("### Proposition 1, made visible",
      "",
      f"The Query-KL gradient flows only through the prompts' log-likelihoods l_θ(q) ({cite('§2')}): "
      "the responses never enter it. To see it, the two ERPO terms' gradients were recomputed "
      f"with {code('train.score', 'train.py')}'s forward over [prompt | response] rows (the prompt's "
      "log-probs come out of the same forward as the response's), once with the sampled responses and "
      f"once with each prompt given another prompt's responses (rows shifted by G = {v.G}):",
      "",
      "| term | gradient norm g, sampled responses | g′, responses swapped | ‖g − g′‖ / ‖g‖ |",
      "|---|---|---|---|",
      f"| α · Query-KL | {d.num(qs.norm())} | {d.num(qw.norm())} | {d.num(rel_diff(qs, qw), ROUNDING)} |",
      f"| PG(A · w) | {d.num(p['sampled']['pg'].norm())} | {d.num(p['swapped']['pg'].norm())} | "
      f"{d.num(rel_diff(p['sampled']['pg'], p['swapped']['pg']))} |",
      "",
      "The Query-KL gradient is the same (within float32 rounding; the driver requires ≤ 1e-6) whatever "
      "the responses, the policy gradient is not. With the sampled responses this is the forward "
      "training runs (`train.accumulate_gradient` calls `train.score` on the same rows): its Query-KL "
      f"gradient and §5's differ by {d.num(rel_diff(qs, e.grads['query_kl']), ROUNDING)} (relative): "
      "the same computation.",
      "")


def after_section(d, v) -> dict:
    t, b, G = v.t, v.t.batch, v.G
    old_r, old_p = v.seq_logp(b.scores.old, b.resp_mask), v.seq_logp(b.scores.prompt, b.prompt_mask)
    after = {k: (v.seq_logp(r, b.resp_mask) - old_r, v.seq_logp(p, b.prompt_mask) - old_p)
             for k, (r, p) in t.after.items()}
    d("## 6. After the optimizer step",
      "",
      f"{code('train.ppo_update', 'train.py')} ({cite('§5')}) applied ERPO's gradient (AdamW, lr "
      f"{v.run.args.lr:g}). From the same weights, GRPO's update was run on the same batch too. The "
      "change of each sampled response's log-likelihood log π(o|q) = Σ_t log π(o_t | q, o_<t):",
      "",
      "| prompt | response | reward | A · w (ERPO) | Δ log π(o\\|q), ERPO | A (GRPO) "
      "| Δ log π(o\\|q), GRPO |",
      "|---|---|---|---|---|---|---|")
    for i in range(len(old_r)):
        d(f"| {i // G + 1} | {i % G + 1} | {t.collected.rewards[i]:g} | "
          f"{d.num(b.adv[i] * b.weights[i], WEIGHT)} | "
          f"{d.num(after['erpo'][0][i], SEQ)} | {d.num(b.adv[i])} | {d.num(after['grpo'][0][i], SEQ)} |")
    qkl = {k: losses.query_kl(p, b.qref, b.prompt_mask)[::G] for k, (_, p) in t.after.items()}
    before = losses.query_kl(b.scores.prompt, b.qref, b.prompt_mask)[::G]
    signed = b.adv != 0
    agree = {k: int(((after[k][0] > 0) == (b.adv > 0))[signed].sum()) for k in after}
    silent = ", ".join(str(g + 1) for g in range(v.groups) if not bool(signed[g * G:(g + 1) * G].any()))
    d("",
      f"Of the {int(signed.sum())} responses with A ≠ 0, ERPO's step moved {agree['erpo']} in the "
      f"direction of their advantage (up if A > 0, down if A < 0) and GRPO's {agree['grpo']}. "
      + (f"The responses to prompt {silent} (A = 0) moved too: no PG term pushes them (under GRPO "
         "β · Policy-KL pulls them toward the reference, under ERPO nothing acts on them), but they "
         "share every parameter with the rest. " if silent else "")
      + "And the prompts, whose log-likelihood l_θ(q) (the rollout policy's, where §3's s(q) is the "
      "reference's) only ERPO's Query-KL term targets:",
      "",
      "| prompt | l_θ(q) before | Δ l(q), ERPO | Δ l(q), GRPO | Query-KL before | after ERPO "
      "| after GRPO |",
      "|---|---|---|---|---|---|---|")
    for k in range(v.groups):
        d(f"| {k + 1} | {d.num(old_p[k * G], SEQ)} | {d.num(after['erpo'][1][k * G], SEQ)} | "
          f"{d.num(after['grpo'][1][k * G], SEQ)} | {d.num(before[k], K3)} | {d.num(qkl['erpo'][k], K3)} | "
          f"{d.num(qkl['grpo'][k], K3)} |")
    rise = {k: qkl[k] - before for k in qkl}
    rose = all(bool((r > 0).all()) for r in rise.values())
    how = ("by less than GRPO's on every prompt" if bool((rise["erpo"] < rise["grpo"]).all()) else
           "by more than GRPO's on every prompt" if bool((rise["erpo"] > rise["grpo"]).all()) else
           "by more than GRPO's on some prompts and less on others")
    d("",
      (f"Both updates raised every prompt's Query-KL, ERPO's {how}: at this point α · Query-KL's "
       "gradient is a small fraction of the policy gradient's (§5), too small to hold the prompts in "
       "place against it in one step." if rose else
       f"The updates moved the prompts' Query-KL, ERPO's {how}.")
      + " Its effect builds up over a run: [\"Does it reproduce in miniature?\"]"
      "(studies.md#does-it-reproduce-in-miniature) in docs/studies.md compares the Query-KL of whole GRPO "
      "and ERPO runs.",
      "",
      "![change of each response's log-likelihood against the advantage the loss gave it]"
      "(img/walkthrough_update.png)",
      "")
    return {"update": {k: (after[k][0].tolist(), (b.adv * (b.weights if k == "erpo" else 1)).tolist())
                       for k in after}}


def metrics_section(d, v, setup):
    m = setup["metrics"]
    d("## The step in metrics.jsonl",
      "",
      "What `train.py` logs for this step (`experience.step_metrics`), recomputed from the tensors above: "
      f"`reward` the mean of the {len(v.t.collected.rewards)} rewards, `query_kl` the rows' mean "
      "Query-KL of the rollout policy "
      "against the reference (§4's table, every prompt), `policy_kl` the token mean of §4's second "
      "table over every response, `loss` and `grad_norm` ERPO's from §5:",
      "",
      "| reward | query_kl | policy_kl | loss | grad_norm |",
      "|---|---|---|---|---|",
      "| " + " | ".join(d.num(m[k], K3 if k.endswith("_kl") else 0.0) for k in setup["metric_keys"]) + " |",
      "",
      f"They are line {setup['traced']} of the `metrics.jsonl` that `train.py` writes with the same "
      f"arguments, and its line {setup['traced'] + 1} is the step the walkthrough ran next, after "
      "putting ERPO's weights back (`tests/test_walkthrough.py` runs it and compares both):",
      "",
      f"    head -{setup['subset']} data/tinymath/train.jsonl > /tmp/subset.jsonl",
      "    " + setup["command"],
      "",
      "Regenerate this page (about 10 s on 2 CPU cores) with `python -m study.walkthrough --out docs` "
      "(without `--out`, into runs/walkthrough/).")


# ----------------------------------------------------------------------------------------------
# Figures


def figures(data, folder):
    """walkthrough_kl_tokens.png (k3 per token of the prompt and of the response) and
    walkthrough_update.png (change of each response's log-likelihood against its advantage)."""
    from plumbing.plots import _plt
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.2))
    for ax, (key, title) in zip(axes, (("prompt", "Query-KL: k3 per prompt token"),
                                       ("response", "Policy-KL: k3 per response token"))):
        labels, values = data[key]
        ax.bar(range(len(values)), values, color="tab:blue" if key == "prompt" else "tab:orange")
        ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("k3")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "walkthrough_kl_tokens.png"), dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, color in (("erpo", "tab:blue"), ("grpo", "tab:red")):
        delta, adv = data["update"][key]
        ax.scatter(adv, delta, s=18, color=color, label=f"{key.upper()} (x: A{' · w' * (key == 'erpo')})",
                   alpha=0.8)
    ax.axhline(0, color="gray", lw=0.5)
    ax.axvline(0, color="gray", lw=0.5)
    ax.set_xlabel("advantage the loss used")
    ax.set_ylabel("Δ log π(o|q) after the step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "walkthrough_update.png"), dpi=90)
    plt.close(fig)
