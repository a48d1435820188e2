"""Checkpoints: atomic, pickle-free, complete enough to resume a run bit for bit.

A checkpoint is a directory ``run_dir/checkpoint-N``::

    models/<name>/        weights as safetensors: ``save_pretrained`` for Hugging Face models
                          (loadable with ``from_pretrained``), ``model.safetensors`` otherwise
    optimizer.{json,safetensors}   the optimiser's state dict, tensors in safetensors, the rest JSON
    scheduler.{json,safetensors}   the scheduler's state dict
    state.{json,safetensors}       every other ``TrainState`` field: counters, transform states
                                   (NamedTuples of tensors), the loop's ``torch.Generator``
    rng.{json,safetensors}         global RNGs: torch (CPU, CUDA), Python ``random``, NumPy
    config.json  trainer_state.json (step, time, final metrics, extra JSON)  README.md (model card)
    manifest.json                  every file and its size, written last

Atomicity: everything is written into ``run_dir/.tmp-step-N-<random>``, every file and directory
is fsynced, then the directory is renamed to ``checkpoint-N`` (``os.replace``, atomic on POSIX)
and ``run_dir`` is fsynced. A process killed at any moment leaves either a complete
``checkpoint-N`` or a temporary directory that :func:`latest_checkpoint` ignores and the next
save removes. Old checkpoints are renamed away before they are deleted, so a half-deleted
one is never taken for a checkpoint. One writer per ``run_dir`` is assumed.

Distributed runs (``rlcore.loops.dist``): every rank calls ``save_checkpoint``. By default FSDP2
tensors are gathered, rank 0 writes, and the others wait for it (and fail with it): stored weights
and optimiser state are those of one process. With ``sharded=True`` each rank writes its own rows
of every FSDP2 model and of the optimiser state (``loops.checkpoint_shards``: ``models/<name>/`` and
``optimizer/`` hold ``shards.json`` and one safetensors file per rank), hashes its files for the
manifest, and no rank gathers a full tensor; such a checkpoint loads at any world size (each rank
reads only its rows) and ``rlcore export`` writes it as a plain folder one file at a time.

No pickle anywhere: tensors go to safetensors, everything else to JSON; loading never executes
stored code (``loops.checkpoint_codec``: a stored type is rebuilt from the template, or is one of
rlcore's own loaded NamedTuples or dataclasses). The run folder's lock and the resume checks are
``loops.run_dir``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save_file, save_model
from torch import nn

from rlcore.loops.checkpoint_codec import CheckpointError, load_tensors, read_json, read_pair, write_pair
from rlcore.loops.checkpoint_shards import INDEX, is_sharded_folder, read_index, read_rows, save_shards, split_rows
from rlcore.loops.lora import is_peft, load_adapter_weights
from rlcore.loops.dist.sync import (all_ranks_ok, drop_tied, full_optimizer_state, full_weights,
                                          load_full_weights, shard_optimizer_state)
from rlcore.loops.dist import all_reduce_sum, dist_info, gathered, is_fsdp2, unwrap_model
from rlcore.loops.state import TrainState

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "checkpoint_info", "resume",
           "Checkpointer", "verify_checkpoint"]

FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(?P<step>\d+)$")
_OLD = re.compile(r"^\.old-(?P<name>checkpoint-(?P<step>\d+))-[0-9a-f]+$")  # set aside by a re-save
# The scratch folders of a save, by the exact names it gives them (``.tmp-step-N-<hex>`` being written,
# ``.old-checkpoint-N-<hex>`` set aside by a re-save, ``.del-checkpoint-N-<hex>`` being deleted): the
# only folders ``_prune`` deletes besides the checkpoints ``keep_last`` drops; any other name is left alone.
SCRATCH_NAME = re.compile(r"^(?:\.tmp-step-\d+|\.old-checkpoint-\d+|\.del-checkpoint-\d+)-[0-9a-f]+$")
_SPECIAL = ("models", "optimizer", "scheduler", "reward_fn", "env")  # not stored as state: code, rebuilt by the run
_MANIFEST_BYTES = 16 << 20  # a manifest lists files: names, sizes, hashes


# --- models ------------------------------------------------------------------------------------
def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "save_pretrained") and hasattr(model, "config")


def _save_config(model: nn.Module, directory: Path) -> None:
    """What ``from_pretrained`` needs besides the weights (a sharded folder's weights are the ranks')."""
    model = unwrap_model(model)
    if hasattr(model, "save_config"):  # a diffusers model: its config is a dict, saved by the model
        model.save_config(directory)
    elif _is_hf(model):
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(directory)


def _save_model(model: nn.Module, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    directory.mkdir(parents=True)
    model = unwrap_model(model)  # DDP: no ``module.`` prefix, the checkpoint loads in one process
    if weights is not None and hasattr(model, "save_config"):  # a diffusers model's gathered weights, its names
        model.save_config(directory)
        save_file({k: v.contiguous() for k, v in drop_tied(model, weights).items()},
                  str(directory / "diffusion_pytorch_model.safetensors"))
    elif _is_hf(model):
        model.save_pretrained(directory, **({} if weights is None else {"state_dict": weights}))
    elif weights is not None:
        save_file({k: v.contiguous() for k, v in drop_tied(model, weights).items()},
                  str(directory / "model.safetensors"))
    else:
        save_model(model, str(directory / "model.safetensors"))  # drops duplicates of tied tensors


def _load_model(model: nn.Module, directory: Path) -> None:
    """Load every ``*.safetensors`` of ``directory`` into ``model``'s own tensors, in place (a DDP
    wrapper through its module; an FSDP2 module keeps its shards of the full tensors)."""
    if is_sharded_folder(directory):
        return _load_sharded_model(model, directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_tensors(f))
    model = unwrap_model(model)
    if is_peft(model):  # a LoRA policy: the folder holds its adapter (peft's names), the base is rebuilt
        try:
            return load_adapter_weights(model, weights, str(directory))
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    if is_fsdp2(model):
        try:
            return load_full_weights(model, weights)
        except ValueError as e:
            raise CheckpointError(f"{directory}: {e}") from e
    own = model.state_dict()
    unexpected = sorted(set(weights) - set(own))
    if unexpected and hasattr(type(model), "from_pretrained"):  # renamed on save: let HF map the names
        weights = type(model).from_pretrained(directory).state_dict()
        unexpected = sorted(set(weights) - set(own))
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = sorted(k for k in set(own) - set(weights) if own[k].data_ptr() not in loaded)  # not tied
    if unexpected or missing:
        raise CheckpointError(f"{directory}: weights do not fit the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    try:
        model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes differ
        raise CheckpointError(f"{directory}: weights do not fit the model: {e}") from e


def _load_sharded_model(model: nn.Module, directory: Path) -> None:
    """Each tensor of ``model`` (its rows, for an FSDP2 shard) read from a sharded folder, in place."""
    index = read_index(directory)
    model = unwrap_model(model)
    if is_peft(model):
        raise CheckpointError(f"{directory}: a sharded folder holds full weights, the model is a LoRA adapter's")
    own = drop_tied(model, model.state_dict())
    stored = index["tensors"]
    unexpected, missing = sorted(set(stored) - set(own)), sorted(set(own) - set(stored))
    if unexpected or missing:
        raise CheckpointError(f"{directory}: weights do not fit the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, t in own.items():
            if list(t.shape) != stored[name]["shape"]:
                raise CheckpointError(f"{directory}: {name}: stored shape {stored[name]['shape']}, the model's "
                                      f"{list(t.shape)}")
            rows = split_rows(t)
            target = t.to_local() if rows is not None else t
            target.copy_(read_rows(directory, index, name, rows))


def _optimizer_tensors(sd: dict) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}


def _load_sharded_optimizer(path: Path, stored: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``stored`` (the optimiser's state dict less its tensors) with each tensor read from
    ``path/optimizer``: the rows of its parameter's shard (a DTensor like the parameter) or whole."""
    from torch.distributed.tensor import DTensor

    directory = path / "optimizer"
    index = read_index(directory)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not (isinstance(stored, dict) and isinstance(stored.get("state"), dict)
            and all(isinstance(st, dict) for st in stored["state"].values())):
        raise CheckpointError(f"{path / 'optimizer.json'}: expected {{'state': {{index: {{name: value}}}}, ...}}")
    state = {i: dict(st) for i, st in stored["state"].items()}
    keys = {str(i): i for i in state}  # the state dict's own keys (ints), by their names in the index
    for name, entry in index["tensors"].items():
        i, _, key = name.partition(".")
        if not (i.isdigit() and int(i) < len(params) and i in keys and key in state[keys[i]]):
            raise CheckpointError(f"{directory / INDEX}: tensor {name!r} is no state of the optimiser's "
                                  f"{len(params)} parameters")
        p, i = params[int(i)], keys[i]
        if entry["split"] and list(p.shape) != entry["shape"]:
            raise CheckpointError(f"{directory / INDEX}: {name}: shape {entry['shape']}, its parameter's "
                                  f"{list(p.shape)}")
        rows = split_rows(p) if entry["split"] else None
        value = read_rows(directory, index, name, rows)
        if rows is not None:
            value = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        state[i][key] = value
    unfilled = sorted(f"{i}.{k}" for i, st in state.items() for k, v in st.items() if v is None)
    if unfilled:
        raise CheckpointError(f"{directory / INDEX}: no tensor for the optimiser state {unfilled[:5]} that "
                              f"{path / 'optimizer.json'} lists")
    return {**stored, "state": state}


