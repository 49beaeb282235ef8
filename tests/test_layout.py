"""The shape of the codebase, as the README promises it: thin entry scripts on a library floor.

Entry scripts (train.py, evaluate.py, analysis.py) import the floor; no module imports an entry
script; there are no import cycles; losses.py imports only torch, the standard library and
losses.py (torch-only); no
function outside tests/ and bench/ is longer than 60 lines; train.py keeps its story (rl_step,
ppo_update, train_rl), and the RL step (rl_step and the train.py functions it calls) fits on two
screens (<= 150 lines); and every option is written once (the parser is the options table). Line
and module lengths and the linter: tests/test_style.py.
"""

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = {"train", "evaluate", "analysis"}
# bench/ and study/ drive the entry scripts from above (benchmarks, the miniature study): not layers.
SKIP_DIRS = {".venv", ".git", "tests", "bench", "study", "__pycache__", "runs", "results"}


def project_modules():
    """{dotted module name: path} of every .py file of the project (tests/bench excluded)."""
    mods = {}
    for dirpath, dirnames, files in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return mods


def imports_of(path):
    """Every module name imported anywhere in the file (top level or inside functions)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def project_graph():
    mods = project_modules()
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def test_no_module_imports_an_entry_script():
    bad = {m: deps & ENTRY for m, deps in project_graph().items() if deps & ENTRY}
    assert not bad, f"modules importing an entry script: {bad}"


# The layers, bottom to top: what each holds. A module may import its own layer and those below,
# never one above; every module of the project is in exactly one layer (a new package names its own).
LAYERS = [
    ("the floor: loss terms (torch only) and plumbing", {"losses", "plumbing"}),
    ("the world and the network: data, tasks, the verifier, the model", {"data", "tasks", "reward", "modeling"}),
    ("the sampler", {"rollout", "sampler"}),
    ("the RL step's parts, evaluation's parts, the warm start", {"rl", "evaluation", "sft"}),
    ("entry scripts and the lab", {"train", "evaluate", "analysis", "labs"}),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of a dotted module name, by its top-level name (package or root file)."""
    top = module.split(".")[0]
    found = [i for i, (_, names) in enumerate(LAYERS) if top in names]
    assert len(found) == 1, f"{module}: in {len(found)} layers (add its package to one of LAYERS)"
    return found[0]


def test_imports_point_down_the_layers():
    graph = project_graph()
    up = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert not up, "imports pointing up the layers:\n" + "\n".join(up)
    assert layer_of("losses") == 0 and layer_of("plumbing.checkpoints") == 0 and layer_of("train") == 4


def test_the_root_shows_the_method():
    """At most 12 .py files at the root, the user's five among them; every package says what it holds
    (a docstring in its __init__.py)."""
    root = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(root) <= 12, root
    assert {"train.py", "rollout.py", "losses.py", "reward.py", "evaluate.py"} <= set(root)
    for pkg in sorted({m.split(".")[0] for m in project_modules() if "." in m}):
        init = os.path.join(ROOT, pkg, "__init__.py")
        assert os.path.exists(init) and ast.get_docstring(ast.parse(open(init).read())), f"{pkg}/: no docstring"


def test_no_import_cycles():
    graph, state, stack = project_graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_losses_imports_only_torch_and_the_standard_library():
    """losses.py (every loss term, the policy-gradient surrogates among them): torch and the standard
    library, so a reader can lift it into another codebase."""
    roots = {i.split(".")[0] for i in imports_of(os.path.join(ROOT, "losses.py"))}
    assert roots - {"torch"} <= set(sys.stdlib_module_names), roots


def test_no_function_longer_than_60_lines():
    longs = []
    for m, path in project_modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    longs.append(f"{m}.{node.name}: {n} lines")
    assert not longs, longs


