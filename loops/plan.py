"""The memory model: per-rank peak memory of a recipe's run, from the model's shape and the run's settings.

``plan_memory(shape, PlanSettings(recipe="grpo", world_size=8, strategy="fsdp2"))`` returns a
:class:`MemoryPlan`: bytes per rank for each **component** (parameters, frozen copies, gradients,
optimiser state, activations, logits, KV cache, the FSDP2 all-gather, a stated overhead) in each
**phase** of a step (``load``, ``generate``, ``score``, ``train``, ``step``), its peak, whether it
fits a device (``plan.fits(80 * 10**9)``) and a markdown table (``plan.table()``). ``fitting``
tries the settings that trade memory (gradient checkpointing, smaller micro-batches, FSDP2, CPU
offload, LoRA) and returns those that fit. ``rlcore plan RECIPE --model ...`` prints both.

Everything here is arithmetic on two frozen dataclasses: no model is built, nothing is imported
beyond the standard library (a tiny-llama shape reads the character tokenizer's size).

What is modelled, as the code runs (each term names the code it follows):

- **Shapes**: the Llama family's decoder (Llama, Mistral, Qwen2, Qwen3): per block ``q, k, v, o``
  (``H·n_h·d``, ``H·n_kv·d`` twice, ``n_h·d·H``; biases on ``q, k, v`` for Qwen2, on all four with
  Llama's ``attention_bias``), a gated MLP ``3·H·I`` (biases with ``mlp_bias``), two RMSNorm scales ``2H`` (Qwen3: ``2d`` more for
  its q/k norms); the root: embeddings ``V·H``, a final norm ``H``, an LM head ``V·H`` unless tied. A
  reward model or a separate critic has a one-output score head instead of the LM head.
- **Models on a rank**: the policy; a reference (GRPO, RLOO, PPO, DPO, online DPO) as a full frozen
  copy (``loops.models.make_reference``), none under LoRA (the adapter disabled); PPO's critic
  (``shared``: a ``ValueHead`` of ``H + 1``; ``separate``: a trained classifier of the policy's shape);
  a reward model (frozen, of the policy's shape) when ``reward_model``.
- **Precision**: weights, gradients and AdamW's two moments in the weights' ``dtype`` (torch's AdamW
  keeps its state in the parameter's dtype: float32 weights give float32 state, bfloat16 weights
  bfloat16 state); a LoRA adapter in float32 (peft's default); ``mixed_precision="bf16"`` keeps
  float32 weights and runs the forward under autocast, which saves a bfloat16 copy of every block
  weight for the backward.
- **Sharding** (``strategy="fsdp2"``, ``loops.recipe.shard_models``): parameters, gradients and
  optimiser state divided by the world size; the root (embeddings, final norm, head) held whole
  after a forward (``loops.dist``: for the policy until its backward ends, or its next no-grad
  scoring pass ends; for a frozen model while it scores, ``loops.dist.release_gathered``); two
  blocks gathered at a time in a forward (the one running and the last one's gather) and in a
  backward with ``fsdp_backward_prefetch`` (the one running and the next; without it, the default
  on a CPU, one), all of them from forward to backward with ``fsdp_reshard_after_forward=False``;
  during the backward the roots' and one block's unsharded gradients and one flat reduce-scatter input of the
  largest group (under LoRA only the adapter has gradients: sharded with its block, counted whole). ``fsdp_param_dtype`` gathers and runs the blocks and roots in that dtype (the
  activations, the KV cache and the unsharded gradients too), the shards and AdamW staying in
  ``dtype`` and the reduce-scatter input in float32. ``fsdp_cpu_offload`` keeps the shards, their
  gradients and the optimiser state (and its step) in host memory (:attr:`MemoryPlan.host`).
  ``strategy="none"`` on several ranks adds ``update``'s flat all-reduce bucket (``2**25`` elements);
  ``strategy="ddp"`` adds, at the end of the backward, the buckets' copy of every trained gradient.
- **Load** (``loops.recipe.build_policy``, ``build_reference``, ``shard_models``): under FSDP2 a policy
  from a ``from_pretrained`` folder (safetensors; a LoRA policy's base too) is built on the meta device and
  each rank reads only its rows (``sharded_load=True``, the default); one built from a config (the
  tiny models) or loaded otherwise is built whole on every rank, then sharded (``sharded_load=False``).
  The reference is built on the meta device and filled with each rank's rows of the policy; a reward
  model and a separate critic are built whole beside those shards, then sharded. The ``load`` phase
  is the largest of these moments.
- **Activations** of one micro-batch (``rows × (prompt_length + completion_length)`` tokens) as
  autograd saves them on transformers' sdpa path (measured with ``saved_tensors_hooks``, see
  ``tests/loops/test_plan.py``): per block and token, each RMSNorm its float32 input ``4H`` bytes, its
  normalised input ``b·H`` when its scale trains, its output ``a·H`` when a linear after it trains
  (``b`` the weights' bytes, ``a`` the compute dtype's); attention ``4H·a`` (query, keys and values
  repeated to the query heads, output: sdpa with a padding mask; without padding its grouped-query
  mode keeps keys and values at ``n_kv·d``) plus ``4·n_h`` (log-sum-exp), ``6H`` more under autocast (the
  rotary embedding in float32); the MLP ``3I·a`` (gate, its SiLU, up) plus ``I·a`` when ``down``
  trains; a LoRA target ``r·a`` (and its dropped-out input ``(a + 1)·in`` with ``lora_dropout``). Frozen
  weights save nothing for themselves. After the blocks, per token: the final norm ``4H (+ b·H)``, and
  per scored token the gathered hidden state ``b·H``. Gradient checkpointing keeps each block's input
  (``b·H`` per token) and recomputes one block during the backward. The backward's own working set:
  ``(3I + 2H)·a`` per token (a block's largest activation gradients). With one micro-batch per
  optimiser step the gradients appear as the activations are freed, so the ``train`` phase holds
  the larger of the two; with several, the gradients of the earlier micro-batches stay beside the
  activations (their sum).
- **Logits** (``rlcore.lm_head.hidden_logprobs``): the ``[N, V]`` logits never exist; blocks of
  ``rows × 4096`` float32 logits of ``32 MiB`` (on a CPU; ``16×`` that on an accelerator), two live
  at once, and in the backward a float32 ``[N, H]`` hidden gradient and, when the head trains, a
  float32 ``[V, H]`` weight gradient (plus its cast to the weights' dtype).
- **KV cache** (online recipes, ``loops.engines``): preallocated for ``generation_batch_size`` rows
  (default the rank's ``prompts × num_samples``) at ``prompt_length + completion_length`` positions:
  ``2·L·rows·n_kv·d·T·b``; the prefill and each decode step add one block's no-grad working set
  ``(6H + 3I)·b`` per token and ``rows × V`` logits (in the weights' dtype and two float32 copies).
- **Scoring** (no grad): ``forward_batch_size`` rows (default all) through one block at a time, the
  trunk's output ``b·H`` per token and two head blocks.
- **Optimiser step**: the gradients, the state, and AdamW's temporaries: on an accelerator torch's
  ``foreach`` implementation (one state-sized buffer, ``√v`` of every parameter at once), on a CPU
  its per-parameter loop (two buffers of the largest parameter).

Not modelled: the CUDA context and NCCL's buffers (add them as ``overhead``), the caching
allocator's fragmentation, checkpoint saving, quantised weights, packing (``padding_free``), the
vLLM engine, the ReFT and DDPO recipes, tokens whose prompt and completion are shorter than the
stated lengths (the plan is for the longest rows). On a CPU, glibc's heap keeps freed memory that
a later tensor of another size cannot reuse; ``benchmarks/plan_check.py`` measures with
``MALLOC_MMAP_THRESHOLD_`` set so that the resident set follows the live tensors (docs/scale.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "SHAPES", "shape_of", "tiny_llama_shape", "PlanSettings", "RECIPE_MODELS", "COMPONENTS",
           "MemoryPlan", "plan_memory", "saved_activations", "fitting", "parse_bytes", "format_bytes", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPONENTS = ("parameters", "frozen copies", "gradients", "optimiser state", "activations", "logits", "KV cache",
              "FSDP2 all-gather", "overhead")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_DEFAULT = ("q_proj", "v_proj")  # peft's default targets for the Llama family
_FAMILY = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}
_BLOCK_BYTES, _GPU_SCALE, _VOCAB_CHUNK = 32 * 2**20, 16, 4096  # rlcore.logprobs' / rlcore.lm_head's
_BUCKET = 2**25  # loops.dist.sync's flat all-reduce bucket, in elements


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's sizes (the public numbers of its ``config.json``)."""

    hidden_size: int          # H
    num_layers: int           # L
    num_heads: int            # n_h
    num_kv_heads: int         # n_kv (grouped-query attention when < n_h)
    intermediate_size: int    # I, the gated MLP's width
    vocab_size: int           # V
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # d; None: H / n_h
    attention_bias: bool = False  # biases on q, k, v and o (Llama's attention_bias)
    qkv_bias: bool = False    # biases on q, k, v only (Qwen2)
    mlp_bias: bool = False    # biases on the MLP's three linears (Llama's mlp_bias)
    qk_norm: bool = False     # RMSNorm on queries and keys (Qwen3)
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            _positive(f, getattr(self, f))
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: expected a multiple of num_heads ({self.num_heads}) when head_dim is not "
                             f"given, got {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads ({self.num_heads}), got {self.num_kv_heads}")

    @property
    def dim(self) -> int:
        """``d``, the width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_heads

    def linears(self) -> dict[str, tuple[int, int]]:
        """``module -> (in, out)`` of one block's linear layers."""
        H, I, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.dim, self.num_kv_heads * self.dim
        return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def block_params(self) -> int:
        """Parameters of one decoder block."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.dim
        bias = (qkv if self.attention_bias or self.qkv_bias else 0) + (self.hidden_size if self.attention_bias else 0)
        bias += 2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0
        norms = 2 * self.hidden_size + (2 * self.dim if self.qk_norm else 0)
        return sum(i * o for i, o in self.linears().values()) + bias + norms

    def root_params(self, task: str = "causal_lm") -> int:
        """Parameters outside the blocks: embeddings, final norm and the head (``task``: ``causal_lm``, an LM
        head unless tied; ``reward``, a bias-free score; ``value``, a score with a bias)."""
        V, H = self.vocab_size, self.hidden_size
        head = {"causal_lm": 0 if self.tie_word_embeddings else V * H, "reward": H, "value": H + 1}[task]
        return V * H + H + head

    def num_params(self, task: str = "causal_lm") -> int:
        """All parameters, a tied embedding counted once (``sum(p.numel() for p in model.parameters())``)."""
        return self.num_layers * self.block_params() + self.root_params(task)


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: expected a positive integer, got {value!r}")


# public configs of released models, written out (nothing is downloaded)
SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape(896, 24, 14, 2, 4864, 151936, tie_word_embeddings=True, qkv_bias=True, name="qwen2.5-0.5b"),
    ModelShape(4096, 32, 32, 32, 11008, 32000, name="llama-2-7b"),
    ModelShape(4096, 32, 32, 8, 14336, 128256, name="llama-3-8b"),
    ModelShape(5120, 64, 40, 8, 27648, 152064, qkv_bias=True, name="qwen2.5-32b"),
    ModelShape(8192, 80, 64, 8, 28672, 128256, name="llama-3-70b"),
]}
SHAPES.update({"7b": SHAPES["llama-2-7b"], "8b": SHAPES["llama-3-8b"], "32b": SHAPES["qwen2.5-32b"],
               "70b": SHAPES["llama-3-70b"], "0.5b": SHAPES["qwen2.5-0.5b"]})


def tiny_llama_shape(hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     vocab_size: int | None = None) -> ModelShape:
    """rlcore's ``tiny-llama`` (``loops.models.build_model``): ``I = 4H``, as many key/value heads as heads, the
    embedding tied to the head; ``vocab_size`` None: the character tokenizer's."""
    if vocab_size is None:
        from rlcore.loops.models import build_tokenizer

        vocab_size = len(build_tokenizer())
    return ModelShape(hidden_size, num_layers, num_heads, num_heads, 4 * hidden_size, vocab_size,
                      tie_word_embeddings=True, name=f"tiny-llama-{hidden_size}x{num_layers}")