# --- global RNGs ---------------------------------------------------------------------------------
def _global_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return out


def _set_global_rng(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].cpu())
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    if "numpy" in rng:
        import numpy as np
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# --- files, fsync, atomic publication -----------------------------------------------------------
def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root, topdown=False):
        for f in files:
            _fsync(os.path.join(directory, f))
        _fsync(directory)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    return digest.hexdigest()


def _hashes(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in paths}


def _write_manifest(root: Path, known: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """``manifest.json``: size and SHA-256 of every file, written last (truncation and bit rot are
    caught); ``known``: entries other ranks computed for the files they wrote."""
    known = known or {}
    files = {name: known.get(name) or _hashes(root, [p])[name] for p in sorted(root.rglob("*")) if p.is_file()
             for name in [p.relative_to(root).as_posix()]}
    (root / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1))


def _verify_together(path: Path) -> None:
    """``verify_checkpoint`` on every rank of a distributed run, each hashing its share of the files."""
    info = dist_info()
    if not info.distributed:
        return verify_checkpoint(path)
    error = None
    try:
        verify_checkpoint(path, share=(info.rank, info.world_size))
    except Exception as e:  # noqa: BLE001 -- an I/O error too: raised by _together once every rank knows
        error = e
    _together(error, path, "verify the checkpoint")


