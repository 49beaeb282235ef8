"""Benchmarks and problem sets: every source becomes a list of {"id", "problem", "answer", ...}.

`load_benchmark(name_or_path)` is the one entry point. It accepts a registered name (below), a group
name ("tiny", "paper"), or a local .jsonl / .json / .parquet file; all are mapped to the same
normalized rows so that evaluate.py and train.py never look at raw field names.

The paper's six benchmarks (method.md §6) are loaded with `datasets.load_dataset` from these
Hugging Face hub datasets (or from a local copy, see `data_dir`):

| name          | hub id                      | config | split | problem    | answer                  | n   |
|---------------|-----------------------------|--------|-------|------------|-------------------------|-----|
| aime24        | HuggingFaceH4/aime_2024     | -      | train | problem    | answer (str, "025")     | 30  |
| aime25        | math-ai/aime25              | -      | test  | problem    | answer                  | 30  |
| amc           | AI-MO/aimo-validation-amc   | -      | train | problem    | answer (float, 27.0)    | 83  |
| math500       | HuggingFaceH4/MATH-500      | -      | test  | problem    | answer (+ solution)     | 500 |
| minerva       | math-ai/minervamath         | -      | test  | question   | answer                  | 272 |
| olympiadbench | math-ai/olympiadbench       | -      | test  | question   | final_answer (list)     | 675 |

Also registered: `amc23` (math-ai/amc23, test, question/answer, 40: AMC 2023 only) and
`olympiadbench-hothan` (Hothan/OlympiadBench, config OE_TO_maths_en_COMP, train,
question/final_answer, 674: the upstream English text-only open-ended maths split; the 675-row set
above is the one shipped with the Qwen2.5-Math evaluation suite, which the 675 in the paper matches).
The AMC set is AMC12 2022 + 2023 (83 problems). Real files have traps (method.md §9). This module
has no answer normaliser of its own: every answer is `reward.gold_answer(raw value)`, the gold
answer as the grader reads it (floats 27.0 / "27.0" -> "27", zero-padded "025" -> "25",
e-notation "4.5e33" -> "4.5 \\times 10^{33}", list answers (OlympiadBench `final_answer`) -> the
single element, or ", "-joined when there are several, surrounding $...$ removed; anything else,
such as units, intervals or "58,500", is left to the grader). A row without an answer field
takes the last \\boxed{} of its solution, found by `reward.extract_boxed`, as grading does.
A blank field ("", whitespace, []) counts as missing, and an answer the grader cannot read (a dict,
a bool, a nested list, NaN) is an error naming the file and line. A problem may be a chat of one
user message ([{"role": "user", "content": ...}], the shape of verl-style prompts, under a problem
or question field): its content is the question; any other chat (a system prompt, earlier turns)
is an error, since the prompt template writes the chat itself (data/prompts.py).

The embedded tiny world (data/tinymath/, made by data/tinymath/prepare.py) is registered too:

| name       | file                     | what                                      |
|------------|--------------------------|-------------------------------------------|
| tiny-test  | data/tinymath/test.jsonl | in-distribution held-out set (levels 3-5) |
| tiny-hard  | data/tinymath/hard.jsonl | harder than training (levels 6-7)         |
| tiny-ood   | data/tinymath/ood.jsonl  | out-of-distribution phrasing              |
| tiny-train | data/tinymath/train.jsonl| the RL training problems                  |

Training set: `math-l3to5` = file simplelr_qwen_level3to5/train.parquet of the hub dataset
hkust-nlp/SimpleRL-Zoo-Data (MATH levels 3-5, 8,523 problems; question / gt_answer, nested
verl-style answers are found too), or a local math_l3to5.jsonl in data_dir.

Groups: "tiny" = tiny-test + tiny-hard + tiny-ood; "paper" = the six paper benchmarks.
"""

import json
import os

from plumbing.errors import DataError
from reward import extract_boxed, gold_answer

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_DIR = os.path.join(HERE, "tinymath")

