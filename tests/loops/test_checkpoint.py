"""Checkpoints: round trip, atomicity, keep-last-k, bitwise resume, corruption errors, no pickle,
crash safety under SIGKILL."""

import dataclasses
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import rlcore.loops
from rlcore import keys as K
from rlcore.loops import checkpoint as ckpt
from rlcore.loops.checkpoint import (Checkpointer, checkpoint_info, latest_checkpoint, list_checkpoints,
                                     load_checkpoint, resume, save_checkpoint)
from rlcore.loops.checkpoint_codec import CheckpointError
from rlcore.loops.fold import fold
from rlcore.loops.state import advance, init_state, with_transforms
from rlcore.loops.update import make_optimizer, make_scheduler, update
from rlcore.masked import aggregate
from rlcore.testing import MockLM, make_rollout
from rlcore.transforms import (KLControllerState, RunningMoments, adaptive_kl_init, adaptive_kl_update,
                               running_moments_init)


def make_state(model_seed=0, *, seed=11, kl=0.1):
    model = MockLM(vocab_size=16, hidden_size=8, max_positions=16, seed=model_seed)
    ref = MockLM(vocab_size=16, hidden_size=8, max_positions=16, seed=99).requires_grad_(False)
    opt = make_optimizer(model, lr=1e-2, weight_decay=0.01)
    sched = make_scheduler(opt, total_steps=20, warmup_steps=3, kind="cosine")
    return init_state({"policy": model, "ref": ref}, optimizer=opt, scheduler=sched, seed=seed,
                      transforms={"kl": adaptive_kl_init(kl), "moments": running_moments_init()})


def response_logprobs(model, mb):
    ids = torch.cat([mb[K.PROMPT_IDS], mb[K.RESPONSE_IDS]], -1)
    attn = torch.cat([mb[K.PROMPT_MASK], mb[K.RESPONSE_MASK]], -1)
    logits = model(ids, attn).logits[:, mb[K.PROMPT_IDS].shape[1] - 1:-1]
    return logits.log_softmax(-1).gather(-1, mb[K.RESPONSE_IDS][..., None])[..., 0]


def loss_fn(state, mb, **denominators):
    mask = mb[K.RESPONSE_MASK]
    lp = response_logprobs(state.model(), mb)
    nll = aggregate(-lp, mask, **denominators)
    kl = aggregate(lp - mb[K.REF_LOGPROBS], mask, **denominators)
    # global RNGs used inside the step (as dropout or sampling would): resume must restore them
    noise = 1.0 + 0.01 * torch.rand(()) + 0.01 * random.random()
    loss_kl = state.transforms["kl"].coef.to(lp.dtype) * kl
    loss = noise * nll + loss_kl
    return loss, {"loss_nll": (noise * nll).detach(), "loss_kl": loss_kl.detach(), "kl": kl.detach()}


def step(state, batch):
    state, metrics = update(state, batch, loss_fn, minibatch_size=4, micro_batch_size=2, epochs=2,
                            mask_key=K.RESPONSE_MASK)
    kl = adaptive_kl_update(state.transforms["kl"], metrics["kl"], 8, target=0.5, horizon=100)
    return advance(with_transforms(state, kl=kl), samples_seen=8), metrics


BATCHES = [make_rollout(8, 5, 3, vocab_size=16, generator=torch.Generator().manual_seed(i)) for i in range(10)]


def params(state, name="policy"):
    return [p.detach().clone() for p in state.models[name].parameters()]


def opt_tensors(state):
    return {(k, n): v.clone() for k, s in state.optimizer.state_dict()["state"].items() for n, v in s.items()}


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