def verify_checkpoint(path: str | Path, *, share: tuple[int, int] = (0, 1)) -> None:
    """Check a checkpoint against its ``manifest.json`` before anything is read from it.

    Every listed file must be a regular file inside the checkpoint (no ``..``, no absolute path,
    no symbolic link on the way, no device or pipe) with the recorded size and SHA-256, and every
    file present must be listed (a planted file is never loaded). Every load path runs this:
    ``load_checkpoint`` (resume), ``init_from`` and ``rlcore eval``. ``share=(k, n)`` hashes only
    every ``n``-th listed file from the ``k``-th (the ranks of a run split the reading; sizes and
    names are checked in full).

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    path = Path(path)
    if path.is_symlink() or not (path / "manifest.json").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no manifest.json, or a symbolic link)")
    manifest = read_json(path / "manifest.json", max_bytes=_MANIFEST_BYTES)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / 'manifest.json'}: expected {{'files': {{name: {{size, sha256}}}}}}")
    present = set()
    for f in path.rglob("*"):
        if f.is_symlink() or not (f.is_dir() or f.is_file()):
            raise CheckpointError(f"{f}: a symbolic link or special file inside the checkpoint; refused")
        if f.is_file() and f.name != "manifest.json":
            present.add(f.relative_to(path).as_posix())
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointError(f"{path}: files not in manifest.json: {unlisted[:5]}")
    for position, (name, entry) in enumerate(files.items()):
        parts = PurePosixPath(name).parts
        if not isinstance(name, str) or not parts or PurePosixPath(name).is_absolute() or ".." in parts \
                or "\\" in name or name == "manifest.json":
            raise CheckpointError(f"{path / 'manifest.json'}: the entry {name!r} is not a path inside the checkpoint")
        size, sha = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("sha256")) \
            if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or (sha is not None and not isinstance(sha, str)):
            raise CheckpointError(f"{path / 'manifest.json'}: the entry for {name!r} needs an int size and a "
                                  f"sha256 string, got {entry!r}")
        f = path / name
        if name not in present:
            raise CheckpointError(f"{f}: missing from the checkpoint (listed in manifest.json)")
        found = f.stat().st_size
        if found != size:
            raise CheckpointError(f"{f}: truncated or altered: {found} bytes, manifest.json says {size}")
        if sha is not None and position % share[1] == share[0] and _sha256(f) != sha:
            raise CheckpointError(f"{f}: corrupted: its SHA-256 differs from the one in manifest.json")


def _check_keep_last(keep_last: Any) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last: expected None (keep all) or an int >= 1, got {keep_last!r}")


def _publish(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of ``run_dir`` (``checkpoint-N`` with a manifest), by step.

    A re-save of step ``N`` killed between its two renames leaves the previous ``checkpoint-N``
    aside as ``.old-checkpoint-N-*``: while ``checkpoint-N`` is absent, that directory is listed in
    its place (and the next save renames it back).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found: dict[int, Path] = {}
    for pattern in (_NAME, _OLD):  # checkpoint-N first: an .old- copy only stands in for a missing one
        for p in run_dir.iterdir():
            if (m := pattern.match(p.name)) and not p.is_symlink() and (p / "manifest.json").is_file():
                found.setdefault(int(m.group("step")), p)
    return [found[step] for step in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``run_dir``, or ``None``.

    Temporary directories of interrupted saves (``.tmp-step-*``) are ignored.
    """
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _prune(run_dir: Path, keep_last: int | None) -> None:
    for p in run_dir.iterdir():  # an interrupted re-save (see list_checkpoints): put the checkpoint back
        m = _OLD.match(p.name)
        if m and not (run_dir / m.group("name")).exists() and (p / "manifest.json").is_file():
            os.replace(p, run_dir / m.group("name"))
    doomed = list_checkpoints(run_dir)[:-keep_last] if keep_last else []
    for p in doomed:  # rename first: a half-deleted directory never looks like a checkpoint
        os.replace(p, run_dir / f".del-{p.name}-{secrets.token_hex(4)}")
    if doomed:
        _fsync(run_dir)
    for p in run_dir.iterdir():  # only the save's own scratch names: never a folder of the user's
        if SCRATCH_NAME.match(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


# --- metadata and model card ----------------------------------------------------------------------
def _as_dict(config: Any) -> dict:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config)