# name -> (hub id, config, split). Field names are not listed: normalize_row tries the known ones.
HUB = {
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("math-ai/aime25", None, "test"),
    "amc": ("AI-MO/aimo-validation-amc", None, "train"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "minerva": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("math-ai/olympiadbench", None, "test"),
    "amc23": ("math-ai/amc23", None, "test"),
    "olympiadbench-hothan": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
}
# Training sets stored as files inside a hub dataset: name -> (hub id, file in it). MATH levels
# 3-5 as used by SimpleRL-Zoo / Dr.GRPO and the paper (8,523 problems).
HUB_FILES = {
    "math-l3to5": ("hkust-nlp/SimpleRL-Zoo-Data", "simplelr_qwen_level3to5/train.parquet"),
}
TINY = {
    "tiny-test": "test.jsonl",
    "tiny-hard": "hard.jsonl",
    "tiny-ood": "ood.jsonl",
    "tiny-train": "train.jsonl",
}
GROUPS = {
    "tiny": ["tiny-test", "tiny-hard", "tiny-ood"],
    "paper": ["aime24", "aime25", "amc", "math500", "minerva", "olympiadbench"],
}
ALIASES = {
    "aime2024": "aime24", "aime_2024": "aime24", "aime2025": "aime25", "aime_2025": "aime25",
    "amc22_23": "amc", "math-500": "math500", "math_500": "math500", "minerva_math": "minerva",
    "minervamath": "minerva", "olympiad": "olympiadbench", "olympiad_bench": "olympiadbench",
}
# Local copies looked up in `data_dir` before going to the hub (file names people actually use).
LOCAL_FILES = {
    "aime24": ["aime24.jsonl", "aime2024.jsonl"],
    "aime25": ["aime25.jsonl", "aime2025.jsonl"],
    "amc": ["amc.jsonl", "amc22_23.jsonl"],
    "math500": ["math500.jsonl"],
    "minerva": ["minerva.jsonl", "minerva_math.jsonl"],
    "olympiadbench": ["olympiadbench.jsonl"],
    "amc23": ["amc23.jsonl"],
    "math-l3to5": ["math_l3to5.jsonl", "math-l3to5.jsonl"],
}

# Raw field names, in order of preference.
PROBLEM_KEYS = ["problem", "question", "Problem", "Question"]
ANSWER_KEYS = ["answer", "final_answer", "Answer", "gt_answer", "gt", "ground_truth", "expected_answer",
               "extra_info.answer", "reward_model.ground_truth"]  # a.b = nested field (verl parquet)
SOLUTION_KEYS = ["solution", "Solution"]
ID_KEYS = ["id", "unique_id", "ID", "problem_idx", "idx"]


def known_names():
    return sorted(set(HUB) | set(HUB_FILES) | set(TINY) | set(GROUPS))


def canonical_name(name):
    """Registered name for `name` (case-insensitive, aliases resolved), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in HUB or key in HUB_FILES or key in TINY or key in GROUPS else None


def expand_benchmarks(names):
    """Expand group names ("tiny", "paper") in a list of names/paths; keep order, drop repeats."""
    out = []
    for name in names:
        key = canonical_name(name)
        for item in GROUPS.get(key, [key or name]):
            if item not in out:
                out.append(item)
    return out


class MissingField(DataError):
    """A row without a problem or an answer (or with a blank one): a training set skips it and
    names it, unless --strict-data; in a benchmark it is an error."""


def _lookup(row, key):
    """row[key], where "a.b" is a nested field (verl parquet: extra_info.answer); None if absent."""
    v = row
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v


def _blank(v):
    """No value, or one that holds nothing: None, "", whitespace, []. A blank problem asks the model
    nothing, and a blank answer matches no response: both are treated as a missing field."""
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, (list, tuple)) and not v)


def _first(row, keys):
    """(top-level field, value) of the first key of `keys` with a non-blank value, else (None, None)."""
    for k in keys:
        v = _lookup(row, k)
        if not _blank(v):
            return k.split(".")[0], v
    return None, None


def _present(row, keys):
    """The keys of `keys` the row has (blank, as _first found nothing), for the message."""
    return [k for k in keys if _lookup(row, k) is not None]


def _jsonable(v):
    return v is None or isinstance(v, (str, int, float, bool)) or (
        isinstance(v, (list, tuple)) and all(_jsonable(x) for x in v)
    ) or (isinstance(v, dict) and all(isinstance(k, str) and _jsonable(x) for k, x in v.items()))


def _shown(value):
    """A raw value for a message, as the data file writes it, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_chat(value):
    """A list of chat messages ({"role": ..., "content": ...}), the shape of verl-style prompts (a
    verl file's own "prompt" field is not read as the problem: rename it to "problem")."""
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "role" in m for m in value)


