"""A checkpoint is untrusted data: loading one never imports a module it names, never opens a file
outside its folder, never follows a link, never loads a file the manifest does not vouch for, and
every load path (resume, ``init_from``, ``rlcore eval``) checks the SHA-256 of every file."""

import dataclasses
import hashlib
import json
import os
import sys

import pytest

from rlcore.loops.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from rlcore.loops.checkpoint_codec import CheckpointError
from rlcore.loops.recipe import checkpoint_model_dir
from rlcore.loops.recipes import RECIPES
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


# --- a checkpoint's config is data: eval, export and init_from take code and trust from the caller --------------
TINY_CLI = ["--hidden_size", "16", "--num_layers", "1", "--num_heads", "2", "--num_train", "8", "--num_eval", "4"]
TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_train=8, num_eval=4)


def refresh_manifest(path):
    """Rewrite a checkpoint's manifest after its files were changed, as an attacker would."""
    from rlcore.loops.checkpoint import _write_manifest
    (path / "manifest.json").unlink()
    _write_manifest(path)


@pytest.fixture(scope="module")
def grpo_checkpoint(tmp_path_factory):
    """A one-step GRPO run of a tiny model, trained from the command line."""
    from rlcore.loops import cli
    run = tmp_path_factory.mktemp("grpo") / "run"
    assert cli.main(["train", "grpo", "--steps", "1", "--batch_size", "2", "--num_samples", "2",
                     "--max_new_tokens", "4", "--run_dir", str(run), *TINY_CLI]) == 0
    return latest_checkpoint(run)


@pytest.fixture
def hostile_checkpoint(tmp_path, grpo_checkpoint, monkeypatch):
    """A copy of the GRPO checkpoint whose stored config names a reward function of a module that
    writes a marker file when imported or called, and allows remote code; ``(path, marker)``."""
    return plant(tmp_path, grpo_checkpoint, monkeypatch)


