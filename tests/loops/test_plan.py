"""The memory model (loops.plan): a hand-computed case, parameter counts equal to the built models', the
activation rules equal to what autograd saves, sharding, LoRA and checkpointing in the right direction,
clear errors, and the ``rlcore plan`` command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          LlamaConfig, Qwen2Config, Qwen3Config)

from rlcore.loops import cli
from rlcore.loops.models import build_model
from rlcore.loops.plan import (COMPONENTS, RECIPE_MODELS, SHAPES, ModelShape, PlanSettings, fitting, format_bytes,
                               parse_bytes, plan_memory, saved_activations, shape_of, tiny_llama_shape)
from rlcore.loops.recipes import RECIPES
from rlcore.loops.score import token_logprobs_from_model
from rlcore.loops.update import enable_gradient_checkpointing

TINY = ModelShape(64, 2, 4, 4, 256, 103, tie_word_embeddings=True, name="tiny")


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_two_block_tiny_llama_by_hand():
    """H = 64, 2 blocks, V = 103, tied: a block is q, k, v, o (4·64²) + the MLP (3·64·256) + two norms (2·64)
    = 65,664; the root is the embedding 103·64 + the final norm 64 = 6,656; 137,984 parameters in all.
    Full-parameter SFT in float32 on one rank: parameters 4 bytes each, gradients the same, AdamW 2 × 4."""
    n = 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 103 * 64 + 64
    assert n == 137_984 == TINY.num_params() == _numel(build_model(vocab_size=103, hidden_size=64, num_layers=2,
                                                                      num_heads=4))
    plan = plan_memory(TINY, PlanSettings(recipe="sft", batch_size=4, prompt_length=8, completion_length=8))
    assert plan.params == plan.trainable == n
    step = plan.bytes["step"]
    assert step["parameters"] == 4 * n and step["gradients"] == 4 * n and step["frozen copies"] == 0
    assert plan.bytes["train"]["optimiser state"] == 2 * 4 * n
    assert step["optimiser state"] == 2 * 4 * n + 4 * n  # + foreach AdamW's √v buffer on an accelerator
    cpu = plan_memory(TINY, dataclasses.replace(plan.settings, device="cpu"))
    assert cpu.bytes["step"]["optimiser state"] == 2 * 4 * n + 2 * 4 * 64 * 256  # two buffers of the largest matrix
    assert list(plan.bytes) == ["load", "train", "step"] and set(plan.bytes["train"]) == set(COMPONENTS)
    assert plan.peak == max(plan.total(p) for p in plan.bytes)


def test_a_reference_is_a_frozen_copy_and_fsdp2_divides_by_the_world_size():
    one = plan_memory(TINY, PlanSettings(recipe="dpo", batch_size=8))
    n = TINY.num_params()
    assert one.bytes["step"]["frozen copies"] == 4 * n and one.params == 2 * n and one.trainable == n
    four = plan_memory(TINY, PlanSettings(recipe="dpo", batch_size=8, world_size=4, strategy="fsdp2"))
    assert four.bytes["step"]["optimiser state"] == pytest.approx(one.bytes["step"]["optimiser state"] / 4, abs=1)
    assert four.bytes["step"]["gradients"] == pytest.approx(4 * n / 4, abs=1)
    assert four.bytes["step"]["parameters"] == pytest.approx(4 * n / 4, abs=1)
    root = 4 * TINY.root_params()  # held whole by the frozen reference only while it scores
    assert four.bytes["step"]["frozen copies"] == pytest.approx(4 * n / 4, abs=1)
    assert four.bytes["score"]["frozen copies"] == pytest.approx(4 * n / 4 + root, abs=1)
    assert four.bytes["train"]["FSDP2 all-gather"] == 2 * 4 * TINY.block_params()  # cuda: the next block prefetched
    cpu = plan_memory(TINY, dataclasses.replace(four.settings, device="cpu"))  # no backward prefetch by default
    assert cpu.bytes["train"]["FSDP2 all-gather"] == 4 * TINY.block_params()
    assert cpu.bytes["score"]["FSDP2 all-gather"] == 2 * 4 * TINY.block_params()  # a forward holds two
    with pytest.raises(ValueError, match="fsdp_backward_prefetch: expected true, false or None, got 'yes'"):
        dataclasses.replace(four.settings, fsdp_backward_prefetch="yes")
    for prefetch, blocks in ((True, 2), (False, 1)):
        for device in ("cpu", "cuda"):
            given = dataclasses.replace(four.settings, device=device, fsdp_backward_prefetch=prefetch)
            assert plan_memory(TINY, given).bytes["train"]["FSDP2 all-gather"] == blocks * 4 * TINY.block_params()
    # read sharded from a folder, the reference built on the meta device and filled with each rank's rows
    assert four.bytes["load"]["parameters"] == pytest.approx(2 * 4 * n / 4, abs=1)
    built = plan_memory(TINY, dataclasses.replace(four.settings, sharded_load=False))
    assert built.bytes["load"]["parameters"] == 4 * n  # built whole on every rank, then sharded
    # one rank under fsdp2 is unsharded, as shard_models leaves it
    assert plan_memory(TINY, dataclasses.replace(one.settings, strategy="fsdp2")).bytes == one.bytes


def test_a_frozen_model_given_a_device_is_whole_there_or_in_host_memory():
    """DPO (float32) on 4 ranks under fsdp2, read sharded: the reference sharded holds n/4 per rank
    (+ its root, gathered while it scores), whole on the device n, on the host nothing on the device and n in host memory;
    at load a whole reference is a copy beside the policy's shards."""
    n, root = TINY.num_params(), TINY.root_params()
    settings = PlanSettings(recipe="dpo", batch_size=8, world_size=4, strategy="fsdp2", device="cuda")
    sharded = plan_memory(TINY, settings)
    whole = plan_memory(TINY, dataclasses.replace(settings, ref_device="cuda"))
    host = plan_memory(TINY, dataclasses.replace(settings, ref_device="cpu"))
    assert sharded.bytes["step"]["frozen copies"] == pytest.approx(4 * n / 4, abs=1)
    assert sharded.bytes["score"]["frozen copies"] == pytest.approx(4 * n / 4 + 4 * root, abs=1)
    assert whole.bytes["score"]["frozen copies"] == 4 * n  # a whole model has no root to gather
    assert whole.bytes["step"]["frozen copies"] == 4 * n and host.bytes["step"]["frozen copies"] == 0
    assert (sharded.host, whole.host, host.host) == (0, 0, 4 * n)
    assert whole.bytes["load"]["parameters"] == pytest.approx(4 * n / 4 + 4 * n, abs=1)
    assert host.bytes["load"]["parameters"] == pytest.approx(4 * n / 4, abs=1)
    rm = dataclasses.replace(settings, recipe="grpo", reward_model=True, reward_device="cpu")
    assert plan_memory(TINY, rm).host == 4 * TINY.num_params("reward")
    with pytest.raises(ValueError, match="ref_device: expected one of .*got 'tpu'"):
        PlanSettings(ref_device="tpu")