def _model_card(step: int, config: dict, metrics: Mapping[str, float], models: Mapping[str, nn.Module],
                sharded: frozenset[str] = frozenset()) -> str:
    base = config.get("base_model") or config.get("model_name_or_path") or config.get("model") or next(
        (getattr(m, "name_or_path", "") for m in models.values() if getattr(m, "name_or_path", "")), "")
    recipe = config.get("recipe", "")
    tags = ", ".join(t for t in ("rlcore", str(recipe)) if t)
    hf = any(_is_hf(m) for m in models.values())
    lines = ["---"] + (["library_name: transformers"] if hf else []) + ([f"base_model: {base}"] if base else []) + \
            [f"tags: [{tags}]", "---", "", f"# {recipe or 'rlcore'} checkpoint, step {step}", "",
             f"Trained with rlcore{f' ({recipe} recipe)' if recipe else ''}"
             f"{f' from `{base}`' if base else ''}. Models: {', '.join(f'`models/{n}`' for n in models)}.", ""]
    if metrics:
        lines += ["## Final metrics", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.6g} |" for k, v in metrics.items()] + [""]
    lines += ["## Config", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    name = next((n for n, m in models.items() if _is_hf(m)), None)
    if name in sharded:
        lines += ["## Loading", "", f"`models/{name}` holds the weights sharded over the ranks that trained it "
                  "(`shards.json`, one safetensors file per rank). "
                  f"`rlcore export {recipe or 'RECIPE'} --checkpoint checkpoint-{step} --out DIR` writes them as a "
                  "plain `from_pretrained` folder; the run resumes from them at any world size.", ""]
    elif name is not None and is_peft(models[name]):
        lines += ["## Loading", "", f"`models/{name}` holds a LoRA adapter; its base is the run's `model`.", "",
                  "```python", "from peft import PeftModel",
                  f'model = PeftModel.from_pretrained(base_model, "checkpoint-{step}/models/{name}")', "```", "",
                  f"`rlcore export {recipe or 'RECIPE'} --checkpoint checkpoint-{step} --out DIR` writes the merged "
                  "weights as a plain `from_pretrained` folder.", ""]
    elif name is not None:
        lines += ["## Loading", "", "```python", "from transformers import AutoModelForCausalLM",
                  f'model = AutoModelForCausalLM.from_pretrained("checkpoint-{step}/models/{name}")', "```", ""]
    return "\n".join(lines)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """``full_weights``, but of a sharded LoRA model only its trainable tensors (the adapter and
    ``modules_to_save``), under the model's names: the frozen base is never gathered, since the
    checkpoint holds the adapter alone (a collective: every rank calls it)."""
    if not (is_peft(model) and is_fsdp2(model)):
        return full_weights(model)
    trained = {n for n, p in model.named_parameters()
               if p.requires_grad or "lora_" in n or ".modules_to_save." in n}  # a frozen adapter too
    return {n: gathered(t).detach().cpu()
            for n, t in model.state_dict().items() if n in trained}


def _trainable(models: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    return {n: m for n, m in models.items() if any(p.requires_grad for p in m.parameters())}


# --- public API ---------------------------------------------------------------------------------------
def _write_contents(tmp: Path, state: TrainState, step: int, config: dict, models: Mapping[str, nn.Module],
                    extra_json: Any, metrics: Mapping[str, float], weights: Mapping[str, Any],
                    optimizer_state: dict | None, tokenizer: Any = None, sharded: frozenset[str] = frozenset()) -> None:
    for name, model in models.items():
        if name in sharded:  # the ranks write the weights (save_shards); the folder gets the model's config
            _save_config(model, tmp / "models" / name)
        else:
            _save_model(model, tmp / "models" / name, weights.get(name))
    if tokenizer is not None and "policy" in models:  # the policy folder loads with from_pretrained, both halves
        tokenizer.save_pretrained(tmp / "models" / "policy")
    if optimizer_state is not None:
        write_pair(tmp, "optimizer", optimizer_state)
    if state.scheduler is not None:
        write_pair(tmp, "scheduler", state.scheduler.state_dict())
    rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in _SPECIAL}
    write_pair(tmp, "state", rest)
    write_pair(tmp, "rng", _global_rng())
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "models": sorted(models),
            "metrics": dict(metrics), "extra": extra_json}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2, default=str))
    unwrapped = {n: unwrap_model(m) for n, m in models.items()}
    (tmp / "README.md").write_text(_model_card(step, config, metrics, unwrapped, sharded))