def rl_step_and_its_callees(src):
    """{name: lines} of train.rl_step and every train.py function it reaches (called or passed on)."""
    funcs = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
    seen, todo = set(), ["rl_step"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [n.id for n in ast.walk(funcs[name]) if isinstance(n, ast.Name) and n.id in funcs]
    return {name: funcs[name].end_lineno - funcs[name].lineno + 1 for name in seen}


def test_the_rl_step_reads_on_two_screens():
    """rl_step and what it calls in train.py, docstrings included: <= 150 lines (the rest of the
    step is in modules of its own: rl/experience.py, losses.py)."""
    parts = rl_step_and_its_callees(open(os.path.join(ROOT, "train.py")).read())
    assert {"rl_step", "ppo_update", "accumulate_gradient", "score_old_and_ref"} <= set(parts)
    assert sum(parts.values()) <= 150, sorted(parts.items(), key=lambda kv: -kv[1])
    toy = "def rl_step():\n    a()\n\n\ndef a():\n    return b\n\n\ndef b():\n    pass\n\n\ndef c():\n    pass\n"
    assert rl_step_and_its_callees(toy) == {"rl_step": 2, "a": 2, "b": 2}


def test_train_py_reads_top_to_bottom():
    src = open(os.path.join(ROOT, "train.py")).read()
    assert "def rl_step(" in src and "def ppo_update(" in src and "def train_rl(" in src  # the story stays


def test_every_option_is_written_once_and_the_parser_is_the_table():
    import losses
    import train
    from plumbing import options

    names = [row[0] for row in train.OPTIONS]
    knobs = [k for k, *_ in options.algo_knobs()]
    assert len(names) == len(set(names)) and not set(names) & set(knobs)
    assert set(knobs) == {f for f in losses.Algo.__dataclass_fields__ if f != "doc"}
    parser = options.build_parser(train.OPTIONS, "")
    dests = {a.dest for a in parser._actions} - {"help", "config"}
    assert dests == set(names) | set(knobs)
    args, _ = train.parse_args([])
    for name, default, *_ in train.OPTIONS:
        if name not in ("out", "lr_decay_steps"):                         # resolved by parse_args
            assert getattr(args, name) == default, name


# ----------------------------------------------------------------------------------------------
# One RL step, followed as a reader follows it: from train.rl_step through every call our code
# makes (the sampler included) to the optimizer step. A call counts unless transformers' code lies
# between it and rl_step: the model's own forward is transformers', and the hooks it calls back (the
# attention mask of modeling/models.py) are not on the reader's path; torch's and the standard
# library's wrappers (no_grad, autograd.Function, contextmanager) are. plumbing/ is the floor a reader trusts by
# name (all_sum, timer, faults.point, optimizer.step, microbatches) and is listed, not counted.

STEP_FILES = 10


def files_one_rl_step_opens(out, data=None) -> dict[str, set[str]]:
    """{file relative to ROOT: the functions of it one RL step of the tiny model calls}, by running
    train.rl_step under sys.setprofile."""
    import train

    found, entry = {}, []

    def ours(code):
        f = code.co_filename
        return f.startswith(ROOT + os.sep) and os.sep + ".venv" + os.sep not in f and \
            os.sep + "tests" + os.sep not in f

    def on_call(frame, event, arg):
        if event != "call" or not ours(frame.f_code):
            return
        f = frame
        while f is not None and f is not entry[0]:                       # no transformers frame above
            if os.sep + "transformers" + os.sep in f.f_code.co_filename:
                return
            f = f.f_back
        if f is not None:
            found.setdefault(os.path.relpath(frame.f_code.co_filename, ROOT), set()).add(frame.f_code.co_name)

    def traced_step(run, step):
        entry[:] = [sys._getframe()]
        sys.setprofile(on_call)
        try:
            return real_step(run, step)
        finally:
            sys.setprofile(None)

    real_step, train.rl_step = train.rl_step, traced_step
    try:
        train.main(["--steps", "1", "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4",
                    "--max-new-tokens", "32", "--eval-every", "0", "--save-every", "0", "--out", str(out),
                    "--query-cache-dir", "", *(["--train-data", data] if data else [])])
    finally:
        train.rl_step = real_step
    return found


def test_one_rl_step_opens_at_most_ten_files(tmp_path):
    files = files_one_rl_step_opens(tmp_path / "run")
    read = sorted(f for f in files if not f.startswith("plumbing" + os.sep))
    assert {"train.py", "rollout.py", "losses.py", "reward.py"} <= set(read), read
    assert len(read) <= STEP_FILES, read


def main(argv=None):
    """python -m tests.test_layout: the files one RL step opens, their lines and functions."""
    import argparse
    import tempfile
    argparse.ArgumentParser(description="The files one RL step of the tiny model opens (traced), with "
                            "their lines and the functions it calls in each.").parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = files_one_rl_step_opens(os.path.join(tmp, "run"))
    for f in sorted(files, key=lambda f: (f.startswith("plumbing"), f)):
        n = sum(1 for _ in open(os.path.join(ROOT, f)))
        print(f"{f:28s} {n:5d} lines  {', '.join(sorted(files[f]))[:120]}")
    outside = [f for f in files if not f.startswith("plumbing")]
    print(f"{len(outside)} files outside plumbing/, {len(files)} in all")


if __name__ == "__main__":
    main()
