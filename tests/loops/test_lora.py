"""LoRA policies from a config (loops/lora.py, ``use_peft`` in loops.config.RunConfig): the
adapter-off reference, every recipe's step, exact resume, init_from and the merged export."""

import copy
import dataclasses
import json

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import dpo, grpo, online_dpo, ppo, reward, rloo, sft
from rlcore.loops.checkpoint import latest_checkpoint
from rlcore.loops.cli import main as cli
from rlcore.loops.collect import generate_rollout
from rlcore.loops.fold import stop_when
from rlcore.loops.lora import AdapterOff, adapter_off, is_adapter_dir, is_peft, load_adapter_weights
from rlcore.loops.models import build_tokenizer, make_reference
from rlcore.loops.recipe import build_policy, build_reference
from rlcore.loops.config import check_config
from rlcore.loops.score import token_logprobs_from_model

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations hit inside peft

TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=32, num_eval=8, run_dir=None, log_every=100)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=("all-linear",))
ONLINE = dict(batch_size=4, num_samples=4, max_new_tokens=6, eval_every=0)
IDS = torch.tensor([[3, 9, 14, 20, 7, 11], [0, 0, 5, 8, 13, 2]])
MASK = IDS != 0


def _lora_policy(**fields):
    return build_policy(grpo.Config(**{**TINY, **LORA, **fields}))[0]