# --- round trip ---------------------------------------------------------------------------------
def test_round_trip_restores_everything(tmp_path):
    torch.manual_seed(0)
    state, _ = fold(step, make_state(), BATCHES, num_steps=2)
    state = dataclasses.replace(state, episodes=5, tokens_seen=77, skipped_steps=1)
    rng_before = (torch.get_rng_state(), random.getstate())
    path = save_checkpoint(tmp_path, state, config={"recipe": "ppo", "lr": 1e-2, "dtype": torch.float32},
                           extra_json={"note": "x"}, metrics={"loss": 1.5})
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]  # untouched
    assert path == tmp_path / "checkpoint-2" and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no temporary left
    assert not (path / "models" / "ref").exists()  # frozen models are not stored by default

    torch.manual_seed(123)
    random.seed(5)
    template = make_state(model_seed=7, seed=0, kl=0.9)
    loaded = load_checkpoint(path, template)
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]
    assert_bitwise(params(loaded), params(state))
    assert opt_tensors(loaded).keys() == opt_tensors(state).keys()
    assert_bitwise(list(opt_tensors(loaded).values()), list(opt_tensors(state).values()))
    assert loaded.optimizer.state_dict()["param_groups"] == state.optimizer.state_dict()["param_groups"]
    assert loaded.scheduler.state_dict() == state.scheduler.state_dict()
    assert loaded.optimizer is template.optimizer and loaded.models["policy"] is template.models["policy"]
    kl = loaded.transforms["kl"]
    assert type(kl) is KLControllerState and torch.equal(kl.coef, state.transforms["kl"].coef)
    assert kl.coef.dtype == torch.float64
    assert type(loaded.transforms["moments"]) is RunningMoments
    assert torch.equal(loaded.rng.get_state(), state.rng.get_state())
    for name in ("step", "optimizer_steps", "samples_seen", "episodes", "tokens_seen", "policy_version",
                 "skipped_steps"):
        assert getattr(loaded, name) == getattr(state, name), name
    info = checkpoint_info(path)
    assert info["step"] == 2 and info["extra"] == {"note": "x"} and info["metrics"] == {"loss": 1.5}
    assert info["config"] == {"recipe": "ppo", "lr": 1e-2, "dtype": "torch.float32"}
    card = (path / "README.md").read_text()
    assert "ppo" in card and "| loss | 1.5 |" in card and '"lr": 0.01' in card


def test_checkpoint_files_are_json_safetensors_or_markdown(tmp_path):
    path = save_checkpoint(tmp_path, make_state())
    for f in path.rglob("*"):
        if f.is_file():
            assert f.suffix in {".json", ".safetensors", ".md"}, f
            assert not f.read_bytes().startswith(b"\x80"), f"{f} looks like a pickle"


def test_no_pickle_in_loops_code():
    """Nothing in loops/ pickles: no pickle module, no torch.save, torch.load only with weights_only=True."""
    folder = Path(rlcore.loops.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert len(files) >= 5
    for f in files:
        text = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|joblib|cloudpickle)\b", text, re.M), f
        assert not re.search(r"\bpickle\.(load|dump)", text), f
        assert not re.search(r"\btorch\.save\(", text), f
        assert "allow_pickle=True" not in text, f
        for m in re.finditer(r"\btorch\.load\(", text):
            call = text[m.end():m.end() + 300].split(")")[0]
            assert "weights_only=True" in call, f"{f}: torch.load without weights_only=True"


# --- atomicity, listing, keep-last ----------------------------------------------------------------
def test_latest_ignores_temporary_and_incomplete_dirs(tmp_path):
    state = make_state()
    save_checkpoint(tmp_path, dataclasses.replace(state, step=3))
    (tmp_path / ".tmp-step-9-abcd").mkdir()
    (tmp_path / "checkpoint-8").mkdir()  # no manifest: never finished
    (tmp_path / "checkpoint-notanumber").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-8", state)


