"""Prompt templates: the one place where a problem becomes the text the model sees.

Training (train.py) and evaluation (evaluate.py) both call `build_prompt`, so a checkpoint is
always evaluated with the template it was trained on. The *whole* prompt, chat template included,
is the query q whose log-likelihood l_theta(q) the Query-KL regularizes (method.md §2).
"""

from dataclasses import dataclass

from plumbing.errors import DataError

# The instruction appended to every problem in the paper (method.md §5).
PAPER_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the "
    "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)

# template name -> how the user turn is written. "paper": problem + the paper's instruction (real
# models); "plain": the problem alone (the embedded tiny world, whose model learned the format
# during its warm start, so 40 constant instruction tokens would only cost compute).
TEMPLATES = {
    "paper": "{problem} " + PAPER_INSTRUCTION,
    "plain": "{problem}",
}


def build_prompt(tokenizer, problem: str, template: str = "paper") -> str:
    """Return the full prompt text for `problem` (tokenize it with add_special_tokens=False).

    The user turn is wrapped in the tokenizer's chat template when it has one (Qwen2.5-Math and
    the tiny model both do), ending with the assistant header so the model answers next.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose from {sorted(TEMPLATES)}")
    if not isinstance(problem, str) or not problem.strip():
        # rows from data.benchmarks are text already; anything else would reach the model as a
        # Python repr (a chat-message list) or as a prompt that asks nothing (a blank problem)
        raise DataError(f"a problem must be non-empty text, got {problem!r:.60} "
                        "(load rows with data.benchmarks, which reads chat-message problems)")
    # replace, not str.format: the paper's instruction holds a literal "\\boxed{}", which format
    # reads as a positional field (IndexError on every --template paper prompt)
    user = TEMPLATES[template].replace("{problem}", problem.strip())
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    return user + "\n"


def encode_prompts(tokenizer, problems, template: str) -> list[list[int]]:
    """One token-id list per problem row ({"problem": ...}): the templated prompt, no BOS added."""
    return [tokenizer(build_prompt(tokenizer, p["problem"], template), add_special_tokens=False).input_ids
            for p in problems]


@dataclass
class PromptSet:
    """Problem rows and their prompt token ids, index-aligned."""
    rows: list[dict]
    ids: list[list[int]]

    def __len__(self):
        return len(self.rows)


def load_prompt_set(source, tokenizer, template, max_prompt_len=None, limit=None, training=False,
                    strict=False, read_row=None) -> PromptSet:
    """A benchmark or training set, encoded. Training sets skip (and count) rows without a problem
    or an answer unless strict; prompts longer than max_prompt_len are dropped, with a count.
    read_row: data.benchmarks.load_benchmark's (each row checked where its file line is known)."""
    from data.benchmarks import load_benchmark, load_problems

    rows = (load_problems(source, limit=limit, strict=strict, read_row=read_row) if training
            else load_benchmark(source, limit=limit, read_row=read_row))
    ids = encode_prompts(tokenizer, rows, template)
    keep = [i for i, x in enumerate(ids) if max_prompt_len is None or len(x) <= max_prompt_len]
    if not keep:
        raise DataError(f"{source}: all {len(rows)} prompts are longer than {max_prompt_len} tokens "
                        "(raise --max-prompt-len)")
    if len(keep) < len(rows):
        print(f"dropped {len(rows) - len(keep)} of {len(rows)} prompts longer than {max_prompt_len} tokens")
    return PromptSet([rows[i] for i in keep], [ids[i] for i in keep])


def check_positions(name, ids, max_new_tokens, max_positions, flag="--max-new-tokens"):
    """Raise DataError when some prompt plus `max_new_tokens` does not fit the model's
    `max_positions` (config.max_position_embeddings: 4,096 for Qwen2.5-Math-7B): beyond it a model
    decodes garbage without an error. None: no limit known."""
    over = [len(x) for x in ids if len(x) + max_new_tokens > max_positions] if max_positions else []
    if not over:
        return
    longest = max(over)
    fix = (f"lower {flag} to {max_positions - longest}" if longest < max_positions else
           f"drop those problems (a prompt of {longest} tokens alone exceeds the {max_positions} positions)")
    raise DataError(f"{name}: {len(over)} of {len(ids)} prompts do not fit the model's {max_positions} "
                    f"positions with {flag} {max_new_tokens} (longest prompt {longest} tokens): {fix}, "
                    "or leave the set out")
