"""Bad input ends in one line, not a traceback: `error: <file>:<line>: <what is wrong> (<how to
fix it>)` and a non-zero exit. DataError carries such a message; `one_line` turns the errors a
block may raise on bad input into that exit."""

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
