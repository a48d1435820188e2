"""The GRPO, RLOO, DPO and SFT examples of TRL 1.16's documentation, their config values and reward
functions as TRL writes them, run on a local tiny model folder and a local jsonl in TRL's dataset
format: from the CLI (`rlcore train RECIPE --config x.yaml`) and from Python, logging TRL's metric names.

Each YAML is what `trl <cmd> --config x.yaml` takes. Only the model and dataset names are replaced,
and the sizes marked "shrunk" are made tiny so that each run takes seconds on a CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.loops import cli
from rlcore.loops.config import load_config
from rlcore.loops.recipes import RECIPES

pytest.importorskip("transformers")

# --- the reward functions, unchanged from TRL 1.16's GRPO and RLOO pages ---------------------------
# "Example 2" of the GRPO page's custom reward functions (conversational data)
FORMAT_REWARD = '''\
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
'''
# the RLOO page's example with a TLDR-style dataset (standard data)
UNIQUE_CHARS_REWARD = '''\
def reward_num_unique_chars(completions, **kwargs):
    return [len(set(c)) for c in completions]
'''

# --- the configs, as `trl <cmd> --config` reads them -------------------------------------------------
EXAMPLES = {
    # GRPO page, "Quick start": GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", train_dataset=
    # trl-lib/DeepMath-103K, reward_funcs=...) with GRPOConfig's defaults (the quick start's
    # accuracy_reward needs math_verify, so the page's format_reward_func scores instead)
    "grpo": dict(yaml="""\
model_name_or_path: {model}  # Qwen/Qwen2.5-0.5B-Instruct
dataset_name: {data}  # trl-lib/DeepMath-103K
output_dir: {out}  # Qwen2.5-0.5B-GRPO
# shrunk for a CPU test (TRL's default in brackets)
max_steps: 2  # [num_train_epochs: 3]
per_device_train_batch_size: 4  # [8]
num_generations: 2  # [8]
max_completion_length: 8  # [256]
logging_steps: 1  # [10]
""", reward_module=FORMAT_REWARD, reward="format_reward_func",
        metrics=("reward", "reward_std", "rewards/format_reward_func/mean", "rewards/format_reward_func/std",
                 "frac_reward_zero_std", "num_tokens", "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                 "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "learning_rate", "grad_norm", "loss")),
    # RLOO page, the example on trl-lib/tldr with reward_num_unique_chars: RLOOConfig(output_dir=
    # "Qwen2.5-72B-RLOO", per_device_train_batch_size=4, bf16=True, use_vllm=True, vllm_mode="server",
    # vllm_server_host=...); the vLLM server options are left out (no vLLM server on a CPU)
    "rloo": dict(yaml="""\
model_name_or_path: {model}  # Qwen/Qwen2.5-72B
dataset_name: {data}  # trl-lib/tldr
output_dir: {out}  # Qwen2.5-72B-RLOO
per_device_train_batch_size: 4
bf16: true
# shrunk for a CPU test (TRL's default in brackets)
max_steps: 2  # [num_train_epochs: 3]
max_completion_length: 8  # [256]
logging_steps: 1  # [10]
""", reward_module=UNIQUE_CHARS_REWARD, reward="reward_num_unique_chars",
        metrics=("reward", "reward_std", "rewards/reward_num_unique_chars/mean",
                 "rewards/reward_num_unique_chars/std", "frac_reward_zero_std", "num_tokens",
                 "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/region_mean",
                 "learning_rate", "grad_norm", "loss")),
    # DPO page, "Quick start": DPOTrainer(model="Qwen/Qwen3-0.6B", train_dataset=
    # trl-lib/ultrafeedback_binarized) with DPOConfig's defaults
    "dpo": dict(yaml="""\
model_name_or_path: {model}  # Qwen/Qwen3-0.6B
dataset_name: {data}  # trl-lib/ultrafeedback_binarized
output_dir: {out}  # Qwen3-0.6B-DPO
# shrunk for a CPU test (TRL's default in brackets)
max_steps: 2  # [num_train_epochs: 3]
per_device_train_batch_size: 2  # [8]
logging_steps: 1  # [10]
""", metrics=("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
              "logps/chosen", "logps/rejected", "num_tokens", "learning_rate", "grad_norm")),
    # SFT page, "Quick start": SFTTrainer(model="Qwen/Qwen3-0.6B", train_dataset=trl-lib/Capybara)
    # with SFTConfig's defaults
    "sft": dict(yaml="""\