def test_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    state = make_state()
    save_checkpoint(tmp_path, dataclasses.replace(state, step=1))

    def boom(root):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, dataclasses.replace(state, step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_keep_last_k_and_scratch_cleanup(tmp_path):
    state = make_state()
    (tmp_path / ".tmp-step-0-dead").mkdir(parents=True)  # left by a killed writer
    for s in range(1, 6):
        save_checkpoint(tmp_path, dataclasses.replace(state, step=s), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5"]
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-4", tmp_path / "checkpoint-5"]
    save_checkpoint(tmp_path, dataclasses.replace(state, step=5, samples_seen=42), keep_last=2)  # re-save
    assert load_checkpoint(tmp_path / "checkpoint-5", make_state()).samples_seen == 42
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5"]


# --- resume ----------------------------------------------------------------------------------------
def test_resume_is_bitwise_exact(tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    straight, hist = fold(step, make_state(), BATCHES, num_steps=5)

    torch.manual_seed(0)
    random.seed(0)
    first, h1 = fold(step, make_state(), BATCHES, num_steps=3, callbacks=[Checkpointer(tmp_path, every=3)])
    torch.manual_seed(999)  # the crash: global RNGs elsewhere, fresh objects, another init
    random.seed(999)
    resumed = resume(tmp_path, make_state(model_seed=5, seed=3, kl=0.7))
    assert resumed.step == 3
    second, h2 = fold(step, resumed, BATCHES, num_steps=5)

    assert h1 + h2 == hist  # every metric of every step, exactly
    assert_bitwise(params(second), params(straight))
    assert_bitwise(list(opt_tensors(second).values()), list(opt_tensors(straight).values()))
    assert second.scheduler.state_dict() == straight.scheduler.state_dict()
    assert torch.equal(second.transforms["kl"].coef, straight.transforms["kl"].coef)
    assert torch.equal(second.rng.get_state(), straight.rng.get_state())
    assert (second.step, second.optimizer_steps, second.samples_seen, second.policy_version) == \
        (straight.step, straight.optimizer_steps, straight.samples_seen, straight.policy_version)


def test_resume_without_global_rng_differs(tmp_path):
    """The exactness test can fail: skipping the global RNG restore changes the run."""
    torch.manual_seed(0)
    random.seed(0)
    _, hist = fold(step, make_state(), BATCHES, num_steps=3)
    torch.manual_seed(0)
    random.seed(0)
    fold(step, make_state(), BATCHES, num_steps=2, callbacks=[Checkpointer(tmp_path, every=2)])
    torch.manual_seed(999)
    state = load_checkpoint(latest_checkpoint(tmp_path), make_state(), restore_global_rng=False)
    _, h2 = fold(step, state, BATCHES, num_steps=3)
    assert h2[0] != hist[2]


def test_resume_without_checkpoint_returns_the_state(tmp_path):
    state = make_state()
    assert resume(tmp_path, state) is state


def test_checkpointer_callback_saves_every_n_and_at_end(tmp_path):
    cb = Checkpointer(tmp_path, every=2, keep_last=2, config={"recipe": "sft"})
    fold(step, make_state(), BATCHES, num_steps=5, callbacks=[cb])
    assert [p.name for p in cb.saved] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
    assert "loss" in checkpoint_info(tmp_path / "checkpoint-5")["metrics"]
    with pytest.raises(ValueError, match="every: expected a positive int"):
        Checkpointer(tmp_path, every=0)


# --- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, damage, message", [
    ("models/policy/model.safetensors", "truncate", r"model\.safetensors: truncated or altered"),
    ("optimizer.safetensors", "header", r"optimizer\.safetensors: corrupted: its SHA-256 differs"),
    ("state.safetensors", "header", r"state\.safetensors: corrupted: its SHA-256 differs"),
    ("state.json", "garbage", r"state\.json: corrupted: its SHA-256 differs"),
    ("scheduler.json", "delete", r"scheduler\.json: missing from the checkpoint"),
])
def test_corrupted_files_raise_naming_the_file(tmp_path, target, damage, message):
    path = save_checkpoint(tmp_path, make_state())
    f = path / target
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[:-10])
    elif damage == "header":
        f.write_bytes(data[:8] + b"\xff" * 8 + data[16:])  # same size, broken header
    elif damage == "garbage":
        f.write_bytes(b"\x00" * len(data))
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, make_state())