def _perturbed(model):
    """``model`` with every LoRA B made non-zero (a fresh adapter computes exactly the base)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def _logprobs(model, chunked=True):
    with torch.no_grad():
        return token_logprobs_from_model(model, IDS, MASK, chunked=chunked)


def _frozen_base(model):
    """A frozen copy of the base under ``model`` (what the reference must compute): the plain
    policy of the same seed, built apart (the tests change only the adapter and the saved copies)."""
    assert is_peft(model)
    return make_reference(build_policy(grpo.Config(**TINY))[0])


# --- the adapter ----------------------------------------------------------------------------------
def test_apply_lora_trains_only_the_adapter_and_starts_at_the_base():
    plain = build_policy(grpo.Config(**TINY))[0]
    model = _lora_policy()
    assert is_peft(model) and not is_peft(plain)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight  # all-linear: every projection, not the LM head
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= targets
    assert "lm_head" not in targets
    torch.testing.assert_close(_logprobs(model), _logprobs(plain), rtol=0, atol=0)  # B = 0


def test_lora_fields_are_peft_s():
    model = build_policy(sft.Config(**{**TINY, **LORA, "lora_r": 3, "lora_alpha": 12, "lora_dropout": 0.2,
                                       "lora_target_modules": ("q_proj",), "lora_modules_to_save": ("lm_head",)}))[0]
    lora = model.peft_config["default"]
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (3, 12, 0.2, {"q_proj"})
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 12 / 3 and layer.lora_dropout["default"].p == 0.2
    assert any("lm_head.modules_to_save" in n for n, p in model.named_parameters() if p.requires_grad)


def test_dropout_off_includes_the_adapter_s():
    model = _lora_policy(lora_dropout=0.3)  # the online recipes' disable_dropout default
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_gpt2_policy_gets_peft_s_default_targets():
    model = build_policy(grpo.Config(**TINY, model="tiny-gpt2", use_peft=True))[0]
    assert set(model.peft_config["default"].target_modules) == {"c_attn"}


def test_target_modules_that_are_not_in_the_model_are_named():
    with pytest.raises(ValueError, match=r"lora_target_modules: \('qkv',\) does not fit LlamaForCausalLM.*"
                                         r"linear layers are named \[.*'q_proj'"):
        _lora_policy(lora_target_modules=("qkv",))


def test_lora_ranges_are_checked_before_a_model_is_built():
    for field, value, allowed in (("lora_r", 0, ">= 1"), ("lora_alpha", -1, "> 0"), ("lora_dropout", 1.0, r"in \[0, 1\)")):
        with pytest.raises(ValueError, match=f"{field}: expected {allowed}, got {value}"):
            check_config(grpo.Config(**{**LORA, field: value}))


def test_quantisation_is_refused_where_bitsandbytes_cannot_serve():
    cases = [(dict(load_in_4bit=True, load_in_8bit=True), "choose one"),
             (dict(load_in_4bit=True), "quantised weights do not train; set use_peft"),
             (dict(load_in_8bit=True, use_peft=True), "built from a config, not loaded"),
             (dict(load_in_4bit=True, use_peft=True, model="/models/qwen"), "runs on CUDA here; device is 'cpu'")]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            check_config(grpo.Config(**fields))


# --- the reference: the same model with the adapter off -------------------------------------------
def test_adapter_off_equals_a_frozen_copy_of_the_base_on_both_paths():
    model = _perturbed(_lora_policy())
    ref, frozen = adapter_off(model), _frozen_base(model)
    assert list(ref.parameters()) == []  # no second copy of the weights
    for chunked in (True, False):
        torch.testing.assert_close(_logprobs(ref, chunked), _logprobs(frozen, chunked), rtol=0, atol=0)
        assert not torch.allclose(_logprobs(model, chunked), _logprobs(frozen, chunked))  # adapter back on after
    assert ref.get_output_embeddings() is model.get_output_embeddings()  # all-linear leaves the head: one tensor


@pytest.mark.parametrize("head", [dict(lora_modules_to_save=("lm_head",)),
                                  dict(lora_target_modules=("q_proj", "lm_head"))], ids=["saved", "lora"])
def test_a_peft_wrapped_head_scores_alike_on_both_paths(head):
    model = _perturbed(_lora_policy(**head))
    if "lora_modules_to_save" in head:
        with torch.no_grad():
            model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(3.0)
    paths = []
    for chunked in (True, False):
        model.zero_grad()
        lp = token_logprobs_from_model(model, IDS, MASK, chunked=chunked)
        (lp * MASK[:, 1:]).sum().backward()
        paths.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (lp_hidden, g_hidden), (lp_logits, g_logits) = paths
    torch.testing.assert_close(lp_hidden[MASK[:, 1:]], lp_logits[MASK[:, 1:]], rtol=1e-5, atol=1e-5)
    for name in g_logits:
        torch.testing.assert_close(g_hidden[name], g_logits[name], rtol=1e-4, atol=1e-6)
    ref, frozen = adapter_off(model), _frozen_base(model)
    torch.testing.assert_close(_logprobs(ref), _logprobs(frozen), rtol=0, atol=0)


def test_adapter_off_generates_the_base_s_answers():
    model = _perturbed(_lora_policy())
    tokenizer = build_tokenizer()
    prompts = ["12+34=", "abc"]
    for engine in ("hf", "loop"):  # Hugging Face generate and the KV-cache loop
        kw = dict(max_new_tokens=5, do_sample=False, behaviour=None, engine=engine)
        ours = generate_rollout(adapter_off(model), tokenizer, prompts, **kw)[K.RESPONSE_IDS]
        base = generate_rollout(_frozen_base(model), tokenizer, prompts, **kw)[K.RESPONSE_IDS]
        assert torch.equal(ours, base)


def test_adapter_off_needs_a_peft_model():
    with pytest.raises(TypeError, match="disable_adapter"):
        AdapterOff(build_policy(grpo.Config(**TINY))[0])


def test_build_reference_of_a_lora_policy_is_the_adapter_off_and_stays_the_base():
    config = grpo.Config(**TINY, **LORA)
    policy = build_policy(config)[0]
    ref = build_reference(config, policy)
    assert isinstance(ref, AdapterOff) and ref.peft_model is policy
    before = _logprobs(ref)
    _perturbed(policy)  # training moves the adapter, not the base
    torch.testing.assert_close(_logprobs(ref), before, rtol=0, atol=0)


# --- every recipe trains its adapter ----------------------------------------------------------------
def _base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def _check_only_adapter_moved(before, model):
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items()), "a base weight moved"
    assert any(not torch.all(p == 0) for n, p in after.items() if "lora_B" in n), "the adapter did not move"


def test_sft_lora_lowers_the_loss_and_keeps_the_base():
    config = sft.Config(**{**TINY, **LORA, "batch_size": 16, "max_length": 24, "lr": 1e-2, "steps": 12})
    before = _base_weights(build_policy(config)[0])
    state, hist = sft.train(config)
    _check_only_adapter_moved(before, state.model())
    assert sum(h["loss"] for h in hist[-3:]) < sum(h["loss"] for h in hist[:3])


# A random tiny model's logits are E·h with frozen embeddings of scale 0.02: an adapter on the trunk
# alone barely sharpens them, so the learning tests train the (untied) LM head beside it.
HEAD = dict(lora_modules_to_save=("lm_head",))


def test_dpo_lora_lowers_the_loss_with_the_adapter_off_reference():
    config = dpo.Config(**{**TINY, **LORA, **HEAD, "batch_size": 16, "max_length": 24, "lr": 3e-2, "steps": 12})
    state, hist = dpo.train(config)
    assert isinstance(state.model("ref"), AdapterOff) and state.model("ref").peft_model is state.model()
    assert hist[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference at the start
    assert sum(h["loss"] for h in hist[-3:]) / 3 < 0.6, [h["loss"] for h in hist]


def test_device_fields_are_checked_at_load():
    for name in ("device", "ref_device", "reward_device"):
        with pytest.raises(ValueError, match=f"{name}: expected a device such as 'cpu', 'cuda' or 'cuda:1', got 'gpu0'"):
            check_config(grpo.Config(**{name: "gpu0"}))


def test_an_adapter_off_reference_cannot_live_elsewhere():
    with pytest.raises(ValueError, match="ref_device: 'meta': the reference of a LoRA policy is the policy itself"):
        build_reference(grpo.Config(**TINY, **LORA, ref_device="meta"), _lora_policy())
    assert build_reference(grpo.Config(**TINY, **LORA, ref_device="cpu"), _lora_policy()).device.type == "cpu"


def test_sync_ref_model_with_a_lora_policy_is_refused():
    with pytest.raises(ValueError, match="sync_ref_model: the reference of a LoRA policy is its base"):
        dpo.train(dpo.Config(**{**TINY, **LORA, "sync_ref_model": True, "steps": 1}))


def _digits(prompts, completions, **_):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


@pytest.mark.parametrize("module", [grpo, rloo, ppo, online_dpo], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_online_recipes_train_the_adapter_against_the_base(module):
    extra = {"dataset": None} if module is not online_dpo else {}
    config = module.Config(**{**TINY, **LORA, **ONLINE, **extra, "steps": 3, "lr": 1e-2})
    before = _base_weights(build_policy(config)[0])
    state, hist = module.train(config, reward_fn=_digits)
    assert isinstance(state.model("ref"), AdapterOff)
    _check_only_adapter_moved(before, state.model())
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    if module is ppo:  # the separate value model trains in full, as TRL's
        assert not is_peft(state.model("value"))


def test_grpo_lora_raises_the_reward():
    config = grpo.Config(**{**TINY, **LORA, **HEAD, "num_samples": 4, "max_new_tokens": 8, "eval_every": 0,
                            "steps": 12, "lr": 3e-2, "batch_size": 8})
    _, hist = grpo.train(config, reward_fn=_digits)
    first, last = (sum(h["rollout/score"] for h in part) / 3 for part in (hist[:3], hist[-3:]))
    assert last > first + 0.2, [h["rollout/score"] for h in hist]


def test_ppo_lora_raises_the_reward():
    config = ppo.Config(**{**TINY, **LORA, **HEAD, "num_samples": 4, "max_new_tokens": 8, "eval_every": 0,
                           "steps": 12, "lr": 3e-2, "batch_size": 8, "kl_coef": 0.0})
    _, hist = ppo.train(config, reward_fn=_digits)
    first, last = (sum(h["rollout/score"] for h in part) / 3 for part in (hist[:3], hist[-3:]))
    assert last > first + 0.1, [h["rollout/score"] for h in hist]


def test_reward_model_lora_trains_the_adapter_and_the_score_head():
    config = reward.Config(**{**TINY, **LORA, "batch_size": 16, "max_length": 24, "lr": 1e-2, "steps": 6})
    state, hist = reward.train(config)
    trained = {n for n, p in state.model().named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trained) and any("score" in n and "lora_" not in n for n in trained)
    assert hist[-1]["loss"] < hist[0]["loss"]


# --- checkpoints: the adapter, exact resume, init_from, export ---------------------------------------
@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A finished 3-step LoRA GRPO run (checkpoints at steps 2 and 3) and its final state."""
    root = tmp_path_factory.mktemp("lora_run")
    config = grpo.Config(**{**TINY, **LORA, **ONLINE, "steps": 3, "save_every": 2, "lr": 1e-2,
                            "run_dir": str(root / "run")})
    state, hist = grpo.train(config, reward_fn=_digits)
    return config, state, hist


