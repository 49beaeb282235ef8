"""The README and the pages it links stay true: short enough to finish, every link and anchor
resolves, every command in the README parses (the Quickstart's main job runs for real, shortened),
and the headline table is the one study/headline.py builds from its committed summaries."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def slug(heading) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path) -> set:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text(path), re.M)}


def test_the_readme_is_short():
    assert len(text(README).splitlines()) <= 400


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run's last line is the README's test command, character for character."""
    readme = open(README).read()
    command = next(line.strip() for line in readme.splitlines() if line.strip().endswith("pytest -q tests"))
    ci = [line for line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines() if line.strip()]
    assert ci[-1] == command


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for target in LINK.findall(text(page)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(file):
            bad.append(f"{target}: no {os.path.relpath(file, ROOT)}")
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, bad


# A page or a docstring that names a README section by its title (the README's "Results"; README,
# "Quickstart"): the title must still be one of the README's headings (sections move to docs/).
SECTION_MENTION = re.compile(r"""README(?:'s|,)\s*\\?"([^"\\]+)\\?\"""")
SOURCE_DIRS = (ROOT, *(os.path.join(ROOT, d)
                       for d in ("docs", "study", "labs", "plumbing", "tasks", "data", "bench")))
SOURCES = [os.path.join(d, f) for d in SOURCE_DIRS if os.path.isdir(d)
           for f in sorted(os.listdir(d)) if f.endswith((".md", ".py"))]


def test_every_named_readme_section_exists():
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text(README), re.M)}
    bad = [f"{os.path.relpath(path, ROOT)}: README section {name!r}" for path in SOURCES
           for name in SECTION_MENTION.findall(text(path)) if name.strip() not in headings]
    assert not bad, f"named README sections that are no README heading: {bad}"
    sample = """the README's "Results", (README, "Quickstart") and the README's \\"X\\" """
    assert SECTION_MENTION.findall(sample) == ["Results", "Quickstart", "X"]


def test_commands_assume_the_active_environment():
    """One convention: the README says once that commands assume `. .venv/bin/activate`; no page
    calls .venv/bin/python, pip or torchrun by path."""
    assert ". .venv/bin/activate" in text(README)
    bad = [f"{os.path.relpath(p, ROOT)}: {line.strip()}" for p in PAGES for line in text(p).splitlines()
           if re.search(r"\.venv/bin/(python|pip|torchrun|pytest)", line)]
    assert not bad, bad


def test_the_lab_says_how_to_get_pytest():
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        assert re.search(r"^pytest\b", f.read(), re.M)
    assert "pip install -r requirements-dev.txt" in text(os.path.join(ROOT, "docs", "teaching.md"))


def test_the_rl_loss_snippet_adds_its_terms():
    """The README's abridged losses.rl_loss: the PG term, then each KL term added to it, as in the code."""
    snippet = text(README).split("and `losses.rl_loss` reads them:")[1].split("```", 2)[1]
    assigns = [line.split("=", 1)[1].strip() for line in snippet.splitlines()
               if line.strip().startswith("loss =")]
    assert len(assigns) == 3 and all(a.startswith("loss + ") for a in assigns[1:]), assigns
    with open(os.path.join(ROOT, "losses.py")) as f:
        code = f.read()
    assert "loss = loss + algo.beta * kl" in code and "loss = loss + algo.alpha * qkl" in code


def readme_commands():
    """Every command line of the README's indented code blocks that runs one of the repository's
    scripts: (script, its arguments)."""
    out, fenced = [], False
    for line in text(README).splitlines():
        fenced ^= line.startswith("```")            # a fenced block is code to read, not to run
        if fenced or not line.startswith("    ") or line.lstrip().startswith("#"):
            continue
        for cmd in line.strip().split("&&"):
            words = shlex.split(cmd.strip()) if cmd.strip() else []
            while words and ("=" in words[0] or words[0].endswith(("torchrun", "python", "python3"))
                             or words[0].startswith("--nproc")):
                words = words[1:]
            if words and words[0] in ("-m",) and len(words) > 1:
                out.append((words[1], words[2:]))
            elif words and words[0].endswith(".py") and os.path.exists(os.path.join(ROOT, words[0])):
                out.append((words[0], words[1:]))
    return out


def test_the_readme_names_its_commands():
    scripts = {s for s, _ in readme_commands()}
    assert {"train.py", "pytest", "venv", "labs.drift_pair", "study.headline"} <= scripts, scripts


@pytest.mark.parametrize("script,argv", [c for c in readme_commands() if c[0] not in ("pytest", "venv")],
                         ids=[" ".join([c[0], *c[1]])[:60] for c in readme_commands() if c[0] not in ("pytest", "venv")])
def test_every_readme_command_parses(script, argv):
    """train.py's and evaluate.py's arguments go through their own parsers; a module's --help runs."""
    if script == "train.py":
        import train
        train.parse_args(argv)
    elif script == "evaluate.py":
        import evaluate
        evaluate.parse_args(argv)
    else:
        r = subprocess.run([sys.executable, *(["-m", script] if not script.endswith(".py") else [script]), "--help"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-1000:]


def test_the_quickstart_main_job_runs(tmp_path):
    """The main command, shortened to 2 steps of 8 prompts and a small evaluation, into its own folder."""
    (argv,) = [a for s, a in readme_commands() if s == "train.py" and "--algo" in a and "--out" not in a]
    import train
    train.main([*argv, "--out", str(tmp_path / "erpo"), "--steps", "2", "--rollout-batch", "8", "--update-batch",
                "4", "--eval-limit", "8", "--eval-every", "2", "--max-new-tokens", "24"])
    assert (tmp_path / "erpo" / "metrics.jsonl").exists()


def test_the_headline_table_is_the_one_built_from_the_summaries():
    from study import headline

    study = headline.aggregate(headline.load_summaries(headline.RESULTS))
    table = headline.table(study)
    assert table in text(README)
    assert text(os.path.join(headline.RESULTS, "table.md")) == table
    paired = headline.paired_table(study)                  # the verdict's numbers: ERPO - GRPO by seed
    assert paired in text(README) and text(os.path.join(headline.RESULTS, "paired.md")) == paired