def plant(tmp_path, checkpoint, monkeypatch, **fields):
    import shutil
    path = tmp_path / "checkpoint-1"
    shutil.copytree(checkpoint, path)
    marker = tmp_path / "marker"
    (tmp_path / "planted_rewards.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        f"def fn(prompts, completions, **kw):\n    pathlib.Path({str(marker)!r}).write_text('called')\n"
        "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("planted_rewards", None)
    stored = json.loads((path / "config.json").read_text())
    stored.update(reward_funcs=["planted_rewards:fn"], trust_remote_code=True, temperature=0.5, **fields)
    (path / "config.json").write_text(json.dumps(stored))
    refresh_manifest(path)
    return path, marker


@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_never_run_a_stored_reward_function(hostile_checkpoint, command, capsys, tmp_path):
    from rlcore.loops import cli
    path, marker = hostile_checkpoint
    extra = ["--out", str(tmp_path / "out")] if command == "export" else []
    assert cli.main([command, "grpo", "--checkpoint", str(path), *TINY_CLI, *extra]) == 0
    assert not marker.exists() and "planted_rewards" not in sys.modules
    err = capsys.readouterr().err
    for line in ("reward_funcs: the stored ['planted_rewards:fn'] is not used", "using []",
                 "trust_remote_code: the stored True is not used"):
        assert line in err, (line, err)
    assert f"{path / 'config.json'}" in err


def test_eval_takes_stored_hyper_parameters_but_not_trust(tmp_path, grpo_checkpoint, monkeypatch, capsys):
    """``temperature`` (it only shapes numbers) comes from the checkpoint; ``trust_remote_code``,
    ``reward_funcs``, ``dataset``, ``device`` and ``init_from`` are the caller's."""
    from rlcore.loops import cli
    seen = []
    monkeypatch.setitem(RECIPES, "grpo", dataclasses.replace(RECIPES["grpo"],
                                                             evaluate=lambda state, config: seen.append(config) or {}))
    path, marker = plant(tmp_path, grpo_checkpoint, monkeypatch, dataset=str(tmp_path / "x.jsonl"), device="cuda:7",
                         init_from=str(tmp_path / "elsewhere"), reward_model=str(tmp_path / "rm"),
                         reward_weights=[0.5])  # they weigh the stored functions: without them, a crash
    assert cli.main(["eval", "grpo", "--checkpoint", str(path), *TINY_CLI]) == 0
    config = seen[-1]
    assert config.temperature == 0.5 and config.trust_remote_code is False and config.reward_funcs == ()
    assert config.reward_weights is None
    assert config.dataset is None and config.device == "cpu" and config.init_from == str(path)
    assert cli.main(["eval", "grpo", "--checkpoint", str(path), *TINY_CLI, "--temperature", "0.7"]) == 0
    assert seen[-1].temperature == 0.7  # the caller's value wins over a stored hyper-parameter
    assert cli.main(["eval", "grpo", "--checkpoint", str(path), *TINY_CLI, "--learning_rate", "0.123"]) == 0
    assert seen[-1].lr == 0.123  # a TRL name of the caller's is no conflict with the stored lr
    assert not marker.exists()
    err = capsys.readouterr().err
    for name in ("dataset", "device", "init_from", "reward_model", "reward_weights"):
        assert f"{name}: the stored " in err, (name, err)
    assert "without --dataset, the built-in task's prompts are evaluated, not the run's data" in err


def test_a_stored_path_inside_any_setting_is_not_taken(tmp_path):
    from rlcore.loops.checkpoint_config import data_settings
    stored = {"loss_kwargs": {"fn": "os:system"}, "prompts": ["../../etc/passwd"], "hidden_size": 32,
              "model": "tiny-gpt2", "task": "add"}
    caller = {"loss_kwargs": {}, "prompts": ["a"], "hidden_size": 64, "model": "tiny-llama", "task": "add"}
    taken, ignored = data_settings(stored, list(stored), caller)
    assert taken == {"hidden_size": 32, "model": "tiny-gpt2", "task": "add"}  # a built-in model name is no path
    assert [name for name, _, _ in ignored] == ["loss_kwargs", "prompts"]
    taken, ignored = data_settings({"model": "/models/other"}, ["model"], caller)
    assert taken == {} and ignored == [("model", "/models/other", "tiny-llama")]
    taken, _ = data_settings(stored, list(stored), caller, given=["hidden_size"])
    assert "hidden_size" not in taken  # the caller's explicit value wins


def test_a_stored_environment_is_never_taken():
    """A built-in environment name holds no path, yet ``python`` runs model-written code: a run's
    environment and tools come from the caller alone."""
    from rlcore.loops.checkpoint_config import data_settings
    stored = {"env": "python", "tools": [], "tool_format": "llama3", "max_turns": 3}
    caller = {"env": None, "tools": [], "tool_format": "qwen", "max_turns": 4}
    taken, ignored = data_settings(stored, list(stored), caller)
    assert taken == {"max_turns": 3}
    assert [name for name, _, _ in ignored] == ["env", "tool_format"]


# --- the adapter base of a LoRA checkpoint is the caller's -------------------------------------------------------
@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    from rlcore.loops.recipes import sft
    run = tmp_path_factory.mktemp("lora") / "run"
    config = sft.Config(steps=1, batch_size=4, use_peft=True, lora_r=2, run_dir=str(run), **TINY)
    sft.train(config)
    return config, latest_checkpoint(run)


def _with_stored(tmp_path, checkpoint, **fields):
    import shutil
    path = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, path)
    stored = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**stored, **fields}))
    refresh_manifest(path)
    return path


def test_an_adapter_base_named_only_by_the_checkpoint_is_refused(tmp_path, lora_checkpoint):
    import dataclasses
    from rlcore.loops.recipe import build_policy
    config, checkpoint = lora_checkpoint
    plain = dataclasses.replace(config, run_dir=None, use_peft=False)
    assert build_policy(dataclasses.replace(plain, init_from=str(checkpoint)))[0] is not None  # its own base: fine
    path = _with_stored(tmp_path, checkpoint, model=str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=r"model: the adapter was trained on '.*elsewhere', the model given is "
                                         r"'tiny-llama'; a base model named only by a checkpoint is not loaded"):
        build_policy(dataclasses.replace(plain, init_from=str(path)))
    path = _with_stored(tmp_path / "b", checkpoint, init_from=str(tmp_path / "sft"))
    with pytest.raises(ValueError, match=r"init_from: the adapter's run started from '.*sft', a path stored in a "
                                         r"checkpoint, which is not followed \(given: None\)"):
        build_policy(dataclasses.replace(plain, init_from=str(path)))


