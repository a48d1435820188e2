"""One run per folder: the lock a run holds on its ``run_dir`` (``run_dir_lock``), the claim a new
run makes on it (``claim_run_dir``: never into another run's files, unless told to remove them), and
the check that a resume continues the same run (``check_resume``: the same recipe, the same
settings but those in ``RESUMABLE_CHANGES``). ``open_run_dir`` is the lock and the claim together,
what ``loops.recipe.run`` holds for a whole run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rlcore.loops.checkpoint import SCRATCH_NAME, checkpoint_info, list_checkpoints
from rlcore.loops.checkpoint_codec import CheckpointError, read_json

__all__ = ["LOCK_NAME", "RUN_FILES", "RunDirError", "run_dir_lock", "run_files", "claim_run_dir", "open_run_dir",
           "RESUMABLE_CHANGES", "check_resume", "resume_command", "interrupted_report"]


LOCK_NAME = ".rlcore.lock"  # held by the run writing the folder (run_dir_lock)


class RunDirError(FileExistsError, ValueError):
    """A run refused the folder it was given (``claim_run_dir``): a setting to change, not a fault of the program."""


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
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(f"run_dir: {run_dir} is not a folder (it, or a folder above it, is an existing "
                                 "file); pick another run_dir") from None
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
_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
_STANDS_IN = re.compile(r"^\.old-checkpoint-\d+-[0-9a-f]+$")  # a checkpoint a re-save set aside (list_checkpoints)
# what an interrupted overwrite left set aside (_remove): .del-<a run's file>-<8 hex>
_SET_ASIDE = re.compile(r"^\.del-(?:" + "|".join(re.escape(n) for n in sorted(RUN_FILES))
                        + r"|\.tmp-step-\d+-[0-9a-f]+|\.old-checkpoint-\d+-[0-9a-f]+)-[0-9a-f]{8}$")
_MANIFEST_BYTES = 16 << 20
_LINE_BYTES = 1 << 20


def _rlcore_checkpoint(p: Path) -> bool:
    """``p`` is a folder holding rlcore's ``manifest.json``: ``{"format": int, "files": {...}}``."""
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        manifest = read_json(p / "manifest.json", max_bytes=_MANIFEST_BYTES)
    except CheckpointError:
        return False
    return (isinstance(manifest, dict) and type(manifest.get("format")) is int
            and isinstance(manifest.get("files"), dict))