def test_ddp_holds_a_second_copy_of_the_gradients_at_the_end_of_the_backward():
    n = TINY.num_params()
    none = plan_memory(TINY, PlanSettings(recipe="sft", batch_size=8, world_size=2))
    ddp = plan_memory(TINY, PlanSettings(recipe="sft", batch_size=8, world_size=2, strategy="ddp"))
    assert ddp.bytes["step"]["gradients"] == 4 * n and none.bytes["step"]["gradients"] == 4 * n + 4 * n  # bucket
    assert ddp.total("train") >= none.total("train") and ddp.params == none.params


def test_fsdp_param_dtype_gathers_in_bfloat16_and_keeps_float32_shards():
    base = PlanSettings(recipe="grpo", world_size=4, strategy="fsdp2", batch_size=8)
    full, half = plan_memory(TINY, base), plan_memory(TINY, dataclasses.replace(base, fsdp_param_dtype="bfloat16"))
    for phase in ("train", "step"):
        assert half.bytes[phase]["optimiser state"] == full.bytes[phase]["optimiser state"]
    assert half.bytes["step"]["gradients"] == full.bytes["step"]["gradients"]  # float32 shards
    assert half.bytes["train"]["FSDP2 all-gather"] * 2 == full.bytes["train"]["FSDP2 all-gather"]
    assert half.bytes["generate"]["KV cache"] * 2 == full.bytes["generate"]["KV cache"]
    assert half.bytes["train"]["activations"] < full.bytes["train"]["activations"]
    one = PlanSettings(recipe="grpo")  # one process: no sharding, nothing gathered in another dtype
    assert plan_memory(TINY, dataclasses.replace(one, fsdp_param_dtype="bfloat16")).bytes == plan_memory(TINY, one).bytes