# --- every JSON file is bounded and named --------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["state.json", "rng.json", "trainer_state.json", "optimizer.json",
                                  "scheduler.json", "config.json"])
def test_deeply_nested_json_names_the_file(tmp_path, name):
    from rlcore.loops.checkpoint import checkpoint_info
    path = save_checkpoint(tmp_path, make_state(), config={"lr": 1.0})
    rewrite(path, name, DEEP)
    load = checkpoint_info if name == "config.json" else lambda p: load_checkpoint(p, make_state())
    with pytest.raises(CheckpointError, match=rf"{name}: JSON nested 100000 deep, more than the 64 levels allowed"):
        load(path)


def test_deep_manifest_and_stored_config_name_their_file(tmp_path):
    from rlcore.loops.checkpoint_config import stored_config
    path = save_checkpoint(tmp_path, make_state())
    rewrite(path, "config.json", DEEP)
    with pytest.raises(CheckpointError, match=r"config.json: JSON nested 100000 deep"):
        stored_config(path)
    (path / "manifest.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=r"manifest.json: JSON nested 100000 deep"):
        verify_checkpoint(path)


def test_json_too_big_malformed_or_of_another_type_names_the_file(tmp_path):
    from rlcore.loops.checkpoint_codec import read_json
    (tmp_path / "a.json").write_text(json.dumps({"x": "y" * 100}))
    with pytest.raises(CheckpointError, match=r"a.json: a JSON file over 50 bytes; refused"):
        read_json(tmp_path / "a.json", max_bytes=50)
    path = save_checkpoint(tmp_path / "run", make_state())
    rewrite(path, "state.json", "[1, 2]")
    with pytest.raises(CheckpointError, match=r"state.json: expected a JSON object at the top level, got list"):
        load_checkpoint(path, make_state())
    rewrite(path, "trainer_state.json", '{"step": 1')
    with pytest.raises(CheckpointError, match=r"trainer_state.json: unreadable JSON \(JSONDecodeError"):
        load_checkpoint(path, make_state())


def test_a_deep_adapter_config_names_the_file(tmp_path, lora_checkpoint):
    import dataclasses
    from rlcore.loops.recipe import build_policy
    config, checkpoint = lora_checkpoint
    path = _with_stored(tmp_path, checkpoint)
    (path / "models" / "policy" / "adapter_config.json").write_text(DEEP)
    refresh_manifest(path)
    with pytest.raises(ValueError, match=r"adapter_config.json: JSON nested 100000 deep"):
        build_policy(dataclasses.replace(config, run_dir=None, use_peft=False, init_from=str(path)))


# --- crafted safetensors headers ------------------------------------------------------------------------------
def craft(path, header, data=b"\0" * 16, length=None):
    """A safetensors file with ``header`` (JSON) and ``data``; ``length`` overrides the stated header size."""
    text = json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


F32 = lambda shape, begin, end: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}  # noqa: E731


@pytest.mark.parametrize("header,length,message", [
    ({"w": F32([1 << 40, 1 << 20], 0, 16)}, None, r"tensor 'w': shape \[1099511627776, 1048576\] of F32 needs"),
    ({"w": F32([1 << 30], 0, 4 << 30)}, None, r"the tensors' data ends at byte 4294967296 of a data section of 16 "
                                              r"bytes \(tensor 'w'\)"),
    ({"a": F32([4], 0, 16), "b": F32([2], 8, 16)}, None, r"tensor 'b': data_offsets \[8, 16\] overlap"),
    ({"a": F32([2], 8, 16)}, None, r"tensor 'a': data_offsets \[8, 16\] leave a gap"),
    ({"w": F32([4], 0, 16)}, 1 << 40, r"safetensors header length 1099511627776 does not fit a file of"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, None, r"tensor 'w': shape must be a list"),
    ({"w": {"dtype": "XX", "shape": [4], "data_offsets": [0, 16]}}, None, r"tensor 'w': unknown dtype 'XX'"),
])
def test_crafted_safetensors_headers_are_refused_naming_file_and_tensor(tmp_path, header, length, message):
    from rlcore.loops.checkpoint_codec import load_tensors
    path = craft(tmp_path / "model.safetensors", header, length=length)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: .*{message}"):
        load_tensors(path)