def _chat_question(messages, source):
    """The question of a problem given as chat messages. Only a single user message with text is
    unambiguous: the prompt template writes the chat itself (data/prompts.py), so a system prompt or
    an earlier turn would be dropped without a word, and no template has a place for them."""
    roles = [str(m["role"]) for m in messages]
    content = messages[0].get("content")
    if roles != ["user"]:
        raise DataError(f"{source}: the problem is a chat of {len(roles)} messages (roles "
                        f"{', '.join(roles)}), but only one user message can be a problem, as "
                        "--template writes the chat itself (give the question alone, as text or as "
                        "the one user message)")
    if not isinstance(content, str):
        raise DataError(f"{source}: the problem's user message has content {_shown(content)}, not text "
                        "(give the question as a string in \"content\")")
    if not content.strip():
        raise MissingField(f"{source}: no problem: its user message is empty or whitespace "
                           "(fill it in, or drop the row)")
    return content.strip()


def _problem_text(value, source="?"):
    """The question of a row's problem field: a string, or a chat of one user message (see
    _chat_question). Anything else is a DataError: str() of it would reach the model as a repr."""
    if isinstance(value, str):
        return value.strip()
    if _is_chat(value):
        return _chat_question(value, source)
    raise DataError(f"{source}: the problem is of type {type(value).__name__} ({_shown(value)}), not text "
                    "(give the question as a string)")


def _no_problem(row, source):
    """The MissingField of a row without a problem: a blank field is named, else the fields tried."""
    blank = _present(row, PROBLEM_KEYS)
    if blank:
        return MissingField(f"{source}: no problem: {blank[0]!r} is empty or whitespace "
                            "(fill it in, or drop the row)")
    return MissingField(f"{source}: no problem field (tried {PROBLEM_KEYS}; the row's fields "
                        f"are {sorted(row)})")


def _no_answer(row, source):
    """The MissingField of a row without an answer: a blank field is named, else the fields tried."""
    blank = _present(row, ANSWER_KEYS)
    if blank:
        return MissingField(f"{source}: no answer: {blank[0]!r} is {_shown(_lookup(row, blank[0]))} "
                            "and no solution has a \\boxed{} (fill it in, or drop the row)")
    return MissingField(f"{source}: no answer (tried {ANSWER_KEYS} and a \\boxed{{}} in the "
                        f"solution; the row's fields are {sorted(row)})")


def _gold(answer, source):
    """reward.gold_answer(answer); an answer the grader cannot read is a DataError naming the row."""
    try:
        return gold_answer(answer)
    except ValueError as e:
        raise DataError(f"{source}: {e}") from None


