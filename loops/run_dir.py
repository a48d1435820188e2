"""One run per folder: the lock a run holds on its ``run_dir`` (``run_dir_lock``) and the check
that a resume continues the same run (``check_resume``: the same recipe, the same settings but
those in ``RESUMABLE_CHANGES``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rlcore.loops.checkpoint import checkpoint_info
from rlcore.loops.checkpoint_codec import CheckpointError

__all__ = ["LOCK_NAME", "run_dir_lock", "RESUMABLE_CHANGES", "check_resume"]


LOCK_NAME = ".rlcore.lock"  # held by the run writing the folder (run_dir_lock)


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir/.rlcore.lock`` while a run writes there: a second writer gets a clear error.

    An operating-system lock (``filelock``): released on any exit, a killed run included, so a
    crashed run never leaves a stale lock behind (a killed run may leave the unlocked file; a normal
    exit removes it). Yields the lock file's path.

    Raises:
        RuntimeError: another process (or another run in this one) holds the folder.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(run_dir / LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RuntimeError(f"run_dir: {run_dir} is in use by another run (its lock {lock.lock_file} is held); "
                           "wait for that run to end, or pick another run_dir") from None
    try:
        yield Path(lock.lock_file)
    finally:
        with contextlib.suppress(OSError):  # removed while still held: the folder holds only the run's files
            os.unlink(lock.lock_file)
        lock.release()


# Fields a resumed run may change: how long it runs, where and how often it logs, saves and evaluates.
RESUMABLE_CHANGES = frozenset({"steps", "num_epochs", "resume", "run_dir", "save_every", "keep_last", "eval_every",
                               "log_every", "report_to", "log_completions", "eval_batch_size", "num_eval_images", "eval_seed",
                               "device", "init_from", "gradient_checkpointing"})


def check_resume(checkpoint: str | Path, config: Mapping[str, Any], recipe: str) -> None:
    """Refuse to resume ``checkpoint`` under another recipe, or with settings that change the run.

    ``config`` (a plain dict) must match the one stored with the checkpoint in every field but
    ``RESUMABLE_CHANGES`` (fields the stored config lacks are not compared).

    Raises:
        ValueError: naming the stored recipe, or every differing field with both values, and how
            to proceed.
    """
    stored = checkpoint_info(checkpoint)["config"]
    if not isinstance(stored, dict):
        raise CheckpointError(f"{checkpoint}/config.json: expected a mapping, got {type(stored).__name__}")
    if stored.get("recipe", recipe) != recipe:
        raise ValueError(f"resume: {checkpoint} belongs to a {stored['recipe']!r} run, not {recipe!r}; pick another "
                         f"run_dir (init_from={str(checkpoint)!r} starts a new run from its weights)")
    changed = {k: (stored[k], v) for k, v in config.items()
               if k in stored and k not in RESUMABLE_CHANGES and k != "recipe" and stored[k] != v}
    if changed:
        listed = ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in sorted(changed.items()))
        raise ValueError(f"resume: {checkpoint} was written with {listed}; resume with the run's values, or pick "
                         f"another run_dir (init_from={str(checkpoint)!r} starts a new run from its weights)")
