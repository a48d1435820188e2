"""The recipes on a CUDA device (marked ``gpu``: skipped without one; ``make test-gpu`` runs them).

Every language-model recipe from the command line on a Qwen2.5-shaped local folder with
``--device cuda``, bf16 weights, a LoRA adapter and gradient checkpointing; bf16 autocast against
float32; chunked generation's reproducibility; the CUDA peak-memory metric.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from rlcore import keys as K
from rlcore.lm_head import hidden_logprobs
from rlcore.logprobs import token_logprobs
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


# --- the rest of the library on CUDA -------------------------------------------------------------
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("recipe", ["reft_sft", "reft_dpo", "reft_reward", "reft_grpo", "reft_rloo"])
def test_every_reft_recipe_trains_on_cuda(recipe, tmp_path, capsys):
    name = "reft" if recipe == "reft_sft" else recipe
    assert cli(["train", name, "--config", str(CONFIGS / f"{recipe}.yaml"), "--device", "cuda", "--steps", "2",
                "--num_train", "16", "--num_eval", "4", "--eval_every", "2", "--save_every", "2",
                "--run_dir", str(tmp_path / recipe)]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert all(math.isfinite(v) for k, v in final.items() if k.startswith("loss"))


@pytest.mark.parametrize("recipe", ["grpo", "online_dpo"])
def test_async_generation_on_cuda(recipe, tmp_path, capsys):
    """The generator process holds its own CUDA copy of the policy and receives the learner's weights."""
    assert cli(["train", recipe, "--async", "--max_lag", "1", "--device", "cuda", "--steps", "3",
                *RECIPES[recipe], "--run_dir", str(tmp_path / recipe)]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert all(math.isfinite(v) for k, v in final.items() if k.startswith("loss"))


def test_ddpo_trains_on_cuda(tmp_path):
    pytest.importorskip("diffusers")
    from rlcore.loops.recipes import ddpo

    config = ddpo.Config(device="cuda", run_dir=str(tmp_path / "run"), prompts=("stripes", "checkers", "blob"),
                         sample_size=8, block_out_channels=(8,), prediction_type="sample", sample_num_steps=3,
                         sample_guidance_scale=1.0, sample_batch_size=4, sample_num_batches_per_epoch=2,
                         train_batch_size=2, train_learning_rate=1e-3, num_epochs=2, save_every=1, num_eval_images=4)
    state, history = ddpo.train(config)
    assert next(state.model().parameters()).device.type == "cuda"
    assert history and all(math.isfinite(h["loss"]) for h in history)


def _head(n, hdim, vocab, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hdim, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, device="cuda", generator=g) / hdim ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device="cuda", generator=g).to(dtype).requires_grad_()
    return h, w, b, torch.randint(0, vocab, (n,), device="cuda", generator=g)


@pytest.mark.parametrize("config", [dict(), dict(temperature=0.7), dict(softcap=3.0, logit_scale=0.5, temperature=1.3)])
def test_hidden_logprobs_on_cuda_match_the_logits_path(config):
    """Float32 on the GPU (TF32 off) against float64 on the CPU: values, entropy and both gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, b, y = _head(300, 64, 5003, torch.float32)
    lp, ent = hidden_logprobs(h, w, y, bias=b, chunk_size=1024, with_entropy=True, **config)
    h64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in (h, w, b))
    s, c, tau = config.get("logit_scale", 1.0), config.get("softcap"), config.get("temperature", 1.0)
    logits = s * (h64 @ w64.T + b64)
    logits = (c * torch.tanh(logits / c) if c else logits) / tau
    logp = logits.log_softmax(-1)
    lp_ref, ent_ref = logp.gather(-1, y.cpu()[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp.cpu().double(), lp_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent.cpu().double(), ent_ref, rtol=1e-4, atol=1e-4)
    g1, g2 = torch.rand(300, dtype=torch.float64), torch.rand(300, dtype=torch.float64)
    ours = torch.autograd.grad((lp * g1.cuda().float()).sum() + (ent * g2.cuda().float()).sum(), (h, w, b))
    refs = torch.autograd.grad((lp_ref * g1).sum() + (ent_ref * g2).sum(), (h64, w64, b64))
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a.cpu().double(), r, rtol=1e-3, atol=1e-4)


def test_hidden_logprobs_on_cuda_under_bf16_autocast_and_out_of_range_labels():
    h, w, _, y = _head(64, 32, 999, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp = hidden_logprobs(h, w, y, chunk_size=256)
    ref = (h.double() @ w.double().T).log_softmax(-1).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=0.1)  # bf16 operands: ~3 significant digits
    (grad_h,) = torch.autograd.grad(lp.sum(), (h,))
    assert torch.isfinite(grad_h).all()
    bad = y.clone()
    bad[3] = 999  # named before any kernel reads past the vocabulary (a device assert on CUDA)
    with pytest.raises(ValueError, match=r"labels: expected ids in \[0, 999\)"):
        hidden_logprobs(h.detach(), w.detach(), bad, chunk_size=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_on_cuda_match_float64(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (3 * torch.randn(4, 17, 3001, device="cuda", generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, 3001, (4, 17), device="cuda", generator=g)
    lp = token_logprobs(logits, y)
    ref = logits.detach().double().log_softmax(-1).gather(-1, y[..., None])[..., 0]
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-4 if dtype == torch.float32 else 0.1)
    (grad,) = torch.autograd.grad(lp.sum(), (logits,))
    ref_grad = torch.nn.functional.one_hot(y, 3001).double() - logits.detach().double().softmax(-1)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