def normalize_row(row, index, source="?"):
    """Raw dataset row -> {"id": str, "problem": str, "answer": str, "solution"?, ...extras}.

    Extras (level, subject, url, ...) are kept when JSON-serializable (images are dropped). A row
    with no answer field falls back to the last \\boxed{} of its solution. A row without a problem
    or an answer (blank counts as without) raises MissingField; a problem or an answer the model or
    the grader cannot read (a dict answer, a chat with a system prompt, ...) raises DataError.
    """
    pkey, problem = _first(row, PROBLEM_KEYS)
    if problem is None:
        raise _no_problem(row, source)
    problem = _problem_text(problem, source)
    akey, answer = _first(row, ANSWER_KEYS)
    skey, solution = _first(row, SOLUTION_KEYS)
    if isinstance(solution, (list, tuple)):
        solution = "\n\n".join(str(s) for s in solution)
    norm = _gold(answer, source)
    if not norm and solution:    # no answer, or one that reads as nothing (["", null], "$ $"): the box
        answer = extract_boxed(str(solution))
        norm = _gold(answer, source)
    if not norm:
        raise _no_answer(row, source)
    ikey, pid = _first(row, ID_KEYS)
    out = {k: v for k, v in row.items() if k not in (pkey, akey, skey, ikey) and _jsonable(v)}
    if not isinstance(answer, str) or norm != answer.strip():
        out["answer_raw"] = answer if _jsonable(answer) else str(answer)
    out.update(id=str(pid if pid is not None else index), problem=problem, answer=norm)
    if solution:
        out["solution"] = str(solution)
    return out


# ----------------------------------------------------------------------------- loading

def _read_jsonl(path):
    """-> (rows, line numbers). Read as bytes and decoded line by line, so a bad byte or a bad
    line is reported with its line number."""
    rows, lines = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start}; "
                                "save the file as UTF-8 JSON lines)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON: {e.msg} at column {e.colno} "
                                "(each line must be one JSON object)") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__} "
                                "(each line must be one object like {\"problem\": ..., \"answer\": ...})")
            rows.append(row)
            lines.append(n)
    return rows, lines