def test_checkpoint_holds_the_adapter_loadable_with_peft(grpo_run):
    config, state, _ = grpo_run
    folder = latest_checkpoint(config.run_dir) / "models" / "policy"
    assert is_adapter_dir(folder) and not (folder / "model.safetensors").exists()
    assert sorted(p.name for p in (folder.parent).iterdir()) == ["policy"]  # no reference stored
    base = _frozen_base(state.model()).requires_grad_(False)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder))
    torch.testing.assert_close(_logprobs(loaded), _logprobs(state.model()), rtol=0, atol=0)
    card = (folder.parents[1] / "README.md").read_text()
    assert "PeftModel.from_pretrained" in card and "rlcore export" in card


def test_resume_with_an_adapter_is_exact(tmp_path, grpo_run):
    config, straight, hist = grpo_run
    cut = dataclasses.replace(config, run_dir=str(tmp_path / "cut"))
    grpo.train(cut, reward_fn=_digits, callbacks=[stop_when(lambda s, m: s.step == 2)])
    resumed, hist2 = grpo.train(dataclasses.replace(cut, resume=True), reward_fn=_digits)
    assert resumed.step == 3 and hist2[-1]["loss"] == hist[-1]["loss"]
    for (name, a), b in zip(straight.model().named_parameters(), resumed.model().parameters()):
        assert torch.equal(a, b), name


