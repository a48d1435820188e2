"""A run folder has one writer, and a resume continues the same run: the lock, the resume checks and
the order of logging and checkpointing."""

import json
import re

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
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]  # TRL's grouping of the tags
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([h["loss"] for h in history])
    with pytest.raises(ValueError, match=r"report_to: expected names from .* got 'tensorbord'"):
        load_config(sft.Config, overrides={"report_to": "tensorboard,tensorbord"})


# --- a run folder belongs to one run ---------------------------------------------------------------
def snapshot(folder):
    """Every file under ``folder`` with its bytes: what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_into_another_runs_folder_is_refused_before_writing(tmp_path):
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=6, save_every=1, run_dir=str(run)))
    before = snapshot(run)
    assert {"checkpoint-5", "checkpoint-6", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    with pytest.raises(FileExistsError, match=r"run_dir: .*run holds another run \(checkpoint-5, checkpoint-6, "
                                              r"metrics.jsonl\); continue it with --resume true .*a new run_dir.*"
                                              r"--overwrite true"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run)))
    assert snapshot(run) == before  # nothing written, nothing deleted, metrics.jsonl whole
    state, _ = sft.train(sft.Config(**TINY, steps=6, save_every=1, run_dir=str(run), resume=True))
    assert state.step == 6  # the old run is intact and still resumable


def test_overwrite_deletes_only_the_old_runs_files(tmp_path):
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=3, save_every=1, run_dir=str(run), report_to=("tensorboard",)))
    (run / ".tmp-step-9-0123abcd").mkdir()  # a save a kill interrupted
    state, _ = sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), overwrite=True))
    assert state.step == 1
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "metrics.jsonl"]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    resumed, _ = sft.train(sft.Config(**TINY, steps=2, run_dir=str(run), resume=True))
    assert resumed.step == 2  # from the new run's checkpoint-1, not a stale one


def test_overwrite_refuses_a_folder_holding_files_no_run_writes(tmp_path):
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=1, run_dir=str(run)))
    (run / "notes.txt").write_text("mine")
    (run / "checkpoint-7").symlink_to(tmp_path)  # a link is never a run's file, nor followed
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"overwrite: .*run also holds files no rlcore run wrote \(checkpoint-7 "
                                         r"\(a symbolic link\), notes.txt\); .*move them away, or pick a new run_dir"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), overwrite=True))
    assert snapshot(run) == before


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"run_dir: .*: resume and overwrite contradict each other .*choose one"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(tmp_path), resume=True, overwrite=True))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["missing", "empty", "lock", "other files"])
def test_a_folder_without_a_runs_files_starts_a_run(tmp_path, content):
    run = tmp_path / "run"
    if content != "missing":
        run.mkdir()
    if content == "lock":
        (run / LOCK_NAME).write_text("")  # left by a killed run
    if content == "other files":
        (run / "config.yaml").write_text("steps: 1\n")
    state, _ = sft.train(sft.Config(**TINY, steps=1, run_dir=str(run)))
    assert state.step == 1 and (run / "checkpoint-1").is_dir()


def test_run_files_names_what_a_run_writes():
    from rlcore.loops.run_dir import run_files

    named = ["tensorboard", "images", "lora", "completions.jsonl", "samples.md", "wandb"]
    scratch = [".tmp-step-4-00ff00ff", ".old-checkpoint-2-0a0b0c0d", ".del-checkpoint-1-deadbeef",
               ".del-wandb-0123abcd"]
    others = ["checkpoint-x", "notes.txt", "checkpoints", ".del-x", ".tmp-mydata", ".old-notes", ".del-notes-deadbeef",
              ".tmp-step-4"]

    def check(folder, anchor):
        for name in named + scratch + others + ["checkpoint-9"]:  # checkpoint-9: no manifest
            (folder / name).mkdir()
        (folder / LOCK_NAME).write_text("")
        if anchor == "checkpoint":
            (folder / "checkpoint-3").mkdir()
            (folder / "checkpoint-3" / "manifest.json").write_text('{"format": 1, "files": {}}')
        elif anchor == "metrics":
            (folder / "metrics.jsonl").write_text('{"step": 1, "time": 1.5, "loss": 2.0}\n')
        ours, foreign, other = run_files(folder)
        rlcore = {"checkpoint": ["checkpoint-3"], "metrics": ["metrics.jsonl"], None: []}[anchor]
        expected = sorted(scratch + rlcore + (named if anchor else []))
        assert sorted(p.name for p in ours) == expected
        assert sorted(p.name for p in foreign) == sorted(["checkpoint-9"] + ([] if anchor else named))
        assert sorted(p.name for p in other) == sorted(others)

    import tempfile
    from pathlib import Path
    for anchor in ("checkpoint", "metrics", None):
        with tempfile.TemporaryDirectory() as d:
            check(Path(d), anchor)
    assert run_files("/nonexistent/run") == ([], [], [])


def test_a_run_leaves_folders_with_scratch_like_names_alone(tmp_path):
    """Only the exact scratch names a save writes are ever deleted; ``.tmp-mydata`` is the user's."""
    run = tmp_path / "run"
    mine = [".del-notes", ".old-checkpoint-notes", ".old-notes", ".tmp-mydata", ".tmp-step-x"]
    for name in mine:
        (run / name).mkdir(parents=True)
    (run / ".tmp-mydata" / "important").write_text("precious")
    state, _ = sft.train(sft.Config(**TINY, steps=1, save_every=1, run_dir=str(run)))  # a new run: they are no run's
    assert state.step == 1
    (run / ".tmp-step-9-0123abcd").mkdir()  # saves a kill interrupted: the save's own debris
    (run / ".del-checkpoint-0-deadbeef").mkdir()
    state, _ = sft.train(sft.Config(**TINY, steps=3, save_every=1, keep_last=1, run_dir=str(run), resume=True))
    assert state.step == 3
    assert sorted(p.name for p in run.iterdir()) == sorted([*mine, "checkpoint-3", "metrics.jsonl"])
    assert (run / ".tmp-mydata" / "important").read_text() == "precious"


