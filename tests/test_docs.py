"""The repository stands alone: every `docs/method.md §N` the code cites exists, and no code file
points at files outside the repository (the team's scratch space is not shipped)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "method.md")

# Folders that are not part of the shipped source: VCS, virtual environments, caches, run outputs
# (see .gitignore), and tests/ (which may quote references on purpose).
SKIP_DIRS = {".git", ".venv", "venv", "tests", "__pycache__", ".pytest_cache", "runs", "results",
             ".whl", ".gl", "node_modules"}

HEADING = re.compile(r"^## §(\d+) \S", re.M)
# `method.md §2`, `§2-§4`, `§2-3`, `§2–4`, `§5, §8` (a list item needs its own §, so a
# following "§8, 1 more" does not swallow the number after the comma).
REF = re.compile(r"method\.md\s*§\s*(\d+)((?:\s*[-–]\s*§?\s*\d+|\s*,\s*§\s*\d+)*)")
TAIL = re.compile(r"([-–,])\s*§?\s*(\d+)")
FORBIDDEN = ("ERPO.md", "ENV-NOTES", "../shared")


def doc_sections(path=DOC):
    with open(path, encoding="utf-8") as f:
        return [int(n) for n in HEADING.findall(f.read())]


def ref_numbers(match):
    """Section numbers of one reference match: ranges expanded, lists split."""
    nums = [int(match.group(1))]
    for sep, n in TAIL.findall(match.group(2)):
        n = int(n)
        if sep == ",":
            nums.append(n)
        else:
            if n <= nums[-1]:
                raise ValueError(f"reversed or empty range in {match.group(0)!r}")
            nums.extend(range(nums[-1] + 1, n + 1))
    return nums


def source_files(root=ROOT, exts=(".py", ".md"), skip_top=()):
    """Files under root with the given extensions, outside SKIP_DIRS (at any depth), virtual
    environments (any folder with a pyvenv.cfg), and the top-level folders in skip_top."""
    for dirpath, dirnames, filenames in os.walk(root):
        top = os.path.relpath(dirpath, root) == "."
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.endswith(".egg-info")
                             and not (top and (d in skip_top or d.startswith("out")))
                             and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg")))
        for name in sorted(filenames):
            if name.endswith(exts):
                yield os.path.join(dirpath, name)


def unresolved_refs(root, sections):
    """['path:line: text -> §N missing', ...] for every method.md reference without a heading."""
    bad = []
    for path in source_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            for m in REF.finditer(line):
                try:
                    nums = ref_numbers(m)
                except ValueError as e:
                    bad.append(f"{os.path.relpath(path, root)}:{i}: {e}")
                    continue
                missing = [n for n in nums if n not in sections]
                if missing:
                    bad.append(f"{os.path.relpath(path, root)}:{i}: {m.group(0)!r} -> "
                               f"no '## §N' heading for {missing}")
    return bad


def test_method_doc_has_sections_1_to_9_once_each():
    secs = doc_sections()
    assert all(n in secs for n in range(1, 10)), f"docs/method.md headings are {secs}, need §1..§9"
    assert len(secs) == len(set(secs)), f"duplicate '## §N' headings in docs/method.md: {secs}"
    assert secs == sorted(secs), f"'## §N' headings out of order: {secs}"


def test_every_method_md_reference_resolves():
    bad = unresolved_refs(ROOT, set(doc_sections()))
    assert not bad, "references to missing sections of docs/method.md:\n" + "\n".join(bad)


def test_reference_parser_on_a_temporary_tree(tmp_path):
    """The checker itself: ranges and lists are expanded, and a missing section is reported."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        '"""See docs/method.md §2-§4 and docs/method.md §2-3."""\n'
        '# docs/method.md §5, §8, "KL estimators"; also (docs/method.md §10)\n')
    (tmp_path / "b.md").write_text("Read docs/method.md §6 then `docs/method.md §7–9`.\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("# docs/method.md §99 (tests/ is skipped)\n")

    found = []
    for path in source_files(str(tmp_path)):
        with open(path) as f:
            found += [ref_numbers(m) for m in REF.finditer(f.read())]
    assert sorted(found) == [[2, 3], [2, 3, 4], [5, 8], [6], [7, 8, 9], [10]]

    assert unresolved_refs(str(tmp_path), set(doc_sections())) == []
    bad = unresolved_refs(str(tmp_path), set(range(1, 10)))
    assert len(bad) == 1 and "[10]" in bad[0] and "a.py:2" in bad[0]
    (tmp_path / "c.py").write_text("# docs/method.md §4-2\n")
    assert any("reversed" in b for b in unresolved_refs(str(tmp_path), set(range(1, 11))))


def test_code_does_not_point_outside_the_repository():
    bad = []
    for path in source_files(ROOT, exts=(".py",), skip_top=("bench",)):
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                for s in FORBIDDEN:
                    if s in line:
                        bad.append(f"{os.path.relpath(path, ROOT)}:{i}: {s!r}: {line.strip()[:100]}")
    assert not bad, ("code refers to files outside the repository (cite docs/method.md §N "
                     "instead):\n" + "\n".join(bad))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
