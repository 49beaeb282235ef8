"""The GRPO family's implicit per-prompt weight, beside ERPO's explicit query weight w(q).

    python -m labs.reweighting                      # -> runs/reweighting/reweighting.png and .json
    python -m labs.reweighting --out labs/results   # the same, and REWRITES the committed copy

The definition. With binary rewards, every group-relative estimator of losses.group_advantages
("grpo", "drgrpo", "rloo", "maxrl") gives a group advantages proportional to its centred rewards:
A_i = c(q) (R_i - p), p = the group's success rate (its mean reward). The group's policy-gradient
term is then c(q) * sum_i (R_i - p) grad log pi(o_i): REINFORCE with the group-mean baseline
(Dr.GRPO, c = 1), scaled by c(q), the prompt's EFFECTIVE WEIGHT. `effective_weight` reads c off the
code's own estimator on a constructed group of G rewards (c = sum A (R - p) / sum (R - p)^2, the
exact ratio when A is proportional, which it checks); a group whose rewards are all equal
(p = 0 or 1) has R_i - p = 0 and A = 0: weight 0 in every estimator. Per response, before the loss
aggregation (token-mean etc.) and the PPO clip.

For G responses (GRPO's std is the unbiased, Bessel one of losses.py: sigma^2 = G/(G-1) p(1-p)):

    grpo     1 / (sigma + eps)         drgrpo   1           rloo   G / (G - 1)
    maxrl    1 / (p + eps), p > 0      dapo     grpo's, and 0 where losses.nonconstant_groups drops the
                                                group (p = 0 or 1; its gradient is 0 anyway: DAPO's
                                                filter changes what ELSE fills the batch, not this)
    erpo     its advantage's (grpo) times w(q) = clip(s_bar / s_q, 0, 2) (losses.query_weights, the
             paper's version: s_q the query's reference NLL, s_bar the training set's mean)

The batch: G = 8 responses to each of 9 prompts with 0..8 successes, and hand-picked query NLLs (in
nats) over the tiny world's range (20 to 46 nats, s_bar = 30.3: docs/teaching.md, part C) plus one
short, typical query (12 nats) whose weight the clip caps at 2. Output: reweighting.json (every
plotted number) and reweighting.png, drawn from the JSON by `plot`.
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import losses  # noqa: E402  (the repo's estimators, from its root)

G = 8
NLL = [33.0, 20.0, 46.0, 12.0, 27.0, 41.0, 24.0, 37.0, 30.3]   # the query NLL of the prompt with k successes
MEAN_NLL = 30.3
ESTIMATORS = ("grpo", "drgrpo", "rloo", "maxrl", "dapo", "erpo")


def binary_group(successes, group_size=G) -> torch.Tensor:
    """G binary rewards with `successes` ones: the group of a prompt with success rate successes / G."""
    if not 0 <= successes <= group_size:
        raise ValueError(f"need 0 <= successes <= group_size, got {successes} of {group_size}")
    return torch.tensor([1.0] * successes + [0.0] * (group_size - successes))


def read_weight(rewards, advantages) -> float:
    """c with A_i = c (R_i - p) over one group (p = mean R); 0 for an all-equal group. Raises if A is
    not proportional to the centred rewards (then no single per-prompt weight describes it)."""
    centred = rewards.double() - rewards.double().mean()
    A = advantages.double()
    norm = float((centred * centred).sum())
    if norm < 1e-12:
        if A.abs().max() > 0:
            raise ValueError(f"an all-equal group with nonzero advantages {A.tolist()}")
        return 0.0
    c = float((A * centred).sum()) / norm
    if (A - c * centred).abs().max() > 1e-5 * max(1.0, abs(c)):
        raise ValueError(f"advantages {A.tolist()} are not proportional to R - p = {centred.tolist()}")
    return c


def effective_weight(kind, successes, group_size=G, nll=None, mean_nll=MEAN_NLL) -> float:
    """The effective per-prompt weight of estimator `kind` (ESTIMATORS) for a prompt with `successes`
    of `group_size` correct responses, read off the code's own functions. "erpo" needs the query's
    reference NLL `nll` (and s_bar = `mean_nll`)."""
    if kind not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {kind!r}")
    r = binary_group(successes, group_size)
    if kind in ("dapo", "erpo"):
        algo = losses.make_algo(kind)
        c = read_weight(r, losses.group_advantages(r, group_size, algo.adv, algo.adv_eps))
        if kind == "dapo":
            return c * float(losses.nonconstant_groups(r, group_size)[0]) if algo.dynamic_sampling else c
        if nll is None:
            raise ValueError("erpo's weight needs the query's reference NLL (nll=...)")
        return c * query_weight(nll, mean_nll, algo.weight_clip)
    eps = losses.make_algo("grpo").adv_eps
    return read_weight(r, losses.group_advantages(r, group_size, kind, eps))


def query_weight(nll, mean_nll=MEAN_NLL, clip=None) -> float:
    """ERPO's w(q) of one query, from losses.query_weights (clip: the erpo algorithm's by default)."""
    clip = losses.make_algo("erpo").weight_clip if clip is None else clip
    return float(losses.query_weights(torch.tensor([float(nll)]), mean_nll, clip)[0])


def record(group_size=G, nll=NLL, mean_nll=MEAN_NLL) -> dict:
    """The JSON: the batch (success rates, NLLs) and every estimator's weight per prompt, the ERPO
    band (GRPO's weight times the batch's smallest and largest w) and the w(s) curve."""
    ks = list(range(group_size + 1))
    if len(nll) != len(ks):
        raise ValueError(f"need one NLL per prompt ({len(ks)}), got {len(nll)}")
    weights = {kind: [effective_weight(kind, k, group_size, s, mean_nll) for k, s in zip(ks, nll)]
               for kind in ESTIMATORS}
    w = [query_weight(s, mean_nll) for s in nll]
    grid = [5.0 + 0.5 * i for i in range(91)]
    return {"command": "python -m labs.reweighting", "group_size": group_size, "successes": ks,
            "p": [k / group_size for k in ks], "nll": list(nll), "mean_nll": mean_nll,
            "weight_clip": list(losses.make_algo("erpo").weight_clip), "query_weight": w,
            "weights": weights,
            "erpo_band": {"low": [c * min(w) for c in weights["grpo"]],
                          "high": [c * max(w) for c in weights["grpo"]]},
            "w_curve": {"nll": grid, "w": [query_weight(s, mean_nll) for s in grid]}}


STYLE = {"grpo": ("C0", "o", "GRPO: 1/(σ+ε), Bessel σ"), "drgrpo": ("C1", "s", "Dr.GRPO: 1"),
         "rloo": ("C2", "^", "RLOO: G/(G−1)"), "maxrl": ("C3", "D", "MaxRL: 1/p"),
         "dapo": ("C4", "x", "DAPO: GRPO's, filtered at p∈{0,1}"), "erpo": ("C5", "*", "ERPO: GRPO's × w(q)")}


def plot(rec, path):
    """Left: weight vs p (log y; the 0s of p = 0 and 1 sit on the bottom edge). Right: w(q) vs NLL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    p, floor = rec["p"], 0.3
    inner = [i for i, k in enumerate(rec["successes"]) if 0 < k < rec["group_size"]]
    edges = [i for i in range(len(p)) if i not in inner]
    ax.fill_between([p[i] for i in inner], [rec["erpo_band"]["low"][i] for i in inner],
                    [rec["erpo_band"]["high"][i] for i in inner], color="C5", alpha=0.15,
                    label="ERPO band: GRPO's × [min w, max w] of the batch")
    for kind in ESTIMATORS:
        color, marker, label = STYLE[kind]
        ys = rec["weights"][kind]
        ax.plot([p[i] for i in inner], [ys[i] for i in inner], color=color, marker=marker, lw=1.0,
                ms=9 if kind == "erpo" else 6, label=label, ls=":" if kind == "erpo" else "-")
        ax.plot([p[i] for i in edges], [max(ys[i], floor) for i in edges], color=color, marker=marker,
                ls="none", ms=6)
    ax.set_yscale("log")
    ax.set_ylim(floor * 0.8, 80)
    ax.set_xlabel(f"success rate p of the prompt ({rec['group_size']} responses, binary rewards)")
    ax.set_ylabel("effective weight c(q):  A_i = c(q)(R_i − p)")
    ax.set_title("Per-prompt weight vs REINFORCE with the group-mean baseline\n"
                 f"(p = 0, 1: weight 0 in all, drawn at {floor})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    bx.plot(rec["w_curve"]["nll"], rec["w_curve"]["w"], color="C5", lw=1.2,
            label=f"w = clip(s̄/s, {rec['weight_clip'][0]:g}, {rec['weight_clip'][1]:g}), "
                  f"s̄ = {rec['mean_nll']}")
    bx.scatter(rec["nll"], rec["query_weight"], color="C5", marker="*", s=90, zorder=3,
               label="the batch's queries")
    for s, w, k in zip(rec["nll"], rec["query_weight"], rec["successes"]):
        bx.annotate(f"p={k}/{rec['group_size']}", (s, w), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    bx.axvline(rec["mean_nll"], color="gray", lw=0.8, ls="--")
    bx.set_xlabel("query's reference NLL s (nats)")
    bx.set_ylabel("ERPO's query weight w(q)")
    bx.set_title("ERPO's explicit w(q) of the query's NLL", fontsize=10)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7.5)
    fig.suptitle("The GRPO family's implicit per-prompt weight, and ERPO's explicit w(q) "
                 "(python -m labs.reweighting)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def table(rec) -> str:
    """The lines the command prints: every estimator's weight per prompt."""
    lines = [f"{'p':>5} {'NLL':>6} {'w(q)':>6} " + " ".join(f"{k:>8}" for k in ESTIMATORS)]
    for i, k in enumerate(rec["successes"]):
        lines.append(f"{k}/{rec['group_size']:<3} {rec['nll'][i]:6.1f} {rec['query_weight'][i]:6.3f} "
                     + " ".join(f"{rec['weights'][e][i]:8.3f}" for e in ESTIMATORS))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "reweighting"),
                   help="folder of reweighting.json and reweighting.png (default runs/reweighting; "
                        "labs/results holds the committed ones)")
    a = p.parse_args(argv)
    rec = record()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "reweighting.json"), "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    print(f"wrote {plot(rec, os.path.join(a.out, 'reweighting.png'))} and reweighting.json")
    print(table(rec))


if __name__ == "__main__":
    main()
