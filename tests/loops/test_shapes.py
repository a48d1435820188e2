"""Offline models shaped like real families (loops/shapes.py), and every language-model recipe on
a local model folder through the real loading path: bf16 weights, a LoRA adapter on all linear
layers, gradient checkpointing, from the command line."""

import json

import pytest
import torch

from rlcore.loops.cli import main as cli
from rlcore.loops.models import load_model, load_tokenizer
from rlcore.loops.recipe import build_policy
from rlcore.loops.shapes import FAMILIES, build_family_model, family_config, family_tokenizer, save_family_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _parameters(config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_real_sizes_have_the_real_models_parameter_counts():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings); Llama-3.2-1B: 1,235,814,400.
    assert _parameters(family_config("qwen2.5", "0.5b")) == 494_032_768
    assert _parameters(family_config("llama3", "1b")) == 1_235_814_400
    qwen = family_config("qwen2.5", "0.5b")
    assert (qwen.vocab_size, qwen.num_key_value_heads, qwen.num_attention_heads, qwen.tie_word_embeddings) == \
        (151_936, 2, 14, True)
    assert not family_config("llama3", "8b").tie_word_embeddings and family_config("llama3", "8b").vocab_size == 128_256


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_models_keep_the_family_s_traits(family):
    tokenizer = family_tokenizer(family)
    model = build_family_model(family, tokenizer=tokenizer, seed=1)
    config = model.config
    assert config.vocab_size == FAMILIES[family].vocab_size and config.num_key_value_heads < config.num_attention_heads
    assert config.model_type == FAMILIES[family].model_type
    assert torch.equal(model.model.embed_tokens.weight, build_family_model(family, tokenizer=tokenizer, seed=1)
                       .model.embed_tokens.weight)  # seeded
    logits = model(torch.tensor([tokenizer("12 + 34 = 46")["input_ids"]])).logits
    assert logits.shape[-1] == FAMILIES[family].vocab_size


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_has_the_family_s_specials_and_chat_template(family):
    tok = family_tokenizer(family)
    assert tok.eos_token == FAMILIES[family].eos and tok.pad_token_id is not None and tok.pad_token_id < 8
    text = "Question: what is 7 times 8? Answer: 56"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(chat, tokenize=False)
    assert full.startswith(prompt) and full.endswith(tok.eos_token + ("\n" if family == "qwen2.5" else ""))
    with pytest.raises(ValueError, match=r"size: qwen2.5 has sizes \['0.5b', '1.5b', 'tiny'\], got '7b'"):
        family_config("qwen2.5", "7b")
    with pytest.raises(ValueError, match="family: unknown 'gemma'"):
        family_tokenizer("gemma")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_family_model(tmp_path_factory.mktemp("qwen") / "Qwen2.5-tiny", "qwen2.5", seed=3)


def test_saved_folder_loads_as_a_checkpoint_would(qwen_dir):
    model, tokenizer = load_model(str(qwen_dir)), load_tokenizer(str(qwen_dir))
    fresh = build_family_model("qwen2.5", tokenizer=tokenizer, seed=3)
    ids = torch.tensor([tokenizer("sort: 3 1 2")["input_ids"]])
    torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=1e-6, atol=1e-6)
    assert tokenizer.chat_template == FAMILIES["qwen2.5"].chat_template
    ours = family_tokenizer("qwen2.5")  # transformers loads Qwen's own class: the same tokens
    for text in ("12 + 345 = 357", "Question: what's 7 times 8?\n  Answer: 56", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tokenizer(text)["input_ids"] == ours(text)["input_ids"]
    def split(family):
        return [piece for piece, _ in family_tokenizer(family).backend_tokenizer.pre_tokenizer.pre_tokenize_str("2024")]
    assert split("qwen2.5") == ["2", "0", "2", "4"] and split("llama3") == ["202", "4"]  # numbers: 1 or 3 digits


# Each recipe from the command line on the local folder, as the README shows it.
REAL = ["--dtype", "bfloat16", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
        "--lora_target_modules", "all-linear", "--gradient_checkpointing", "true", "--steps", "2", "--num_eval", "4"]
RECIPES = {
    "sft": ["--batch_size", "4", "--max_length", "32", "--num_train", "16"],
    "dpo": ["--batch_size", "4", "--max_length", "32", "--num_train", "16"],
    "reward": ["--batch_size", "4", "--max_length", "32", "--num_train", "16"],
    "grpo": ["--batch_size", "2", "--num_samples", "2", "--max_new_tokens", "4", "--num_train", "16"],
    "rloo": ["--batch_size", "2", "--num_samples", "2", "--max_new_tokens", "4", "--num_train", "16"],
    "ppo": ["--batch_size", "2", "--num_samples", "2", "--max_new_tokens", "4", "--num_train", "16"],
    "online_dpo": ["--batch_size", "2", "--max_new_tokens", "4", "--num_train", "16"],
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_trains_a_local_bf16_lora_model(recipe, qwen_dir, tmp_path, capsys):
    run_dir = tmp_path / recipe
    argv = ["train", recipe, "--model", str(qwen_dir), *REAL, *RECIPES[recipe], "--run_dir", str(run_dir),
            "--save_every", "2"]
    assert cli(argv) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final"]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in final.items() if k.startswith("loss"))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["memory/peak_rss_gib"] > 0 for line in lines)
    saved = run_dir / "checkpoint-2" / "models" / "policy"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()


def test_remote_code_is_refused_unless_trusted(tmp_path):
    """A folder whose config asks for its own code: nothing of it runs without trust_remote_code."""
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "rlcore-custom", "architectures": ["Custom"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"}}))
    code = f"open({str(marker)!r}, 'w').write('x')\n"
    (folder / "configuration_custom.py").write_text(code)
    (folder / "modeling_custom.py").write_text(code)
    family_tokenizer("qwen2.5").save_pretrained(folder)
    from rlcore.loops.recipes import grpo
    with pytest.raises(ValueError, match=r"model: .*custom ships its own modelling code .* set trust_remote_code: "
                                         r"true \(--trust_remote_code true\)"):
        build_policy(grpo.Config(model=str(folder)))
    assert not marker.exists()
