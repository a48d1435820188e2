"""Tests of the preference-optimisation recipe (loops/recipes/dpo.py) on tiny offline models."""

import copy
import functools
import dataclasses
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from rlcore import keys as K
from rlcore.algorithms.dpo_variants import DPO_LOSSES
from rlcore.algorithms.preference import PREFERENCE_LOSSES
from rlcore.loops.collate import collate_mismatched, collate_preference, collate_unpaired
from rlcore.loops.tokenization import tokenize_dataset
from rlcore.loops.recipes.dpo import (REFERENCE_FREE, UNPAIRED, Config, bind_loss, dpo_step, evaluate, kto_step,
                                      needs_reference, preference_loss_fn, train, unpair, with_reference)
from rlcore.loops.models import make_reference, mix_into_reference, pad_token_id
from rlcore.loops.recipe import build_policy, init_train_state
from rlcore.loops.config import load_config
from rlcore.loops.recipes.sft import Config as SFTConfig
from rlcore.loops.recipes.sft import train as train_sft
from rlcore.loops.tasks import preference_dataset
from rlcore.testing import assert_pure

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_train=64, num_eval=32, batch_size=16, max_length=24,
            lr=3e-3, run_dir=None, log_every=100)


@pytest.fixture(scope="module")
def pairs():
    """A tiny policy and 6 tokenised preference pairs (do not modify the model)."""
    model, tok = build_policy(Config(**{**TINY, "hidden_size": 16, "num_heads": 2}))
    rows = tokenize_dataset(preference_dataset("add", 6), tok, format="preference")
    return model, tok, rows


def _state(model, config, ref=True):
    models = {"policy": copy.deepcopy(model)}
    if ref:
        models["ref"] = make_reference(model)
    return init_train_state(models, config)


