"""`--impl`: which implementation labs/grade.py grades (the student's exercises by default)."""

import importlib

import pytest

IMPLS = {"exercises": "labs.exercises", "repo": "labs.repo_functions"}


def pytest_addoption(parser):
    parser.addoption("--impl", choices=sorted(IMPLS), default="exercises",
                     help="grade labs/exercises.py (default) or the repo's own functions "
                          "(labs/repo_functions.py)")


@pytest.fixture(scope="session")
def impl(request):
    """The module whose six functions are graded."""
    return importlib.import_module(IMPLS[request.config.getoption("--impl")])