def test_crafted_weights_in_a_checkpoint_are_refused_on_every_load_path(tmp_path):
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes import sft
    from rlcore.loops.state import init_state
    model, _ = build_policy(sft.Config(**TINY))
    path = save_checkpoint(tmp_path, init_state({"policy": model}))
    weights = path / "models" / "policy" / "model.safetensors"
    craft(weights, {"model.embed_tokens.weight": F32([1 << 40, 1 << 20], 0, 16)})
    refresh_manifest(path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.embed_tokens.weight': shape"):
        build_policy(sft.Config(init_from=str(path), **TINY))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.embed_tokens.weight': shape"):
        load_checkpoint(path, init_state({"policy": model}))


def test_a_tensor_the_json_tree_names_but_the_file_lacks(tmp_path):
    path = save_checkpoint(tmp_path, make_state())
    tree = json.loads((path / "state.json").read_text())
    tree["transforms"]["kl"]["fields"]["coef"]["__tensor__"] = "state.nowhere"
    rewrite(path, "state.json", json.dumps(tree))
    with pytest.raises(CheckpointError, match=r"state.safetensors: no tensor 'state.nowhere', which state.json "
                                              r"refers to"):
        load_checkpoint(path, make_state())


# --- init_from: the head, the vocabulary and every weight are checked ------------------------------------------
def _saved(tmp_path, model):
    from rlcore.loops.state import init_state
    return save_checkpoint(tmp_path, init_state({"policy": model}))


def test_init_from_a_reward_checkpoint_is_refused_for_a_policy(tmp_path):
    from rlcore.loops.models import build_reward_model, build_tokenizer
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes import reward, sft
    path = _saved(tmp_path, build_reward_model(tokenizer=build_tokenizer(), hidden_size=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"holds a sequence classifier \(a reward model\); this recipe trains a causal "
                                         r"language model \(a policy\) and would start from a random LM head"):
        build_policy(sft.Config(init_from=str(path), **TINY))
    loaded, _ = build_policy(reward.Config(init_from=str(path), **TINY), task=reward.MODEL_TASK)  # a reward recipe may
    assert type(loaded).__name__ == "LlamaForSequenceClassification"


def test_init_from_another_vocabulary_is_refused_before_training(tmp_path):
    from rlcore.loops.models import build_model
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes import sft
    path = _saved(tmp_path, build_model(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"init_from: .* has a vocabulary of 40 tokens, the model 'tiny-llama' 103; "
                                         r"it must share the model 'tiny-llama''s tokenizer"):
        build_policy(sft.Config(init_from=str(path), **TINY))


@pytest.mark.parametrize("change,message", [
    ("drop", r"missing \['model.layers.0.mlp.down_proj.weight'\], unexpected \[\]"),
    ("add", r"missing \[\], unexpected \['planted.weight'\]"),
])
def test_missing_or_extra_weights_are_an_error_naming_the_keys(tmp_path, change, message, capfd):
    import torch
    from safetensors.torch import load_file, save_file
    from rlcore.loops.recipe import build_policy
    from rlcore.loops.recipes import sft
    path = _saved(tmp_path, build_policy(sft.Config(**TINY))[0])
    weights_file = path / "models" / "policy" / "model.safetensors"
    weights = load_file(weights_file)
    if change == "drop":
        del weights["model.layers.0.mlp.down_proj.weight"]
    else:
        weights["planted.weight"] = torch.zeros(2)
    save_file(weights, weights_file, metadata={"format": "pt"})
    refresh_manifest(path)
    with pytest.raises(ValueError, match=rf"init_from: .*models/policy: the saved weights do not fill a "
                                         rf"LlamaForCausalLM: {message}"):
        build_policy(sft.Config(init_from=str(path), **TINY))
    assert "LOAD REPORT" not in capfd.readouterr().err


# --- adapter_config.json, stored model sizes and export's auto_map are data too ---------------------------------
def _edit_json(path, file, **fields):
    data = json.loads((path / file).read_text())
    data.update(fields)
    (path / file).write_text(json.dumps(data))
    refresh_manifest(path)


@pytest.mark.parametrize("field,value,message", [
    ("target_modules", "(\\w|\\W|.)*Z", r"target_modules: expected a non-empty list of plain module names"),
    ("target_modules", ["q_proj", ".*"], r"target_modules: expected a non-empty list"),
    ("r", 200_000_000, r"r: 200000000 is not the rank of the adapter's tensors"),
    ("r", True, r"r: expected a positive int"),
    ("lora_dropout", 1.5, r"lora_dropout: expected a number in \[0, 1\)"),
    ("bias", "everything", r"bias: expected one of"),
    ("layers_pattern", ["(a+)+$"], r"layers_pattern: \['\(a\+\)\+\$'\] is not taken from a checkpoint"),
    ("rank_pattern", {".*": 100000}, r"rank_pattern: .* is not taken from a checkpoint"),
    ("alpha_pattern", {".*": 3}, r"alpha_pattern: .* is not taken"),
    ("exclude_modules", "(x+)+y", r"exclude_modules: .* is not taken"),
    ("layer_replication", [[0, 100000]], r"layer_replication: .* is not taken"),
    ("megatron_config", {"a": 1}, r"megatron_config: .* is not taken"),
    ("init_lora_weights", "pissa", r"init_lora_weights: .* is not taken"),
    ("planted_field", 1, r"planted_field: 1 is not taken"),
])
@pytest.mark.parametrize("command", ["export", "init_from"])
def test_adapter_config_is_an_allow_list_checked_before_peft(tmp_path, lora_checkpoint, field, value, message,
                                                             command, monkeypatch):
    import dataclasses
    import peft
    from rlcore.loops import cli
    from rlcore.loops.recipe import build_policy
    config, checkpoint = lora_checkpoint
    path = _with_stored(tmp_path, checkpoint)
    _edit_json(path, "models/policy/adapter_config.json", **{field: value})
    monkeypatch.setattr(peft.LoraConfig, "from_pretrained", lambda *a, **k: pytest.fail("peft read the file"))
    where = r"models/policy/adapter_config.json: "
    if command == "export":
        with pytest.raises(CheckpointError, match=where + message):
            cli.main(["export", "sft", "--checkpoint", str(path), "--out", str(tmp_path / "out"), *TINY_CLI])
    else:
        with pytest.raises(CheckpointError, match=where + message):
            build_policy(dataclasses.replace(config, run_dir=None, use_peft=False, init_from=str(path)))


def test_a_real_adapter_config_still_loads(tmp_path, lora_checkpoint):
    from rlcore.loops.lora import adapter_settings
    _, checkpoint = lora_checkpoint
    settings, header = adapter_settings(checkpoint / "models" / "policy")
    assert settings["r"] == 2 and sorted(settings["target_modules"]) == ["q_proj", "v_proj"]
    assert all(".lora_" in k for k in header)


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A one-step SFT run of a tiny model (full weights)."""
    from rlcore.loops import cli
    run = tmp_path_factory.mktemp("sft") / "run"
    assert cli.main(["train", "sft", "--steps", "1", "--batch_size", "2", "--run_dir", str(run), *TINY_CLI]) == 0
    return latest_checkpoint(run)


def _copy(tmp_path, checkpoint):
    import shutil
    path = tmp_path / "checkpoint-1"
    shutil.copytree(checkpoint, path)
    return path


def _no_big_model(monkeypatch):
    """Building any model of more than 10 M parameters fails the test (the sizes came from a file)."""
    from transformers import PreTrainedModel
    real = PreTrainedModel.post_init

    def post_init(self):
        real(self)
        size = sum(p.numel() for p in self.parameters())
        if size > 10_000_000 and not any(p.is_meta for p in self.parameters()):
            pytest.fail(f"built a {size}-parameter {type(self).__name__} from a checkpoint's stored sizes")
    monkeypatch.setattr(PreTrainedModel, "post_init", post_init)


@pytest.mark.parametrize("which", ["full", "lora"])
def test_eval_checks_stored_sizes_against_the_weights_before_building_the_reference(
        tmp_path, sft_checkpoint, lora_checkpoint, which, monkeypatch):
    from rlcore.loops import cli
    path = _copy(tmp_path, sft_checkpoint if which == "full" else lora_checkpoint[1])
    _edit_json(path, "config.json", hidden_size=16384, num_layers=48, num_heads=128)
    _no_big_model(monkeypatch)
    cli_args = ["--num_train", "8", "--num_eval", "4"]  # the sizes come from the stored config
    with pytest.raises(CheckpointError, match=r"models/policy.*(do not fill a LlamaForCausalLM|the adapter does not "
                                              r"fit the base model).*(missing|other shapes)"):
        cli.main(["eval", "sft", "--checkpoint", str(path), *cli_args])


@pytest.mark.parametrize("fields,message", [
    ({"hidden_size": 16384, "intermediate_size": 65536},
     r"do not fill a LlamaForCausalLM: missing \[\], unexpected \[\], other shapes \[\('model.embed_tokens.weight'"),
    ({"num_hidden_layers": 100000}, r"config.json: num_hidden_layers: 100000 layers, but the saved weights hold at "
                                    r"most 1"),
    ({"model_type": "gpt2"}, r"do not fill a GPT2LMHeadModel: missing \[.*'transformer.h.0"),
])
def test_a_model_folder_config_is_checked_against_its_weights(tmp_path, sft_checkpoint, fields, message,
                                                              monkeypatch):
    from rlcore.loops import cli
    path = _copy(tmp_path, sft_checkpoint)
    _edit_json(path, "models/policy/config.json", **fields)
    _no_big_model(monkeypatch)
    with pytest.raises(CheckpointError, match=r"models/policy.*" + message):
        cli.main(["export", "sft", "--checkpoint", str(path), "--out", str(tmp_path / "out"), *TINY_CLI])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_load_exact_names_transformers_own_load_error(tmp_path, monkeypatch):
    from rlcore.loops import models
    from rlcore.loops.models import build_model, load_exact
    build_model(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    monkeypatch.setattr(models, "check_saved_model", lambda *a, **k: None)  # the layer of defence behind it
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 32, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"the saved weights do not load into the model its config.json describes "
                                         r"\(RuntimeError"):
        load_exact(tmp_path)


def test_stored_work_sizes_are_bounded_by_the_callers(tmp_path, grpo_checkpoint, monkeypatch, capsys):
    from rlcore.loops import cli
    seen = []
    monkeypatch.setitem(RECIPES, "grpo", dataclasses.replace(RECIPES["grpo"],
                                                             evaluate=lambda state, config: seen.append(config) or {}))
    path = _copy(tmp_path, grpo_checkpoint)
    _edit_json(path, "config.json", num_eval=30_000_000, max_new_tokens=1 << 30, eval_batch_size=2)
    assert cli.main(["eval", "grpo", "--checkpoint", str(path), "--hidden_size", "16", "--num_layers", "1",
                     "--num_heads", "2"]) == 0
    defaults = RECIPES["grpo"].config()
    assert seen[-1].num_eval == defaults.num_eval and seen[-1].max_new_tokens == defaults.max_new_tokens
    assert seen[-1].eval_batch_size == 2  # a smaller stored work size is taken
    err = capsys.readouterr().err
    assert "num_eval: the stored 30000000 is not used (a work size above the caller's" in err
    assert "max_new_tokens: the stored 1073741824 is not used" in err


def test_export_writes_no_auto_map(tmp_path, sft_checkpoint, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rlcore.loops import cli
    path = _copy(tmp_path, sft_checkpoint)
    planted = {"AutoConfig": "planted.Config", "AutoModelForCausalLM": "planted.Model"}
    _edit_json(path, "models/policy/config.json", auto_map=planted)
    out = tmp_path / "out"
    assert cli.main(["export", "sft", "--checkpoint", str(path), "--out", str(out), *TINY_CLI]) == 0
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((out / name).read_text()), name
    assert "auto_map {'AutoConfig': 'planted.Config'" in capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(out) is not None and AutoTokenizer.from_pretrained(out) is not None
