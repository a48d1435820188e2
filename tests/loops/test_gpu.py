"""The recipes on a CUDA device (marked ``gpu``: skipped without one; ``make test-gpu`` runs them).

Every language-model recipe from the command line on a Qwen2.5-shaped local folder with
``--device cuda``, bf16 weights, a LoRA adapter and gradient checkpointing; bf16 autocast against
float32; chunked generation's reproducibility; the CUDA peak-memory metric.
"""

import dataclasses
import json

import pytest
import torch

from rlcore import keys as K
from rlcore.loops.recipes import grpo, sft
from rlcore.loops.chunks import generate_in_chunks
from rlcore.loops.cli import main as cli
from rlcore.loops.models import load_model, load_tokenizer
from rlcore.loops.score import token_logprobs_from_model
from rlcore.loops.shapes import save_family_model
from tests.loops.test_shapes import REAL, RECIPES

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_family_model(tmp_path_factory.mktemp("qwen") / "Qwen2.5-tiny", "qwen2.5", seed=3)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_trains_on_cuda(recipe, qwen_dir, tmp_path, capsys):
    run_dir = tmp_path / recipe
    assert cli(["train", recipe, "--model", str(qwen_dir), "--device", "cuda", *REAL, *RECIPES[recipe],
                "--run_dir", str(run_dir)]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in final.items() if k.startswith("loss"))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["memory/peak_cuda_gib"] > 0 for line in lines)


def test_bf16_log_probs_on_cuda_stay_close_to_float32(qwen_dir):
    tokenizer = load_tokenizer(str(qwen_dir))
    ids = torch.tensor([tokenizer("Question: what is 7 times 8? Answer: 56")["input_ids"]], device="cuda")
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(str(qwen_dir), dtype=dtype).to("cuda")
        for chunked in (True, False):
            with torch.no_grad():
                out[dtype, chunked] = token_logprobs_from_model(model, ids, None, chunked=chunked).float()
    torch.testing.assert_close(out["float32", True], out["float32", False], rtol=1e-4, atol=1e-4)
    for chunked in (True, False):  # bf16 weights: ~3 significant digits per logit
        torch.testing.assert_close(out["bfloat16", chunked], out["float32", chunked], rtol=0, atol=0.1)


def test_autocast_bf16_tracks_float32_training(qwen_dir):
    base = sft.Config(model=str(qwen_dir), device="cuda", steps=3, batch_size=4, max_length=32, num_train=16,
                      num_eval=4, run_dir=None, lr=1e-3)
    _, full = sft.train(base)
    _, mixed = sft.train(dataclasses.replace(base, mixed_precision="bf16"))
    for a, b in zip(full, mixed):
        assert abs(a["loss"] - b["loss"]) < 0.05 * abs(a["loss"]), (a["loss"], b["loss"])


def test_chunked_generation_on_cuda_is_reproducible(qwen_dir):
    model, tokenizer = load_model(str(qwen_dir)).to("cuda").eval(), load_tokenizer(str(qwen_dir))
    prompts = ["12 + 34 =", "sort: 3 1 2 ->", "reverse: abc ->", "7 times 8"]
    kw = dict(rows_per_call=4, num_samples=2, max_new_tokens=6, seed=9, engine="loop")
    first, again = (generate_in_chunks(model, tokenizer, prompts, **kw) for _ in range(2))
    assert first.device.type == "cuda" and (first == again).all()
    assert first[K.RESPONSE_IDS].shape[0] == 8


def test_grpo_with_lora_on_cuda_keeps_the_reference_on_the_device(qwen_dir):
    config = grpo.Config(model=str(qwen_dir), device="cuda", use_peft=True, lora_r=4, steps=2, batch_size=2,
                         num_samples=2, max_new_tokens=4, num_train=8, num_eval=4, run_dir=None,
                         generation_batch_size=2, forward_batch_size=2)
    state, hist = grpo.train(config, reward_fn=lambda prompts, completions, **_: [float(len(c)) for c in completions])
    assert state.model("ref").device.type == "cuda" and len(hist) == 2


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "dpo"])
def test_a_reference_on_the_cpu_beside_a_policy_on_cuda(recipe, qwen_dir, tmp_path, capsys):
    """``ref_device: cpu`` (and the reward model with ``reward_device``): the scorers move each
    forward's rows to the model and its results back; PPO's full KL reads both models."""
    extra = ["--kl", "full"] if recipe == "ppo" else []
    assert cli(["train", recipe, "--model", str(qwen_dir), "--device", "cuda", "--ref_device", "cpu",
                *RECIPES[recipe], "--steps", "2", "--num_eval", "4", "--eval_every", "2", *extra]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in final.items() if k.startswith("loss"))