def save_checkpoint(run_dir: str | Path, state: TrainState, *, step: int | None = None, config: Any = None,
                    models: Mapping[str, nn.Module] | None = None, extra_json: Any = None,
                    metrics: Mapping[str, float] | None = None, keep_last: int | None = None,
                    tokenizer: Any = None, sharded: bool = False) -> Path:
    """Write ``state`` to ``run_dir/checkpoint-{step}`` atomically; return that path.

    Args:
        run_dir: the run directory (created if needed).
        state: the ``TrainState`` (or any frozen dataclass with ``models``/``optimizer``/``scheduler``).
        step: the checkpoint's number (default ``state.step``).
        config: the run's config (a dataclass or mapping), stored as JSON (non-JSON values as str)
            and shown in the model card; its ``base_model`` / ``recipe`` entries name the card.
        models: name -> module to save (default: the models of ``state`` with trainable parameters;
            a frozen reference is rebuilt from its source, not stored).
        extra_json: any JSON-serialisable value, kept in ``trainer_state.json``.
        metrics: the latest metrics (floats), kept in ``trainer_state.json`` and the model card.
        keep_last: keep only the newest ``keep_last`` checkpoints (older ones are deleted after
            the new one is in place); ``None`` keeps all.
        tokenizer: saved beside the policy's weights (``models/policy``), so that folder loads with
            ``from_pretrained`` for both the model and its tokenizer.
        sharded: in a distributed run, each rank writes its own rows of the FSDP2 models and of the
            optimiser state (``loops.checkpoint_shards``) instead of rank 0 writing gathered tensors.
    Returns:
        ``Path`` of the new checkpoint. Reads the global RNG states without changing them.

    Distributed: call it on every rank (FSDP2 shards are gathered, or each rank writes its own;
    rank 0 writes the rest with its RNGs; every rank returns once the checkpoint is in place or
    raises if any rank failed).
    """
    _check_keep_last(keep_last)
    run_dir = Path(run_dir)
    step = state.step if step is None else int(step)
    models = _trainable(state.models) if models is None else dict(models)
    split = frozenset(n for n, m in models.items() if is_fsdp2(m) and not is_peft(m)) \
        if sharded and dist_info().distributed else frozenset()  # an adapter is small: gathered, rank 0 writes
    if split:
        return _save_sharded(run_dir, run_dir / f"checkpoint-{step}", state, step, _as_dict(config), models, split,
                             extra_json, dict(metrics or {}), keep_last, tokenizer)
    weights = {name: _gathered(model) for name, model in models.items()}  # collectives: every rank
    optimizer_state = None if state.optimizer is None else full_optimizer_state(state.optimizer)
    final, error = run_dir / f"checkpoint-{step}", None
    if dist_info().is_main:
        try:
            _write_checkpoint(run_dir, final, state, step, _as_dict(config), models, extra_json,
                              dict(metrics or {}), weights, optimizer_state, keep_last, tokenizer)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, after the other ranks hear of it
            error = e
    _together(error, final, "write the checkpoint")  # the barrier: every rank waits for rank 0's write
    return final