model_name_or_path: {model}  # Qwen/Qwen3-0.6B
dataset_name: {data}  # trl-lib/Capybara
output_dir: {out}  # Qwen3-0.6B-SFT
# shrunk for a CPU test (TRL's default in brackets)
max_steps: 2  # [num_train_epochs: 3]
per_device_train_batch_size: 2  # [8]
logging_steps: 1  # [10]
""", metrics=("loss", "num_tokens", "learning_rate", "grad_norm")),
}


def rows(recipe):
    """80 rows in the format of the example's dataset."""
    def chat(role, text):
        return [{"role": role, "content": text}]

    if recipe == "grpo":  # DeepMath-103K: a conversational prompt and a solution column
        return [{"prompt": chat("user", f"What is {i} + 1?"), "solution": str(i + 1)} for i in range(80)]
    if recipe == "rloo":  # tldr: a standard prompt (and a completion column, not used)
        return [{"prompt": f"POST: day {i} was long.\nTL;DR:", "completion": " long day"} for i in range(80)]
    if recipe == "dpo":  # preference pairs, conversational, with the prompt apart
        return [{"prompt": chat("user", f"{i} + 1?"), "chosen": chat("assistant", str(i + 1)),
                 "rejected": chat("assistant", str(i + 2))} for i in range(80)]
    return [{"messages": chat("user", f"{i} + 1?") + chat("assistant", str(i + 1))} for i in range(80)]  # Capybara


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama-architecture model folder, its tokenizer with a chat template."""
    from rlcore.loops.models import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("model") / "m"
    tokenizer = build_tokenizer()
    assert tokenizer.chat_template
    build_model("llama", tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_example(recipe, tmp_path, model_dir, *, with_reward_funcs):
    example = EXAMPLES[recipe]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(recipe)))
    text = example["yaml"].format(model=model_dir, data="data.jsonl", out=tmp_path / "run")
    if "reward" in example:
        (tmp_path / f"{recipe}_rewards.py").write_text(example["reward_module"])
        if with_reward_funcs:  # as TRL's CLI takes it: a dotted import path
            text += f"reward_funcs: [{recipe}_rewards.{example['reward']}]\n"
    (tmp_path / "x.yaml").write_text(text)
    return tmp_path / "x.yaml"


def logged(tmp_path):
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if not any(k.startswith("eval/") for k in line)]


def check_metrics(recipe, tmp_path):
    steps = logged(tmp_path)
    assert [s["step"] for s in steps][:2] == [1, 2]
    missing = [name for name in EXAMPLES[recipe]["metrics"] if name not in steps[-1]]
    assert missing == [], missing
    assert steps[-1]["num_tokens"] > steps[0]["num_tokens"] > 0


@pytest.mark.parametrize("recipe", list(EXAMPLES))
def test_a_trl_documentation_example_runs_from_the_cli(recipe, tmp_path, monkeypatch, model_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_example(recipe, tmp_path, model_dir, with_reward_funcs=True)
    assert cli.main(["train", recipe, "--config", str(config)]) == 0
    check_metrics(recipe, tmp_path)


@pytest.mark.parametrize("recipe", list(EXAMPLES))
def test_a_trl_documentation_example_runs_from_python(recipe, tmp_path, monkeypatch, model_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = RECIPES[recipe]
    config = load_config(entry.config, write_example(recipe, tmp_path, model_dir, with_reward_funcs=False))
    if "reward" in EXAMPLES[recipe]:  # TRL: GRPOTrainer(reward_funcs=fn, args=GRPOConfig(...), ...)
        import importlib

        reward = getattr(importlib.import_module(f"{recipe}_rewards"), EXAMPLES[recipe]["reward"])
        state, history = entry.train(config, reward_fn=reward)
    else:
        state, history = entry.train(config)
    assert state.step == 2 and len(history) == 2
    check_metrics(recipe, tmp_path)


def test_a_trl_example_runs_as_a_command(tmp_path, model_dir):
    """`rlcore train grpo --config x.yaml` in a process of its own."""
    config = write_example("grpo", tmp_path, model_dir, with_reward_funcs=True)
    exe = Path(sys.executable).with_name("rlcore")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "rlcore.loops.cli"]
    done = subprocess.run([*command, "train", "grpo", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    check_metrics("grpo", tmp_path)


def test_reward_funcs_take_trl_cli_forms(tmp_path, monkeypatch):
    """`trl grpo --reward_funcs` names TRL's own functions bare and others by dotted path."""
    from trl.rewards import think_format_reward

    from rlcore.loops.reward_fns import import_reward_fn

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cli_form_rewards.py").write_text(UNIQUE_CHARS_REWARD)
    assert import_reward_fn("think_format_reward") is think_format_reward
    assert import_reward_fn("cli_form_rewards.reward_num_unique_chars")(completions=["aab"]) == [2]
    punish = import_reward_fn("get_soft_overlong_punishment")  # built as TRL's CLI builds it
    assert punish(completion_ids=[[0] * 1024, [0] * 1280]) == [0.0, -1.0]
    with pytest.raises(ValueError, match=r"expected 'package.module:function', got 'nothing'"):
        import_reward_fn("nothing")


