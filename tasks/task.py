"""The task record and its registry (tasks/__init__.py tells the story; the built-in tasks,
tasks/math.py, tasks/countdown.py and tasks/zipf.py, register themselves with `register`).

TASKS is an extension table (plumbing/extension.py, chosen by --task): a task from outside the repo
is one row, added with the pattern's one call, under its own name,

    extension.register(tasks.TASKS, task.name, task)     # or its shorthand: tasks.register(task)
"""


import os
from dataclasses import dataclass, field
from typing import Callable

from data.prompts import PromptSet, load_prompt_set
from reward import Scored
from plumbing import extension
from plumbing.errors import DataError


def keep_row(row: dict, where: str) -> dict:
    """The default `Task.read_row`: the normalized row (data.benchmarks) as it is."""
    return row


@dataclass(frozen=True)
class Task:
    name: str
    doc: str                                              # one line, for --help and the README
    score: Callable[[str, dict], Scored]                  # (completion, the whole row) -> Scored
    read_row: Callable[[dict, str], dict] = keep_row      # (row, "file:line") -> row; DataError if bad
    datasets: dict = field(default_factory=dict)          # set name -> file (e.g. "countdown-test")
    train_data: str | None = None                         # its default training set (--train-data)
    heldout: tuple = ()                                   # its default held-out sets (--eval-data)
    outcomes: tuple = ("correct", "wrong", "no_answer")   # outcomes logged as counts (others: "error")
    # (completions, rows, timeout) -> ([Scored], extra counts): for scorers that batch (math's
    # process pool); None: `score` one completion at a time
    score_batch: Callable | None = None
    format_ok: Callable[[str], bool] | None = None        # the format of --reward acc+format
    # the row fields that make a row this task's (Countdown: numbers, target): a row that carries
    # them all is refused by another task unless its "task" field says so (read_by)
    fields: tuple = ()
    # the response length its solutions need, in its warm start's tokens: --max-new-tokens's default
    # when the task is --task (train.py), and a warning below it
    max_new_tokens: int | None = None
    # the warm start it is made for (a model folder): its tokenizer is the yardstick of tokenizer_misfit
    model: str | None = None
    # its prompt template, a key of data.prompts.TEMPLATES (a task's module may register its own there):
    # --template's default when the task is --task (train.py, evaluate.py); None: "plain"
    template: str | None = None


# A model's tokenizer that spells the task's prompts in this many times the tokens its own warm start
# does is refused (tokenizer_misfit). Measured on 64 training prompts: zipf under the math warm
# start's tokenizer 4.11 tokens per word against its own 2.34 (1.76x: its dialect words letter by
# letter, and every reward 0); math under its own 1.30, the paper's Qwen tokenizer near it.
MISFIT = 1.5


# --task name -> Task: an extension table (plumbing/extension.py); a row's name is its task's own
TASKS: dict[str, Task] = extension.declare("task", {})


def register(task: Task, replace: bool = True) -> Task:
    """extension.register(TASKS, task.name, task), the task modules' shorthand: a name registered
    again is replaced (a module or a notebook cell run twice), unless replace=False."""
    return extension.register(TASKS, task.name, task, replace=replace)


