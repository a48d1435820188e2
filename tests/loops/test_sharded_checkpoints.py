"""Sharded checkpoints (``loops.checkpoint_shards``, ``fsdp_checkpoint: sharded``): every rank writes its
own rows, the manifest covers every shard file, and a checkpoint written at one world size resumes at
another (4 → 2 → 1) with the next step's loss of the run that went on at 4; on the same world size the
resume is exact; ``rlcore export`` writes a plain ``from_pretrained`` folder from the shards."""

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from rlcore.loops.checkpoint import load_checkpoint, verify_checkpoint
from rlcore.loops.checkpoint_codec import CheckpointError
from rlcore.loops.checkpoint_shards import (INDEX, gather_folder, plain_folder, read_index, read_rows, rows_of,
                                            shard_file)
from rlcore.loops.dist import dist_info
from rlcore.loops.recipes import dpo
from tests.loops.conftest import run_ranks, write_rank

SETTINGS = dict(hidden_size=32, num_layers=2, num_heads=4, num_train=32, num_eval=0, eval_every=0, seed=1,
                batch_size=8, max_length=24, save_every=1, keep_last=None, strategy="fsdp2")
TOL = dict(rel=1e-4, abs=1e-5)


# --- the format, in one process ------------------------------------------------------------------------
@given(n=st.integers(0, 40), world=st.integers(1, 9))
def test_the_ranks_rows_tile_the_tensor_as_torch_chunk_splits_it(n, world):
    rows = [rows_of(n, world, r) for r in range(world)]
    assert rows[0][0] == 0 and rows[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    chunks = torch.arange(n).chunk(world) if n else ()
    assert [stop - start for start, stop in rows if stop > start] == [len(c) for c in chunks]


def _write_folder(directory: Path, tensors: dict, world: int, split: set) -> None:
    """A sharded folder as ``world`` ranks would write it (the rows rule, rank 0 the rest and the index)."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        part = {}
        for name, t in tensors.items():
            if name in split:
                start, stop = rows_of(t.shape[0], world, rank)
                part[name] = t[start:stop].contiguous()
            elif rank == 0:
                part[name] = t
        save_file(part, str(directory / shard_file(rank, world)))
    index = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "split": name in split}
             for name, t in tensors.items()}
    (directory / INDEX).write_text(json.dumps({"format": 1, "world_size": world, "tensors": index}))


TENSORS = {"a": torch.arange(35.0).reshape(7, 5), "b": torch.arange(3.0), "c": torch.tensor(2.5),
           "d": torch.arange(6, dtype=torch.long).reshape(2, 3)}


@pytest.mark.parametrize("world", [1, 3, 4])
def test_any_rows_read_back_from_the_files_that_hold_them(tmp_path, world):
    _write_folder(tmp_path, TENSORS, world, split={"a", "b", "d"})
    index = read_index(tmp_path)
    for name, t in TENSORS.items():
        assert torch.equal(read_rows(tmp_path, index, name), t)
    for new_world in (1, 2, 3, 5):  # the rows another world size's rank holds
        for rank in range(new_world):
            rows = rows_of(7, new_world, rank)
            assert torch.equal(read_rows(tmp_path, index, "a", rows), TENSORS["a"][rows[0]:rows[1]])


def test_a_plain_folder_is_written_one_file_at_a_time(tmp_path):
    from safetensors.torch import load_file

    _write_folder(tmp_path / "sharded", TENSORS, 3, split={"a", "b"})
    (tmp_path / "sharded" / "config.json").write_text("{}")
    files = gather_folder(tmp_path / "sharded", tmp_path / "small", max_file_bytes=100)
    assert len(files) > 1
    weight_map = json.loads((tmp_path / "small" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(TENSORS)
    for name, t in TENSORS.items():
        assert torch.equal(load_file(str(tmp_path / "small" / weight_map[name]))[name], t)
    save_file({"a": torch.full((7, 5), 7.0)}, str(tmp_path / "sharded" / "model.safetensors"))  # planted weights
    plain = plain_folder(tmp_path / "sharded", tmp_path / "plain")
    assert sorted(f.name for f in plain.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(plain / "model.safetensors"))["a"], TENSORS["a"])  # the shards' weights


@pytest.mark.parametrize("fault, match", [
    (lambda d: (d / shard_file(2, 3)).unlink(), "missing"),
    (lambda d: save_file({"a": torch.zeros(2, 5), "b": torch.zeros(1)}, str(d / shard_file(2, 3))),
     r"expected float32 \[1, 5\]"),
    (lambda d: save_file({"a": torch.zeros(1, 5, dtype=torch.float64), "b": torch.zeros(1)},
                         str(d / shard_file(2, 3))), "expected float32"),
    (lambda d: save_file({"a": torch.zeros(1, 5), "b": torch.zeros(1), "z": torch.zeros(1)},
                         str(d / shard_file(2, 3))), "does not place there"),
    (lambda d: (d / INDEX).write_text(json.dumps({"format": 1, "world_size": 3,
                                                  "tensors": {"a": {"shape": [7, -5], "dtype": "float32",
                                                                    "split": True}}})), "shape"),
    (lambda d: (d / INDEX).write_text(json.dumps({"format": 1, "world_size": True, "tensors": {}})), "world_size"),
    (lambda d: (d / shard_file(1, 3)).write_bytes(b"\xff" * 16), "header"),
    (lambda d: (d / INDEX).write_text(json.dumps({"format": 1, "world_size": 3,
                                                  "tensors": {"a": {"shape": [7, 5], "dtype": ["float32"],
                                                                    "split": True}}})), "dtype"),
    (lambda d: (d / INDEX).write_text(json.dumps({"format": 1, "world_size": 3,
                                                  "tensors": {"a": {"shape": [0, 2 ** 70], "dtype": "float32",
                                                                    "split": True}}})), "shape"),
])
def test_a_folder_that_does_not_match_its_index_is_refused_naming_the_file(tmp_path, fault, match):
    _write_folder(tmp_path, {k: TENSORS[k] for k in ("a", "b")}, 3, split={"a", "b"})
    fault(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        read_index(tmp_path)


# --- written by ranks, resumed at other world sizes ---------------------------------------------------
def _run(out_dir, name, steps, source=None):
    """DPO under fsdp2 for ``steps`` steps in ``out_dir/name`` (resuming from ``source``'s first checkpoint
    copied there); this rank's history and gathered parameters."""
    run_dir = Path(out_dir) / name
    if source is not None and dist_info().is_main:
        shutil.copytree(Path(out_dir) / source / "checkpoint-1", run_dir / "checkpoint-1")
    from rlcore.loops.dist import barrier

    barrier()
    state, history = dpo.train(dpo.Config(**SETTINGS, steps=steps, run_dir=str(run_dir), resume=source is not None))
    params = {f"{name}/{k}": (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for k, p in state.model("policy").named_parameters()}
    return history, params


def _four_ranks(out_dir):
    torch.set_num_threads(1)
    history, params = _run(out_dir, "w4", 3)
    write_rank(out_dir, dist_info().rank, {"w4": history}, params)


def _two_ranks(out_dir):
    torch.set_num_threads(1)
    out, tensors = {}, {}
    for name, steps, source in (("w2-from-w4", 3, "w4"), ("w2", 2, None), ("w2-resumed", 2, "w2")):
        out[name], params = _run(out_dir, name, steps, source)
        tensors.update(params)
    write_rank(out_dir, dist_info().rank, out, tensors)


def _node_local_run_dirs(out_dir):
    """Each rank given its own run folder, as a path local to each node would be."""
    rank = dist_info().rank
    try:
        dpo.train(dpo.Config(**SETTINGS, steps=1, run_dir=str(Path(out_dir) / f"node{rank}" / "run")))
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    write_rank(out_dir, rank, {"error": error}, {})


@pytest.mark.slow
def test_a_run_folder_some_rank_does_not_see_is_refused_before_the_first_step(tmp_path):
    ranks = run_ranks(_node_local_run_dirs, tmp_path)
    for info, _ in ranks:
        assert info["error"] and "fsdp_checkpoint: full" in info["error"]
    assert not list(tmp_path.glob("node*/run/metrics.jsonl"))  # refused before any step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    four = run_ranks(_four_ranks, out, world_size=4)
    two = run_ranks(_two_ranks, out)
    return out, four, two


@pytest.mark.slow
def test_every_rank_writes_its_rows_and_the_manifest_covers_them(runs):
    out = runs[0]
    path = out / "w4" / "checkpoint-2"
    verify_checkpoint(path)
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    for folder in ("models/policy", "optimizer"):
        shards = sorted(f for f in manifest if f.startswith(f"{folder}/shard-"))
        assert shards == [f"{folder}/{shard_file(r, 4)}" for r in range(4)]
        assert f"{folder}/{INDEX}" in manifest
    assert not list(path.glob("models/policy/model*.safetensors"))  # nothing gathered
    assert not list(path.glob(".hashes-*")) and not list(out.glob("w4/.tmp-*"))
    assert "rlcore export" in (path / "README.md").read_text()


@pytest.mark.slow
def test_a_four_rank_checkpoint_resumes_at_two_and_one_with_the_losses_of_going_on_at_four(runs):
    """Resumed from step 1: step 2's loss reads the resharded weights, step 3's the weights moved by
    the resharded optimiser state."""
    out, four, two = runs
    continued = [row["loss"] for row in four[0][0]["w4"][1:]]  # steps 2 and 3 at 4 ranks
    assert [row["loss"] for row in two[0][0]["w2-from-w4"]] == pytest.approx(continued, **TOL)
    # in one process: the run resumed from the 4-rank checkpoint (strategy none: nothing to shard)
    run_dir = out / "w1-from-w4"
    shutil.copytree(out / "w4" / "checkpoint-1", run_dir / "checkpoint-1")
    _, history = dpo.train(dpo.Config(**{**SETTINGS, "strategy": "none"}, steps=3, run_dir=str(run_dir), resume=True))
    assert [row["loss"] for row in history] == pytest.approx(continued, **TOL)


@pytest.mark.slow
def test_a_resume_on_the_same_world_size_is_exact(runs):
    info, tensors = runs[2][0]
    names = [k.split("/", 1)[1] for k in tensors if k.startswith("w2/")]
    assert names
    for name in names:
        assert torch.equal(tensors[f"w2-resumed/{name}"], tensors[f"w2/{name}"]), name
    assert info["w2-resumed"][-1]["loss"] == info["w2"][-1]["loss"]


@pytest.mark.slow
def test_a_shard_file_edited_or_missing_is_refused(runs, tmp_path):
    out = runs[0]
    for fault in ("edit", "missing"):
        path = tmp_path / fault
        shutil.copytree(out / "w4" / "checkpoint-2", path)
        shard = path / "models" / "policy" / shard_file(3, 4)
        if fault == "edit":
            data = bytearray(shard.read_bytes())
            data[-1] ^= 1
            shard.write_bytes(bytes(data))
        else:
            shard.unlink()
        with pytest.raises(CheckpointError, match=shard_file(3, 4)):
            load_checkpoint(path, dpo._setup(dpo.Config(**{**SETTINGS, "strategy": "none"}))[0])


@pytest.mark.slow
def test_export_and_init_from_read_a_sharded_checkpoint(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlcore.loops import cli

    out, four, _ = runs
    assert cli.main(["export", "dpo", "--checkpoint", str(out / "w4"), "--out", str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = four[0][1]
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), trained[f"w4/{name}"]), name
    assert (tmp_path / "exported" / "tokenizer.json").is_file()
    state = dpo._setup(dpo.Config(**{**SETTINGS, "strategy": "none"}, run_dir=None, init_from=str(out / "w4")))[0]
    for name, p in state.model("policy").named_parameters():
        assert torch.equal(p.detach(), trained[f"w4/{name}"]), name


CRASH_ONCE = '''
from pathlib import Path

calls = 0


def crash_once(prompts, completions, **_):
    """Rank 1 of the first launch fails in step 2's scoring (the step 1 checkpoint is written)."""
    global calls
    calls += 1
    if calls == 2 and __import__("os").environ["RANK"] == "1" and not Path("crashed").exists():
        Path("crashed").write_text("rank 1, step 2")
        raise RuntimeError("a worker lost mid-run")
    return [float(len(c)) for c in completions]
'''


@pytest.mark.slow
def test_a_failed_sharded_torchrun_job_continues_from_its_last_checkpoint_relaunched_by_hand_or_by_torchrun(tmp_path):
    """The same ``torchrun`` command with ``--resume true``: a rank fails in step 2, the job ends with
    an error, and the command launched again continues from the sharded checkpoint of step 1; with
    ``--max-restarts 1`` torchrun relaunches the ranks itself and the one command ends the run (each
    attempt keys its rendezvous apart: with the last attempt's addresses read, it failed 2 runs in 3)."""
    import os
    import subprocess
    import sys

    from rlcore.loops.dist import free_port

    (tmp_path / "crash_once.py").write_text(CRASH_ONCE)
    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")

    def launch(*restarts):
        cmd = [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               *restarts, "-m", "rlcore.loops.cli", "train", "grpo", "--strategy", "fsdp2", "--reward_funcs",
               "crash_once:crash_once", "--steps", "3", "--save_every", "1", "--resume", "true", "--batch_size", "4",
               "--num_samples", "2", "--max_new_tokens", "4", "--hidden_size", "32", "--num_layers", "1",
               "--num_train", "16", "--num_eval", "0", "--eval_every", "0", "--run_dir", str(run)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    failed = launch()
    assert failed.returncode != 0 and "a worker lost mid-run" in failed.stderr
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-1"]
    done = launch()
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # step 1 from the first launch, 2 and 3 from the second
    assert (run / "checkpoint-3" / "models" / "policy" / shard_file(1, 2)).is_file()

    # torchrun relaunching the workers itself: one command, the same three steps
    (tmp_path / "crashed").unlink()
    shutil.rmtree(run)
    restarted = launch("--max-restarts", "1")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "a worker lost mid-run" in restarted.stderr and (tmp_path / "crashed").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
