"""Bad input ends in one line, not a traceback: `error: <file>:<line>: <what is wrong> (<how to
fix it>)` and a non-zero exit. DataError carries such a message; `one_line` turns the errors a
block may raise on bad input into that exit; `check_heldout` is one such check."""

import os
from contextlib import contextmanager


class DataError(ValueError):
    pass


@contextmanager
def one_line(errors=(DataError,), what=""):
    """Exit with `error: [what: ]<the exception's first line>` on any of `errors`."""
    try:
        yield
    except errors as e:
        raise SystemExit(f"error: {what + ': ' if what else ''}{str(e).splitlines()[0]}") from None


def check_heldout(evalsets: dict, train_name: str, train, source_of):
    """DataError if a held-out set (`evalsets`: name -> data.prompts.PromptSet) is the training set
    (`train`): the same file (source_of: a set name -> the file behind it, else the name itself),
    or rows whose problems are all training problems (a copy, or the first lines of it). Its
    accuracy would be training accuracy."""
    train_path, trained = source_of(train_name), {str(r.get("problem")) for r in train.rows}
    for name, evalset in evalsets.items():
        path, rows = source_of(name), evalset.rows
        same_file = all(map(os.path.isfile, (path, train_path))) and os.path.samefile(path, train_path)
        if same_file or (rows and all(str(r.get("problem")) in trained for r in rows)):
            what = "is the training file" if same_file else "holds only training problems"
            raise DataError(f"--eval-data {name} {what} (--train-data {train_name}): its accuracy would be "
                            "training accuracy, not held-out; give a set the run does not train on")
