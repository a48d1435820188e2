"""One run per folder: the lock a run holds on its ``run_dir`` (``run_dir_lock``), the claim a new
run makes on it (``claim_run_dir``: never into another run's files, unless told to remove them), and
the check that a resume continues the same run (``check_resume``: the same recipe, the same
settings but those in ``RESUMABLE_CHANGES``). ``open_run_dir`` is the lock and the claim together,
what ``loops.recipe.run`` holds for a whole run."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rlcore.loops.checkpoint import checkpoint_info
from rlcore.loops.checkpoint_codec import CheckpointError

__all__ = ["LOCK_NAME", "RUN_FILES", "run_dir_lock", "run_files", "claim_run_dir", "open_run_dir",
           "RESUMABLE_CHANGES", "check_resume", "resume_command", "interrupted_report"]


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


# What a run writes at the top of its folder: logs, trackers, images and exports by name, and
# checkpoints with the scratch folders of their saves (loops.checkpoint) by pattern.
RUN_FILES = frozenset({"metrics.jsonl", "metrics.tmp", "completions.jsonl", "samples.jsonl", "samples.md",
                       "tensorboard", "wandb", "images", "lora"})
_RUN_PATTERN = re.compile(r"^(checkpoint-\d+|\.tmp-step-\d+-[0-9a-f]+|\.old-checkpoint-\d+-[0-9a-f]+"
                          r"|\.del-.+-[0-9a-f]{8})$")


def run_files(run_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """``(a run's files, everything else)`` at the top of ``run_dir``, each sorted by name.

    A run's files are the names of ``RUN_FILES`` and the checkpoint names (``checkpoint-N`` and the
    ``.tmp-`` / ``.old-`` / ``.del-`` folders of interrupted saves); a symbolic link is never one
    (a run writes none). The lock (``LOCK_NAME``) is in neither list. A missing folder: ``([], [])``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return [], []
    ours, others = [], []
    for p in sorted(run_dir.iterdir()):
        if p.name == LOCK_NAME:
            continue
        written = not p.is_symlink() and (p.name in RUN_FILES or _RUN_PATTERN.match(p.name) is not None)
        (ours if written else others).append(p)
    return ours, others


def _names(paths: list[Path], limit: int = 6) -> str:
    shown = ", ".join(p.name for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def claim_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Let a run start in ``run_dir``: a resume continues the run there; a new run needs a folder
    that holds no other run's files, or ``overwrite`` to remove them first.

    A folder that is missing, empty, or holds only the lock or files no run writes starts a new run
    as it is. With ``overwrite`` the other run's files (``run_files``) are renamed aside, then
    deleted; nothing else is touched, and a folder that also holds other files is refused rather
    than half-cleared. Call it holding the lock (``open_run_dir``), before the run writes anything.

    Raises:
        ValueError: ``resume`` and ``overwrite`` together, or ``overwrite`` of a folder that also
            holds files no run writes (named).
        FileExistsError: a new run (neither flag) into a folder holding another run's files (named),
            saying how to continue it or start over.
    """
    if resume and overwrite:
        raise ValueError(f"run_dir: {run_dir}: resume and overwrite contradict each other (resume continues the "
                         "run in the folder, overwrite deletes it); choose one")
    if resume:
        return
    ours, others = run_files(run_dir)
    if not ours:
        return
    if not overwrite:
        raise FileExistsError(f"run_dir: {run_dir} holds another run ({_names(ours)}); continue it with --resume true "
                              "(resume=True), or start over in a new run_dir, or with --overwrite true "
                              "(overwrite=True), which deletes that run's files first")
    if others:
        raise ValueError(f"overwrite: {run_dir} also holds files no run writes ({_names(others)}); overwrite deletes "
                         "only a run's files and will not leave them behind a new run: move them away, or pick "
                         "a new run_dir")
    _remove(Path(run_dir), ours)


def _remove(run_dir: Path, paths: list[Path]) -> None:
    """Rename each path aside (``.del-<name>-<hex>``: never again taken for a run's file), then delete it."""
    doomed = []
    for p in paths:
        aside = p if p.name.startswith(".del-") else run_dir / f".del-{p.name}-{secrets.token_hex(4)}"
        os.replace(p, aside)
        doomed.append(aside)
    for p in doomed:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


@contextlib.contextmanager
def open_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool = False) -> Iterator[Path]:
    """``run_dir_lock(run_dir)`` held while the run writes, its ``claim_run_dir`` checked first."""
    with run_dir_lock(run_dir) as lock:
        claim_run_dir(run_dir, resume=resume, overwrite=overwrite)
        yield lock


_RESTATED = ("--resume", "--overwrite", "--run_dir")  # flags the resume command sets itself


def resume_command(argv: Sequence[str], run_dir: str | Path) -> str:
    """The ``rlcore`` command line continuing a run started with ``argv`` (``["train", RECIPE,
    ...]``): its flags but ``--resume`` / ``--overwrite`` / ``--run_dir``, then ``--resume true
    --run_dir RUN_DIR``, quoted for a POSIX shell.

    >>> resume_command(["train", "sft", "--steps", "6", "--overwrite", "true", "--run_dir", "R"], "R")
    'rlcore train sft --steps 6 --resume true --run_dir R'
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _RESTATED:
            skip = True  # and its value
        elif not arg.startswith(tuple(f"{flag}=" for flag in _RESTATED)):
            kept.append(arg)
    return "rlcore " + shlex.join([*kept, "--resume", "true", "--run_dir", str(run_dir)])


def interrupted_report(stopped: Any, argv: Sequence[str]) -> str:
    """What ``rlcore`` prints for a run stopped by a signal (``loops.fold.Interrupted``): where it
    stopped, what was saved, and the command that continues it (``resume_command``)."""
    lines = [f"rlcore: {stopped.summary}"]
    if stopped.run_dir:
        lines.append(f"rlcore: resume with: {resume_command(argv, stopped.run_dir)}")
    return "\n".join(lines)


# Fields a resumed run may change: how long it runs, where and how often it logs, saves and evaluates.
RESUMABLE_CHANGES = frozenset({"steps", "num_epochs", "resume", "run_dir", "save_every", "keep_last", "eval_every",
                               "log_every", "report_to", "log_completions", "eval_batch_size", "num_eval_images", "eval_seed",
                               "device", "init_from", "gradient_checkpointing", "overwrite"})


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
