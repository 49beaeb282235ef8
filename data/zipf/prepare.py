"""Generate the Zipf world, its tokenizer and an untrained model, from one seed.

    python -m data.zipf.prepare            # writes data/zipf/*.jsonl and data/zipf/base/

Splits (all disjoint by problem text; eval sets are drawn first so training can never contain them):
    test.jsonl   500  levels 2-4, topics by the Zipf law     in-distribution held-out set
    rare.jsonl   300  levels 2-4, only the 5 rarest dialects held-out set of unusual questions
    train.jsonl 4000  levels 2-4, topics by the Zipf law     RL training set
    sft.jsonl  30000  levels 1-5, topics by the Zipf law     the warm-start corpus (not committed)

The tokenizer is the tiny world's (data/tinymath/prepare.py: a byte-level BPE with one token per
digit and Qwen2's pre-tokenizer) trained on this world's warm-start and RL training text, so a
rare topic's words are pieced together from sub-words. The model is a Qwen2 like the tiny world's.
"""

import argparse
import os
import random

from data.tinymath.prepare import CHAT_TEMPLATE, train_tokenizer, write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
RARE = range(7, 12)  # dialect indices of the rare held-out set: the 5 least common dialects (design 2)

# split name -> parts (number of problems, levels, topic indices or None = the Zipf law).
# Order matters: eval sets first.
SPLITS = {
    "test": [(500, (2, 3, 4), None)],
    "rare": [(300, (2, 3, 4), RARE)],
    "train": [(4000, (2, 3, 4), None)],
    "sft": [(30000, (1, 2, 3, 4, 5), None)],
}
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)
VOCAB = 768


def generate_splits(seed: int) -> dict[str, list[dict]]:
    """Every split as a list of rows, deterministically from `seed`; no text in two splits."""
    from data.zipf.world import draw_dialect, make_problem

    rng = random.Random(seed)
    seen, out = set(), {}
    for name, parts in SPLITS.items():
        rows = []
        for size, levels, topics in parts:
            made = 0
            while made < size:
                level = levels[made % len(levels)]  # equal share of each level
                dialect = None if topics is None else draw_dialect(rng, topics)
                row = make_problem(rng, level, dialect=dialect)
                if row["problem"] in seen:
                    continue
                seen.add(row["problem"])
                rows.append({"id": f"{name}-{len(rows)}", **row})
                made += 1
        out[name] = rows
    return out


def init_model(tokenizer, seed: int):
    """A randomly initialised Qwen2 of MODEL's shape (tied embeddings, grouped-query attention)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=eos,
                         pad_token_id=pad, bos_token_id=None, **MODEL)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=HERE, help="folder for the JSONL splits and base/ (default: here)")
    p.add_argument("--no-model", action="store_true", help="only write the JSONL splits")
    args = p.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    splits = generate_splits(args.seed)
    for name, rows in splits.items():
        write_jsonl(os.path.join(args.out, f"{name}.jsonl"), rows)
        print(f"{name:6s} {len(rows):6d} problems -> {os.path.join(args.out, name + '.jsonl')}")
    if args.no_model:
        return
    texts = [r["problem"] + "\n" + r["solution"] for r in splits["sft"] + splits["train"]]
    tokenizer = train_tokenizer(texts + [CHAT_TEMPLATE], vocab_size=VOCAB)
    model = init_model(tokenizer, args.seed)
    base = os.path.join(args.out, "base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters() / 1e6:.2f}M params -> {base}")


if __name__ == "__main__":
    main()
