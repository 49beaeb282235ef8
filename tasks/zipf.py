"""The Zipf world (data/zipf/): the tiny world's kind of word problem with topics drawn from a
long-tailed law and written in dialects drawn from another, so that some questions are rare under
its warm start (study/zipf.py measures what that does). A boxed number graded exactly as the math
task grades it (reward.py's verifier); its own sets make `--task zipf` train on zipf-train and
evaluate on zipf-test and zipf-rare.

    python train.py --task zipf --model data/zipf/warmstart --max-new-tokens 160 --algo grpo

(its solutions are up to 144 tokens long: --max-new-tokens defaults to the task's 160, over
train.py's 96, and a run given less is warned; another --model's tokenizer that spells its dialect
words letter by letter is refused: tasks.task.tokenizer_misfit.)
"""

import os

from tasks.math import OUTCOMES, TASK as MATH, score, score_batch
from tasks.task import Task, register

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "zipf")

TASK = register(Task(
    name="zipf",
    doc="the Zipf world's word problems (data/zipf/): a boxed number, graded as math",
    score=score,
    score_batch=score_batch,
    datasets={f"zipf-{s}": os.path.join(DATA, f"{s}.jsonl") for s in ("train", "test", "rare")},
    train_data="zipf-train",
    heldout=("zipf-test", "zipf-rare"),
    outcomes=OUTCOMES,
    format_ok=MATH.format_ok,
    max_new_tokens=160,
    model=os.path.join(DATA, "warmstart"),
))
