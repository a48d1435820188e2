"""Checkpoint faults: a writer killed at every step of a save, and every file of a checkpoint damaged.

tests/loops/test_checkpoint.py kills a looping writer at 24 random moments (and asserts that at
least one kill landed inside a save). Here the kill points are enumerated: a forked child counts
the filesystem operations of one save (file writes, safetensors writes, mkdir, fsync, rename,
rmtree) and SIGKILLs itself just before operation ``k``, or just after a torn write of half of
file ``k``, for every ``k``. After each kill the parent checks that every listed checkpoint loads,
that the latest is the previous complete one or the new one (with the right contents), that
``resume`` returns it, and that the next save succeeds and clears the debris. Two saves are
enumerated: a new step with ``keep_last`` pruning, and a re-save of an existing step.

Then each file of a checkpoint is damaged (truncated, truncated with the manifest rewritten to
match, header garbage, emptied, deleted) and loading must raise ``CheckpointError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from rlcore.loops import checkpoint as ckpt
from rlcore.loops.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, resume, save_checkpoint
from rlcore.loops.checkpoint_codec import CheckpointError
from rlcore.loops.state import init_state
from rlcore.loops.update import make_optimizer, make_scheduler
from rlcore.testing import MockLM
from rlcore.transforms import KLControllerState, running_moments_init

def make_state(step: int = 0):
    model = MockLM(vocab_size=8, hidden_size=4, max_positions=8, seed=0)
    opt = make_optimizer(model, lr=1e-2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))  # the weights say which step they belong to
    state = init_state(model, optimizer=opt, scheduler=make_scheduler(opt, total_steps=10), seed=0,
                       transforms={"kl": KLControllerState(torch.tensor(float(step))), "m": running_moments_init()})
    return dataclasses.replace(state, step=step)


def step_of(path: Path) -> int:
    return int(re.search(r"checkpoint-(\d+)", path.name).group(1))


def assert_is_step(state, step: int) -> None:
    assert state.step == step
    assert all(torch.all(p == step) for p in state.models["policy"].parameters())
    assert float(state.transforms["kl"].coef) == step


# --- counting and killing the filesystem operations of a save ------------------------------------
def _targets():
    """(owner, attribute) of every operation a save performs on the filesystem."""
    return [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "mkdir"), (shutil, "rmtree"),
            (pathlib.Path, "write_text"), (ckpt, "save_file"), (ckpt, "save_model")]


_WRITES = {"write_text", "save_file", "save_model"}


def _written_path(name: str, args) -> Path:
    if name == "write_text":
        return Path(args[0])
    return Path(args[1])  # save_file(tensors, path), save_model(model, path)


def _instrument(kill_at: int | None, torn: bool, log: list[str]) -> None:
    """Patch the operations (in this process only): count them, and die at number ``kill_at``."""
    for owner, attr in _targets():
        original = getattr(owner, attr)

        def op(*args, __original=original, __name=attr, **kwargs):
            k = len(log)
            log.append(__name)
            if k == kill_at and not (torn and __name in _WRITES):
                os.kill(os.getpid(), signal.SIGKILL)
            if __name == "fsync":  # a killed process loses nothing from the page cache: skip the wait
                return None
            out = __original(*args, **kwargs)
            if k == kill_at and torn:  # a torn write: half of the file reached the disk
                path = _written_path(__name, args)
                os.truncate(path, path.stat().st_size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(owner, attr, op)


def _save_in_child(run_dir: Path, step: int, kill_at: int, torn: bool) -> int:
    """Fork a child that saves ``step`` and is killed at operation ``kill_at``; return its signal."""
    state = make_state(step)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns to pytest
        code = 3
        try:
            torch.set_num_threads(1)
            _instrument(kill_at, torn, [])
            save_checkpoint(run_dir, state, keep_last=2)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


def _count_ops(tmp_path: Path, base: Path, step: int) -> list[str]:
    run_dir = tmp_path / "count"
    shutil.copytree(base, run_dir)
    log: list[str] = []
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in _targets()]
    try:
        _instrument(None, False, log)
        save_checkpoint(run_dir, make_state(step), keep_last=2)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    shutil.rmtree(run_dir)
    return log


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A run directory holding checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("base")
    for step in (1, 2):
        save_checkpoint(root, make_state(step))
    return root


@pytest.mark.parametrize("step", [3, 2], ids=["new_step_with_pruning", "re_save_of_the_latest"])
def test_a_kill_at_any_operation_of_a_save_loses_no_checkpoint(tmp_path, base, step, monkeypatch):
    # fsync guards against power loss, not against a killed process (the page cache survives it):
    # calls are still counted and killed at, but do not wait for the disk
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    ops = _count_ops(tmp_path, base, step)
    assert len(ops) >= 20, f"only {len(ops)} kill points: {ops}"
    points = [(k, False) for k in range(len(ops))] + [(k, True) for k, op in enumerate(ops) if op in _WRITES]
    template = make_state()
    for k, torn in points:
        run_dir = tmp_path / f"kill-{k}-{int(torn)}"
        shutil.copytree(base, run_dir, copy_function=os.link)  # a save never writes into existing files
        assert _save_in_child(run_dir, step, k, torn) == signal.SIGKILL, f"no kill at operation {k} ({ops[k]})"
        where = f"killed at operation {k} ({ops[k]}{', torn' if torn else ''}) of {len(ops)}"
        listed = list_checkpoints(run_dir)
        for path in listed:  # never an unreadable checkpoint, latest or not
            assert_is_step(load_checkpoint(path, make_state(), restore_global_rng=False), step_of(path))
        steps = [step_of(p) for p in listed]
        latest = latest_checkpoint(run_dir)
        assert latest is not None and max(steps) >= 2, f"{where}: the last complete checkpoint is gone: {steps}"
        assert_is_step(resume(run_dir, template, restore_global_rng=False), max(steps))
        save_checkpoint(run_dir, make_state(4), keep_last=2)  # the next save works and clears the debris
        assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")], where
        assert [p.name for p in list_checkpoints(run_dir)][-1] == "checkpoint-4"
        shutil.rmtree(run_dir)
    print(f"kill points: {len(points)} ({sum(t for _, t in points)} torn writes) over {len(ops)} operations")


# --- damaged files -----------------------------------------------------------------------------
def _damage(path: Path, f: Path, how: str) -> None:
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "truncated_and_manifest_updated":  # bypasses the size check: the reader must notice
        f.write_bytes(data[: len(data) // 2])
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["files"][str(f.relative_to(path))] = len(data) // 2
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif how == "header_garbage":
        f.write_bytes(b"\xff" * 16 + data[16:])
    elif how == "emptied":
        f.write_bytes(b"")
    elif how == "deleted":
        f.unlink()


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")


DAMAGES = ["truncated", "truncated_and_manifest_updated", "header_garbage", "emptied", "deleted"]


def test_every_damaged_file_is_named_in_a_checkpoint_error(tmp_path):
    rng = torch.get_rng_state(), random.getstate()  # loading restores the stored global RNGs
    try:
        _damaged_files(tmp_path)
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])


def _damaged_files(tmp_path):
    reference = save_checkpoint(tmp_path / "ref", make_state(5))
    names = _files(reference)
    assert {"models/policy/model.safetensors", "optimizer.safetensors", "state.safetensors",
            "rng.safetensors", "scheduler.safetensors"} <= set(names)
    checked = 0
    for name in names:
        if name in ("README.md", "config.json"):  # informative (model card, run config): not read by a load
            continue
        for how in DAMAGES:
            path = tmp_path / f"{name.replace('/', '_')}-{how}"
            shutil.copytree(reference, path)
            _damage(path, path / name, how)
            with pytest.raises(CheckpointError) as err:
                load_checkpoint(path, make_state())  # global RNGs too: rng.* must be read
            assert Path(name).name in str(err.value), f"{name} {how}: {err.value}"
            checked += 1
    assert checked >= 40
    print(f"damaged files: {checked} (every file x {len(DAMAGES)} damages), each named in a CheckpointError")


def test_same_size_payload_corruption_is_detected(tmp_path):
    path = save_checkpoint(tmp_path, make_state(5))
    f = path / "models" / "policy" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"  # the last float32 becomes NaN, the size is unchanged
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path, make_state(), restore_global_rng=False)


def test_resume_skips_an_unfinished_newer_checkpoint_and_refuses_a_damaged_latest(tmp_path):
    save_checkpoint(tmp_path, make_state(1))
    save_checkpoint(tmp_path, make_state(2))
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / "checkpoint-9")
    (tmp_path / "checkpoint-9" / "manifest.json").unlink()  # written last: a save that never finished
    assert_is_step(resume(tmp_path, make_state(), restore_global_rng=False), 2)
    f = tmp_path / "checkpoint-2" / "state.safetensors"
    f.write_bytes(f.read_bytes()[:-3])  # damaged after it was published: an error, not a silent fallback
    with pytest.raises(CheckpointError, match="state.safetensors"):
        resume(tmp_path, make_state(), restore_global_rng=False)
    assert_is_step(load_checkpoint(list_checkpoints(tmp_path)[0], make_state(), restore_global_rng=False), 1)
