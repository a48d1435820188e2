"""A run folder has one writer, and a resume continues the same run: the lock, the resume checks and
the order of logging and checkpointing."""

import json

import pytest

from rlcore.loops.recipes import sft
from rlcore.loops.run_dir import LOCK_NAME, run_dir_lock
from rlcore.loops.logging import read_jsonl
from tests.robustness.test_untrusted_checkpoints import rewrite

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_train=16, num_eval=4, batch_size=4, max_length=24,
            log_every=100)


def test_a_second_writer_is_refused_and_the_lock_is_released(tmp_path):
    with run_dir_lock(tmp_path) as lock:
        assert lock == tmp_path / LOCK_NAME
        with pytest.raises(RuntimeError, match=r"run_dir: .* is in use by another run \(its lock .* is held\)"):
            sft.train(sft.Config(**TINY, steps=1, run_dir=str(tmp_path)))
    with run_dir_lock(tmp_path):  # released on exit, also after the error above
        pass
    state, _ = sft.train(sft.Config(**TINY, steps=1, run_dir=str(tmp_path)))
    assert state.step == 1
    with run_dir_lock(tmp_path):  # and after a run
        pass


def test_resume_refuses_another_recipe_and_changed_settings(tmp_path):
    run = str(tmp_path / "run")
    sft.train(sft.Config(**TINY, steps=2, save_every=1, run_dir=run))
    with pytest.raises(ValueError, match=r"resume: .*checkpoint-2 was written with lr=0.001 \(now 0.002\); resume "
                                         r"with the run's values, or pick another run_dir \(init_from="):
        sft.train(sft.Config(**TINY, steps=3, lr=2e-3, run_dir=run, resume=True))
    ckpt = tmp_path / "run" / "checkpoint-2"
    config = json.loads((ckpt / "config.json").read_text())
    rewrite(ckpt, "config.json", json.dumps({**config, "recipe": "dpo"}))  # another recipe's run, manifest intact
    with pytest.raises(ValueError, match=r"resume: .*checkpoint-2 belongs to a 'dpo' run, not 'sft'"):
        sft.train(sft.Config(**TINY, steps=3, run_dir=run, resume=True))
    state, _ = sft.train(sft.Config(**TINY, steps=3, run_dir=str(tmp_path / "other"), resume=True))
    assert state.step == 3  # nothing to resume: a fresh run


def test_resume_with_only_run_settings_changed_continues(tmp_path):
    run = str(tmp_path / "run")
    sft.train(sft.Config(**TINY, steps=2, save_every=1, run_dir=run))
    state, _ = sft.train(sft.Config(**{**TINY, "log_every": 1}, steps=4, save_every=2, keep_last=1, run_dir=run,
                                    resume=True))
    assert state.step == 4
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_kill_right_after_a_checkpoint_loses_no_logged_step(tmp_path, monkeypatch):
    """The step's line is written before its checkpoint: a run killed just after saving step 3 has
    logged step 3, and the resumed run logs each later step once."""
    from rlcore.loops import checkpoint
    run = str(tmp_path / "run")
    real = checkpoint.save_checkpoint

    def killed_after_saving_step_3(run_dir, state, **kw):
        path = real(run_dir, state, **kw)
        if state.step == 3:
            raise KeyboardInterrupt("killed after saving step 3")
        return path
    monkeypatch.setattr(checkpoint, "save_checkpoint", killed_after_saving_step_3)
    with pytest.raises(KeyboardInterrupt):
        sft.train(sft.Config(**TINY, steps=5, save_every=1, run_dir=run))
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.setattr(checkpoint, "save_checkpoint", real)
    state, _ = sft.train(sft.Config(**TINY, steps=5, save_every=1, run_dir=run, resume=True))
    assert state.step == 5
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_checkpoints_policy_folder_loads_with_from_pretrained_model_and_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.loops.recipe import policy_tokenizer
    state, _ = sft.train(sft.Config(**TINY, steps=1, run_dir=str(tmp_path)))
    folder = tmp_path / "checkpoint-1" / "models" / "policy"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ours = policy_tokenizer(sft.Config(**TINY))
    text = "spell: abc\n"
    assert tokenizer(text)["input_ids"] == ours(text)["input_ids"] and tokenizer.pad_token_id == ours.pad_token_id
    assert tokenizer.chat_template == ours.chat_template
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():  # loaded weights sit at other alignments: BLAS rounds differently (seen ~1e-5)
        torch.testing.assert_close(model(ids).logits, state.model()(ids).logits, rtol=1e-4, atol=1e-4)


def test_report_to_from_the_config_reaches_tensorboard_and_is_checked_at_load(tmp_path):
    pytest.importorskip("tensorboard")
    from rlcore.loops.config import load_config
    from tests.loops.test_logging import tensorboard_scalars
    state, history = sft.train(sft.Config(**TINY, steps=2, run_dir=str(tmp_path), report_to=("tensorboard",)))
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["loss"]] == [1, 2]
    assert [v for _, v in scalars["loss"]] == pytest.approx([h["loss"] for h in history])
    with pytest.raises(ValueError, match=r"report_to: expected names from .* got 'tensorbord'"):
        load_config(sft.Config, overrides={"report_to": "tensorboard,tensorbord"})