def test_resume_into_a_run_without_a_checkpoint_is_refused(tmp_path):
    """A run killed before its first save (``save_every 0``) leaves metrics.jsonl only: a resume has
    nothing to continue, and would erase those lines; a new run or ``--overwrite`` decides."""
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=3, run_dir=str(run)))
    for p in run.glob("checkpoint-*"):
        import shutil
        shutil.rmtree(p)  # as if killed before the save
    before = snapshot(run)
    with pytest.raises(FileExistsError, match=r"resume: .*run holds a run \(metrics.jsonl\) but no checkpoint, so "
                                              r"there is nothing to resume from; start over there with --overwrite "
                                              r"true .*or pick a new run_dir"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), resume=True))
    assert snapshot(run) == before
    with pytest.raises(FileExistsError, match=r"holds another run \(metrics.jsonl\)"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run)))
    assert snapshot(run) == before
    state, _ = sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), overwrite=True))
    assert state.step == 1 and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]


def test_a_metrics_file_no_rlcore_run_wrote_is_never_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": 1.0}}\n' for i in range(1, 6)))
    before = snapshot(run)
    for flags in (dict(resume=True), {}, dict(overwrite=True)):
        with pytest.raises(ValueError, match=r"run holds .*metrics.jsonl \(not rlcore's lines, and no rlcore "
                                             r"checkpoint beside it\).*move them away, or pick (a new|another) run_dir"):
            sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), **flags))
        assert snapshot(run) == before


def test_overwrite_refuses_checkpoints_and_named_folders_no_rlcore_run_wrote(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-500").mkdir(parents=True)  # another trainer's: no rlcore manifest
    (run / "checkpoint-500" / "model.safetensors").write_text("weights")
    (run / "lora").mkdir()  # the user's adapters, no rlcore run beside them
    (run / "lora" / "adapter.safetensors").write_text("adapter")
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"overwrite: .*run holds files no rlcore run wrote \(checkpoint-500 \(no "
                                         r"rlcore manifest.json\), lora \(no rlcore checkpoint or metrics.jsonl "
                                         r"beside it\)\); .*move them away, or pick a new run_dir"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run), overwrite=True))
    assert snapshot(run) == before
    with pytest.raises(FileExistsError, match=r"run_dir: .*run holds checkpoint-500 \(no rlcore manifest.json\), "
                                              r"lora .*no rlcore run wrote them.*move them away, or pick another"):
        sft.train(sft.Config(**TINY, steps=1, run_dir=str(run)))
    assert snapshot(run) == before


def test_a_run_dir_that_is_a_file_is_refused_at_load(tmp_path, monkeypatch):
    from rlcore.loops import recipe
    from rlcore.loops.config import ConfigError, load_config

    path = tmp_path / "run"
    path.write_text("not a folder")

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(recipe, "build_model", built)
    for run_dir in (path, path / "sub"):
        with pytest.raises(ConfigError, match=rf"run_dir: '{re.escape(str(run_dir))}' (is an existing file|lies "
                                              r"under .*, an existing file).*pick another run_dir"):
            sft.train(sft.Config(**TINY, steps=1, run_dir=str(run_dir)))
        with pytest.raises(ConfigError, match=r"run_dir: .*existing file"):
            load_config(sft.Config, None, {"run_dir": str(run_dir)})
    assert path.read_text() == "not a folder"


def test_every_recipe_claims_its_folder(tmp_path):
    """The check sits in ``loops.recipe.run``, which every recipe's train goes through: ReFT and DDPO too."""
    pytest.importorskip("diffusers")
    from pathlib import Path

    from rlcore.loops.recipes import ddpo
    from rlcore.loops.recipes.reft import load_config, train_reft_sft

    reft_config = Path(__file__).resolve().parents[2] / "configs" / "reft_sft.yaml"
    for name, train, config in [
        ("reft", train_reft_sft, lambda **kw: load_config(reft_config, steps=1, num_train=16, num_eval=4, **kw)),
        ("ddpo", ddpo.train, lambda **kw: ddpo.Config(
            prompts=("stripes", "checkers"), sample_size=8, block_out_channels=(8,), prediction_type="sample",
            sample_num_steps=2, sample_guidance_scale=1.0, sample_batch_size=2, sample_num_batches_per_epoch=1,
            train_batch_size=2, num_epochs=1, num_eval_images=2, **kw))]:
        run = tmp_path / name
        state, _ = train(config(run_dir=str(run)))
        assert state.step == 1
        before = snapshot(run)
        with pytest.raises(FileExistsError, match=r"holds another run .*--resume true"):
            train(config(run_dir=str(run)))
        assert snapshot(run) == before
        state, _ = train(config(run_dir=str(run), overwrite=True))
        assert state.step == 1


