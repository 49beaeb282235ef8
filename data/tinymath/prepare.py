"""Generate the tiny math world, its tokenizer and an untrained tiny model, from one seed.

    python -m data.tinymath.prepare            # writes data/tinymath/*.jsonl and data/tinymath/base/

Splits (all disjoint by problem text; eval sets are drawn first so training can never contain them):
    test.jsonl   500  levels 3-5, training phrasing      in-distribution test (plays MATH500)
    hard.jsonl   300  levels 6-7, training phrasing      harder than RL training (plays AIME)
    ood.jsonl    300  levels 3-5, held-out phrasing      out of RL's distribution (plays Minerva)
    train.jsonl 8523  levels 3-5, training phrasing      RL training set (plays MATH L3-5, 8,523)
    sft.jsonl  30000  levels 1-7 training phrasing, 10% levels 1-5 held-out phrasing:
                      the warm-start corpus, the "pretraining" of the tiny model (not committed)

The tokenizer is a byte-level BPE (as Qwen2's) with digits split one per token, trained on the
warm-start and RL training text only, so the out-of-distribution words are pieced together from
sub-words the model has seen in other contexts. The model is a 4-layer Qwen2 (~0.9M parameters),
loaded with AutoModelForCausalLM.from_pretrained exactly like Qwen2.5-Math-7B.
"""

import argparse
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

# split name -> parts (number of problems, levels, phrasing style). Order matters: eval sets first.
SPLITS = {
    "test": [(500, (3, 4, 5), "train")],
    "hard": [(300, (6, 7), "train")],
    "ood": [(300, (3, 4, 5), "ood")],
    "train": [(8523, (3, 4, 5), "train")],
    # The warm start plays the pretrained base model: it has seen every level and, rarely, the
    # held-out phrasing (as Qwen2.5-Math has seen competition and science text before RL), while
    # RL trains on levels 3-5 in the training phrasing only.
    "sft": [(27000, (1, 2, 3, 4, 5, 6, 7), "train"), (3000, (1, 2, 3, 4, 5), "ood")],
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's chat format, reduced to what the tiny world needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split: letters in words, every digit on its own, punctuation runs, spaces.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)


def generate_splits(seed: int) -> dict[str, list[dict]]:
    """Every split as a list of rows, deterministically from `seed`; no text in two splits."""
    from data.tinymath.world import make_problem

    rng = random.Random(seed)
    seen, out = set(), {}
    for name, parts in SPLITS.items():
        rows = []
        for size, levels, style in parts:
            made = 0
            while made < size:
                level = levels[made % len(levels)]  # equal share of each level
                row = make_problem(rng, level, style)
                if row["problem"] in seen:
                    continue
                seen.add(row["problem"])
                rows.append({"id": f"{name}-{len(rows)}", **row})
                made += 1
        out[name] = rows
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def train_tokenizer(texts: list[str], vocab_size: int = 768):
    """Byte-level BPE with one token per digit (Qwen2's scheme), as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's normalizer and pre-tokenizer: transformers' AutoTokenizer re-applies Qwen2's
    # own to any tokenizer next to a Qwen2 config.json (docs/method.md §9), so anything else would be
    # silently replaced. tests/test_world.py checks both loaders tokenize alike.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def write_splits(splits: dict[str, list[dict]], out: str) -> None:
    """Each split to out/<name>.jsonl, saying where it went."""
    os.makedirs(out, exist_ok=True)
    for name, rows in splits.items():
        write_jsonl(os.path.join(out, f"{name}.jsonl"), rows)
        print(f"{name:6s} {len(rows):6d} problems -> {os.path.join(out, name + '.jsonl')}")


def init_model(tokenizer, seed: int):
    """A randomly initialised tiny Qwen2 (tied embeddings, grouped-query attention)."""
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

    splits = generate_splits(args.seed)
    write_splits(splits, args.out)
    if args.no_model:
        return

    from data.prompts import build_prompt

    # The tokenizer sees what the model will train on: prompts (chat template) and solutions.
    texts = [r["problem"] + "\n" + r["solution"] for r in splits["sft"] + splits["train"]]
    tokenizer = train_tokenizer(texts + [CHAT_TEMPLATE])
    model = init_model(tokenizer, args.seed)
    base = os.path.join(args.out, "base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    row = splits["train"][0]
    n_prompt = len(tokenizer(build_prompt(tokenizer, row["problem"], "plain"),
                             add_special_tokens=False).input_ids)
    n_sol = len(tokenizer(row["solution"], add_special_tokens=False).input_ids)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters() / 1e6:.2f}M params -> {base}")
    print(f"example: prompt {n_prompt} tokens, solution {n_sol} tokens")


if __name__ == "__main__":
    main()