def shape_of(model: Any) -> ModelShape:
    """A :class:`ModelShape` from a name of :data:`SHAPES`, a ``from_pretrained`` folder (its ``config.json``)
    or that file, a ``transformers`` config, a mapping of ``config.json``'s fields, or rlcore's tiny-llama
    fields (``hidden_size``, ``num_layers``, ``num_heads``, optional ``vocab_size``)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (str, Path)):
        key = str(model).lower()
        if key in SHAPES:
            return SHAPES[key]
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"model: expected a name of {sorted(SHAPES)}, a from_pretrained folder or its config.json, "
                             f"got {str(model)!r} (no such file)")
        return _from_fields(json.loads(path.read_text()), where=str(path))
    if isinstance(model, Mapping):
        return _from_fields(dict(model), where="model")
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        return _from_fields(model.to_dict(), where=type(model).__name__)
    raise ValueError(f"model: expected a shape name, a path, a transformers config or a mapping, got {type(model).__name__}")


def _from_fields(fields: dict[str, Any], *, where: str) -> ModelShape:
    if "num_layers" in fields and "num_hidden_layers" not in fields:  # rlcore's tiny-llama settings
        return tiny_llama_shape(fields.get("hidden_size", 64), fields["num_layers"], fields.get("num_heads", 4),
                                fields.get("vocab_size"))
    kind = fields.get("model_type", "llama")
    if kind not in _FAMILY:
        raise ValueError(f"{where}: model_type: expected one of {sorted(_FAMILY)} (the Llama-family decoder this model "
                         f"counts), got {kind!r}")
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if fields.get(k) is None]
    if missing:
        raise ValueError(f"{where}: expected the fields {list(need)}, missing {missing}")
    return ModelShape(fields["hidden_size"], fields["num_hidden_layers"], fields["num_attention_heads"],
                      fields.get("num_key_value_heads") or fields["num_attention_heads"], fields["intermediate_size"],
                      fields["vocab_size"], tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
                      head_dim=fields.get("head_dim"),
                      attention_bias=bool(fields.get("attention_bias", False)), mlp_bias=bool(fields.get("mlp_bias", False)),
                      qkv_bias=_FAMILY[kind].get("qkv_bias", False), qk_norm=_FAMILY[kind].get("qk_norm", False),
                      name=fields.get("_name_or_path") or kind)


@dataclasses.dataclass(frozen=True)
class RecipeModels:
    """What a recipe holds and how its batch becomes rows (``loops.recipes``)."""

    online: bool          # generates its rollouts (a KV cache, a generate and a score phase)
    reference: bool       # loads a frozen reference copy (none under LoRA)
    pairs: bool           # a training row is a pair: two sequences per item
    task: str = "causal_lm"


RECIPE_MODELS: dict[str, RecipeModels] = {
    "sft": RecipeModels(online=False, reference=False, pairs=False),
    "reward": RecipeModels(online=False, reference=False, pairs=True, task="reward"),
    "dpo": RecipeModels(online=False, reference=True, pairs=True),
    "grpo": RecipeModels(online=True, reference=True, pairs=False),
    "rloo": RecipeModels(online=True, reference=True, pairs=False),
    "ppo": RecipeModels(online=True, reference=True, pairs=False),
    "online_dpo": RecipeModels(online=True, reference=True, pairs=True),
}


def _setting(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """A run's settings, named as the recipes' ``Config`` fields where they exist."""

    recipe: str = _setting("grpo", "a recipe of RECIPE_MODELS (sft, reward, dpo, grpo, rloo, ppo, online_dpo)")
    dtype: str = _setting("float32", "the weights' dtype, and so the gradients' and AdamW's: float32 | bfloat16 | float16")
    mixed_precision: str | None = _setting(None, "bf16: the forward under autocast over float32 weights")
    use_peft: bool = _setting(False, "LoRA: only the adapter (float32) trains; the reference is the base, no copy")
    lora_r: int = _setting(16, "LoRA rank")
    lora_target_modules: tuple[str, ...] | None = _setting(None, "LoRA targets: names of a block's linears, or "
                                                                 "all-linear; None: q_proj, v_proj (peft's default)")
    lora_dropout: float = _setting(0.0, "LoRA dropout (the RL recipes turn dropout off)")
    gradient_checkpointing: bool = _setting(False, "recompute each block in the backward")
    batch_size: int = _setting(8, "items per step, all ranks together: prompts (online), pairs (dpo, reward), "
                                  "sequences (sft)")
    micro_batch_size: int | None = _setting(None, "rows of one rank per forward and backward (pairs for dpo, reward, "
                                                  "online_dpo); None: all of the rank's rows")
    num_samples: int = _setting(8, "completions per prompt (online recipes)")
    prompt_length: int = _setting(256, "prompt tokens per row (the longest)")
    completion_length: int = _setting(256, "completion tokens per row: max_new_tokens online, the scored part offline")
    generation_batch_size: int | None = _setting(None, "rows per generation call on a rank; None: all")
    forward_batch_size: int | None = _setting(None, "rows per no-grad scoring forward on a rank; None: all")
    world_size: int = _setting(1, "ranks")
    strategy: str = _setting("none", "none: each rank holds each model whole | ddp: whole, the gradients sent in "
                                     "buckets during the backward (a copy of them) | fsdp2: sharded over the ranks")
    fsdp_cpu_offload: bool = _setting(False, "fsdp2: shards, their gradients and AdamW's state in host memory")
    fsdp_reshard_after_forward: bool = _setting(True, "fsdp2: free each gathered block after its forward")
    fsdp_backward_prefetch: bool | None = _setting(None, "fsdp2: gather the block the backward reaches next while it "
                                                         "runs this one; None: on for cuda, off for cpu")
    fsdp_param_dtype: str | None = _setting(None, "fsdp2: the dtype blocks are gathered and run in (bfloat16 | "
                                                  "float16); shards and AdamW stay in dtype, gradients reduced in "
                                                  "float32; None: dtype")
    reference: bool | None = _setting(None, "a frozen reference copy; None: as the recipe loads one (False: none, as "
                                            "with DPO's precompute_ref)")
    value_model: str = _setting("shared", "PPO's critic: shared (a value head) | separate (a model of the policy's shape)")
    reward_model: bool = _setting(False, "a frozen reward model of the policy's shape")
    device: str = _setting("cuda", "cuda | cpu: the logits' block size and AdamW's implementation")
    ref_device: str | None = _setting(None, "the reference's device: None: with the policy (sharded under fsdp2); "
                                            "device: whole there on every rank; another (cpu beside cuda): in host "
                                            "memory")
    reward_device: str | None = _setting(None, "the reward model's device, as ref_device")
    sharded_load: bool = _setting(True, "fsdp2: the policy is read sharded from a from_pretrained folder; False: "
                                        "built whole on every rank, then sharded (a model built from a config)")
    overhead: int = _setting(0, "bytes per rank outside the tensors (CUDA context, NCCL, the process's own)")

    def __post_init__(self) -> None:
        _choice("recipe", self.recipe, RECIPE_MODELS)
        _choice("dtype", self.dtype, DTYPE_BYTES)
        _choice("mixed_precision", self.mixed_precision, (None, "bf16"))
        _choice("fsdp_param_dtype", self.fsdp_param_dtype, (None, "bfloat16", "float16"))
        _choice("strategy", self.strategy, ("none", "ddp", "fsdp2"))
        _choice("value_model", self.value_model, ("shared", "separate"))
        _choice("device", self.device, ("cuda", "cpu"))
        _choice("ref_device", self.ref_device, (None, "cuda", "cpu"))
        _choice("reward_device", self.reward_device, (None, "cuda", "cpu"))
        for f in ("lora_r", "batch_size", "num_samples", "prompt_length", "completion_length", "world_size"):
            _positive(f, getattr(self, f))
        for f in ("micro_batch_size", "generation_batch_size", "forward_batch_size"):
            if getattr(self, f) is not None:
                _positive(f, getattr(self, f))
        if isinstance(self.overhead, bool) or not isinstance(self.overhead, int) or self.overhead < 0:
            raise ValueError(f"overhead: expected a number of bytes >= 0, got {self.overhead!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout: expected a float in [0, 1), got {self.lora_dropout!r}")
        targets = self.lora_target_modules
        if targets is not None and tuple(targets) != ("all-linear",) and not set(targets) <= set(LORA_MODULES):
            raise ValueError(f"lora_target_modules: expected ['all-linear'] or names of {list(LORA_MODULES)}, "
                             f"got {list(targets)}")
        if self.mixed_precision and self.dtype != "float32":
            raise ValueError(f"mixed_precision: autocast runs over float32 weights; expected dtype 'float32', "
                             f"got {self.dtype!r}")
        if self.strategy == "fsdp2" and self.world_size > 1 and self.batch_size % self.world_size:
            raise ValueError(f"batch_size: expected a multiple of world_size ({self.world_size}) under fsdp2, "
                             f"got {self.batch_size}")
        if not (self.fsdp_backward_prefetch is None or isinstance(self.fsdp_backward_prefetch, bool)):
            raise ValueError(f"fsdp_backward_prefetch: expected true, false or None, got {self.fsdp_backward_prefetch!r}")
        if self.fsdp_cpu_offload and self.strategy != "fsdp2":
            raise ValueError(f"fsdp_cpu_offload: applies to strategy 'fsdp2', got strategy {self.strategy!r}")
        if self.recipe in ("grpo", "rloo") and self.num_samples < 2:
            raise ValueError(f"num_samples: {self.recipe} compares the samples of a prompt; expected >= 2, "
                             f"got {self.num_samples}")


def _choice(field: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
        raise ValueError(f"{field}: expected one of {list(allowed)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank, by phase and component (``bytes[phase][component]``), for one shape and settings."""

    shape: ModelShape
    settings: PlanSettings
    bytes: Mapping[str, Mapping[str, int]]
    host: int                 # bytes per rank in host memory (the shards under fsdp_cpu_offload)
    params: int               # parameters of the models on a rank, unsharded (policy, reference, critic, reward)
    trainable: int            # parameters that train

    def total(self, phase: str) -> int:
        return sum(self.bytes[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.bytes, key=self.total)

    @property
    def peak(self) -> int:
        """The largest phase's bytes: the device memory a rank needs."""
        return self.total(self.peak_phase)

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory

    def table(self, device_memory: int | None = None) -> str:
        """The plan as markdown: one row per component, one column per phase, the totals, the peak."""
        s, phases = self.settings, list(self.bytes)
        lines = [f"{s.recipe}, {self.shape.name or 'model'} ({self.params / 1e9:.3g}B parameters on a rank unsharded, "
                 f"{self.trainable / 1e9:.3g}B trained), {s.dtype}{', autocast bf16' if s.mixed_precision else ''}, "
                 f"{'LoRA r=' + str(s.lora_r) if s.use_peft else 'full parameters'}, "
                 f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, {s.world_size} rank(s), "
                 f"strategy {s.strategy}{' + CPU offload' if s.fsdp_cpu_offload else ''}"
                 f"{', gathered in ' + s.fsdp_param_dtype if s.fsdp_param_dtype and s.strategy == 'fsdp2' else ''}; "
                 "per rank:",
                 "", "| component | " + " | ".join(phases) + " |", "| --- |" + " ---: |" * len(phases)]
        for c in COMPONENTS:
            if any(self.bytes[p][c] for p in phases):
                lines.append(f"| {c} | " + " | ".join(format_bytes(self.bytes[p][c]) for p in phases) + " |")
        lines.append("| **total** | " + " | ".join(f"**{format_bytes(self.total(p))}**" for p in phases) + " |")
        lines.append("")
        lines.append(f"Peak: {format_bytes(self.peak)} per rank ({self.peak_phase})"
                     + (f"; host memory per rank: {format_bytes(self.host)}" if self.host else "")
                     + ("" if device_memory is None else
                        f"; {'fits' if self.fits(device_memory) else 'does NOT fit'} in {format_bytes(device_memory)}"))
        return "\n".join(lines)


def _targets(s: PlanSettings) -> tuple[str, ...]:
    if s.lora_target_modules is None:
        return _LORA_DEFAULT
    return LORA_MODULES if tuple(s.lora_target_modules) == ("all-linear",) else tuple(s.lora_target_modules)


def _run_bytes(s: PlanSettings) -> int:
    """Bytes of the weights a forward runs with: ``fsdp_param_dtype``'s when a sharded run sets it, else ``dtype``'s."""
    sharded = s.strategy == "fsdp2" and s.world_size > 1
    return DTYPE_BYTES[s.fsdp_param_dtype] if sharded and s.fsdp_param_dtype else DTYPE_BYTES[s.dtype]


def _block_activations(shape: ModelShape, s: PlanSettings) -> float:
    """Bytes autograd saves per token in one block of a trained model (the rules of the module docstring)."""
    H, I, b = shape.hidden_size, shape.intermediate_size, _run_bytes(s)
    autocast = s.mixed_precision is not None and b == 4
    a, lora = (2 if s.mixed_precision else b), s.use_peft
    trains = set(_targets(s)) if lora else set(LORA_MODULES)
    norms = 2 * 4 * H + (0 if lora else 2 * b * H)                       # float32 inputs, normalised inputs
    norms += a * H * (bool(trains & {"q_proj", "k_proj", "v_proj"}) + bool(trains & {"gate_proj", "up_proj"}))
    attention = 4 * H * a + 4 * shape.num_heads + (6 * H if autocast else 0)
    mlp = 3 * I * a + (I * a if "down_proj" in trains else 0)
    dims = shape.linears()
    adapters = sum(s.lora_r * a + (dims[t][0] * (a + 1) if s.lora_dropout else 0) for t in trains) if lora else 0
    return norms + attention + mlp + adapters


def saved_activations(shape: Any, settings: PlanSettings, *, tokens: int, scored: int) -> int:
    """Bytes autograd saves in one forward of the policy over ``tokens`` tokens, ``scored`` of them read by the LM
    head (``loops.score``'s chunked path), weights excluded: what ``saved_tensors_hooks`` sees.

    ``L·tokens·s_block + tokens·(4H + b·H) + scored·b·H`` (``s_block`` the per-token rules of the module docstring;
    under LoRA no ``4H + b·H``: the final norm's scale is frozen and the first block's input needs no gradient,
    so one norm input fewer is saved); with gradient checkpointing ``L·tokens·b·H`` (each block's input)
    instead of the blocks' saves, one block recomputed in the backward on top (:func:`plan_memory` adds it);
    under autocast over float32 weights the bfloat16 copies of the block weights on top.
    """
    shape = shape_of(shape)
    H, L, b = shape.hidden_size, shape.num_layers, _run_bytes(settings)
    blocks = tokens * L * (b * H if settings.gradient_checkpointing else _block_activations(shape, settings))
    outside = tokens * (0 if settings.use_peft else 4 * H + b * H) + scored * b * H
    weights = L * shape.block_params() * 2 if settings.mixed_precision and b == 4 else 0
    return round(blocks + outside + weights)


def _rows(s: PlanSettings, m: RecipeModels) -> dict[str, int]:
    """Rows on one rank: items of the batch, rollout rows, rows per micro-batch forward, generation, scoring."""
    W = s.world_size
    items = math.ceil(s.batch_size / W)
    rollout = items * s.num_samples if m.online else items
    if s.recipe == "online_dpo":
        train_items = items  # one pair (best against worst) per prompt
    else:
        train_items = rollout
    micro = min(s.micro_batch_size or train_items, train_items)
    forward = micro * (2 if m.pairs else 1)
    return {"items": items, "rollout": rollout, "train_items": train_items, "micro": micro, "forward": forward,
            "generate": min(s.generation_batch_size or rollout, rollout) if m.online else 0,
            "score": min(s.forward_batch_size or rollout, rollout) * (2 if m.pairs and not m.online else 1)}


def backward_prefetch(setting: bool | None, device: str) -> bool:
    """``fsdp_backward_prefetch`` as a run reads it (``loops.recipe``, and the plan): ``None`` is on
    unless ``device`` is a CPU, where gloo's all-gather is synchronous and a prefetch only holds memory."""
    return device.split(":")[0] != "cpu" if setting is None else setting


def plan_memory(shape: Any, settings: PlanSettings | None = None) -> MemoryPlan:
    """Per-rank memory of a recipe's step, by phase and component, for a model shape and run settings.

    ``peak = max over phases Σ components``, each term as the module docstring states (and follows the
    code it names). The phases: ``load`` (models built whole, then sharded), ``generate`` (online
    recipes: the KV cache), ``score`` (no-grad forwards: reference and old log-probs), ``train`` (the
    forward and backward of one micro-batch), ``step`` (gradients, clipping, AdamW). The resident terms
    (parameters, frozen copies, optimiser state) are those of a step after the first, when AdamW's
    state exists.

    Args:
        shape: a :class:`ModelShape` or anything :func:`shape_of` reads (a name, a folder, a config).
        settings: the run's :class:`PlanSettings` (default: GRPO's defaults in float32 on one rank).
    Returns:
        A :class:`MemoryPlan`; ``plan.peak`` bytes, ``plan.table()`` markdown.

    >>> plan = plan_memory("llama-3-8b", PlanSettings(recipe="sft", dtype="bfloat16", world_size=8,
    ...                                                strategy="fsdp2", gradient_checkpointing=True))
    >>> plan.peak_phase, round(plan.peak / 2**30, 1)  # GiB
    ('train', 14.7)
    >>> built = plan_memory("llama-3-8b", dataclasses.replace(plan.settings, sharded_load=False))
    >>> built.peak_phase, round(built.peak / 2**30, 1)  # the policy whole on every rank before sharding
    ('load', 15.0)
    """
    shape, s = shape_of(shape), settings or PlanSettings()
    m = RECIPE_MODELS[s.recipe]
    H, L, V, I = shape.hidden_size, shape.num_layers, shape.vocab_size, shape.intermediate_size
    W, lora, block = s.world_size, s.use_peft, shape.block_params()
    sharded = s.strategy == "fsdp2" and W > 1  # one process: shard_models leaves the models whole
    offload = sharded and s.fsdp_cpu_offload
    b, g = DTYPE_BYTES[s.dtype], _run_bytes(s)  # the weights' (shards', AdamW's) bytes; those a forward runs with
    a = 2 if s.mixed_precision else g           # the activations' compute dtype
    rows = _rows(s, m)
    T = s.prompt_length + s.completion_length

    # the models on a rank, each as its parameters outside the blocks: the trained ones, then the frozen ones
    own = [shape.root_params(m.task)] + ([shape.root_params("value")] if s.recipe == "ppo" and s.value_model == "separate"
                                         else [])
    has_ref = (m.reference if s.reference is None else s.reference) and not lora  # LoRA: the adapter switched off
    # the frozen models by where they sit: with the policy (sharded under fsdp2), whole on the device, in host memory
    frozen_by: dict[str | None, list[int]] = {None: [], s.device: [], "host": []}
    for present, placed, task in ((has_ref, s.ref_device, "causal_lm"), (s.reward_model, s.reward_device, "reward")):
        if present:
            frozen_by[placed if placed in (None, s.device) else "host"].append(shape.root_params(task))
    frozen_roots = [r for where in frozen_by.values() for r in where]
    adapter = L * sum(s.lora_r * (i + o) for t, (i, o) in shape.linears().items() if t in _targets(s)) if lora else 0
    value_head = H + 1 if s.recipe == "ppo" and s.value_model == "shared" else 0  # stays whole beside the shards
    params = sum(L * block + r for r in own + frozen_roots) + adapter + value_head
    trainable = (adapter if lora else L * block + own[0]) + sum(L * block + r for r in own[1:]) + value_head
    trained_bytes = (adapter * 4 if lora else (L * block + own[0]) * b) + sum((L * block + r) * b for r in own[1:]) \
        + value_head * b  # a LoRA adapter trains in float32
    head_trains = m.task == "causal_lm" and not lora

    def share(n: float) -> float:  # what one rank keeps of n sharded bytes
        return n / W if sharded else n

    def on_device(root: int, gathered: bool) -> float:  # a model's parameters; the root whole once gathered
        return (0.0 if offload else share((L * block + root) * b)) + (root * g if sharded and gathered else 0)

    extra = adapter * 4 + value_head * b
    params_in_use = sum(on_device(r, True) for r in own) + extra
    params_in_step = sum(on_device(r, False) for r in own) + extra
    # a sharded frozen model's root is whole only while it scores (loops.dist.release_gathered after each pass)
    frozen = sum(on_device(r, False) for r in frozen_by[None]) + sum((L * block + r) * b for r in frozen_by[s.device])
    scoring_root = max(frozen_by[None], default=0) * g if sharded else 0
    frozen_host = sum((L * block + r) * b for r in frozen_by["host"])
    optimiser = 0.0 if offload else share(2 * trained_bytes)

    # gradients: whole, or shards plus (during the backward) the roots' and a block's unsharded gradients (in the
    # gathered dtype) and one flat reduce-scatter input of the largest group (float32 with fsdp_param_dtype)
    grads = 0.0 if offload else share(trained_bytes)
    unsharded = 0 if lora else (sum(own) + block) * g + max(own[0], block) * (4 if s.fsdp_param_dtype else g)
    grads_backward = grads + (unsharded if sharded else 0)
    head_grad = V * H * g if head_trains else 0  # the LM head's, the first the backward makes
    bucket = min(trained_bytes, _BUCKET * (4 if lora else b)) if s.strategy == "none" and W > 1 else 0
    if offload:
        step_temp = 0.0  # the step runs on the host
    elif s.device == "cuda":
        step_temp = share(trained_bytes)  # foreach: one state-sized buffer
    else:
        largest = max(s.lora_r * max(shape.linears()[t]) for t in _targets(s)) * 4 if lora else max(V * H, H * I) * b
        step_temp = 2 * share(largest)

    # activations of one micro-batch of each trained model (the policy, a separate critic)
    tokens = rows["forward"] * T
    scored = rows["forward"] * (1 if m.task == "reward" else s.completion_length)  # a reward model reads one state
    per_block = tokens * _block_activations(shape, s)
    saved = saved_activations(shape, s, tokens=tokens, scored=scored) + tokens * (3 * I + 2 * H) * a \
        + (per_block if s.gradient_checkpointing else 0)  # the backward's working set, a recomputed block
    activations, last_block = saved * len(own), per_block * len(own)

    # the LM head: two float32 blocks of logits; in the backward float32 hidden and weight gradients
    budget = _BLOCK_BYTES * (_GPU_SCALE if s.device == "cuda" else 1)

    def head_blocks(n: int) -> float:
        rows_per_block = max(1, budget // (4 * _VOCAB_CHUNK))
        return 2 * min(n, rows_per_block) * min(_VOCAB_CHUNK, V) * 4 if m.task == "causal_lm" else 0

    logits = head_blocks(scored) + (scored * H * (4 + (a if a != 4 else 0)) if m.task == "causal_lm" else 0)
    logits += V * H * (4 + (g if g != 4 else 0)) if head_trains else 0

    gathered = 2 * block * g if sharded else 0  # a forward: the block running and the last one's gather
    prefetch = backward_prefetch(s.fsdp_backward_prefetch, s.device)
    gathered_train = L * block * g if sharded and not s.fsdp_reshard_after_forward \
        else (gathered if prefetch else block * g if sharded else 0)  # a backward: its block (and the next)
    work = (6 * H + 3 * I) * g  # one block's no-grad working set per token
    phases: dict[str, dict[str, float]] = {}
    if sharded:
        # the policy read sharded or built whole and sharded (by build_reference when there is a sharded
        # reference: its copy is built on the meta device and filled with each rank's rows; a reference placed
        # on the device is a whole copy); a reward model and a separate critic built whole beside those shards,
        # then sharded (a reward model placed in host memory: none on the device)
        policy = (L * block + own[0]) * b
        ref_sharded, ref_whole = has_ref and s.ref_device is None, has_ref and s.ref_device == s.device
        first = policy / W if s.sharded_load else policy
        later = (policy / W if s.sharded_load or ref_sharded else policy) + (policy / W if ref_sharded else 0) \
            + ((L * block + shape.root_params("causal_lm")) * b if ref_whole else 0) \
            + sum((L * block + r) * b for r in own[1:]) \
            + (shape.num_params("reward") * b if s.reward_model and s.reward_device in (None, s.device) else 0)
        phases["load"] = {"parameters": max(first, later)}
    else:
        phases["load"] = {"parameters": params_in_step, "frozen copies": frozen}
    resident = {"parameters": params_in_use, "frozen copies": frozen, "optimiser state": optimiser,
                "FSDP2 all-gather": gathered}
    if m.online:
        rg = rows["generate"]
        kv = 2 * L * rg * shape.num_kv_heads * shape.dim * T * g
        prefill = math.ceil(rg / s.num_samples) * s.prompt_length * work
        phases["generate"] = {**resident, "KV cache": kv, "activations": prefill, "logits": rg * V * (g + 8)}
    if m.online or m.reference:
        f = rows["score"]
        phases["score"] = {**resident, "frozen copies": frozen + scoring_root, "activations": f * T * (work + g * H),
                           "logits": head_blocks(f * s.completion_length)}
    # the backward starts with every activation saved and the head's gradients, and ends with every
    # gradient made and the first block's activations: the larger of the two (several micro-batches
    # per step: the earlier ones' gradients are there from the start)
    start = {**resident, "FSDP2 all-gather": gathered_train, "activations": activations, "logits": logits,
             "gradients": head_grad + (grads if rows["micro"] < rows["train_items"] else 0)}
    sent = trained_bytes if s.strategy == "ddp" and W > 1 else 0  # ddp: the buckets' copy of the gradients
    end = {**resident, "FSDP2 all-gather": gathered_train, "activations": last_block,
           "gradients": grads_backward + sent}
    phases["train"] = max(start, end, key=lambda p: sum(p.values()))
    phases["step"] = {"parameters": params_in_step, "frozen copies": frozen, "optimiser state": optimiser + step_temp,
                      "gradients": grads + bucket}
    table = {p: {c: round(v.get(c, 0)) + (s.overhead if c == "overhead" else 0) for c in COMPONENTS}
             for p, v in phases.items()}
    host = int(share(params * b) + 3 * share(trained_bytes) + 2 * share(max(V * H, H * I) * b)) if offload else 0
    host += int(frozen_host) if not offload else 0  # a reference or reward model placed on the host, whole
    return MemoryPlan(shape=shape, settings=s, bytes=table, host=host, params=params, trainable=trainable)


def fitting(shape: Any, settings: PlanSettings, device_memory: int, *, limit: int = 8) -> list[tuple[dict, MemoryPlan]]:
    """Settings near ``settings`` whose plan fits ``device_memory`` bytes: ``[(changes, plan)]``, the smallest sets of
    changes (none that only adds changes to a set that fits), fewest first, then the smallest peak, at most ``limit``. Tried: gradient checkpointing, micro-batches of
    ``1, 2, 4, ...`` rows below the given, ``generation_batch_size`` likewise (online), bfloat16 weights,
    FSDP2 (several ranks) with and without CPU offload, and LoRA; a combination the recipes refuse is
    skipped."""
    s, m = settings, RECIPE_MODELS[settings.recipe]
    rows = _rows(s, m)
    halves = lambda n: sorted({n} | {2**k for k in range(int(math.log2(n)) + 1) if 2**k < n})  # noqa: E731
    options: dict[str, list[Any]] = {
        "gradient_checkpointing": [s.gradient_checkpointing, True],
        "micro_batch_size": [s.micro_batch_size] + [k for k in halves(rows["micro"]) if k < rows["micro"]],
        "dtype": [s.dtype] + (["bfloat16"] if s.dtype == "float32" and not s.mixed_precision else []),
        "strategy": [s.strategy] + (["fsdp2"] if s.world_size > 1 and s.strategy != "fsdp2" else []),
        "fsdp_cpu_offload": [s.fsdp_cpu_offload, True],
        "use_peft": [s.use_peft, True],
    }
    if m.online:
        options["generation_batch_size"] = [s.generation_batch_size] + [k for k in halves(rows["generate"])
                                                                        if k < rows["generate"]][-3:]
    found = []
    for values in itertools.product(*(dict.fromkeys(v) for v in options.values())):
        changes = {k: v for k, v in zip(options, values) if v != getattr(s, k)}
        try:
            plan = plan_memory(shape, dataclasses.replace(s, **changes))
        except ValueError:
            continue  # a combination the recipes refuse
        if plan.fits(device_memory):
            found.append((changes, plan))
    # only the smallest sets of changes: none that adds changes to a set that already fits
    items = lambda changes: set(changes.items())  # noqa: E731
    minimal = [(c, p) for c, p in found if not any(items(o) < items(c) for o, _ in found)]
    minimal.sort(key=lambda cp: (len(cp[0]), cp[1].peak))
    return minimal[:limit]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, field: str = "device_memory") -> int:
    """``"80GB"`` → ``80·10⁹``, ``"80GiB"`` → ``80·2³⁰``, ``"512MiB"``, ``"1.5TB"``, a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{field}: expected a size such as 80GB, 80GiB or 512MiB (units {sorted(set(_UNITS) - {''})}), "
                         f"got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (``12.34 GiB``), MiB below one GiB, ``0`` for nothing."""
    if not n:
        return "0"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