# --- metrics.jsonl on resume ------------------------------------------------------------------------
@pytest.mark.parametrize("line", ["{not json", "[1, 2]", '"text"', '{"step": "2"}', '{"loss": 1.0}', '{"step": null}',
                                  '{"step": true}', "[" * 100_000 + "]" * 100_000],
                         ids=["bad-json", "list", "string", "step-str", "no-step", "step-null", "step-bool", "deep"])
def test_a_malformed_metrics_line_is_refused_on_resume_naming_the_line(tmp_path, line):
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=2, save_every=1, run_dir=str(run)))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], line, lines[1]]) + "\n")
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2: expected a JSON object with a numeric \"step\" "
                                         r".*; correct or delete that line, then resume"):
        sft.train(sft.Config(**TINY, steps=3, run_dir=str(run), resume=True))
    assert snapshot(run) == before


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    run = tmp_path / "run"
    sft.train(sft.Config(**TINY, steps=2, save_every=1, run_dir=str(run)))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a kill in the middle of a write
    state, _ = sft.train(sft.Config(**TINY, steps=3, run_dir=str(run), resume=True))
    assert state.step == 3
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_resume_command_restates_resume_and_run_dir():
    from rlcore.loops.run_dir import resume_command

    argv = ["train", "sft", "--config", "my config.yaml", "--resume=false", "--overwrite", "true", "--run_dir", "old",
            "--steps", "9"]
    assert resume_command(argv, "runs/a b") == ("rlcore train sft --config 'my config.yaml' --steps 9 --resume true "
                                                "--run_dir 'runs/a b'")


# --- SIGINT / SIGTERM -------------------------------------------------------------------------------
SLOW_CLI = """
import sys, time
from rlcore.loops import cli
from rlcore.loops.recipes import sft
real = sft.sft_step
def slow(*args, **kwargs):
    time.sleep(0.2)
    return real(*args, **kwargs)
sft.sft_step = slow
sys.exit(cli.main(sys.argv[1:]))
"""


def interrupted_cli(argv, metrics, signum, script=SLOW_CLI):
    """``rlcore`` (every step slowed to 0.2 s) sent ``signum`` once ``metrics`` has its first line:
    ``(exit code, stderr)``."""
    import subprocess
    import sys
    import time

    from tests.loops.conftest import shell_signals

    proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=shell_signals)
    try:
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step logged in time"
            time.sleep(0.1)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_saves_the_step_prints_the_resume_command_and_exits_with_its_code(tmp_path, signame, code):
    import shlex
    import signal

    from rlcore.loops import cli
    from rlcore.loops.checkpoint import list_checkpoints

    run = tmp_path / "run"
    argv = ["train", "sft", "--steps", "40", "--save_every", "0", "--run_dir", str(run),
            *[x for k, v in TINY.items() for x in (f"--{k}", str(v))]]
    rc, err = interrupted_cli(argv, run / "metrics.jsonl", getattr(signal, signame))
    assert rc == code, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    saved = list_checkpoints(run)
    assert len(saved) == 1 and 1 <= int(saved[0].name.split("-")[1]) < 40  # saved at a step boundary
    step = int(saved[0].name.split("-")[1])
    assert f"rlcore: stopped by {signame} after step {step} of 40; a resume continues from {saved[0]}" in err
    command = next(line for line in err.splitlines() if line.startswith("rlcore: resume with: "))
    resume_argv = shlex.split(command[len("rlcore: resume with: "):])
    assert resume_argv[:2] == ["rlcore", "train"] and resume_argv[-4:] == ["--resume", "true", "--run_dir", str(run)]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, step + 1))
    assert cli.main(resume_argv[1:]) == 0  # the printed command continues the run to its end
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 41))


def test_a_signal_without_a_run_dir_exits_with_one_line(tmp_path):
    import signal

    marker = tmp_path / "steps"  # a run without run_dir writes nothing: each slowed step marks this file
    argv = ["train", "sft", "--steps", "40", "--run_dir", "null", *[x for k, v in TINY.items() for x in (f"--{k}", str(v))]]
    script = SLOW_CLI.replace("time.sleep(0.2)", f"time.sleep(0.2); open({str(marker)!r}, 'a').write('1')")
    rc, err = interrupted_cli(argv, marker, signal.SIGINT, script)
    assert rc == 130, err
    assert "Traceback" not in err and "resume with" not in err
    assert re.search(r"^rlcore: stopped by SIGINT after step \d+ of 40; no run_dir: nothing saved$", err, re.M), err
