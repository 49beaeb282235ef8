"""Readability rules, checked (issue #21; they replaced a line cap on train.py, which had made its
code denser instead of clearer):

1. no function over 60 lines (tests/test_layout.py);
2. no line over 110 characters, comments and docstrings included (prose wraps too), except inside
   module-level tables (a module-level assignment whose value is a list/tuple/dict/set literal, or
   such literals joined by an operator, as train.py's `OPTIONS = [...] + sft.OPTIONS`) and a line
   that is only a URL;
3. no module over 600 lines, but losses.py (800): every loss term side by side in one file, the
   policy-gradient surrogates among them, is what the user asked for (a reader diffs GRPO and ERPO
   there);
4. `ruff check` passes with the settings in pyproject.toml (CI installs ruff from requirements-dev.txt).

Rules 2 and 3 cover the modules tests/test_layout.py walks (tests/, bench/, study/ are drivers and
tests, not the library; `python tests/test_style.py --report tests bench study` counts them too).
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.test_layout import project_modules  # noqa: E402  (the same walk as the layout rules)

MAX_LINE = 110     # also [tool.ruff] line-length in pyproject.toml
MAX_MODULE = 600
LONGER = {"losses.py": 800}   # rule 3's one exception, and why: above
URL_ONLY = re.compile(r"""^\s*(#\s*)?[<("']?https?://\S+$""")

def checked_files(extra_dirs=()):
    """{path relative to ROOT (with /): absolute path} of the modules the rules cover, plus every .py
    file under `extra_dirs` (e.g. "tests")."""
    paths = list(project_modules().values())
    for top in extra_dirs:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "results") and d[0] != "."]
            paths += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return {os.path.relpath(p, ROOT).replace(os.sep, "/"): p for p in sorted(paths)}


def _is_table(value):
    if isinstance(value, (ast.List, ast.Tuple, ast.Dict, ast.Set)):
        return True
    return isinstance(value, ast.BinOp) and (_is_table(value.left) or _is_table(value.right))


def table_lines(tree):
    """Line numbers inside module-level tables."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_table(node.value):
            out.update(range(node.lineno, node.end_lineno + 1))
    return out


def long_lines(src):
    """[(line number, length)] of the lines over MAX_LINE outside tables and URL-only lines."""
    tables = table_lines(ast.parse(src))
    return [(i, len(line)) for i, line in enumerate(src.splitlines(), 1)
            if len(line) > MAX_LINE and i not in tables and not URL_ONLY.match(line)]


def offenders(extra_dirs=()) -> list[str]:
    """"path:line: N characters" and "path: N lines" of every line and module over the limits."""
    bad = []
    for rel, path in checked_files(extra_dirs).items():
        with open(path, encoding="utf-8") as f:
            src = f.read()
        bad += [f"{rel}:{i}: {n} characters" for i, n in long_lines(src)]
        if (n := len(src.splitlines())) > LONGER.get(rel, MAX_MODULE):
            bad.append(f"{rel}: {n} lines")
    return bad


def test_no_line_longer_than_110_characters():
    bad = [b for b in offenders() if "characters" in b]
    assert not bad, "lines over 110 characters outside tables:\n" + "\n".join(bad)


def test_no_module_longer_than_600_lines():
    bad = [b for b in offenders() if b.endswith(" lines")]
    assert not bad, ("modules over 600 lines (split by concept, as rollout.py / sampler/ / modeling/):\n"
                     + "\n".join(bad))


def test_tables_and_urls_are_the_only_exemptions():
    src = ("X = [\n    '" + "x" * 120 + "',\n] + Y.Z\n"
           "def f():\n    t = ['" + "y" * 120 + "']\n"
           "# https://example.com/" + "z" * 120 + "\n"
           '"""' + "w" * 120 + '"""\n')
    assert [i for i, _ in long_lines(src)] == [5, 7]


def test_ruff_config_matches_the_line_limit():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert re.search(rf"^line-length\s*=\s*{MAX_LINE}\b", f.read(), re.M)


def test_ruff_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -r requirements-dev.txt; CI always runs this)")
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ROOT]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, f"ruff check (settings: pyproject.toml):\n{res.stdout}{res.stderr}"


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="List the lines and modules over the limits of tests/test_style.py.")
    p.add_argument("--report", nargs="*", default=[], metavar="FOLDER",
                   help="also count these folders (e.g. tests bench study)")
    args = p.parse_args(argv)
    print("\n".join(offenders(args.report)) or "no line or module over the limits")


if __name__ == "__main__":
    main()
