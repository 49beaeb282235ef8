"""The math task (the default): the last \\boxed{} answer of a completion against the row's gold
answer, by reward.py's verifier (exact strings, numbers, then math-verify in a process pool with a
per-answer timeout). Its sets are the embedded tiny world (data/tinymath/) and the paper's
benchmarks, whose names data/benchmarks.py knows."""

import os

import reward
from tasks.task import Scored, Task, register

OUTCOMES = ("correct", "wrong", "no_answer", "rejected", "timeout", "error")


score_batch = reward.grade_rows        # all at once: the verifier's pool grades distinct pairs once


def score(completion: str, row: dict) -> Scored:
    """1.0 if the completion's last boxed answer equals row["answer"], else 0.0."""
    return score_batch([completion], [row], reward.DEFAULT_TIMEOUT)[0][0]


TASK = register(Task(
    name="math",
    doc="a boxed final answer, checked by reward.py (the paper's task)",
    score=score,
    score_batch=score_batch,
    train_data="tiny-train",
    heldout=("tiny-test", "tiny-ood", "tiny-hard"),
    outcomes=OUTCOMES,
    format_ok=reward.has_format,
    model=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tinymath",
                       "warmstart"),
))
