"""Tests of loops/recipe.py: configs, models from configs, data splits and sources, the run."""

import dataclasses
import json

import pytest
import torch
import yaml
from tensordict import TensorDict
from torch import nn

from rlcore.loops.checkpoint import list_checkpoints, save_checkpoint
from rlcore.loops.logging import read_jsonl
from rlcore.loops.recipe import (batch_source, build_policy, build_reference, checkpoint_model_dir, init_train_state,
                                 load_splits, mean_metrics, policy_tokenizer, run)
from rlcore.loops.config import TINY_MODELS, RunConfig, config_dict, load_config
from rlcore.loops.state import init_state
from rlcore.loops.tasks import preference_dataset, task_dataset
from rlcore.loops.update import make_optimizer, update


@dataclasses.dataclass(frozen=True)
class Cfg(RunConfig):  # a recipe's Config: the shared fields, some other defaults, two of its own
    hidden_size: int = 16
    num_layers: int = 1
    num_heads: int = 2
    init_from: str | None = None
    task: str | None = "add"
    dataset: str | None = None
    eval_dataset: str | None = None
    num_train: int = 20
    num_eval: int = 8
    seed: int = 0
    steps: int = 6
    lr: float = 1e-2
    warmup_steps: int = 0
    schedule: str = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    flag: bool = False
    run_dir: str | None = None
    save_every: int = 0
    keep_last: int | None = None
    eval_every: int = 0
    log_every: int = 2
    resume: bool = False


# --- load_config / config_dict --------------------------------------------------------------------
def test_load_config_yaml_and_overrides_are_coerced(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nsteps: 3\nflag: true\ninit_from: null\nbetas: [0.5, 0.6]\n")
    cfg = load_config(Cfg, path)
    assert cfg.lr == 1e-4 and isinstance(cfg.lr, float)  # YAML reads 1e-4 as a string
    assert cfg.steps == 3 and cfg.flag is True and cfg.init_from is None and cfg.betas == (0.5, 0.6)
    cfg = load_config(Cfg, path, {"steps": "7", "flag": "false", "init_from": "ckpt", "keep_last": "none",
                                  "betas": "0.1,0.2", "lr": "2"})
    assert (cfg.steps, cfg.flag, cfg.init_from, cfg.keep_last, cfg.betas, cfg.lr) == (7, False, "ckpt", None,
                                                                                      (0.1, 0.2), 2.0)
    assert load_config(Cfg) == Cfg()


def test_load_config_unknown_key_lists_valid_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown keys \['learning_rate'\].*'lr'"):
        load_config(Cfg, path)
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(Cfg, overrides={"nope": 1})


@pytest.mark.parametrize("field, value", [("steps", "three"), ("steps", "2.5"), ("flag", "maybe"),
                                          ("lr", None), ("betas", [1.0])])
def test_load_config_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"Cfg.{field}"):
        load_config(Cfg, overrides={field: value})


def test_load_config_rejects_a_non_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(Cfg, path)


def test_config_dict_round_trips_through_yaml(tmp_path):
    cfg = Cfg(lr=0.5, betas=(0.1, 0.2), init_from="x")
    d = config_dict(cfg)
    assert d["betas"] == [0.1, 0.2] and json.dumps(d)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    assert load_config(Cfg, path) == cfg


# --- models ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_build_policy_tiny_models(name):
    model, tok = build_policy(Cfg(model=name))
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 16
    assert model.config.model_type == {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}[name]
    again, _ = build_policy(Cfg(model=name))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    other, _ = build_policy(Cfg(model=name, seed=1))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert policy_tokenizer(Cfg(model=name)).get_vocab() == tok.get_vocab()


def test_build_policy_reward_task_is_a_one_label_classifier():
    model, tok = build_policy(Cfg(), task="reward")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == tok.pad_token_id


def test_build_policy_init_from_checkpoint_and_run_dir(tmp_path):
    model, _ = build_policy(Cfg(seed=3))
    state = init_state({"policy": model}, optimizer=make_optimizer(model, lr=0.1))
    save_checkpoint(tmp_path / "run", state, step=4)
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoint-4"):
        loaded, _ = build_policy(Cfg(init_from=str(where)))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    assert checkpoint_model_dir(tmp_path / "run") == tmp_path / "run" / "checkpoint-4" / "models" / "policy"
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        build_policy(Cfg(init_from=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="no model 'value'"):
        checkpoint_model_dir(tmp_path / "run", "value")


def test_init_train_state_optimises_the_trainable_models_only():
    policy, ref = nn.Linear(3, 3), nn.Linear(3, 3)
    state = init_train_state({"policy": policy, "ref": ref}, Cfg(lr=0.25, warmup_steps=2, schedule="linear"))
    params = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for p in policy.parameters()}
    assert set(state.models) == {"policy", "ref"} and state.rng.initial_seed() == 0
    assert state.optimizer.param_groups[0]["lr"] == 0.0  # warm-up starts at 0
    with pytest.raises(ValueError, match="unknown schedule"):
        init_train_state({"policy": policy}, Cfg(schedule="nope"))