def test_lora_trains_only_the_adapter_and_drops_the_reference():
    import peft

    model = peft.get_peft_model(build_model(vocab_size=103, hidden_size=64, num_layers=2, num_heads=4),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    full = plan_memory(TINY, PlanSettings(recipe="grpo", dtype="bfloat16"))
    lora = plan_memory(TINY, PlanSettings(recipe="grpo", dtype="bfloat16", use_peft=True, lora_r=8))
    assert lora.trainable == adapter == 2 * 2 * 8 * (64 + 64)
    assert lora.bytes["step"]["gradients"] == 4 * adapter  # the adapter trains in float32
    assert lora.bytes["train"]["optimiser state"] == 2 * 4 * adapter
    assert lora.bytes["step"]["frozen copies"] == 0 < full.bytes["step"]["frozen copies"]
    assert lora.peak < full.peak
    every = plan_memory(TINY, PlanSettings(recipe="grpo", use_peft=True, lora_r=8, lora_target_modules=("all-linear",)))
    assert every.trainable == 2 * 8 * sum(i + o for i, o in TINY.linears().values())


def test_lora_under_fsdp2_shards_the_frozen_base_and_keeps_the_small_adapter_whole():
    """Hand-computed: the base's bytes divided by the ranks, the adapter's float32 parameters, gradients
    and two AdamW moments whole on each rank (they are a rounding error beside the base)."""
    settings = PlanSettings(recipe="grpo", dtype="bfloat16", use_peft=True, lora_r=8)
    one = plan_memory(TINY, settings)
    four = plan_memory(TINY, dataclasses.replace(settings, world_size=4, strategy="fsdp2"))
    adapter, L, block = one.trainable, TINY.num_layers, TINY.block_params()
    root = TINY.root_params("causal_lm")
    assert four.bytes["step"]["parameters"] == round((L * block + root) * 2 / 4 + 4 * adapter)
    assert four.bytes["step"]["gradients"] == round(4 * adapter / 4)
    assert four.bytes["step"]["optimiser state"] - one.bytes["step"]["optimiser state"] / 4 < 4 * adapter
    assert four.bytes["train"]["gradients"] <= one.bytes["train"]["gradients"]  # no frozen weight's gradient gathered
    assert four.peak < one.peak


def test_gradient_checkpointing_shrinks_the_activations():
    settings = PlanSettings(recipe="sft", batch_size=8, prompt_length=512, completion_length=512)
    off = plan_memory(SHAPES["llama-3-8b"], settings)
    on = plan_memory(SHAPES["llama-3-8b"], dataclasses.replace(settings, gradient_checkpointing=True))
    assert on.bytes["train"]["activations"] < off.bytes["train"]["activations"] / 5
    small = plan_memory(SHAPES["llama-3-8b"], dataclasses.replace(settings, micro_batch_size=2))
    assert small.bytes["train"]["activations"] < off.bytes["train"]["activations"] / 3


def test_parameter_counts_equal_the_built_models():
    configs = [LlamaConfig(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                           num_key_value_heads=2, intermediate_size=80, tie_word_embeddings=False),
               LlamaConfig(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=64, attention_bias=True, mlp_bias=True,
                           head_dim=16),
               Qwen2Config(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=72, tie_word_embeddings=True),
               Qwen3Config(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=72, head_dim=16, tie_word_embeddings=False)]
    for config in configs:
        shape = shape_of(config)
        assert shape.num_params() == _numel(AutoModelForCausalLM.from_config(config)), config.model_type
        config.pad_token_id, config.num_labels = 0, 1  # rlcore's reward models and critics: one output
        assert shape.num_params("reward") == _numel(AutoModelForSequenceClassification.from_config(config))
        assert shape.num_params("value") == _numel(AutoModelForTokenClassification.from_config(config))
    assert tiny_llama_shape(64, 2, 4) == dataclasses.replace(TINY, name="tiny-llama-64x2")
    assert shape_of({"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 103}).num_params() == 137_984


def test_the_built_in_shapes_have_their_published_sizes():
    published = {"qwen2.5-0.5b": 494_032_768, "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
                 "qwen2.5-32b": 32_763_876_352, "llama-3-70b": 70_553_706_496}
    assert {name: SHAPES[name].num_params() for name in published} == published
    assert SHAPES["7b"] is SHAPES["llama-2-7b"] and SHAPES["70b"] is SHAPES["llama-3-70b"]


def test_a_from_pretrained_folder_is_read_from_its_config_json(tmp_path):
    config = Qwen2Config(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=72)
    config.save_pretrained(tmp_path)
    assert shape_of(tmp_path) == shape_of(tmp_path / "config.json") == shape_of(config)
    assert shape_of(tmp_path).qkv_bias and not shape_of(tmp_path).attention_bias


@pytest.mark.parametrize("settings", [
    dict(), dict(dtype="bfloat16"), dict(mixed_precision="bf16"), dict(gradient_checkpointing=True),
    dict(use_peft=True, lora_r=8), dict(use_peft=True, lora_r=8, lora_target_modules=("all-linear",))])
def test_the_activation_rules_equal_what_autograd_saves(settings):
    """The bytes of the tensors autograd saves in the chunked log-prob forward (weights excluded), against
    ``saved_activations``: within 4% (measured 1-2.5%)."""
    import peft

    s = PlanSettings(recipe="sft", **settings)
    config = LlamaConfig(vocab_size=103, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=352, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, s.dtype), attn_implementation="sdpa")
    if s.gradient_checkpointing:
        enable_gradient_checkpointing(model)
        model.train()
    if s.use_peft:
        targets = "all-linear" if s.lora_target_modules else None
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0))
    ids = torch.randint(5, 103, (3, 24))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4] = False  # padded, as batches are (sdpa then saves the keys and values repeated to the query heads)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.mixed_precision is not None):
        token_logprobs_from_model(model, ids, mask)
    measured = sum(n for ptr, n in saved.items() if ptr not in weights)
    predicted = saved_activations(shape_of(config), s, tokens=3 * 24, scored=3 * 23)
    assert predicted == pytest.approx(measured, rel=0.04), (measured, predicted)


