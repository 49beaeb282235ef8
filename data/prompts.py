"""Prompt templates: the one place where a problem becomes the text the model sees.

Training (train.py) and evaluation (evaluate.py) both call `build_prompt`, so a checkpoint is
always evaluated with the template it was trained on. The *whole* prompt, chat template included,
is the query q whose log-likelihood l_theta(q) the Query-KL regularizes (ERPO.md §2).
"""

# The instruction appended to every problem in the paper (ERPO.md §5).
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
    user = TEMPLATES[template].format(problem=problem.strip())
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    return user + "\n"
