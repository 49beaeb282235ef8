"""The shape of the codebase, as the README promises it: thin entry scripts on a library floor.

Entry scripts (train.py, evaluate.py, analysis.py) import the floor; no module imports an entry
script; there are no import cycles; losses.py imports only torch, the standard library and
surrogates.py (torch-only); no
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


# The floor (plumbing, losses, surrogates) imports nothing above it; the task layer imports no entry script.
PLUMBING = {"distributed", "run_dir", "checkpoints", "eval_folder", "optimizer", "options", "batching", "faults",
            "plots", "mathverify_pool", "errors", "interrupts", "timer", "memory_plan", "time_model"}
FLOOR = {"losses", "surrogates", "plumbing", *(f"plumbing.{m}" for m in PLUMBING)}


def test_imports_point_down_the_layers():
    graph = project_graph()
    assert FLOOR <= set(graph), FLOOR - set(graph)
    assert {m for m in graph if m.startswith("plumbing.")} == FLOOR - {"losses", "surrogates", "plumbing"}
    up = {m: deps - FLOOR for m, deps in graph.items() if m in FLOOR and deps - FLOOR}
    assert not up, f"floor modules importing the task layer or an entry script: {up}"
    layers = {m: 0 if m in FLOOR else 2 if m in ENTRY else 1 for m in graph}
    assert all(layers[d] <= layers[m] for m, deps in graph.items() for d in deps)


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
    """losses.py and surrogates.py (the policy-gradient terms it aggregates): torch, the standard
    library, and losses.py the surrogates."""
    for name, allowed in (("losses", {"torch", "surrogates"}), ("surrogates", {"torch"})):
        roots = {i.split(".")[0] for i in imports_of(os.path.join(ROOT, name + ".py"))}
        assert roots - allowed <= set(sys.stdlib_module_names), (name, roots)


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
    step is a module of its own: experience.py, step_plan.py, losses.py, metrics.py)."""
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