def read_rows(path):
    """Raw rows of a local .jsonl / .json / .parquet file -> (rows, where): where[i] names row i
    for error messages ("file.jsonl:12", or "file.json: row 3")."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found (check the path, or use one of the names "
                        f"{known_names()})")
    ext = path.lower().rsplit(".", 1)[-1]
    if ext == "jsonl":
        rows, lines = _read_jsonl(path)
        where = [f"{path}:{n}" for n in lines]
    elif ext == "json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise DataError(f"{path}{line}: not a valid UTF-8 JSON file "
                            f"({e}; expected a JSON list of rows)") from None
        if isinstance(data, dict):  # {"data": [...]} or {"test": [...]}: take the one list
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise DataError(f"{path}: expected a JSON list of rows (or an object holding one list)")
            data = lists[0]
        rows = list(data)
        where = [f"{path}: row {i}" for i in range(len(rows))]
    elif ext == "parquet":
        import datasets
        rows = list(datasets.load_dataset("parquet", data_files=path, split="train"))
        where = [f"{path}: row {i}" for i in range(len(rows))]
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet)")
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty; expected one JSON object per line "
                        "with a problem and an answer)")
    return rows, where


def load_hub(hub_id, config=None, split="test", data_file=None):
    """Raw rows of a Hugging Face hub dataset (needs network access or a warm HF cache);
    data_file: one file inside the hub repo (then split is "train")."""
    import datasets
    try:
        if data_file:
            ds = datasets.load_dataset(hub_id, data_files={"train": data_file}, split="train")
        else:
            ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # offline, renamed, gated...: say what to do instead
        raise DataError(f"could not load {hub_id} (config={config}, split={split}) from the "
                         f"Hugging Face hub: {type(e).__name__}: {str(e).splitlines()[0][:200]}. "
                         f"Pass a local .jsonl path, or a data_dir (--data-dir, $ERPO_DATA_DIR) "
                         f"holding a copy.") from e
    return list(ds)


def _local_copy(name, data_dir):
    if not data_dir:
        return None
    for fname in LOCAL_FILES.get(name, []) + [f"{name}.jsonl"]:
        path = os.path.join(data_dir, fname)
        if os.path.isfile(path):
            return path
    return None


def looks_like_path(name):
    """A file path rather than a benchmark name: it exists, has a folder part or a data suffix."""
    return (os.path.exists(name) or "/" in name or os.sep in name
            or name.lower().endswith((".jsonl", ".json", ".parquet")))


def load_benchmark(name_or_path, limit=None, data_dir=None, skip_bad=False, read_row=None):
    """Load a benchmark or problem set as a list of normalized rows (see module docstring).

    name_or_path: registered name (case-insensitive), group name, or a local file path.
    limit: keep the first `limit` rows (quick runs). data_dir: folder with local copies of the
    hub benchmarks (e.g. aime2024.jsonl), tried before the hub; default $ERPO_DATA_DIR.
    read_row: (normalized row, "file:line") -> row, applied to each row as it is read (tasks/: a
    row's task checks its own fields), so a bad row is named by its line in the file.
    Raises DataError (a ValueError whose message names the file and line) for an unknown name, a
    missing, empty or malformed file, a problem or answer the model or grader cannot read, or rows
    without problem/answer -- unless skip_bad, which drops the last with a printed count (real
    training sets have a few: 2 of the 8,523 MATH L3-5 rows have an empty answer).
    """
    data_dir = data_dir if data_dir is not None else os.environ.get("ERPO_DATA_DIR")
    key = canonical_name(name_or_path)
    if key in GROUPS:
        rows = []
        for sub in GROUPS[key]:
            for r in load_benchmark(sub, data_dir=data_dir, read_row=read_row):
                rows.append({**r, "id": f"{sub}/{r['id']}"})
        return rows[:limit] if limit is not None else rows
    if key in TINY:
        source = os.path.join(TINY_DIR, TINY[key])
        if not os.path.isfile(source):
            raise DataError(f"{source}: missing (run python -m data.tinymath.prepare)")
        raw, where = read_rows(source)
    elif key in HUB or key in HUB_FILES:
        source = _local_copy(key, data_dir)
        if source:
            raw, where = read_rows(source)
        else:
            if key in HUB:
                raw, source = load_hub(*HUB[key]), HUB[key][0]
            else:
                raw, source = load_hub(HUB_FILES[key][0], data_file=HUB_FILES[key][1]), HUB_FILES[key][0]
            where = [f"{source}: row {i}" for i in range(len(raw))]
    elif looks_like_path(name_or_path):
        source = name_or_path
        raw, where = read_rows(source)
    else:
        raise DataError(f"unknown benchmark {name_or_path!r} (use one of {known_names()} "
                        f"or a path to a .jsonl/.json/.parquet file)")
    if limit is not None:
        raw = raw[:limit]
    return _dedupe_ids(_normalize_rows(raw, where, source, skip_bad, read_row))


def _normalize_rows(raw, where, source, skip_bad, read_row=None):
    """Raw rows -> normalized rows, each then through read_row. A row without a problem or an
    answer is an error naming its file and line, unless skip_bad (training sets), which skips it
    and names the first few."""
    rows, bad = [], []
    for i, r in enumerate(raw):
        try:
            row = normalize_row(r, i, where[i])
            rows.append(read_row(row, where[i]) if read_row else row)
        except MissingField:
            if not skip_bad:
                raise
            bad.append(where[i])
    if bad:
        print(f"{source}: skipped {len(bad)} of {len(raw)} rows without a problem or an answer "
              f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}; --strict-data makes this an error)")
    if not rows:
        raise DataError(f"{source}: none of its {len(raw)} rows has a problem and an answer "
                        f"(fields tried: {PROBLEM_KEYS} / {ANSWER_KEYS})")
    return rows


def _dedupe_ids(rows):
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):  # resume and per-problem metrics key on the id: must be unique
        rows = [{**r, "id": str(i), "orig_id": r["id"]} for i, r in enumerate(rows)]
    return rows


def load_problems(name_or_path, limit=None, data_dir=None, strict=False, read_row=None):
    """Training problems (e.g. "tiny-train" or "math-l3to5"): the rows of load_benchmark, with
    unusable rows skipped (and counted) rather than fatal, unless strict."""
    return load_benchmark(name_or_path, limit=limit, data_dir=data_dir, skip_bad=not strict,
                          read_row=read_row)


def benchmark_label(name_or_path):
    """Short stable name for tables and JSONL keys: the registered name or the file stem."""
    key = canonical_name(name_or_path)
    if key:
        return key
    base = os.path.basename(os.path.normpath(name_or_path))
    return base.rsplit(".", 1)[0] if "." in base else base
