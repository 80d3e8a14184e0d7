"""Test hook, not a user option: a worker lost mid-run, as a scheduler or a dead machine loses it.

    NANOFORGE_INJECT_KILL="1@3"   rank 1 kills itself with SIGKILL right after step 3 (and any save due then)

It fires only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT unset or 0), so that after
torchrun's elastic restart the group (with --resume auto) runs on to the end. SIGKILL, not an exception: no
handler, no checkpoint, no cleanup, exactly a lost machine."""
import os
import signal

from nanoforge.core.errors import NanoforgeError

KILL_ENV = "NANOFORGE_INJECT_KILL"


def kill_if_asked(rank: int, step: int) -> None:
    spec = os.environ.get(KILL_ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    who, _, when = spec.partition("@")
    if not (who.isdigit() and when.isdigit()):
        raise NanoforgeError(f"{KILL_ENV}={spec!r} should look like 1@3 (rank 1, after step 3)")
    if int(who) == rank and int(when) == step:
        os.kill(os.getpid(), signal.SIGKILL)