def test_online_recipes_have_a_kv_cache_and_the_table_renders():
    plan = plan_memory("qwen2.5-0.5b", PlanSettings(recipe="grpo", batch_size=4, num_samples=8, prompt_length=100,
                                                    completion_length=156, dtype="bfloat16"))
    shape = SHAPES["qwen2.5-0.5b"]
    assert plan.bytes["generate"]["KV cache"] == 2 * 24 * 32 * 2 * 64 * 256 * 2  # 2·L·rows·n_kv·d·T·b
    table = plan.table(parse_bytes("24GB"))
    assert "| component | load | generate | score | train | step |" in table and "fits in 22.35 GiB" in table
    assert shape.name in table and "**total**" in table
    ppo = plan_memory(shape, PlanSettings(recipe="ppo", value_model="separate", reward_model=True))
    assert ppo.params == 2 * shape.num_params() + shape.num_params("value") + shape.num_params("reward")
    assert ppo.trainable == shape.num_params() + shape.num_params("value")


def test_recipes_of_the_plan_are_recipes_of_the_table():
    assert set(RECIPE_MODELS) <= set(RECIPES)


@pytest.mark.parametrize("bad, message", [
    (dict(recipe="trpo"), "recipe: expected one of .*'grpo'.*got 'trpo'"),
    (dict(batch_size=0), "batch_size: expected a positive integer, got 0"),
    (dict(dtype="int8"), "dtype: expected one of .*got 'int8'"),
    (dict(strategy="zero3"), "strategy: expected one of \\['none', 'ddp', 'fsdp2'\\], got 'zero3'"),
    (dict(world_size=4, strategy="fsdp2", batch_size=6), "batch_size: expected a multiple of world_size \\(4\\)"),
    (dict(fsdp_cpu_offload=True), "fsdp_cpu_offload: applies to strategy 'fsdp2', got strategy 'none'"),
    (dict(lora_target_modules=("lm_head",)), "lora_target_modules: expected .*got \\['lm_head'\\]"),
    (dict(mixed_precision="bf16", dtype="bfloat16"), "mixed_precision: .*expected dtype 'float32', got 'bfloat16'"),
    (dict(recipe="grpo", num_samples=1), "num_samples: grpo compares .*got 1"),
])
def test_bad_settings_name_the_field_the_expected_and_the_seen(bad, message):
    with pytest.raises(ValueError, match=message):
        PlanSettings(**bad)


