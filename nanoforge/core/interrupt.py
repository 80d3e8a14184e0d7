"""SIGTERM taken as Ctrl-C is taken: an exception in the main thread, so that the clean-ups which undo a half-done
write (`except BaseException`: temporary directories removed, worker processes stopped) run for a `kill` or a
scheduler's stop too, and the command ends quietly with 128 + the signal's number (commands.run). A worker
process ends with its parent, however the parent ends (exit_with_parent)."""
import ctypes
import os
import signal
from contextlib import contextmanager, suppress
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""
    signum = signal.SIGTERM


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def exit_with_parent(parent: int) -> None:
    """In a worker process of `parent`: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing),
    so a parent killed with SIGKILL leaves no orphan at work, each to print a BrokenPipeError traceback when it
    hands back its result; a parent that is already gone ends it at once."""
    with suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated; the handler before it is back afterwards. Off the main thread
    (where Python cannot take signals) it changes nothing."""
    previous, installed = None, False
    with suppress(ValueError):
        previous, installed = signal.signal(signal.SIGTERM, _raise_terminated), True
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