def test_a_foreign_adapter_is_refused_on_resume(tmp_path, grpo_run):
    config, _, _ = grpo_run
    run = tmp_path / "run"
    import shutil
    shutil.copytree(config.run_dir, run)
    other = dataclasses.replace(config, run_dir=str(run), resume=True, lora_r=2)  # the saved adapter has r = 4
    with pytest.raises(ValueError, match=r"was written with lora_r=4 \(now 2\)"):
        grpo.train(other, reward_fn=_digits)
    folder = latest_checkpoint(run) / "models" / "policy"
    from safetensors.torch import load_file
    weights = load_file(folder / "adapter_model.safetensors")
    small = _lora_policy(lora_r=2)
    with pytest.raises(ValueError, match=r"the adapter does not fit the model: missing \[\], unexpected \[\], "
                                         r"other shapes \['base_model.model.model.layers.0.mlp"):
        load_adapter_weights(small, weights, str(folder))
    with pytest.raises(ValueError, match=r"missing \['base_model.*lora_A.weight'"):
        load_adapter_weights(_lora_policy(), {k: v for k, v in weights.items() if "q_proj.lora_A" not in k}, "x")


def test_init_from_an_adapter_checkpoint_starts_from_the_merged_policy(grpo_run):
    config, state, _ = grpo_run
    trained = _logprobs(state.model())
    plain = build_policy(dataclasses.replace(config, run_dir=None, use_peft=False, init_from=config.run_dir))[0]
    assert not is_peft(plain)
    torch.testing.assert_close(_logprobs(plain), trained, rtol=1e-5, atol=1e-5)  # merged: W + (α/r)·B·A
    again = dataclasses.replace(config, run_dir=None, init_from=config.run_dir)
    policy = build_policy(again)[0]  # a fresh adapter on the merged weights: the reference is the trained policy
    assert is_peft(policy)
    torch.testing.assert_close(_logprobs(build_reference(again, policy)), trained, rtol=1e-5, atol=1e-5)


