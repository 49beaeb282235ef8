"""The Zipf world (data/zipf/): the tiny world's kind of word problem with topics drawn from a
long-tailed law, so that some questions are rare under its warm start (study/zipf.py measures
what that does). A boxed number graded exactly as the math task grades it (reward.py's verifier);
its own sets make `--task zipf` train on zipf-train and evaluate on zipf-test and zipf-rare.

    python train.py --task zipf --model data/zipf/warmstart --algo grpo --out runs/zipf-grpo
"""

import os

from tasks import math as math_task
from tasks.task import Task, register

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "zipf")

TASK = register(Task(
    name="zipf",
    doc="the Zipf world's word problems (data/zipf/): a boxed number, graded as math",
    score=math_task.score,
    score_batch=math_task.score_batch,
    datasets={f"zipf-{s}": os.path.join(DATA, f"{s}.jsonl") for s in ("train", "test", "rare")},
    train_data="zipf-train",
    heldout=("zipf-test", "zipf-rare"),
    outcomes=math_task.OUTCOMES,
    format_ok=math_task.TASK.format_ok,
))
