"""Test hooks, not user options: faults the training loop is made to meet, so that tests can see it survive them.

A worker lost mid-run, as a scheduler or a dead machine loses it:

    NANOFORGE_INJECT_KILL="1@3"   rank 1 kills itself with SIGKILL right after step 3 (and any save due then)

It fires only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT unset or 0), so that after
torchrun's elastic restart the group (with --resume auto) runs on to the end. SIGKILL, not an exception: no
handler, no checkpoint, no cleanup, exactly a lost machine.

Non-finite values, to exercise the guard (train/guard.py):

    NANOFORGE_INJECT_NONFINITE="loss@5,grad@7"   step 5's loss and step 7's gradients are made non-finite
"""
import os
import signal

from nanoforge.core.errors import NanoforgeError

KILL_ENV = "NANOFORGE_INJECT_KILL"
INJECT_ENV = "NANOFORGE_INJECT_NONFINITE"


def kill_if_asked(rank: int, step: int) -> None:
    spec = os.environ.get(KILL_ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    who, _, when = spec.partition("@")
    if not (who.isdigit() and when.isdigit()):
        raise NanoforgeError(f"{KILL_ENV}={spec!r} should look like 1@3 (rank 1, after step 3)")
    if int(who) == rank and int(when) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def parse_injections(spec: str) -> dict[str, set[int]]:
    """NANOFORGE_INJECT_NONFINITE's steps, by kind: {"loss": {5}, "grad": {7}} (in-process tests and subprocesses
    alike)."""
    out: dict[str, set[int]] = {"loss": set(), "grad": set()}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, step = item.partition("@")
        if kind not in out or not step.isdigit():
            raise NanoforgeError(f"{INJECT_ENV}: {item!r} should look like loss@5 or grad@7")
        out[kind].add(int(step))
    return out


def injections_from_env() -> dict[str, set[int]]:
    return parse_injections(os.environ.get(INJECT_ENV, ""))


def poison_loss(loss, step: int, injections: dict[str, set[int]]):
    """The loss, made infinite at the steps NANOFORGE_INJECT_NONFINITE names for "loss"."""
    return loss * float("inf") if step in injections.get("loss", ()) else loss


def poison_grads(model, step: int, injections: dict[str, set[int]]) -> None:
    """A NaN in the first trainable gradient at the steps NANOFORGE_INJECT_NONFINITE names for "grad"."""
    if step in injections.get("grad", ()):
        next(p for p in model.parameters() if p.requires_grad).grad.view(-1)[0] = float("nan")
