"""A checkpoint is untrusted data: loading one never imports a module it names, never opens a file
outside its folder, never follows a link, never loads a file the manifest does not vouch for, and
every load path (resume, ``init_from``, ``rlcore eval``) checks the SHA-256 of every file."""

import hashlib
import json
import os
import sys

import pytest

from rlcore.loops.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from rlcore.loops.checkpoint_codec import CheckpointError
from rlcore.loops.recipe import checkpoint_model_dir
from tests.loops.test_checkpoint import make_state


def rewrite(path, name, text):
    """Replace a file of a checkpoint and update its manifest entry, as an attacker would."""
    (path / name).write_text(text)
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def add_to_manifest(path, name, entry):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = entry
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("module", ["this", "os.path", "json"])
def test_a_stored_type_never_imports_a_module(tmp_path, module):
    path = save_checkpoint(tmp_path, make_state())
    forged = {"__namedtuple__": f"{module}:x", "fields": {}}
    rewrite(path, "rng.json", json.dumps({"torch": forged}))
    sys.modules.pop("this", None)
    with pytest.raises(CheckpointError,
                       match=rf"rng\['torch'\]: the stored type '{module}:x' is not one of rlcore's loaded types"):
        load_checkpoint(path, make_state())
    assert "this" not in sys.modules  # never imported (it prints on import)


def test_rlcore_types_still_load_without_a_template(tmp_path):
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    template = make_state(kl=0.5)
    template = template.__class__(**{**template.__dict__, "transforms": {}})  # no template for the transforms
    restored = load_checkpoint(path, template)
    assert type(restored.transforms["kl"]) is type(state.transforms["kl"])
    assert float(restored.transforms["kl"].coef) == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "models/../../x", "manifest.json"])
def test_manifest_entries_outside_the_folder_are_refused(tmp_path, name):
    path = save_checkpoint(tmp_path / "run", make_state())
    (tmp_path / "run" / "outside.txt").write_text("x")
    add_to_manifest(path, name, {"size": 1, "sha256": "0" * 64})
    with pytest.raises(CheckpointError, match="is not a path inside the checkpoint"):
        load_checkpoint(path, make_state())


def test_symbolic_links_and_planted_files_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "run", make_state())
    weights = path / "models" / "policy" / "model.safetensors"
    (path / "models" / "policy" / "extra.safetensors").write_bytes(weights.read_bytes())
    with pytest.raises(CheckpointError, match=r"files not in manifest.json: \['models/policy/extra.safetensors'\]"):
        load_checkpoint(path, make_state())
    (path / "models" / "policy" / "extra.safetensors").unlink()
    other = save_checkpoint(tmp_path / "other", make_state(model_seed=5))
    weights.unlink()
    weights.symlink_to(other / "models" / "policy" / "model.safetensors")
    with pytest.raises(CheckpointError, match="a symbolic link or special file inside the checkpoint"):
        load_checkpoint(path, make_state())


def test_a_linked_checkpoint_folder_is_not_a_checkpoint_of_the_run(tmp_path):
    save_checkpoint(tmp_path / "run", make_state(), step=1)
    other = save_checkpoint(tmp_path / "other", make_state(), step=9)
    os.symlink(other, tmp_path / "run" / "checkpoint-9")
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-1"
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify_checkpoint(tmp_path / "run" / "checkpoint-9")


def test_init_from_and_eval_verify_every_file(tmp_path):
    """``checkpoint_model_dir`` is the door of init_from and ``rlcore eval``: a flipped byte is caught."""
    path = save_checkpoint(tmp_path, make_state())
    assert checkpoint_model_dir(path) == path / "models" / "policy"
    weights = path / "models" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted: its SHA-256 differs"):
        checkpoint_model_dir(path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted"):
        checkpoint_model_dir(tmp_path)  # a run directory: its latest checkpoint


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True, "2"])
def test_keep_last_must_keep_something(tmp_path, keep_last):
    save_checkpoint(tmp_path, make_state(), step=1)
    with pytest.raises(ValueError, match=r"keep_last: expected None \(keep all\) or an int >= 1"):
        save_checkpoint(tmp_path, make_state(), step=2, keep_last=keep_last)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, every=1, keep_last=keep_last)
    assert [p.name for p in sorted(tmp_path.glob("checkpoint-*"))] == ["checkpoint-1"]  # nothing deleted


def test_a_malformed_manifest_is_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, make_state())
    good = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(["not", "a", "mapping"]))
    with pytest.raises(CheckpointError, match=r"manifest.json: expected \{'files'"):
        load_checkpoint(path, make_state())
    good["files"]["state.json"] = {"size": "big"}
    (path / "manifest.json").write_text(json.dumps(good))
    with pytest.raises(CheckpointError, match=r"the entry for 'state.json' needs an int size"):
        load_checkpoint(path, make_state())