@pytest.mark.slow
def test_dpo_raises_the_margins_and_accuracy():
    config = Config(steps=12, eval_every=12, beta=0.1, **TINY)
    model, _ = build_policy(config)
    before = evaluate(init_train_state({"policy": model, "ref": make_reference(model)}, config), config)
    assert before["rewards/margins"] == 0.0 and before["loss_dpo"] == pytest.approx(0.6931, abs=1e-4)
    state, hist = train(config)
    assert hist[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # policy == reference at the start
    assert sum(h["loss"] for h in hist[-3:]) / 3 < 0.67
    after = hist[-1]
    assert after["eval/rewards/margins"] > 0.05 and after["eval/rewards/accuracies"] > 0.6
    assert after["eval/loss_dpo"] < before["loss_dpo"]
    assert set(state.models) == {"policy", "ref"}
    assert evaluate(state, config) == pytest.approx({k[5:]: v for k, v in after.items() if k.startswith("eval/")})


def test_one_registry_one_name_per_loss():
    """Every DPO kernel by TRL's loss_type and the four other losses, each under one name only."""
    assert set(PREFERENCE_LOSSES) == set(DPO_LOSSES) | {"orpo", "simpo", "cpo", "kto"}
    assert PREFERENCE_LOSSES["ipo"].keywords == {"loss_type": "ipo"}
    assert PREFERENCE_LOSSES["exo_pair"].keywords == {"loss_type": "exo_pair", "label_smoothing": 1e-3}
    with pytest.raises(ValueError, match=r"loss_type: unknown 'dpo_ipo'"):
        bind_loss(Config(loss_type="dpo_ipo"))


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_every_loss_takes_a_training_step(pairs, name):
    model, tok, rows = pairs
    config = Config(loss_type=name, **TINY)
    loss = bind_loss(config)
    state = _state(model, config, ref=needs_reference(config))
    pad = pad_token_id(tok)
    if name in UNPAIRED:
        flat = unpair(rows)[:]
        state, metrics = kto_step(state, (collate_unpaired(flat, pad_id=pad), collate_mismatched(flat, pad_id=pad)),
                                  loss=loss)
    else:
        state, metrics = dpo_step(state, collate_preference(rows[:], pad_id=pad), loss=loss)
    assert torch.isfinite(metrics["loss"]) and metrics["optimizer_steps"] == 1
    moved = any(not torch.equal(a, b) for a, b in zip(model.parameters(), state.model().parameters()))
    assert moved and state.samples_seen == (12 if name in UNPAIRED else 6)


def bound_keywords(fn) -> dict:
    """The keywords a (possibly nested) partial binds: a partial that has attributes of its own (as
    torch.compile leaves on a function it compiled) is wrapped, not flattened, by another partial."""
    kw = {}
    while isinstance(fn, functools.partial):
        kw, fn = {**fn.keywords, **kw}, fn.func
    return kw


def test_bind_loss_defaults_and_errors():
    assert bound_keywords(bind_loss(Config(loss_type="simpo"))) == {}  # SimPO keeps its own β = 2
    assert bound_keywords(bind_loss(Config(loss_type="sigmoid", beta=0.3, loss_kwargs={"rpo_alpha": 1.0}))) == \
        {"loss_type": "sigmoid", "beta": 0.3, "rpo_alpha": 1.0}
    assert bound_keywords(bind_loss(Config(loss_type="hinge", beta=0.2))) == {"loss_type": "hinge", "beta": 0.2}
    with pytest.raises(ValueError, match=r"loss_type: unknown 'nope'; valid: .*'orpo'"):
        bind_loss(Config(loss_type="nope"))
    with pytest.raises(ValueError, match=r"loss_kwargs: 'sigmoid' takes no \['gamma'\]; its parameters: \[.*'rpo_alpha'"):
        bind_loss(Config(loss_type="sigmoid", loss_kwargs={"gamma": 1.0}))
    with pytest.raises(ValueError, match=r"loss_kwargs: beta is a field of its own"):
        bind_loss(Config(loss_kwargs={"beta": 0.2}))
    with pytest.raises(ValueError, match="precompute_ref"):
        train(Config(loss_type="kto", precompute_ref=True, **TINY))
    assert not needs_reference(Config(loss_type="orpo")) and not needs_reference(Config(loss_kwargs={"reference_free": True}))
    assert needs_reference(Config(loss_type="kto")) and set(REFERENCE_FREE) <= set(PREFERENCE_LOSSES)


@pytest.mark.slow
def test_precomputed_reference_equals_the_frozen_copy():
    config = Config(steps=3, beta=0.5, **{**TINY, "num_train": 32})
    frozen, hist_a = train(config)
    pre, hist_b = train(dataclasses.replace(config, precompute_ref=True, eval_every=3))
    assert set(pre.models) == {"policy"} and set(frozen.models) == {"policy", "ref"}
    for a, b in zip(hist_a, hist_b):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert hist_b[-1]["eval/rewards/margins"] == pytest.approx(evaluate(pre, dataclasses.replace(
        config, precompute_ref=True))["rewards/margins"], abs=1e-6)


def test_reference_free_losses_keep_no_reference():
    state, hist = train(Config(loss_type="simpo", steps=2, **TINY))
    assert set(state.models) == {"policy"} and "loss_simpo" in hist[-1]
    state, _ = train(Config(loss_type="sigmoid", loss_kwargs={"reference_free": True}, steps=1, **TINY))
    assert set(state.models) == {"policy"}


def test_with_reference_adds_the_reference_logps(pairs):
    model, tok, rows = pairs
    batch = collate_preference(rows[:], pad_id=pad_token_id(tok))
    state = _state(model, Config(**TINY))
    scored = assert_pure(with_reference, state, batch)
    policy = preference_loss_fn(state, scored, loss=lambda b: (b[K.CHOSEN, K.LOGPS], b))[1]
    torch.testing.assert_close(scored[K.CHOSEN, K.REF_LOGPS], policy[K.CHOSEN, K.LOGPS])
    assert not scored[K.CHOSEN, K.REF_LOGPS].requires_grad and K.REF_LOGPS not in batch[K.CHOSEN].keys()
    assert with_reference(state, scored) is scored  # present already: untouched
    no_ref = init_train_state({"policy": copy.deepcopy(model)}, Config(**TINY))
    assert with_reference(no_ref, batch) is batch


def test_unpair_golden():
    data = Dataset.from_dict({"prompt_ids": [[1], [2]], "chosen_ids": [[3], [4]], "rejected_ids": [[5], [6]],
                              "answer": ["x", "y"]})
    out = unpair(data)
    assert out[:] == {"prompt_ids": [[1], [2], [1], [2]], "completion_ids": [[3], [4], [5], [6]],
                      "label": [True, True, False, False]}


def test_kto_trains_and_reports_pair_accuracy():
    state, hist = train(Config(loss_type="kto", beta=1.0, steps=6, eval_every=6, **TINY))
    assert set(state.models) == {"policy", "ref"} and state.samples_seen == 6 * 16
    assert hist[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # σ(0) with the policy equal to its reference
    assert hist[0]["kl"] == 0.0 and "kl" in hist[-1]
    # the implicit rewards β·(log π − log π_ref) rank the held-out pairs (both 0 before training)
    assert hist[-1]["eval/rewards/margins"] > 0.1 and hist[-1]["eval/rewards/accuracies"] > 0.6
    assert not any(k.startswith("eval/loss") for k in hist[-1])


def test_init_from_an_sft_checkpoint(tmp_path):
    sft_state, _ = train_sft(SFTConfig(steps=2, **{**TINY, "run_dir": str(tmp_path / "sft"), "num_eval": 8}))
    config = Config(steps=0, init_from=str(tmp_path / "sft"), **TINY)
    state, hist = train(config)
    assert hist == []
    for a, b, c in zip(sft_state.model().parameters(), state.model().parameters(),
                       state.model("ref").parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_yaml_config_loads_and_runs(tmp_path):
    config = load_config(Config, CONFIGS / "dpo.yaml", {"steps": "2", "run_dir": str(tmp_path), "eval_every": "2",
                                                        "num_train": 32, "num_eval": 8, "loss_type": "ipo"})
    assert config.beta == 0.1 and config.loss_type == "ipo"
    state, hist = train(config)
    assert state.step == 2 and "eval/rewards/accuracies" in hist[-1]
    assert sorted(p.name for p in (tmp_path / "checkpoint-2" / "models").iterdir()) == ["policy"]  # not the ref


@pytest.mark.slow
def test_resume_with_a_frozen_reference_is_exact(tmp_path):
    from rlcore.loops.fold import stop_when
    base = Config(steps=4, save_every=2, **{**TINY, "num_train": 32, "num_eval": 8})
    straight, hist = train(dataclasses.replace(base, run_dir=str(tmp_path / "a")))
    cut = dataclasses.replace(base, run_dir=str(tmp_path / "b"))
    train(cut, callbacks=[stop_when(lambda s, m: s.step == 2)])
    resumed, hist2 = train(dataclasses.replace(cut, resume=True))  # the reference is rebuilt, not stored
    assert resumed.step == 4 and [h["loss"] for h in hist2] == [h["loss"] for h in hist[2:]]
    for a, b in zip(straight.model().parameters(), resumed.model().parameters()):
        assert torch.equal(a, b)


def test_gpt2_policy():
    state, hist = train(Config(model="tiny-gpt2", loss_type="cpo", steps=2, **TINY))
    assert state.model().config.model_type == "gpt2" and len(hist) == 2


def test_truncation_follows_trl_and_the_configured_mode():
    from rlcore.loops.recipes import dpo
    from rlcore.loops.data import load_local
    from rlcore.loops.models import build_tokenizer
    tokenizer = build_tokenizer()
    data = load_local([{"prompt": "abcdefgh", "chosen": "xy", "rejected": "uvwxyz"}])
    fits = dpo._prepare(data, tokenizer, dpo.Config(max_length=32, max_prompt_length=3))[0]
    assert len(fits["prompt_ids"]) > 3  # prompt + longer answer fit: the prompt is kept whole (TRL)
    for mode, kept in (("keep_end", "fgh"), ("keep_start", "abc")):
        row = dpo._prepare(data, tokenizer, dpo.Config(max_length=10, max_prompt_length=3, truncation_mode=mode))[0]
        assert tokenizer.decode(row["prompt_ids"], skip_special_tokens=True) == kept
        assert len(row["rejected_ids"]) == 10 - 3  # still too long: the answers cut to max_length − max_prompt_length
    with pytest.raises(ValueError, match=r"truncation_mode: expected 'keep_end' or 'keep_start', got 'middle'"):
        dpo._prepare(data, tokenizer, dpo.Config(truncation_mode="middle"))


def test_dpo_trains_on_pairs_with_an_implicit_prompt(tmp_path):
    import json
    from rlcore.loops.recipes import dpo
    rows = [{"chosen": f"{i}+1={i + 1}", "rejected": f"{i}+1={i + 2}"} for i in range(40)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dpo.Config(dataset=str(tmp_path / "pairs.jsonl"), hidden_size=16, num_layers=1, num_heads=2, steps=2,
                        batch_size=4, num_eval=4, run_dir=None)
    state, history = dpo.train(config)
    assert state.optimizer_steps == 2 and history[-1]["loss"] > 0


# --- TR-DPO: the moving reference --------------------------------------------------------------
def test_mix_into_reference_is_the_soft_update_and_refuses_another_architecture():
    policy = build_policy(Config(**{**TINY, "hidden_size": 16, "num_heads": 2}))[0]
    ref = make_reference(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    before = {n: p.clone() for n, p in ref.named_parameters()}
    mix_into_reference(ref, policy, 0.6)
    for name, p in policy.named_parameters():  # θ_ref ← α·θ + (1 − α)·θ_ref, as TRL's sync
        torch.testing.assert_close(dict(ref.named_parameters())[name], 0.6 * p + 0.4 * before[name],
                                   rtol=1e-6, atol=1e-6)
    assert not any(p.requires_grad for p in ref.parameters())
    mix_into_reference(ref, policy, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters()))
    other = build_policy(Config(**{**TINY, "hidden_size": 32}))[0]
    snapshot = [p.clone() for p in ref.parameters()]
    with pytest.raises(ValueError, match=r"ref_model: the reference's parameters differ from the policy's"):
        mix_into_reference(ref, other, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, ref.parameters()))  # untouched
    with pytest.raises(ValueError, match=r"alpha: expected a float in \[0, 1\], got 1.5"):
        mix_into_reference(ref, policy, 1.5)


def test_sync_ref_model_moves_the_reference_every_n_steps():
    config = Config(steps=3, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                    **{**TINY, "num_train": 32})
    initial = build_policy(config)[0]  # the run's initial policy: the same seed builds the same weights
    one, _ = train(dataclasses.replace(config, steps=1))
    assert all(torch.equal(a, b) for a, b in zip(one.model("ref").parameters(), initial.parameters()))
    two, _ = train(dataclasses.replace(config, steps=2))  # synced after step 2: halfway to that policy
    for r, p, p0 in zip(two.model("ref").parameters(), two.model("policy").parameters(), initial.parameters()):
        torch.testing.assert_close(r, 0.5 * p + 0.5 * p0, rtol=1e-6, atol=1e-6)
    _, frozen = train(dataclasses.replace(config, sync_ref_model=False))
    _, synced = train(config)
    assert synced[1]["loss"] == frozen[1]["loss"] and synced[2]["loss"] != frozen[2]["loss"]


def test_sync_ref_model_resumes_exactly_with_the_moved_reference(tmp_path):
    config = Config(steps=3, save_every=1, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                    **{**TINY, "num_train": 32, "run_dir": str(tmp_path / "straight")})
    straight, hist = train(config)
    assert (tmp_path / "straight" / "checkpoint-3" / "models" / "ref").is_dir()
    run_dir = str(tmp_path / "resumed")
    train(dataclasses.replace(config, steps=2, run_dir=run_dir))
    resumed, rest = train(dataclasses.replace(config, run_dir=run_dir, resume=True))
    assert rest[-1]["loss"] == hist[-1]["loss"]  # step 3 reads the reference synced at step 2
    for name in ("policy", "ref"):
        assert all(torch.equal(a, b) for a, b in zip(straight.model(name).parameters(),
                                                     resumed.model(name).parameters()))


def test_sync_ref_model_needs_a_moving_reference():
    with pytest.raises(ValueError, match=r"sync_ref_model: loss_type 'simpo' .* reads no reference"):
        train(Config(loss_type="simpo", sync_ref_model=True, **TINY))
    with pytest.raises(ValueError, match=r"sync_ref_model: .*precompute_ref=True"):
        train(Config(precompute_ref=True, sync_ref_model=True, **TINY))
    with pytest.raises(ValueError, match=r"ref_model_mixup_alpha: expected in \[0, 1\], got 2.0"):
        load_config(Config, overrides={"sync_ref_model": "true", "ref_model_mixup_alpha": "2"})


def test_pairs_past_the_model_context_are_refused_before_the_first_step():
    config = Config(**{**TINY, "max_length": 400}, model="tiny-gpt2", max_position_embeddings=8, steps=1)
    with pytest.raises(ValueError, match=r"dataset: the train split, row \d+: prompt_ids \+ chosen_ids of \d+ tokens "
                                         r"exceeds the model's context of 8 .*set max_length <= 8"):
        train(config)