# --- eval_strategy: no, TRL's default, trains on every row ------------------------------------------
@pytest.mark.parametrize("recipe,owner", [("sft", "rlcore.loops.recipes.sft"), ("dpo", "rlcore.loops.recipes.dpo"),
                                          ("grpo", "rlcore.loops.online")])
def test_eval_strategy_no_trains_on_every_row(recipe, owner, tmp_path, monkeypatch, model_dir):
    """A file of 20 rows (under num_eval's default of 64) with TRL's eval_strategy: no: nothing is held
    out, one epoch of 5 steps of 4 rows (GRPO: 8 completions = 4 prompts) visits all 20, nothing is
    evaluated; `rlcore eval` on the run then asks for a held-out split."""
    import importlib

    from rlcore.loops.recipe import batch_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(recipe)[:20]))
    text = (f"model_name_or_path: {model_dir}\ndataset_name: data.jsonl\noutput_dir: {tmp_path / 'run'}\n"
            f"eval_strategy: no\nmax_steps: 5\nlogging_steps: 1\n")
    if recipe == "grpo":
        (tmp_path / "grpo_rewards.py").write_text(FORMAT_REWARD)
        text += ("per_device_train_batch_size: 8\nnum_generations: 2\nmax_completion_length: 4\n"
                 "reward_funcs: [grpo_rewards.format_reward_func]\n")
    else:
        text += "per_device_train_batch_size: 4\n"
    (tmp_path / "x.yaml").write_text(text)
    config = load_config(RECIPES[recipe].config, tmp_path / "x.yaml")
    assert (config.num_eval, config.eval_every, config.eval_dataset, config.batch_size) == (0, 0, None, 4)

    sizes, seen = [], set()

    def spy(dataset, batch_size, collate_fn, **kwargs):  # the training source: its rows and those collated
        sizes.append(len(dataset))

        def collate(batch):
            seen.update(json.dumps([batch[k][i] for k in sorted(batch)], default=str)
                        for i in range(len(next(iter(batch.values())))))
            return collate_fn(batch)
        return batch_source(dataset, batch_size, collate, **kwargs)

    monkeypatch.setattr(importlib.import_module(owner), "batch_source", spy)
    assert cli.main(["train", recipe, "--config", str(tmp_path / "x.yaml")]) == 0
    assert sizes == [20] and len(seen) == 20
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert not any(k.startswith("eval/") for line in lines for k in line)
    if recipe == "sft":  # nothing was held out: `rlcore eval` refuses, naming what to give
        with pytest.raises(ValueError, match=r"no held-out split: num_eval is 0 and no eval_dataset is given.*"
                                             r"give eval_dataset"):
            cli.main(["eval", "sft", "--checkpoint", str(tmp_path / "run"), "--config", str(tmp_path / "x.yaml")],
                     report=False)
        with pytest.raises(ValueError, match=r"no held-out split"):  # the stored num_eval 0, without the YAML
            cli.main(["eval", "sft", "--checkpoint", str(tmp_path / "run"), "--model", str(model_dir),
                      "--dataset", "data.jsonl"], report=False)
        assert cli.main(["eval", "sft", "--checkpoint", str(tmp_path / "run"), "--config", str(tmp_path / "x.yaml"),
                         "--eval_dataset", "data.jsonl"], report=False) == 0  # a held-out file given: evaluated
