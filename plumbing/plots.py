"""Figures: accuracy vs temperature (the paper's Figs 5-6), Query-KL / Policy-KL and train vs
held-out accuracy over training steps (Figs 1 and 4), and the query/response NLL scatter (App. D).
Every figure has a title; an accuracy over n problems is drawn with its 95% Wilson interval.

matplotlib is imported on first use (Agg backend: files only, no display needed).
"""

import math
import os


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def wilson(p, n, z=1.96):
    """95% Wilson score interval (lo, hi) of a proportion p observed over n trials; (p, p) when n is
    unknown (None or 0). For a mean of per-problem accuracies in [0, 1] (avg@n with n > 1 samples per
    problem) over n problems it is conservative: such a mean's variance is at most p(1 - p) / n."""
    if not n:
        return p, p
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def _error_bars(values, ns, scale=100):
    """matplotlib yerr (2 x len) of Wilson intervals of `values` over `ns` trials, times `scale`."""
    lo_hi = [wilson(v, n) for v, n in zip(values, ns)]
    return [[scale * (v - lo) for v, (lo, _) in zip(values, lo_hi)],
            [scale * (hi - v) for v, (_, hi) in zip(values, lo_hi)]]


def short_labels(names):
    """Display names: drop the path prefix all names share (runs/grpo/final -> grpo/final)."""
    if len(names) < 2:
        return {m: m for m in names}
    parts = [os.path.normpath(m).split(os.sep) for m in names]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    return {m: os.sep.join(p[common:]) for m, p in zip(names, parts)}


def accuracy_vs_temperature(summary, path, metric=None, avg_key="Avg."):
    """One panel per benchmark (and the average), one line per model; `summary` as built by
    evaluate.summarize."""
    plt = _plt()
    metric = metric or f"avg@{summary['n']}"
    benches = summary["benchmarks"] + ([avg_key] if len(summary["benchmarks"]) > 1 else [])
    label = short_labels(summary["models"])
    cols = min(3, len(benches))
    rows = math.ceil(len(benches) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, b in zip(axes.flat, benches):
        for m in summary["models"]:
            by_t = summary["results"][m].get(b, {}).get("by_temperature", {})
            ts = sorted(by_t, key=float)
            ys = [by_t[t][metric] for t in ts]
            yerr = _error_bars(ys, [by_t[t].get("num_problems") for t in ts]) if b != avg_key else None
            ax.errorbar([float(t) for t in ts], [100 * y for y in ys], yerr=yerr, marker="o", ms=3,
                        capsize=2, label=label[m])
        ax.set_title(b)
        ax.set_xlabel("temperature")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(benches):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{metric} vs sampling temperature (bars: 95% Wilson interval over the problems; "
                 f"{avg_key}: mean over benchmarks)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def series(rows, key):
    """(steps, values) of the metric rows that logged `key`."""
    pts = [(r["step"], r[key]) for r in rows if "step" in r and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _save_step_plot(fig, ax, ylabel, path, title):
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# A log axis has no place for 0 (a KL at step 0, a term the loss lacks) or below (rounding): such
# values are drawn as hollow triangles on the axis' bottom edge, and the y label says so.
NONPOSITIVE = "\u25bd on the bottom edge: <= 0"


def plot_log(ax, x, y, fmt, color, label, **kw):
    """Draw one series on a log-scaled axis: its positive values as `fmt` (a gap where a value is not
    positive), the others as triangles at the bottom edge (x in data, y in axes units: they move no
    limit). -> how many were not positive."""
    pos = [v if v > 0 else float("nan") for v in y]
    low = [xi for xi, v in zip(x, y) if not v > 0]
    if len(low) < len(y):
        ax.plot(x, pos, fmt, color=color, label=label, **kw)
    if low:
        ax.plot(low, [0.0] * len(low), "v", color=color, mfc="none", ms=6, clip_on=False,
                transform=ax.get_xaxis_transform(),
                label=None if len(low) < len(y) else f"{label} (all <= 0)")
    return len(low)


def log_ylabel(ax, ylabel, nonpositive: int):
    """Log scale, and the y label saying where the values that have no place on it went."""
    ax.set_yscale("log")
    return f"{ylabel} (log; {NONPOSITIVE})" if nonpositive else f"{ylabel} (log)"


def kl_over_steps(runs: dict, path):
    """runs: {label: metric rows}. Query-KL (solid) and Policy-KL (dashed) per run, log scale:
    the KLs of different runs and kinds differ by orders of magnitude; the exact zeros (policy ==
    reference) are triangles on the bottom edge (plot_log), the y label says so. None if nothing
    to plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    low, drawn = 0, set()
    for i, (name, rows) in enumerate(runs.items()):
        for key, style, kind in (("query_kl", "-", "Query-KL"), ("policy_kl", "--", "Policy-KL")):
            x, y = series(rows, key)
            if x:
                low += plot_log(ax, x, y, style, f"C{i}", f"{name} {kind}")
                drawn.add(kind)
    out = None
    if ax.lines:                    # the title names what is drawn: ERPO logs no Policy-KL unless asked
        only = "Query-KL" if "Policy-KL" not in drawn else "Policy-KL"
        missing = ("Policy-KL: --measure-policy-kl true logs ERPO's" if only == "Query-KL" else "Query-KL")
        title = ("Query-KL (solid) and Policy-KL (dashed)" if len(drawn) == 2 else f"{only} (no {missing})")
        out = _save_step_plot(fig, ax, log_ylabel(ax, "KL", low), path, title + " per training step")
    plt.close(fig)
    return out


def train_vs_heldout(runs: dict, path, problems: dict | None = None):
    """runs: {label: metric rows}. Training accuracy (line) and held-out accuracy (markers), the
    latter with its 95% Wilson interval where `problems` ({label: problems in the held-out set})
    says over how many problems it was measured."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    problems = problems or {}
    for i, (name, rows) in enumerate(runs.items()):
        x, y = series(rows, "train_acc")
        if x:
            ax.plot(x, y, "-", color=f"C{i}", alpha=0.6, label=f"{name} train")
        x, y = series(rows, "eval_acc")
        if x:
            n = problems.get(name)
            ax.errorbar(x, y, yerr=_error_bars(y, [n] * len(y), scale=1) if n else None, fmt="o--",
                        color=f"C{i}", ms=4, capsize=2,
                        label=f"{name} held-out" + (f" ({n} problems)" if n else ""))
    title = "Training vs held-out accuracy" + \
        (" (bars: 95% Wilson interval over the held-out problems)" if problems else "")
    out = _save_step_plot(fig, ax, "accuracy", path, title) if ax.lines or ax.containers else None
    plt.close(fig)
    return out


def nll_scatter(groups: dict, path):
    """groups: {label: (query NLLs, response NLLs)} -> one scatter plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 4))
    for name, (xs, ys) in groups.items():
        ax.scatter(xs, ys, s=6, alpha=0.5, label=name)
    ax.set_title("Query NLL vs response NLL, one point per problem (r: Pearson, 95% interval)", fontsize=9)
    ax.set_xlabel("query NLL (mean per token)")
    ax.set_ylabel("response NLL (mean per token)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
