"""`--help` of every command a user can run: the entry scripts, analysis.py's verbs, the study, the
benchmarks, the data generator and the golden-metrics tool. In-process (one import of torch for
all of them): each must print its usage and exit 0, since argparse renders every option's help only
when asked, so a broken help string (a bare `%` is a format to argparse) hides until a user types
--help."""

import ast
import glob
import importlib.util
import os
import sys

import pytest

from tests.test_docs import source_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# file -> the argument lists whose help is shown (a verb's own --help after the verb)
COMMANDS = {
    "train.py": [["--help"]],
    "evaluate.py": [["--help"]],
    "analysis.py": [["--help"], ["runs", "--help"], ["nll", "--help"]],
    "study/miniature.py": [["--help"]],
    "study/walkthrough.py": [["--help"]],
    "study/long_run.py": [["--help"]],
    "study/headline.py": [["--help"]],
    "study/zipf.py": [["--help"]],
    "bench/bench_rl.py": [["--help"]],
    "bench/bench_monitors.py": [["--help"]],
    "bench/bench_sampler.py": [["--help"]],
    "bench/bench_threads.py": [["--help"]],
    "bench/bench_grader_pool.py": [["--help"]],
    "bench/bench_grader_timing.py": [["--help"]],
    "bench/gpu_check.py": [["--help"]],
    "bench/memory_check.py": [["--help"]],
    "bench/reliability_sweep.py": [["--help"]],
    "data/tinymath/prepare.py": [["--help"]],
    "data/countdown/prepare.py": [["--help"]],
    "data/zipf/prepare.py": [["--help"]],
    "tests/test_golden.py": [["--help"]],
    "tests/test_one_pass.py": [["--help"]],
    "labs/drift_pair.py": [["--help"]],
    "labs/reweighting.py": [["--help"]],
    "tests/test_style.py": [["--help"]],
    "tests/test_layout.py": [["--help"]],
}
# `python plumbing/mathverify_pool.py --server N` is the grader pool's own child process, not a command;
# tests/test_docs.py's main guard runs pytest.
NOT_COMMANDS = {"plumbing/mathverify_pool.py", "tests/test_docs.py"}


def scripts_with_a_main_guard():
    """Every project .py file (the shipped source, as test_docs walks it, and tests/) that does
    something under `if __name__ == "__main__"`."""
    paths = [*source_files(ROOT, (".py",)), *glob.glob(os.path.join(ROOT, "tests", "*.py"))]
    out = set()
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            out.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return out


def test_every_command_is_listed():
    assert scripts_with_a_main_guard() - NOT_COMMANDS == set(COMMANDS)


def load(rel):
    """The script as a module of its own name (a bench/ file is no package member)."""
    name = "entry_" + rel.replace("/", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module              # as `python script.py` has it: dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rel,argv", [(rel, argv) for rel, argvs in COMMANDS.items() for argv in argvs],
                         ids=[f"{rel} {' '.join(argv)}" for rel, argvs in COMMANDS.items() for argv in argvs])
def test_help(rel, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        load(rel).main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage:"), out[-2000:]
    assert "--help" in out
    blocks = out.split("\n\n")                  # usage, the description (if any), then the options
    described = [b for b in blocks[1:] if not b.startswith(("options:", "positional arguments:", "  "))]
    if described:                                # a description is whole sentences, not a cut first line
        assert described[0].rstrip()[-1] in ".:)?", described[0]
