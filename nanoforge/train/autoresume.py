"""`--resume auto`: one command line for the first start and every restart of a run (a requeued job, a
torchrun elastic restart), resolved into plain `--resume` or a fresh start before the stage runs.

    RUN holds a complete checkpoint          -> resume (every --resume check applies: same shape, --init, options)
    RUN absent, empty, or without a checkpoint -> start fresh; a config.toml left by a run killed before its first
                                                save is overwritten by the new start
    RUN's config.toml names another stage    -> refused, naming it (never overwrite a different run)

Every rank under torchrun decides on its own from the same files (the run directory on shared storage), so
they agree; nothing is written here."""
from pathlib import Path

from nanoforge.core.config import load_toml
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights import checkpoint as ckpt

AUTO = "auto"


def resolve_resume(resume: bool | str, out: str | Path, stage: str, log=print) -> bool:
    """`--resume` as the stages take it (a bool): True/False unchanged, "auto" decided from RUN's files."""
    if resume != AUTO:
        return bool(resume)
    run_dir = Path(out)
    config = run_dir / "config.toml"
    saved_stage = load_toml(config).get("run", {}).get("stage") if config.is_file() else None
    if saved_stage is not None and saved_stage != stage:
        raise NanoforgeError(f"--resume auto: {run_dir} holds a {saved_stage!r} run, not {stage}; choose another "
                             "--out (auto never starts over a different run)")
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None:
        log(f"--resume auto: continuing {run_dir} from {latest.name}")
        return True
    if config.is_file():
        log(f"--resume auto: {run_dir} has a config but no checkpoint (stopped before its first save): starting fresh")
    return False
