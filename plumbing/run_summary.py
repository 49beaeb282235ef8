"""What a run prints at its end (`summary`, train.py): held-out accuracy first -> last per set, the final
KLs and entropy, where the run folder and checkpoint are, and the `next:` commands -- each one that
works as pasted (the plots, a comparison with a run beside this one, evaluations sized like the run),
or, where it needs a folder only the user knows, a comment that says so.
"""

import glob
import os

from plumbing import checkpoints
from plumbing import run_dir            # (its readers, used when a summary is made)


def summary(out, wall_s, eval_sets=(), template="plain", save_every=1) -> str:
    """What changed and where things are, from metrics.jsonl (so a resumed run reports the whole
    run): held-out accuracy first -> last per set, the final KLs and entropy, and what to run next
    (`save_every`: the run's --save-every, one reason for no checkpoint)."""
    rows = run_dir.read_jsonl(os.path.join(out, "metrics.jsonl"))
    evals = [r for r in rows if "eval_acc" in r]
    last = next((r for r in reversed(rows) if "query_kl" in r or "sft_loss" in r), {})
    lines = [f"done: {len(rows) and rows[-1].get('step', 0)} steps in {wall_s / 60:.1f} min (this process)"]
    for name in eval_sets:
        key = f"eval_acc/{name}"
        pts = [r for r in evals if key in r]
        if pts:
            lines.append(f"  held-out {name:12s} {100 * pts[0][key]:5.1f}% (step {pts[0]['step']}) -> "
                         f"{100 * pts[-1][key]:5.1f}% (step {pts[-1]['step']})")
    finals = [f"{k} {last[k]:.4g}" for k in ("query_kl", "policy_kl", "entropy", "sft_loss") if k in last]
    if finals:
        lines.append(f"  final (step {last.get('step')}): " + ", ".join(finals))
    skipped = sum(r.get("skipped_steps", 0) for r in rows)
    if skipped:
        lines.append(f"  skipped optimizer steps (non-finite loss or gradient): {skipped}")
    ckpt, saved = checkpoints.checkpoint_dir(out), sorted(glob.glob(os.path.join(out, "sft-*")))
    why = "--save-every 0" if not save_every else \
        "no step was trained" if not any(r.get("step", 0) > 0 for r in rows) else "none was saved"
    where = f", checkpoint {ckpt}/" if checkpoints.has_checkpoint(out) else \
        (f", SFT exports {saved[0]} ... {saved[-1]}" if saved else f", no checkpoint ({why})")
    lines += [f"  run folder {out}/ (metrics.jsonl, config.json){where}",
              "next:",
              f"  python analysis.py runs {out} --out {out}/plots        # KL and train vs held-out curves",
              compare_command(out)]
    if checkpoints.has_checkpoint(out):
        final = checkpoints.is_sharded(out) or checkpoints.is_lora(out)   # shards, adapters: the export
        ckpt = os.path.join(out, "hf") if final and os.path.isdir(os.path.join(out, "hf")) else ckpt
        lines += evaluate_commands(out, ckpt, eval_sets, template)
    return "\n".join(lines)


def compare_command(out) -> str:
    """The `next:` comparison: with a run in a folder beside this one (runs/grpo beside runs/erpo), a
    command that works as pasted; without one, a comment line whose placeholder is plainly one
    (`compare OTHER_RUN` failed when pasted as is)."""
    note = "# a table: held-out, KLs, entropy, B - A"
    other = next(iter(runs_beside(out)), None)
    if other:
        return f"  python analysis.py compare {other} {out}        {note}"
    return f"  # with a run to compare: python analysis.py compare <another run folder> {out}        {note}"


def runs_beside(out) -> list[str]:
    """The run folders (with a metrics.jsonl) beside `out`, in its parent folder, by name."""
    parent = os.path.dirname(os.path.normpath(out))
    names = sorted(os.listdir(parent or "."))
    folders = [os.path.join(parent, n) for n in names if os.path.join(parent, n) != os.path.normpath(out)]
    return [f for f in folders if os.path.isfile(os.path.join(f, "metrics.jsonl"))]


# What `next:` offers after a run: the run's own held-out check (quick), then a sweep sized like the
# run (a few more samples and temperatures on the same problems, minutes to an hour on a CPU, in the
# same folder: it adds to the quick one's samples). evaluate.py's defaults, the paper's protocol on
# every problem (--n 32 x 14 temperatures), are hours to days: 492,800 samples on the tiny world.
LIKE_THE_RUN = {"n": 8, "k": (1, 8), "temperatures": (0.6, 1.0, 1.2)}
PAPER_N, PAPER_TEMPERATURES = 32, 14       # evaluate.py's --n and --temperatures defaults (a test checks)


def evaluate_commands(out, ckpt, eval_sets, template) -> list[str]:
    """The `next:` evaluate.py lines, each with the number of samples it draws: sets x problems x
    samples x temperatures (evaluate.planned_samples counts the same; a test holds them equal).
    `eval_sets`: names, or {name: problems the run held out}; with names only, each set counts
    --eval-limit problems (every held-out set of the shipped tasks has at least 200)."""
    cfg = run_dir.read_config(out) or {}
    limit = cfg.get("eval_limit", 200) or None
    temps = list(dict.fromkeys(round(float(t), 6) for t in cfg.get("eval_temperatures", [1.0])))
    names = list(eval_sets) or ["tiny"]
    sizes = dict(eval_sets) if isinstance(eval_sets, dict) else \
        {name: limit for name in names} if limit and eval_sets else None
    base = f"  python evaluate.py --model {ckpt} --benchmarks {' '.join(names)} --template {template}" + \
        (f" --limit {limit}" if limit else "")

    def count(n, ts):
        if sizes is None:
            return f"every problem of {' '.join(names)} x {n} x {len(ts)} temperature(s)"
        problems = sum(min(v, limit) if limit and v else v for v in sizes.values())
        total = problems * n * len(ts)
        return (f"{total:,} samples = {problems} problems ({len(sizes)} sets) x {n} sample(s) x "
                f"{len(ts)} temperature(s)")

    like = LIKE_THE_RUN
    return [f"{base} --n 1 --temperatures {' '.join(f'{t:g}' for t in temps)} --out {out}/eval   "
            f"# quick, the run's held-out sets at its size, other samples than its own evaluation (at n = 1 "
            f"expect the summary's figures within ~5 points): {count(1, temps)}",
            f"{base} --n {like['n']} --k {' '.join(map(str, like['k']))} --temperatures "
            f"{' '.join(f'{t:g}' for t in like['temperatures'])} --out {out}/eval   "
            f"# sized like the run, adds to the quick one: {count(like['n'], like['temperatures'])}",
            "  (evaluate.py without --limit, --n and --temperatures is the paper's protocol: every problem x "
            f"{PAPER_N} samples x {PAPER_TEMPERATURES} temperatures, a day on a CPU for the tiny world; "
            "docs/evaluation.md)"]