# --- data --------------------------------------------------------------------------------------------
def test_load_splits_task_gives_disjoint_splits():
    train, held_out = load_splits(Cfg(), task_dataset)
    assert len(train) == 20 and len(held_out) == 8
    assert not set(train["prompt"]) & set(held_out["prompt"])
    train, held_out = load_splits(Cfg(), preference_dataset)
    assert {"chosen", "rejected"} <= set(train.column_names)


def test_load_splits_local_files(tmp_path):
    rows = [{"prompt": f"{i}+0=", "completion": str(i)} for i in range(30)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held_out = load_splits(Cfg(task=None, dataset=str(path)), task_dataset)
    assert (len(train), len(held_out)) == (22, 8)
    assert sorted(list(train["prompt"]) + list(held_out["prompt"])) == sorted(r["prompt"] for r in rows)
    again = load_splits(Cfg(task=None, dataset=str(path)), task_dataset)
    assert list(again[1]["prompt"]) == list(held_out["prompt"])  # seeded split
    eval_path = tmp_path / "e.jsonl"
    eval_path.write_text(json.dumps(rows[0]) + "\n")
    train, held_out = load_splits(Cfg(task=None, dataset=str(path), eval_dataset=str(eval_path)), task_dataset)
    assert (len(train), len(held_out)) == (30, 1)
    with pytest.raises(ValueError, match="num_eval"):
        load_splits(Cfg(task=None, dataset=str(path), num_eval=30), task_dataset)
    with pytest.raises(ValueError, match="set `task`"):
        load_splits(Cfg(task=None), task_dataset)


def test_num_eval_0_holds_nothing_out(tmp_path):
    """num_eval 0 without eval_dataset: every row trains; the held-out split is empty, its columns kept."""
    from rlcore.loops.recipe import holds_out, require_held_out

    rows = [{"prompt": f"{i}+0=", "completion": str(i)} for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held_out = load_splits(Cfg(task=None, dataset=str(path), num_eval=0), task_dataset)
    assert len(train) == 20 and len(held_out) == 0 and held_out.column_names == train.column_names
    train, held_out = load_splits(Cfg(num_eval=0), task_dataset)  # a built-in task: no eval rows drawn
    assert (len(train), len(held_out)) == (20, 0) and "answer" in held_out.column_names
    train, held_out = load_splits(Cfg(num_eval=0), preference_dataset)
    assert len(held_out) == 0 and "chosen" in held_out.column_names
    assert not holds_out(Cfg(num_eval=0)) and holds_out(Cfg(num_eval=0, eval_dataset=str(path))) and holds_out(Cfg())
    with pytest.raises(ValueError, match="no held-out split: num_eval is 0 and no eval_dataset"):
        require_held_out(Cfg(num_eval=0))


def test_batch_source_epochs_and_resume():
    data = task_dataset("add", 10)
    source = batch_source(data, 3, lambda rows: tuple(rows["prompt"]), seed=5)
    first = [b for _, b in zip(range(9), source(0))]
    assert all(len(b) == 3 for b in first)  # 3 full batches per epoch, the remainder dropped
    for epoch in range(3):
        seen = [p for b in first[3 * epoch:3 * epoch + 3] for p in b]
        assert len(set(seen)) == 9 and set(seen) <= set(data["prompt"])
    assert first[:3] != first[3:6]  # each epoch has its own order
    for start in (1, 3, 4, 7):
        assert [b for _, b in zip(range(9 - start), source(start))] == first[start:]
    assert [b for _, b in zip(range(9), batch_source(data, 3, lambda r: tuple(r["prompt"]), seed=5)(0))] == first
    ordered = next(batch_source(data, 3, lambda r: tuple(r["prompt"]), shuffle=False)(0))
    assert list(ordered) == list(data["prompt"][:3])
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[1, 10\]"):
        batch_source(data, 11, lambda r: r)


def test_mean_metrics_weights_by_rows():
    td = TensorDict({"acc": torch.tensor(0.0), "side": {"lp": torch.tensor(-4.0)}}, [])
    out = mean_metrics([(1, {"acc": torch.tensor(1.0), "only": 5.0}), (3, td)])
    assert out == {"acc": 0.25, "only": 5.0, "side/lp": -4.0}
    assert all(isinstance(v, float) for v in out.values()) and mean_metrics([]) == {}


# --- run ---------------------------------------------------------------------------------------------
def _toy(cfg):
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    state = init_train_state({"policy": model}, cfg)
    xs = [TensorDict({"x": torch.full((4, 2), float(i + 1))}, [4]) for i in range(10)]

    def loss_fn(state, mb):
        loss = state.model()(mb["x"]).square().mean()
        return loss, {"loss_sq": loss.detach()}

    def step(state, batch):
        return update(state, batch, loss_fn)

    def eval_fn(state):
        return {"w": state.model().weight.sum().detach(), "n": 1.0}

    return state, xs, step, eval_fn


def test_run_wires_eval_checkpoints_and_logs(tmp_path):
    cfg = Cfg(run_dir=str(tmp_path / "run"), save_every=2, keep_last=2, eval_every=3, steps=6)
    state, xs, step, eval_fn = _toy(cfg)
    seen = []
    state, hist = run(step, state, xs, config=cfg, num_steps=6, eval_fn=eval_fn, name="toy",
                      callbacks=[lambda s, m: seen.append(s.step)])
    assert state.step == 6 and len(hist) == 6 and seen == [1, 2, 3, 4, 5, 6]
    assert [("eval/w" in h) for h in hist] == [False, False, True, False, False, True]
    assert hist[2]["eval/n"] == 1.0
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-4", "checkpoint-6"]
    config = json.loads((tmp_path / "run" / "checkpoint-6" / "config.json").read_text())
    assert config["recipe"] == "toy" and config["lr"] == cfg.lr
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6] and logged[2]["eval/w"] == hist[2]["eval/w"]


def test_run_without_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Cfg(save_every=1, eval_every=0)
    state, xs, step, eval_fn = _toy(cfg)
    state, hist = run(step, state, xs, config=cfg, num_steps=2, eval_fn=eval_fn)
    assert state.step == 2 and not any("eval/w" in h for h in hist) and not list(tmp_path.iterdir())


def test_run_resume_continues_exactly(tmp_path):
    straight_cfg = Cfg(run_dir=str(tmp_path / "a"), save_every=3, schedule="linear", steps=6)
    state, xs, step, _ = _toy(straight_cfg)
    straight, hist = run(step, state, xs, config=straight_cfg, num_steps=6)
    cfg = dataclasses.replace(straight_cfg, run_dir=str(tmp_path / "b"))
    state, xs, step, _ = _toy(cfg)
    run(step, state, xs, config=cfg, num_steps=3)
    state, xs, step, _ = _toy(cfg)  # a fresh process: rebuilt from the config, then resumed
    resumed, hist2 = run(step, state, xs, config=dataclasses.replace(cfg, resume=True), num_steps=6)
    assert resumed.step == 6 and resumed.optimizer_steps == 6 and len(hist2) == 3
    assert torch.equal(resumed.model().weight, straight.model().weight)
    assert [h["loss"] for h in hist2] == [h["loss"] for h in hist[3:]]


@pytest.mark.parametrize("recipe,kept", [("sft", True), ("reward", True), ("dpo", False)])
def test_dropout_defaults_follow_trl(tmp_path, recipe, kept):
    """SFT and reward train with the loaded model's dropout (TRL); DPO sets it to 0 (TRL's disable_dropout)."""
    import importlib
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlcore.loops.models import build_tokenizer
    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.3,
                               embd_pdrop=0.3, attn_pdrop=0.3)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    module = importlib.import_module(f"rlcore.loops.recipes.{recipe}")
    config = module.Config(model=str(tmp_path / "model"), run_dir=None)
    assert config.disable_dropout is not kept
    model, _ = build_policy(config)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == ({0.3} if kept else {0.0}), rates
    off, _ = build_policy(dataclasses.replace(config, disable_dropout=True))
    assert {m.p for m in off.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}