def _together(error: BaseException | None, where: Path, what: str) -> None:
    """Every rank learns whether every rank succeeded (one all-reduce): a rank's own error is raised
    on it, the others raise a ``CheckpointError`` pointing to it."""
    ok = all_ranks_ok(error is None)
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"{where}: another rank failed to {what} (see its error)")


def _save_sharded(run_dir: Path, final: Path, state: TrainState, step: int, config: dict,
                  models: Mapping[str, nn.Module], split: frozenset[str], extra_json: Any, metrics: dict,
                  keep_last: int | None, tokenizer: Any) -> Path:
    """``save_checkpoint(sharded=True)``: every rank writes its rows into the same temporary folder
    (named by rank 0), hashes its own files for the manifest; rank 0 writes the rest, the manifest,
    and publishes the folder once every rank has written."""
    info = dist_info()
    weights = {name: _gathered(model) for name, model in models.items() if name not in split}  # collectives
    token = secrets.randbits(31) if info.is_main else 0  # secrets: leaves `random` untouched
    token = int(all_reduce_sum(torch.tensor([token], dtype=torch.long, device=info.device)).item())
    tmp, error = run_dir / f".tmp-step-{step}-{token:08x}", None
    if info.is_main:
        try:
            for name in split:
                (tmp / "models" / name).mkdir(parents=True)
            if state.optimizer is not None:
                (tmp / "optimizer").mkdir(parents=True, exist_ok=True)
        except BaseException as e:  # noqa: BLE001 -- raised by _together, after the other ranks hear of it
            error = e
    _together(error, final, "create the checkpoint's folder")
    try:
        written = []
        for name in sorted(split):
            model = unwrap_model(models[name])
            written += save_shards(tmp / "models" / name, drop_tied(model, model.state_dict()), rank=info.rank,
                                   world_size=info.world_size)
        skeleton = None
        if state.optimizer is not None:
            sd = state.optimizer.state_dict()
            written += save_shards(tmp / "optimizer", _optimizer_tensors(sd), rank=info.rank,
                                   world_size=info.world_size)
            skeleton = {**sd, "state": {i: {k: None if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                                        for i, st in sd["state"].items()}}
        for f in written:
            _fsync(f)
        if info.is_main:
            _write_contents(tmp, state, step, config, models, extra_json, metrics, weights, skeleton, tokenizer,
                            sharded=split)
        else:  # this rank's files, hashed here: rank 0 reads none of them for the manifest
            hashes = tmp / f".hashes-{info.rank}.json"
            hashes.write_text(json.dumps(_hashes(tmp, written)))
            _fsync(hashes)
    except BaseException as e:  # noqa: BLE001
        error = e
    ok = all_ranks_ok(error is None)
    if info.is_main:
        try:
            if ok and error is None:
                known: dict[str, Any] = {}
                for rank in range(1, info.world_size):
                    f = tmp / f".hashes-{rank}.json"
                    known.update(read_json(f, expect=dict))
                    f.unlink()
                _write_manifest(tmp, known)
                _fsync_tree(tmp)
                _publish(tmp, final)
                _prune(run_dir, keep_last)
        except BaseException as e:  # noqa: BLE001
            error = e
        if error is not None or not ok:
            shutil.rmtree(tmp, ignore_errors=True)
    _together(error, final, "write the checkpoint")
    return final


def _write_checkpoint(run_dir: Path, final: Path, state: TrainState, step: int, config: dict,
                      models: Mapping[str, nn.Module], extra_json: Any, metrics: dict, weights: Mapping[str, Any],
                      optimizer_state: dict | None, keep_last: int | None, tokenizer: Any = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".tmp-step-{step}-{secrets.token_hex(4)}"  # secrets: leaves `random` untouched
    tmp.mkdir()
    try:
        _write_contents(tmp, state, step, config, models, extra_json, metrics, weights, optimizer_state, tokenizer)
        _write_manifest(tmp)
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(run_dir, keep_last)


def load_checkpoint(path: str | Path, state_template: TrainState, *, restore_global_rng: bool = True) -> TrainState:
    """Restore a checkpoint into the objects of ``state_template``; return the restored state.

    Weights are copied into ``state_template.models`` (in place, so the optimiser keeps pointing
    at the right parameters); optimiser and scheduler state are loaded into the template's;
    counters, transform states and the generator come back in the returned state; the global
    RNGs are reset to their saved states (``restore_global_rng``). Template models absent from
    the checkpoint (a frozen reference) are left as they are.

    Raises:
        CheckpointError: a missing or truncated file (checked against ``manifest.json``), an
            unreadable safetensors/JSON file (named in the message), or weights / state that do
            not fit the template.
    """
    path = Path(path)
    _verify_together(path)
    meta = read_json(path / "trainer_state.json", expect=dict)
    if not (isinstance(meta.get("models"), list) and all(isinstance(n, str) for n in meta["models"])):
        raise CheckpointError(f"{path / 'trainer_state.json'}: expected 'models': a list of names, "
                              f"got {meta.get('models')!r:.200}")
    absent = sorted(set(meta["models"]) - set(state_template.models))
    if absent:
        raise CheckpointError(f"{path}: models {absent} are stored but not in the template "
                              f"(which has {sorted(state_template.models)})")
    error = None
    try:  # each rank reads its own rows of a sharded checkpoint: one failing makes every rank raise
        _load_weights_and_optimizer(path, meta["models"], state_template)
    except Exception as e:  # noqa: BLE001 -- raised by _together
        error = e
    if dist_info().distributed:
        _together(error, path, "load the checkpoint")
    elif error is not None:
        raise error
    rest = {f.name: getattr(state_template, f.name) for f in dataclasses.fields(state_template)
            if f.name not in _SPECIAL}
    restored = read_pair(path, "state", like=rest)
    if restore_global_rng:
        try:
            _set_global_rng(read_pair(path, "rng"))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a well-formed file of the wrong shape
            raise CheckpointError(f"{path / 'rng.json'}: not the global RNG states rlcore stores "
                                  f"({type(e).__name__}: {e})") from e
    return dataclasses.replace(state_template, **{k: v for k, v in restored.items() if k in rest})


def _load_weights_and_optimizer(path: Path, names: list[str], state_template: TrainState) -> None:
    for name in names:
        _load_model(state_template.models[name], path / "models" / name)
    for name in ("optimizer", "scheduler"):
        target = getattr(state_template, name)
        if target is not None:
            if not (path / f"{name}.json").is_file():
                raise CheckpointError(f"{path}: the template has a {name} but the checkpoint stores none")
            try:
                stored = read_pair(path, name)
                if name == "optimizer":
                    stored = _load_sharded_optimizer(path, stored, target) if (path / name / INDEX).is_file() \
                        else shard_optimizer_state(stored, target)
                target.load_state_dict(stored)
            except (ValueError, KeyError, RuntimeError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{path / name}.json: does not fit the template's {name}: {e}") from e


def checkpoint_info(path: str | Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint (step, time, models, metrics, extra) plus its ``config``."""
    path = Path(path)
    return {**read_json(path / "trainer_state.json", expect=dict), "config": read_json(path / "config.json")}


def resume(run_dir: str | Path, state: TrainState, **kwargs: Any) -> TrainState:
    """``state`` restored from the latest checkpoint of ``run_dir``, or ``state`` itself if none."""
    latest = latest_checkpoint(run_dir)
    return state if latest is None else load_checkpoint(latest, state, **kwargs)


class Checkpointer:
    """A fold callback saving a checkpoint every ``every`` steps (and after the last one).

    ``callbacks=[..., Checkpointer(run_dir, every=500, keep_last=3, config=cfg)]``. The step's
    metrics go into ``trainer_state.json`` and the model card.
    """

    def __init__(self, run_dir: str | Path, *, every: int, keep_last: int | None = None, config: Any = None,
                 models: Mapping[str, nn.Module] | None = None, extra_json: Any = None, at_end: bool = True,
                 tokenizer: Any = None, sharded: bool = False):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        _check_keep_last(keep_last)
        self.run_dir, self.every, self.at_end = Path(run_dir), every, at_end
        self.kwargs = dict(keep_last=keep_last, config=config, models=models, extra_json=extra_json,
                           tokenizer=tokenizer, sharded=sharded)
        self.saved: list[Path] = []
        self._metrics: dict = {}

    def __call__(self, state: TrainState, metrics: dict) -> None:
        self._metrics = metrics
        if state.step % self.every == 0:
            self.saved.append(save_checkpoint(self.run_dir, state, metrics=metrics, **self.kwargs))

    def on_end(self, state: TrainState) -> None:
        done = self.saved and self.saved[-1].name == f"checkpoint-{state.step}"
        if self.at_end and state.step > 0 and not done:
            self.saved.append(save_checkpoint(self.run_dir, state, metrics=self._metrics, **self.kwargs))
