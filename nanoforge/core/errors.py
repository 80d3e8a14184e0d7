"""The one exception type a person is meant to read. The CLI prints its message and exits non-zero;
anything else escaping is a bug and keeps its traceback."""


class NanoforgeError(Exception):
    """An error caused by the user's input (a file, a flag, a checkpoint), with an actionable message."""