def test_bad_shapes_and_sizes_name_the_field():
    with pytest.raises(ValueError, match="model: expected a name of .*got 'gpt-5'"):
        shape_of("gpt-5")
    with pytest.raises(ValueError, match="model_type: expected one of .*got 'gpt2'"):
        shape_of({"model_type": "gpt2", "n_embd": 64})
    with pytest.raises(ValueError, match="missing \\['intermediate_size'\\]"):
        shape_of({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "vocab_size": 10})
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of num_heads \\(4\\), got 3"):
        ModelShape(64, 2, 4, 3, 256, 103)
    with pytest.raises(ValueError, match="hidden_size: expected a positive integer, got 0"):
        ModelShape(0, 2, 4, 4, 256, 103)
    with pytest.raises(ValueError, match="device_memory: expected a size such as 80GB.*got '80XB'"):
        parse_bytes("80XB")
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes(7) == 7
    assert format_bytes(3 * 2**29) == "1.50 GiB" and format_bytes(2**20) == "1.0 MiB" and format_bytes(0) == "0"


def test_fitting_offers_only_settings_that_fit():
    settings = PlanSettings(recipe="grpo", dtype="bfloat16", world_size=8, batch_size=8, prompt_length=512,
                            completion_length=1536)
    memory = parse_bytes("80GB")
    assert not plan_memory("llama-3-8b", settings).fits(memory)
    found = fitting("llama-3-8b", settings, memory)
    assert found and all(plan.fits(memory) for _, plan in found)
    assert [len(changes) for changes, _ in found] == sorted(len(changes) for changes, _ in found)
    assert all(changes for changes, _ in found)


def test_the_command_prints_the_table(capsys, tmp_path):
    assert cli.main(["plan", "grpo", "--model", "llama-3-8b", "--world-size", "8", "--strategy", "fsdp2",
                     "--dtype", "bfloat16", "--gradient-checkpointing", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "| component | load | generate | score | train | step |" in out and "fits in 74.51 GiB" in out
    assert cli.main(["plan", "sft", "--hidden_size", "64", "--num_layers", "2", "--num_heads", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["vocab_size"] == 103 and plan["peak"] == plan_memory(TINY, PlanSettings(recipe="sft")).peak
    Qwen2Config(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=72).save_pretrained(tmp_path)
    assert cli.main(["plan", "dpo", "--model", str(tmp_path), "--device-memory", "1MB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit in 1.0 MiB" in out and "No nearby settings fit" in out
    assert cli.main(["plan", "grpo", "--model", "7b", "--world-size", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "Settings that fit in 74.51 GiB" in out and "| strategy=fsdp2 |" in out
    assert cli.main(["plan", "grpo", "--model", "70b", "--world-size", "8", "--strategy", "fsdp2", "--dtype", "bfloat16",
                     "--gradient-checkpointing", "--no-sharded-load", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out  # each rank builds the policy whole before sharding it: 131 GiB at load
    assert "Peak: 131.42 GiB per rank (load)" in out and "Loaded sharded from a from_pretrained folder" in out
    assert "| fsdp_cpu_offload=True |" in out
    # the text settings whose default is None are read as text
    assert cli.main(["plan", "dpo", "--model", "0.5b", "--world-size", "4", "--strategy", "fsdp2", "--fsdp-param-dtype",
                     "bfloat16", "--ref-device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["fsdp_param_dtype"] == "bfloat16" and plan["settings"]["ref_device"] == "cpu"
    assert plan["host"] > 0


def test_the_command_reports_a_bad_setting_in_one_line(capsys):
    assert cli.main(["plan", "grpo", "--batch-size", "0"], report=True) == 2
    err = capsys.readouterr().err
    assert "rlcore plan grpo: error: batch_size: expected a positive integer, got 0" in err
    assert cli.main(["plan", "grpo", "--model", "nope"], report=True) == 2
    assert "model: expected a name of" in capsys.readouterr().err
