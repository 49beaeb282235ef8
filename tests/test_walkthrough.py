"""docs/walkthrough.md is what `python -m study.walkthrough` writes today, and the step it traces is
the step train.py takes.

The document is regenerated in a fresh interpreter (one thread, as the golden runs) and compared
with the committed copy: the text exactly, every computed number within its tolerance, measured
across CPU kernel variants as the golden metrics' are (tests/rounding.py; `python -m
study.walkthrough --tolerances` writes tests/golden/walkthrough_tolerances.json) with a floor for
what float32 resolves (study/walkthrough_doc.py), plus half a unit of each printed last digit.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from study import walkthrough
from study import walkthrough_doc as doc
from tests.rounding import assert_rounding, is_exact

ROOT = walkthrough.ROOT
COMMITTED = os.path.join(ROOT, "docs", "walkthrough.md")
FIGURES = ("walkthrough_kl_tokens.png", "walkthrough_update.png")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """-> (folder of the fresh walkthrough.md and img/, its record: skeleton, values, metrics)."""
    out = tmp_path_factory.mktemp("walkthrough")
    record = out / "record.json"
    subprocess.run([sys.executable, "-m", "study.walkthrough", "--out", str(out), "--record", str(record)],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    return out, json.loads(record.read_text())


def test_the_committed_walkthrough_is_what_the_command_writes(regenerated):
    out, rec = regenerated
    tolerances = json.loads(read(walkthrough.TOLERANCES))["tolerance"]
    bad = doc.compare(rec["skeleton"], read(COMMITTED), read(out / "walkthrough.md"), tolerances)
    assert not bad, "docs/walkthrough.md is out of date:\n" + "\n".join(bad[:20])
    for name in FIGURES:                                   # regenerated, not compared byte for byte
        assert (out / "img" / name).stat().st_size > 10_000
        assert os.path.exists(os.path.join(ROOT, "docs", "img", name)), f"docs/img/{name} is not committed"


def test_the_comparison_catches_a_changed_number_or_text(regenerated):
    out, rec = regenerated
    fresh = read(out / "walkthrough.md")
    tolerances = json.loads(read(walkthrough.TOLERANCES))["tolerance"]
    numbers = doc.read_numbers(rec["skeleton"], fresh)
    assert doc.compare(rec["skeleton"], fresh, fresh, tolerances) == []
    # the step's grad_norm (the last number) 1% off, then one word of the text changed
    last = numbers[-1]
    i = fresh.rindex(last)
    moved = fresh[:i] + doc.fmt(float(last) * 1.01) + fresh[i + len(last):]
    assert len(doc.compare(rec["skeleton"], moved, fresh, tolerances)) == 1
    assert doc.compare(rec["skeleton"], fresh.replace("Advantages", "Advantage"), fresh, tolerances)
    # a number in the middle (a token's log-prob, a weight, ...) 1% off, past its tolerance
    parts = rec["skeleton"].split(doc.Doc.NUMBER)
    k = next(i for i in range(len(numbers) // 2, len(numbers)) if abs(float(numbers[i])) > 1e-3)
    changed = [doc.fmt(float(x) * (1.01 if i == k else 1)) if i == k else x for i, x in enumerate(numbers)]
    text = "".join(p + n for p, n in zip(parts, changed)) + parts[-1]
    assert doc.compare(rec["skeleton"], text, fresh, tolerances) == [
        f"line {''.join(parts[:k + 1]).count(chr(10)) + 1}, number {k}: committed {changed[k]}, "
        f"now {numbers[k]} "
        f"(tolerance {tolerances[k]:.3g})"]


def test_every_number_is_printed_with_at_least_3_significant_figures(regenerated):
    out, rec = regenerated
    numbers = doc.read_numbers(rec["skeleton"], read(out / "walkthrough.md"))
    assert len(numbers) == len(rec["values"]) > 300
    for s in numbers:
        digits = re.sub(r"\D", "", s.partition("e")[0]).lstrip("0")
        assert len(digits) >= 3 or float(s) == 0 and s.count("0") >= 4, s


def test_the_traced_step_is_the_metrics_line_train_py_writes(regenerated, tmp_path):
    """train.py with the walkthrough's arguments, in a fresh interpreter on one thread: its
    metrics.jsonl line of the traced step has the walkthrough's reward, query_kl, policy_kl, loss
    and grad_norm (recomputed by the walkthrough from the tensors it shows), and its next line is
    the walkthrough's next step, bit for bit."""
    _, rec = regenerated
    out = tmp_path / "run"
    args = walkthrough.argv(walkthrough.write_subset(str(tmp_path)), str(out))
    code = "import sys, torch; torch.set_num_threads(1); import train; train.main(sys.argv[1:])"
    subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    lines = {m["step"]: m for m in map(json.loads, read(out / "metrics.jsonl").splitlines())}
    for k in walkthrough.METRICS:
        if is_exact(k):
            assert rec["metrics"][k] == lines[walkthrough.TRACED][k], k
        else:                                   # recomputed from the shown tensors: other kernels
            assert_rounding(f"walkthrough.traced_step.{k}", rec["metrics"][k], lines[walkthrough.TRACED][k])
        # the step after: the trace (GRPO's update from the same weights) left ERPO's run as it was
        assert rec["next_metrics"][k] == lines[walkthrough.TRACED + 1][k], k


def test_links_resolve():
    """Every method.md#anchor is a heading of docs/method.md (GitHub's anchors), every relative
    link a file of the repository."""
    text = read(COMMITTED)
    method = read(os.path.join(ROOT, "docs", "method.md"))
    headings = {doc.slug(h) for h in re.findall(r"^#+ (.+)$", method, re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) > 20
    for link in links:
        path, _, anchor = link.partition("#")
        assert os.path.exists(os.path.normpath(os.path.join(ROOT, "docs", path))), link
        if path == "method.md" and anchor:
            assert anchor in headings, f"{link}: no such heading in docs/method.md"


def test_number_printing_and_reading():
    assert [doc.fmt(x) for x in (0.5, -1.5, 1.25e-5, -0.0, 1234.5, 30.3, 2e-7)] == \
        ["0.5000", "-1.500", "1.250e-5", "0.000", "1234", "30.30", "2.000e-7"]
    assert [doc.last_digit(s) for s in ("0.5000", "1.250e-5", "1234", "30.30")] == \
        pytest.approx([1e-4, 1e-8, 1, 1e-2])
    d = doc.Doc()
    d(f"a {d.num(0.25)} b | {d.num(-3e-6)} c 12")
    assert d.text() == "a 0.2500 b | -3.000e-6 c 12\n"
    assert doc.read_numbers(d.skeleton(), "a 0.2499 b | -3.001e-6 c 12\n") == ["0.2499", "-3.001e-6"]
    assert doc.read_numbers(d.skeleton(), "a 0.2499 b | -3.001e-6 c 13\n") is None
    later = f"then {d.num(2.0, 0.5)}"                   # recorded before the number printed ahead of it
    d(f"first {d.num(1.0)} {later}")
    assert d.in_order() == ([0.25, -3e-6, 1.0, 2.0], [0.0, 0.0, 0.0, 0.5])
    assert doc.slug("8.2 Advantages (`losses.group_advantages`)") == "82-advantages-lossesgroup_advantages"
    assert doc.slug("§4 Query reweighting") == "4-query-reweighting"
