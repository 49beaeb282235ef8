"""Generate the Zipf world, its tokenizer and an untrained model, from one seed.

    python -m data.zipf.prepare            # writes data/zipf/*.jsonl and data/zipf/base/

Splits (all disjoint by problem text; eval sets are drawn first so training can never contain them).
Topics follow their Zipf law everywhere; dialects follow the steep law (DIALECT_S) in the warm-start
corpus and the flatter RL law (RL_DIALECT_S) in the RL sets:
    test.jsonl   500  levels 2-4, dialects by the RL law       in-distribution held-out set
    rare.jsonl   300  levels 2-4, the 6 rarest dialects only   held-out set of unusual questions
    train.jsonl 4000  levels 2-4, dialects by the RL law       RL training set
    sft.jsonl  30000  levels 1-5, dialects by the steep law    the warm-start corpus (not committed)

The warm start (data/zipf/warmstart, committed) is the repo's own SFT on sft.jsonl, run by hand once
(~18 min on 2 cores; its step-750 export is the committed folder, bit for bit):

    python -m data.zipf.prepare
    python train.py --algo sft --task zipf --model data/zipf/base --sft-data data/zipf/sft.jsonl \
        --sft-steps 750 --max-seq-len 320 --max-new-tokens 160 --export data/zipf/warmstart

A shortened run of the same recipe (SHORT_SFT, from the same base, on one thread) is checked in CI
against the fingerprint it committed (short_sft.json; `python -m study.zipf --short-sft` rewrites it
on purpose).

The tokenizer is the tiny world's (data/tinymath/prepare.py: a byte-level BPE with one token per
digit and Qwen2's pre-tokenizer) trained on this world's warm-start and RL training text, so a
rare dialect's words are pieced together from sub-words. The model is the tiny world's
(init_model: the same shape and seed), over this world's vocabulary.
"""

import argparse
import os
import random

from data.tinymath.prepare import CHAT_TEMPLATE, init_model, train_tokenizer, write_splits
from data.zipf.world import DIALECT_S, RL_DIALECT_S

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1234          # the seed the world (its sets, tokenizer and base model) is built from
RARE = range(6, 12)  # dialect indices of the rare held-out set: the 6 least common dialects (design 3)

# split name -> parts (number of problems, levels, dialect indices or None = all, dialect law exponent).
# Order matters: eval sets first.
SPLITS = {
    "test": [(500, (2, 3, 4), None, RL_DIALECT_S)],
    "rare": [(300, (2, 3, 4), RARE, RL_DIALECT_S)],
    "train": [(4000, (2, 3, 4), None, RL_DIALECT_S)],
    "sft": [(30000, (1, 2, 3, 4, 5), None, DIALECT_S)],
}
VOCAB = 1024
SFT_RECIPE = ["--algo", "sft", "--task", "zipf", "--max-seq-len", "320", "--max-new-tokens", "160"]
SHORT_SFT = ["--sft-steps", "12", "--sft-batch", "16", "--sft-warmup", "4", "--eval-every", "0", "--save-every", "0"]
SHORT_SFT_FILE = os.path.join(HERE, "short_sft.json")


def generate_splits(seed: int, splits=None, exclude=()) -> dict[str, list[dict]]:
    """Every split of `splits` (default SPLITS) as a list of rows, deterministically from `seed`; no
    text in two splits, none of the texts in `exclude` (study/zipf.py's fresh problems)."""
    from data.zipf.world import draw_dialect, make_problem

    rng = random.Random(seed)
    seen, out = set(exclude), {}
    for name, parts in (SPLITS if splits is None else splits).items():
        rows = []
        for size, levels, dialects, law in parts:
            made = 0
            while made < size:
                level = levels[made % len(levels)]  # equal share of each level
                dialect = draw_dialect(rng, dialects, law)
                row = make_problem(rng, level, dialect=dialect)
                if row["problem"] in seen:
                    continue
                seen.add(row["problem"])
                rows.append({"id": f"{name}-{len(rows)}", **row})
                made += 1
        out[name] = rows
    return out


def make_base(splits, out, seed):
    """The tokenizer (trained on the warm-start and RL training text) and the untrained model -> out/."""
    texts = [r["problem"] + "\n" + r["solution"] for r in splits["sft"] + splits["train"]]
    tokenizer = train_tokenizer(texts + [CHAT_TEMPLATE], vocab_size=VOCAB)
    model = init_model(tokenizer, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tokenizer, model


def fingerprint(model_dir) -> dict:
    """A model folder's float64 sum and L2 norm of every parameter (what two runs compare)."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: [v.double().sum().item(), v.double().norm().item()] for k, v in sorted(state.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=HERE, help="folder for the JSONL splits and base/ (default: here)")
    p.add_argument("--no-model", action="store_true", help="only write the JSONL splits")
    args = p.parse_args(argv)

    splits = generate_splits(args.seed)
    write_splits(splits, args.out)
    if args.no_model:
        return
    base = os.path.join(args.out, "base")
    tokenizer, model = make_base(splits, base, args.seed)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters() / 1e6:.2f}M params -> {base}")


if __name__ == "__main__":
    main()