def _rlcore_metrics(p: Path) -> bool:
    """``p`` is a file whose first line is one rlcore's ``JsonlLogger`` writes: a JSON object with a
    numeric ``"step"`` and ``"time"``."""
    if p.is_symlink() or not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            record = json.loads(f.readline(_LINE_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and all(
        isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool) for k in ("step", "time"))


def run_files(run_dir: str | Path) -> tuple[list[Path], list[Path], list[Path]]:
    """``(a run's files, a run's names that no rlcore run wrote, everything else)`` at the top of
    ``run_dir``, each sorted by name.

    An rlcore run is there when the folder holds a checkpoint with rlcore's ``manifest.json``
    (``checkpoint-N``, or ``.old-checkpoint-N-<hex>`` set aside by a re-save) or a ``metrics.jsonl``
    whose first line is rlcore's (a JSON object with a numeric ``step`` and ``time``). A run's files
    are then: those checkpoints and that ``metrics.jsonl``; the scratch folders of a save by their
    exact names (``checkpoint.SCRATCH_NAME``: ``.tmp-step-N-<hex>``, ``.old-checkpoint-N-<hex>``,
    ``.del-checkpoint-N-<hex>``) and what an overwrite sets aside (``.del-<a run's file>-<hex>``),
    run or no run; and the names of ``RUN_FILES`` when an rlcore run is there. A run's names that
    no rlcore run wrote (the second list): a ``checkpoint-N`` without rlcore's manifest, a name of
    ``RUN_FILES`` with no rlcore run in the folder, a symbolic link under either (a run writes
    none). Anything else (``.tmp-mydata``, ``notes.txt``) is the third list, never a run's. The
    lock (``LOCK_NAME``) is in no list. A missing folder: ``([], [], [])``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return [], [], []
    entries = [p for p in sorted(run_dir.iterdir()) if p.name != LOCK_NAME]
    anchors = {p for p in entries if (_rlcore_metrics(p) if p.name == "metrics.jsonl" else
                                      (_CHECKPOINT.match(p.name) or _STANDS_IN.match(p.name)) and _rlcore_checkpoint(p))}
    ours, foreign, others = [], [], []
    for p in entries:
        named = p.name in RUN_FILES or _CHECKPOINT.match(p.name) is not None
        scratch = SCRATCH_NAME.match(p.name) or _SET_ASIDE.match(p.name)
        beside = p.name in RUN_FILES and bool(anchors)  # a run's name, with an rlcore run in the folder
        if p in anchors or (not p.is_symlink() and (scratch or beside)):
            ours.append(p)
        else:
            (foreign if named else others).append(p)
    return ours, foreign, others


def _names(paths: list[Path], limit: int = 6) -> str:
    shown = ", ".join(p.name for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _foreign(paths: list[Path], foreign: list[Path], limit: int = 6) -> str:
    """``_names`` with why each of ``foreign`` is no rlcore run's."""
    def said(p: Path) -> str:
        if p not in foreign:
            return p.name
        if p.is_symlink():
            return f"{p.name} (a symbolic link)"
        if _CHECKPOINT.match(p.name):
            return f"{p.name} (no rlcore manifest.json)"
        if p.name == "metrics.jsonl":
            return f"{p.name} (not rlcore's lines, and no rlcore checkpoint beside it)"
        return f"{p.name} (no rlcore checkpoint or metrics.jsonl beside it)"
    shown = ", ".join(said(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def claim_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Let a run start in ``run_dir``: a resume continues the run there; a new run needs a folder
    that holds no other run's files, or ``overwrite`` to remove them first. What counts as a run's
    file is ``run_files``.

    A folder that is missing, empty, or holds only the lock or files that are no run's (the third
    list of ``run_files``) starts a new run as it is, with or without ``resume``. A folder holding a
    run's names that no rlcore run wrote (an ``HF`` ``checkpoint-500``, a ``lora`` folder of one's
    own) is refused in every mode: a run would write over them. A resume into a run's files without
    a checkpoint is refused: there is nothing to resume from. With ``overwrite`` the other run's
    files are renamed aside, then deleted; nothing else is touched, and a folder that also holds
    other files is refused rather than half-cleared. Call it holding the lock (``open_run_dir``),
    before the run writes anything.

    Raises:
        ValueError: ``resume`` and ``overwrite`` together, or ``overwrite`` of a folder that also
            holds files no rlcore run wrote (named).
        RunDirError: (a ``FileExistsError`` and a ``ValueError``) a run's names no rlcore run wrote
            (named, with why); a resume into a run's files without a checkpoint; a new run
            (neither flag) into a folder holding another run's files (named), saying how to
            continue it or start over.
    """
    if resume and overwrite:
        raise ValueError(f"run_dir: {run_dir}: resume and overwrite contradict each other (resume continues the "
                         "run in the folder, overwrite deletes it); choose one")
    ours, foreign, others = run_files(run_dir)
    if overwrite and (foreign or (ours and others)):
        kept = sorted(foreign + others)
        raise ValueError(f"overwrite: {run_dir} {'also ' if ours else ''}holds files no rlcore run wrote "
                         f"({_foreign(kept, foreign)}); overwrite deletes only an rlcore run's files and will not "
                         "leave others behind a new run: move them away, or pick a new run_dir")
    if foreign:
        raise RunDirError(f"run_dir: {run_dir} holds {_foreign(foreign, foreign)}: names an rlcore run writes, "
                          "but no rlcore run wrote them, and a run here would write over them; move them away, or "
                          "pick another run_dir")
    if overwrite:
        _remove(Path(run_dir), ours)
        return
    if resume:
        if ours and not list_checkpoints(run_dir):
            raise RunDirError(f"resume: {run_dir} holds a run ({_names(ours)}) but no checkpoint, so there is nothing "
                              "to resume from; start over there with --overwrite true (overwrite=True, without "
                              "--resume), which deletes that run's files first, or pick a new run_dir")
        return
    if ours:
        raise RunDirError(f"run_dir: {run_dir} holds another run ({_names(ours)}); continue it with --resume true "
                          "(resume=True), or start over in a new run_dir, or with --overwrite true "
                          "(overwrite=True), which deletes that run's files first")


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


# Fields a resumed run may change: how long it runs, where and how often it logs, saves and evaluates,
# and how its models sit on the ranks (a checkpoint resumes at any world size, sharded or not).
RESUMABLE_CHANGES = frozenset({"steps", "num_epochs", "resume", "run_dir", "save_every", "keep_last", "eval_every",
                               "log_every", "report_to", "log_completions", "eval_batch_size", "num_eval_images", "eval_seed",
                               "device", "init_from", "gradient_checkpointing", "overwrite", "strategy",
                               "fsdp_reshard_after_forward", "fsdp_cpu_offload", "fsdp_backward_prefetch",
                               "fsdp_checkpoint"})


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
