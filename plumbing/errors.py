"""Bad input ends in one line, not a traceback: `error: <file>:<line>: <what is wrong> (<how to
fix it>)` and a non-zero exit. DataError carries such a message; `one_line` turns the errors a
block may raise on bad input into that exit; `check_heldout` is one such check."""

import argparse
import os
import sys
from contextlib import contextmanager


class DataError(ValueError):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line, `<prog>: error: <what>`,
    and exit status 2, not the usage block first (~50 lines for train.py, which under torchrun every
    rank would print)."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


@contextmanager
def one_line(errors=(DataError,), what=""):
    """Exit with `error: [what: ]<the exception's first line>` on any of `errors`."""
    try:
        yield
    except errors as e:
        raise SystemExit(f"error: {what + ': ' if what else ''}{str(e).splitlines()[0]}") from None


def check_heldout(evalsets: dict, train_name: str, train, source_of):
    """DataError if the first held-out set (`evalsets`: name -> data.prompts.PromptSet), whose accuracy
    is eval_acc, the held-out accuracy a run reports, is the training set (`train`): the same file
    (source_of: a set name -> the file behind it, else the name itself), or rows whose problems are
    all training problems (a copy, or its first lines). Sets after it may be training problems: the
    train vs held-out gap is measured so (study/miniature.py)."""
    name, evalset = next(iter(evalsets.items()), (None, None))
    if evalset is None:
        return
    path, train_path = source_of(name), source_of(train_name)
    same_file = all(map(os.path.isfile, (path, train_path))) and os.path.samefile(path, train_path)
    trained = {str(r.get("problem")) for r in train.rows}
    if same_file or (evalset.rows and all(str(r.get("problem")) in trained for r in evalset.rows)):
        what = "is the training file" if same_file else "holds only training problems"
        raise DataError(f"--eval-data {name} {what} (--train-data {train_name}): eval_acc, the held-out "
                        "accuracy, would be training accuracy; give a held-out set first (training problems "
                        "may follow it, to measure the gap)")