def test_init_from_refuses_an_adapter_without_its_run_config(tmp_path, grpo_run):
    config, _, _ = grpo_run
    import shutil
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(latest_checkpoint(config.run_dir), checkpoint)
    from rlcore.loops.checkpoint import _write_manifest
    stored = json.loads((checkpoint / "config.json").read_text())
    for text, message in (("[1, 2]", r"config.json: expected a mapping, got list"),
                          (json.dumps({**stored, "hidden_size": -5}), r"hidden_size: expected an int >= 1, got -5"),
                          (json.dumps({**stored, "model": ["x"]}), r"model: expected a string, got \['x'\]")):
        (checkpoint / "config.json").write_text(text)
        (checkpoint / "manifest.json").unlink()
        _write_manifest(checkpoint)  # a consistent checkpoint whose stored config is bad
        with pytest.raises(ValueError, match=message):
            build_policy(dataclasses.replace(config, run_dir=None, init_from=str(checkpoint)))
    (checkpoint / "config.json").write_text(json.dumps(stored))
    (checkpoint / "models" / "policy" / "adapter_model.safetensors").unlink()
    (checkpoint / "manifest.json").unlink()
    _write_manifest(checkpoint)
    with pytest.raises(ValueError, match="an adapter_config.json without its adapter_model.safetensors"):
        build_policy(dataclasses.replace(config, run_dir=None, init_from=str(checkpoint)))


def test_export_writes_a_merged_from_pretrained_folder(tmp_path, grpo_run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    config, state, _ = grpo_run
    out = tmp_path / "merged"
    assert cli(["export", "grpo", "--checkpoint", config.run_dir, "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["exported"] == str(out)
    assert not is_adapter_dir(out) and (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logprobs(model), _logprobs(state.model()), rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("12+3")["input_ids"] == build_tokenizer()("12+3")["input_ids"]
    with pytest.raises(SystemExit, match="exists and is not empty"):
        cli(["export", "grpo", "--checkpoint", config.run_dir, "--out", str(out)])


def test_eval_of_an_adapter_checkpoint(grpo_run, capsys):
    config, _, _ = grpo_run
    assert cli(["eval", "grpo", "--checkpoint", config.run_dir]) == 0
    assert "reward" in json.loads(capsys.readouterr().out)


# --- precision and memory knobs with an adapter --------------------------------------------------------
def test_bf16_weights_keep_a_float32_adapter_and_step():
    config = sft.Config(**{**TINY, **LORA, "dtype": "bfloat16", "batch_size": 8, "max_length": 24, "steps": 2})
    state, hist = sft.train(config)
    dtypes = {n.split(".")[-2] if "lora_" in n else "base": p.dtype for n, p in state.model().named_parameters()}
    assert dtypes["base"] == torch.bfloat16 and dtypes["default"] == torch.float32
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)


def test_bf16_weights_change_log_probs_within_bf16_rounding():
    """bfloat16 weights keep ~3 significant digits: the log-probs of a random tiny model (|lp| ≈ 4.6)
    move by at most 0.1 from the float32 model's, the adapter's included."""
    full = _perturbed(_lora_policy())
    half = _perturbed(_lora_policy(dtype="bfloat16"))
    for chunked in (True, False):
        torch.testing.assert_close(_logprobs(half, chunked).float()[MASK[:, 1:]],
                                   _logprobs(full, chunked)[MASK[:, 1:]], rtol=0, atol=0.1)


def test_gradient_checkpointing_with_an_adapter_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = _perturbed(_lora_policy(gradient_checkpointing=checkpointing)).train()
        token_logprobs_from_model(model, IDS, MASK).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)
