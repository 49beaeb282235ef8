"""Tasks: what a training or held-out row asks, and how a completion of it is scored.

A task is one small module in this folder that builds a `Task` and registers it:

    TASK = tasks.register(tasks.Task(name="countdown", doc="...", score=score, read_row=read_row,
                                     datasets={"countdown-test": ".../test.jsonl"}, ...))

TASKS is an extension table (plumbing/extension.py): a task defined outside the repo (a notebook, a
module of one's own) is added with the pattern's one call, `extension.register(tasks.TASKS,
task.name, task)` (`tasks.register(task)` is its shorthand), and removed with
`extension.unregister(tasks.TASKS, task.name)`; --task then picks it.

Training (train.py), the held-out evaluation during training (evaluation/heldout.py) and evaluate.py all
grade through `score_rows`, which hands each completion to its row's task together with the
WHOLE row, so per-row data (Countdown's numbers) reaches the scorer. A row's task is its "task"
field, set when the row is loaded (`read_by`): the task that owns the set by name, else the
run's --task; a row that carries another task's own fields (`Task.fields`) without naming its
task is refused, never graded by the wrong task. A run may therefore mix tasks (a JSONL file
whose rows carry "task"); metrics then report accuracy per task.

The task layer sits under the entry scripts and evaluation/heldout.py, above reward.py (the math verifier,
which tasks/math.py calls) and data/ (reading files, prompt templates).
"""

from tasks.task import (TASKS, Scored, Task, get, keep_row, load_rows, owner, prompt_set,  # noqa: F401
                        read_by, register, score_rows, source_of, task_names_in, tokenizer_misfit)
from tasks import countdown, math, zipf  # noqa: F401  isort: skip -- the built-in tasks register themselves
