"""docs/from_trl.md's examples run as written (on tiny models, with a few steps)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from rlcore.loops.recipes import dpo, grpo
from rlcore.loops.config import load_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "from_trl.md"
TINY = {"model": "tiny-llama", "hidden_size": 16, "num_layers": 1, "num_heads": 2, "steps": 2}


def blocks(kind):
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_every_trl_name_in_the_table_is_refused_with_its_rlcore_name():
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)`", DOC.read_text(), flags=re.M)
    assert len(rows) >= 8
    for trl, ours in rows:
        if trl == ours:
            continue
        for recipe in (grpo, dpo):
            fields = {f for f in recipe.Config.__dataclass_fields__}
            if ours in fields and trl not in fields:
                with pytest.raises(ValueError, match=rf"{trl}: did you mean .*'{ours}'"):
                    load_config(recipe.Config, overrides={trl: 1})


def test_the_grpo_example_runs_with_its_trl_reward_function(tmp_path, monkeypatch):
    (python,) = blocks("python")
    (tmp_path / "my_rewards.py").write_text(python)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(40)))
    grpo_yaml = next(b for b in blocks("yaml") if "grpo" in b)
    (tmp_path / "grpo_math.yaml").write_text(grpo_yaml)
    config = load_config(grpo.Config, tmp_path / "grpo_math.yaml",
                         {**TINY, "max_new_tokens": 4, "num_samples": 2, "num_eval": 4, "run_dir": str(tmp_path / "g")})
    assert config.reward_funcs == ("my_rewards:correct",) and config.kl_coef == 0.04
    state, history = grpo.train(config)
    assert state.step == 2 and "rollout/score" in history[-1]


def test_the_dpo_example_runs_on_conversational_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}],
             "chosen": [{"role": "assistant", "content": str(i + 1)}],
             "rejected": [{"role": "assistant", "content": str(i + 2)}]} for i in range(40)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo_yaml = next(b for b in blocks("yaml") if "dpo" in b)
    assert yaml.safe_load(dpo_yaml)["loss_type"] == "sigmoid"
    (tmp_path / "dpo_chat.yaml").write_text(dpo_yaml)
    config = load_config(dpo.Config, tmp_path / "dpo_chat.yaml",
                         {**TINY, "max_length": 64, "max_prompt_length": 32, "batch_size": 4, "micro_batch_size": 2,
                          "num_eval": 4, "run_dir": str(tmp_path / "d")})
    state, history = dpo.train(config)
    assert state.optimizer_steps == 2 and "loss" in history[-1]