def test_a_reference_model_from_a_folder_or_a_checkpoint(tmp_path):
    """TRL's ref_model: the KL / DPO reference loaded from a path instead of copied from the policy."""
    from rlcore.loops.recipes import dpo, grpo
    from rlcore.loops.models import build_model, build_tokenizer
    from rlcore.loops.online import build_online_state
    tokenizer = build_tokenizer()
    other = build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=7)
    other.save_pretrained(tmp_path / "ref")
    tiny = dict(hidden_size=16, num_layers=1, num_heads=2, run_dir=None)
    state, _ = build_online_state(grpo.Config(**tiny, ref_model=str(tmp_path / "ref")))
    ref, policy = state.model("ref"), state.model("policy")
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), other.state_dict().values()))
    assert not torch.equal(ref.lm_head.weight, policy.lm_head.weight)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    # a run directory: its latest checkpoint's policy
    policy_run = tmp_path / "run"
    save_checkpoint(policy_run, init_state({"policy": other}, optimizer=torch.optim.SGD(other.parameters(), lr=0.1)))
    ref2 = build_reference(grpo.Config(**tiny, ref_model=str(policy_run)), policy)
    assert torch.equal(ref2.lm_head.weight, other.lm_head.weight)
    small = build_model("llama", vocab_size=40, hidden_size=16, num_layers=1, num_heads=2)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"ref_model: .* has a vocabulary of 40 tokens, the policy 103"):
        build_reference(dpo.Config(**tiny, ref_model=str(tmp_path / "small")), policy)
    config = dpo.Config(**tiny, steps=1, batch_size=4, num_train=8, num_eval=4, ref_model=str(tmp_path / "ref"))
    trained, _ = dpo.train(config)
    assert torch.equal(trained.model("ref").lm_head.weight, other.lm_head.weight)
    precomputed, _ = dpo.train(dataclasses.replace(config, precompute_ref=True))
    assert "ref" not in precomputed.models


