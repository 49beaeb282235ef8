"""The error for bad input data. Its message names where (file:line) and how to fix it; entry
scripts print it as one line, `error: <file>:<line>: <what is wrong> (<how to fix it>)`, and exit."""


class DataError(ValueError):
    pass