def get(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (tasks: {', '.join(sorted(TASKS))})")
    return TASKS[name]


def owner(set_name: str) -> Task | None:
    """The task whose `datasets` or `heldout` name this set, or whose file it is; else None."""
    path = os.path.abspath(set_name)
    for task in TASKS.values():
        files = {os.path.abspath(f) for f in task.datasets.values()}
        if set_name in task.datasets or set_name in task.heldout or path in files:
            return task
    return None


def source_of(set_name: str) -> str:
    """The file behind a task's named set, else the name itself (a benchmark name or a path)."""
    task = owner(set_name)
    return task.datasets.get(set_name, set_name) if task else set_name


def _another_tasks_row(row: dict, task: Task) -> Task | None:
    """Another task whose every own field the row carries (a Countdown row's numbers and target),
    when the row does not name its task: graded as `task`, it would be scored by the wrong grader
    (the math grader takes a bare \\boxed{target} for a Countdown row's answer)."""
    for other in TASKS.values():
        if other is not task and other.fields and all(row.get(f) is not None for f in other.fields) \
                and not set(other.fields) <= set(task.fields):
            return other
    return None


def read_by(set_name: str, default_task: str) -> Callable[[dict, str], dict]:
    """The function that reads a row of `set_name` as its task does: (row, "file:line") -> the row
    with its "task". A row's task is its "task" field (kept when the file gives one), else the set's
    owner, else the run's --task; then that task's `read_row` checks its own fields (a bad row:
    DataError naming its line). A row without a "task" field that carries another task's fields is
    refused rather than read as that task: guessing from field names would change how rows are
    graded without a word (a math set may have a "target" of its own), while one flag or field says
    it once and for all, and the run's config.json records it."""
    task_of_set = owner(set_name)

    def read(row: dict, where: str) -> dict:
        named = row.get("task")
        name = named or (task_of_set.name if task_of_set else default_task)
        try:
            task = get(name)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        other = None if named else _another_tasks_row(row, task)
        if other:
            raise DataError(f"{where}: the row has {other.name}'s fields ({', '.join(other.fields)}) but "
                            f"no \"task\" field, so it would be graded as {task.name}; pass --task "
                            f"{other.name}, or give the rows a \"task\" field")
        return {**task.read_row(row, where), "task": name}
    return read


def load_rows(rows: list[dict], where: list[str] | str, set_name: str, default_task: str) -> list[dict]:
    """Rows already loaded, read by their tasks (read_by). `where`: each row's "file:line", or one
    name for all (then rows are named by their 1-based position). Sets loaded by name or path go
    through prompt_set / data.benchmarks.load_benchmark(read_row=read_by(...)) instead, which know
    each row's line in its file."""
    read = read_by(set_name, default_task)
    return [read(row, where[i] if isinstance(where, list) else f"{where}: row {i + 1}")
            for i, row in enumerate(rows)]


def prompt_set(set_name: str, tokenizer, template: str, default_task: str, **load) -> PromptSet:
    """A training or held-out set by name or path, encoded (data.prompts.load_prompt_set, whose
    keyword arguments `load` takes), its rows read by their tasks (read_by) as they are loaded, so a
    bad row is named by its line in the file. A task's read_row checks and adds fields; it does not
    change the problem, which is encoded after it."""
    return load_prompt_set(source_of(set_name), tokenizer, template, read_row=read_by(set_name, default_task),
                           **load)


def score_rows(completions: list[str], rows: list[dict], timeout: float = 1.0,
               format_reward: bool = False) -> tuple[list[float], list[bool], dict]:
    """Score completion i against rows[i] by the row's task -> (rewards, correct, counts).
    format_reward: with format_bonus (--reward acc+format).
    counts: total, one count per outcome, "format_ok", the batch scorers' extras, and per task
    "total/<task>" and "correct/<task>" (per-task accuracy of runs that mix tasks)."""
    if len(completions) != len(rows):
        raise ValueError(f"score_rows: {len(completions)} completions but {len(rows)} rows")
    by_task: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_task.setdefault(row.get("task", "math"), []).append(i)
    scored: list[Scored | None] = [None] * len(rows)
    counts = {"total": len(rows), "format_ok": 0}
    for name, idx in by_task.items():
        task = TASKS[name]                                   # (checked as its rows loaded)
        for o in task.outcomes:
            counts.setdefault(o, 0)
        if task.score_batch is not None:
            got, extra = task.score_batch([completions[i] for i in idx], [rows[i] for i in idx], timeout)
            for k, v in extra.items():
                counts[k] = counts.get(k, 0) + v
        else:
            got = [_safe_score(task, completions[i], rows[i]) for i in idx]
        for i, s in zip(idx, got):
            scored[i] = s
        counts[f"total/{name}"] = len(idx)
        counts[f"correct/{name}"] = sum(s.outcome == "correct" for s in got)
    for s in scored:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    rewards = [float(s.reward) for s in scored]
    if format_reward:                                          # --reward acc+format
        rewards = format_bonus(scored, completions, rows, counts)
    return rewards, [s.outcome == "correct" for s in scored], counts


def format_bonus(scored: list[Scored], completions, rows, counts) -> list[float]:
    """--reward acc+format: 0.9 * reward + 0.1 * the row's task's format check; counts "format_ok"."""
    formats = [_format_ok(row, c) for row, c in zip(rows, completions)]
    counts["format_ok"] = sum(formats)
    return [0.9 * s.reward + 0.1 * f for s, f in zip(scored, formats)]


def _safe_score(task, completion, row) -> Scored:
    """A scorer's bug must not end a training run: it is counted as the outcome "error"."""
    try:
        return task.score(completion, row)
    except Exception as e:                                 # any bug of a researcher's scorer
        import sys
        print(f"[{task.name}] scoring failed: {e!r}", file=sys.stderr)
        return Scored(0.0, "error")


def _format_ok(row, completion) -> bool:
    check = get(row.get("task", "math")).format_ok
    return bool(check and check(completion))


def task_names_in(rows: list[dict]) -> list[str]:
    """The tasks of a set's rows, in order of first appearance."""
    return list(dict.fromkeys(r.get("task", "math") for r in rows))


def tokens_per_word(tokenizer, texts) -> float:
    words = sum(len(t.split()) for t in texts)
    return sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts) / max(1, words)


def tokenizer_misfit(task_name: str, tokenizer, model: str, rows: list[dict], limit=64) -> str | None:
    """Why `tokenizer` (of --model `model`) does not fit the task, or None: it spells the task's
    training prompts (its rows among `rows`, at most `limit`) in MISFIT times or more the tokens per
    word of the warm start the task is made for (Task.model), as the math warm start's spells the
    Zipf world's dialect words letter by letter, so that no sample is ever right."""
    task = get(task_name)
    own_model = task.model and os.path.isdir(task.model) and os.path.abspath(task.model)
    if not own_model or os.path.abspath(model) == own_model:
        return None
    texts = [str(r.get("problem", "")) for r in rows if r.get("task") == task_name][:limit]
    if not texts:
        return None
    from transformers import AutoTokenizer
    mine = tokens_per_word(tokenizer, texts)
    own = tokens_per_word(AutoTokenizer.from_pretrained(task.model), texts)
    if mine < MISFIT * own:
        return None
    here = os.path.relpath(task.model)
    here = task.model if here.startswith("..") else here
    return (f"--model {model}: its tokenizer spells --task {task_name}'s prompts in {mine:.2f} tokens per "
            f"word, {mine / own:.1f}x the {own:.2f} of the task's own warm start (words it does not know, "
            f"split up: the task would score 0); give --model {here}")