# --- model loading fields (RunConfig) ----------------------------------------------------------
def _sft(**kw):
    from rlcore.loops.recipes import sft
    return sft.Config(**{**dict(hidden_size=16, num_layers=1, num_heads=2, num_train=16, num_eval=4, batch_size=4,
                                max_length=24, log_every=100, run_dir=None), **kw})


def test_dtype_and_attention_reach_tiny_and_loaded_models(tmp_path):
    model, tok = build_policy(_sft(dtype="bfloat16", attn_implementation="eager"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    base = build_policy(_sft())[0]
    base.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, _ = build_policy(_sft(model=str(tmp_path / "m"), dtype="bfloat16", attn_implementation="sdpa",
                                  revision="main"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.config._attn_implementation == "sdpa"
    for a, b in zip(loaded.parameters(), base.parameters()):
        assert torch.equal(a, b.bfloat16())
    with pytest.raises(ValueError, match=r"dtype: expected one of \['float32', 'bfloat16', 'float16', 'auto'\], "
                                         r"got 'float8'"):
        load_config(type(_sft()), overrides={"dtype": "float8"})


def test_bfloat16_sft_trains_and_gradient_checkpointing_changes_nothing_but_memory():
    from rlcore.loops.recipes import sft
    _, plain = sft.train(_sft(steps=3, lr=1e-2))
    state, checkpointed = sft.train(_sft(steps=3, lr=1e-2, gradient_checkpointing=True))
    assert state.model("policy").is_gradient_checkpointing
    for a, b in zip(plain, checkpointed):  # the same maths, recomputed in the backward pass
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    _, bf16 = sft.train(_sft(steps=3, lr=1e-2, dtype="bfloat16"))
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in bf16)
    assert bf16[0]["loss"] == pytest.approx(plain[0]["loss"], rel=2e-2)  # bf16 rounding only


def test_online_recipes_and_references_take_the_loading_fields():
    from rlcore.loops.recipes import grpo
    from rlcore.loops.online import build_online_state
    config = grpo.Config(hidden_size=16, num_layers=1, num_heads=2, num_train=8, num_eval=4, batch_size=2,
                         num_samples=2, max_new_tokens=4, steps=1, run_dir=None, gradient_checkpointing=True)
    state, _ = build_online_state(config)
    assert state.model("policy").is_gradient_checkpointing and not state.model("ref").training
    state, history = grpo.train(config)
    assert state.step == 1 and torch.isfinite(torch.tensor(history[-1]["loss"]))


def test_reft_refuses_gradient_checkpointing():
    from rlcore.loops.recipes.reft import ReftConfig, train_reft_sft
    with pytest.raises(ValueError, match=r"gradient_checkpointing: ReFT trains interventions on a frozen model"):
        train_reft_sft(ReftConfig(gradient_checkpointing=True, steps=1))


def test_mixed_precision_bf16_keeps_float32_weights_and_close_losses():
    from rlcore.loops.recipes import dpo, grpo, sft
    _, plain = sft.train(_sft(steps=2, lr=1e-2))
    state, mixed = sft.train(_sft(steps=2, lr=1e-2, mixed_precision="bf16"))
    assert {p.dtype for p in state.model("policy").parameters()} == {torch.float32}
    assert mixed[0]["loss"] != plain[0]["loss"]  # the forward ran in bfloat16 ...
    assert mixed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=2e-2)  # ... within its rounding
    tiny = dict(hidden_size=16, num_layers=1, num_heads=2, num_train=8, num_eval=4, batch_size=4, run_dir=None,
                steps=1, mixed_precision="bf16")
    assert torch.isfinite(torch.tensor(dpo.train(dpo.Config(**tiny, max_length=24))[1][-1]["loss"]))
    assert torch.isfinite(torch.tensor(grpo.train(grpo.Config(**{**tiny, "batch_size": 2}, num_samples=2,
                                                              max_new_tokens=4))[1][-1]["loss"]))
    with pytest.raises(ValueError, match=r"mixed_precision: expected 'bf16' or None, got 'fp16' \(float16 autocast "
                                         r"needs loss scaling"):
        load_config(type(_sft()), overrides={"mixed_precision": "fp16"})