def test_template_mismatch_errors(tmp_path):
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    other = dataclasses.replace(state, models={"actor": state.models["policy"]})
    with pytest.raises(CheckpointError, match=r"models \['policy'\] are stored but not in the template"):
        load_checkpoint(path, other)
    bare = save_checkpoint(tmp_path / "bare", dataclasses.replace(state, optimizer=None, scheduler=None))
    with pytest.raises(CheckpointError, match="the template has a optimizer but the checkpoint stores none"):
        load_checkpoint(bare, state)
    wrong = dataclasses.replace(state, models={"policy": nn.Linear(2, 2)}, optimizer=None, scheduler=None)
    with pytest.raises(CheckpointError, match="weights do not fit the model: missing"):
        load_checkpoint(path, wrong)
    wider = dataclasses.replace(state, models={"policy": MockLM(vocab_size=16, hidden_size=4, max_positions=16)},
                                optimizer=None, scheduler=None)
    with pytest.raises(CheckpointError, match="(?s)weights do not fit the model: .*size mismatch"):
        load_checkpoint(path, wider)
    one_group = dataclasses.replace(state, optimizer=torch.optim.AdamW(state.models["policy"].parameters()),
                                    scheduler=None)
    with pytest.raises(CheckpointError, match=r"optimizer\.json: does not fit the template's optimizer"):
        load_checkpoint(path, one_group)


def test_unstorable_value_names_its_path(tmp_path):
    state = with_transforms(make_state(), bad={"x": {1, 2}})
    with pytest.raises(TypeError, match=r"cannot store state\.transforms\.bad\.x of type set"):
        save_checkpoint(tmp_path, state)
    assert not any(tmp_path.iterdir())


# --- Hugging Face models -------------------------------------------------------------------------------
def test_hf_model_is_saved_with_save_pretrained_and_loads_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    state = init_state(model, optimizer=make_optimizer(model, lr=1e-3))
    path = save_checkpoint(tmp_path, state, config={"base_model": "tiny-llama", "recipe": "dpo"})
    assert (path / "models" / "policy" / "config.json").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(path / "models" / "policy")
    assert_bitwise(list(again.state_dict().values()), list(model.state_dict().values()))
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(cfg)
    load_checkpoint(path, init_state(fresh, optimizer=make_optimizer(fresh, lr=1e-3)))
    assert_bitwise(list(fresh.state_dict().values()), list(model.state_dict().values()))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
    card = (path / "README.md").read_text()
    assert "base_model: tiny-llama" in card and "library_name: transformers" in card and "from_pretrained" in card


# --- crash safety ---------------------------------------------------------------------------------------
def _writer(run_dir, ready):
    """Child process: resume, then save checkpoints of successive steps until killed."""
    torch.set_num_threads(1)
    state = resume(run_dir, make_state())
    os.write(ready, b"r")
    while True:
        s = state.step + 1
        with torch.no_grad():
            for p in state.models["policy"].parameters():
                p.fill_(float(s))  # the weights say which step they belong to
        state = with_transforms(dataclasses.replace(state, step=s), kl=KLControllerState(torch.tensor(float(s))))
        save_checkpoint(run_dir, state, keep_last=2, config={"step": s})


def test_sigkill_never_leaves_an_unreadable_latest_checkpoint(tmp_path):
    rng = random.Random(0)
    template = make_state()
    mid_write, last_step, t0 = 0, 0, time.monotonic()
    for _ in range(24):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns to pytest
            try:
                os.close(r)
                _writer(tmp_path, w)
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_write += any(p.name.startswith(".") for p in tmp_path.iterdir())
        latest = latest_checkpoint(tmp_path)
        if latest is None:
            continue
        state = load_checkpoint(latest, template, restore_global_rng=False)  # readable, and consistent:
        assert latest.name == f"checkpoint-{state.step}" and state.step >= last_step
        assert all(torch.all(p == state.step) for p in state.models["policy"].parameters())
        assert float(state.transforms["kl"].coef) == state.step
        last_step = state.step
    assert last_step >= 5, "the writer never got going"
    assert mid_write >= 1, "no kill landed inside a save: the test did not test anything"
    assert time.monotonic() - t0 < 60
    print(f"kills: 24, inside a save: {mid_write}, last step: {last_step}")
