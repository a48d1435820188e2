"""Typed config sections: every setting declared once, with its help, range and units on the field.

A recipe's ``Config`` is a frozen dataclass composed of sections: the model and its loading, the
data, the optimiser, the run, and for the online recipes generation, rewards and the reference;
then the algorithm's own section, declared in the recipe's module. Each field is declared in
exactly one section with :func:`setting` (``tests/loops/test_settings.py`` walks every recipe's
sections and fails on a name declared twice or without help). A recipe that wants another default
for a field it inherits says so in its class statement, not with a second declaration::

    @dataclasses.dataclass(frozen=True)
    class Config(GRPOSettings, OnlineConfig, defaults={"num_samples": 8, "run_dir": "runs/grpo"}):
        ...

The configs stay flat where users meet them: one YAML key and one ``--flag`` per field, read as
``config.kl_coef``. A function that needs one section takes that section's type
(``generate_kwargs(generation: GenerationSettings)``), and a recipe's ``Config`` is one, so it can
be passed whole. ``--help`` (``loops.cli``) and the range checks of ``loops.config.check_config``
are generated from the declarations here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

__all__ = ["Rule", "AT_LEAST_1", "AT_LEAST_0", "POSITIVE", "UNIT", "OPEN_UNIT", "BELOW_1", "setting", "Section",
           "declared", "field_rule", "is_divisor", "field_help", "field_units", "describe",
           "RunSettings", "ModelSettings", "LanguageModelSettings", "DataSettings", "OptimSettings",
           "TruncationSettings", "DropoutSettings", "ChunkSettings", "AggregationSettings", "ReferenceSettings",
           "RewardModelSettings", "RewardSettings", "BudgetSettings", "GenerationSettings", "AgentSettings",
           "RolloutSettings",
           "LossTypeSettings", "KLSettings", "ClipSettings", "check_clip_range", "GroupSettings", "PreferenceSettings"]


class Rule(NamedTuple):
    """The allowed values of a numeric field: ``allowed(value)`` and the words for them (``">= 1"``)."""

    allowed: Callable[[Any], bool]
    what: str


AT_LEAST_1 = Rule(lambda v: v >= 1, ">= 1")
AT_LEAST_0 = Rule(lambda v: v >= 0, ">= 0")
POSITIVE = Rule(lambda v: v > 0, "> 0")
UNIT = Rule(lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN_UNIT = Rule(lambda v: 0 < v <= 1, "in (0, 1]")
BELOW_1 = Rule(lambda v: 0 <= v < 1, "in [0, 1)")


def setting(default: Any = dataclasses.MISSING, *, help: str, range: Rule | None = None, units: str | None = None,
            divisor: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its documentation: ``help`` (the ``--help`` text), ``range`` (checked at
    load; ``None`` of an optional field is always allowed), ``units`` (tokens, steps, seconds...) and
    ``divisor`` (a formula divides by it: past its range it must be at least
    ``rlcore.checks.MIN_DIVISOR``, so a denormal is refused at load rather than met as NaN)."""
    metadata = {"help": help, "range": range, "units": units, "divisor": divisor}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _owner(cls: type, name: str) -> type | None:
    """The nearest base of ``cls`` with a dataclass field ``name``."""
    return next((base for base in cls.__mro__[1:] if name in getattr(base, "__dataclass_fields__", {})), None)


class Section:
    """The base of every config section. ``class C(A, B, defaults={...})`` gives inherited fields
    new defaults (same type, help and range: the declaration stays the section's); the names are
    kept in ``C.__defaults__`` (this class's own, not its bases') so the one-declaration test can
    tell an override from a declaration. A subclass that writes an inherited field again with a
    plain default (``lr: float = 1e-2``) is read the same way: its help and range stay the
    section's; writing it again with :func:`setting` is a second declaration, refused."""

    __defaults__: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__annotations__")  # noqa: RUF063 (the class's own dict, edited in place)
        if own is None:
            own = {}
            cls.__annotations__ = own
        overrides = dict(defaults or {})
        for name in list(own):  # an inherited field written again
            owner = _owner(cls, name)
            if owner is None or name in overrides:
                continue
            value = cls.__dict__.get(name, dataclasses.MISSING)
            section = declared(owner).get(name, owner).__name__
            if isinstance(value, dataclasses.Field) and "help" in value.metadata:
                raise TypeError(f"{cls.__name__}: {name!r} is declared in {section} already; give it another "
                                f"default with defaults={{{name!r}: ...}}")
            if isinstance(value, dataclasses.Field):
                value = value.default_factory() if value.default_factory is not dataclasses.MISSING else value.default
            if value is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}: {name!r} is declared in {section} already; give it another "
                                f"default with defaults={{{name!r}: ...}}")
            del own[name]
            overrides[name] = value
        for name, value in overrides.items():
            owner = _owner(cls, name)
            if owner is None:
                raise TypeError(f"{cls.__name__}: defaults: {name!r} is no field of its sections")
            if name in own:
                raise TypeError(f"{cls.__name__}: {name!r} is both declared and given a default")
            inherited = owner.__dataclass_fields__[name]
            own[name] = typing.get_type_hints(owner)[name]
            mutable = isinstance(value, (dict, list, set))
            factory = (lambda v=value: type(v)(v)) if mutable else dataclasses.MISSING
            setattr(cls, name, dataclasses.field(default=dataclasses.MISSING if mutable else value,
                                                 default_factory=factory, metadata=inherited.metadata))
        cls.__defaults__ = overrides


@functools.lru_cache(maxsize=None)
def declared(cls: type) -> dict[str, type]:
    """``field -> the section that declares it`` for every field of config class ``cls`` (a default
    given with ``defaults=`` is no declaration)."""
    out: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        overrides = klass.__dict__.get("__defaults__", {})
        for name in inspect.get_annotations(klass):
            if name in getattr(klass, "__dataclass_fields__", {}) and name not in overrides:
                out[name] = klass
    return out


def _metadata(cls: type, name: str) -> Any:
    fields = getattr(cls, "__dataclass_fields__", {})
    return fields[name].metadata if name in fields else {}


def field_rule(cls: type, name: str) -> Rule | None:
    """The range of field ``name`` of config class ``cls`` (``None``: any finite number)."""
    return _metadata(cls, name).get("range")


def is_divisor(cls: type, name: str) -> bool:
    """Whether a formula divides by field ``name`` of ``cls``."""
    return bool(_metadata(cls, name).get("divisor"))


def field_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of ``cls`` (``""`` for a field declared without one)."""
    return _metadata(cls, name).get("help", "")


def field_units(cls: type, name: str) -> str | None:
    return _metadata(cls, name).get("units")


def describe(cls: type, name: str) -> str:
    """One line for ``--help``: the help text, then the units and the range when declared."""
    rule = field_rule(cls, name)
    notes = [x for x in (field_units(cls, name), rule.what if rule else None) if x]
    suffix = f" [{'; '.join(notes)}]" if notes else ""
    return f"{field_help(cls, name)}{suffix}"


# --- every recipe ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunSettings(Section):
    """The run: its folder, checkpoints, logs, evaluation period and seed (``loops.recipe.run``)."""

    seed: int = setting(0, help="seeds model init, data order and sampling",
                        range=Rule(lambda v: 0 <= v < 2**63, "in [0, 2**63)"))
    run_dir: str | None = setting(None, help="checkpoints and metrics.jsonl; None writes nothing")
    save_every: int = setting(0, help="checkpoint period (0: only at the end)", units="steps", range=AT_LEAST_0)
    keep_last: int | None = setting(2, help="checkpoints kept (None: all)", range=AT_LEAST_1)
    eval_every: int = setting(0, help="held-out evaluation period (0: never during training)", units="steps",
                              range=AT_LEAST_0)
    log_every: int = setting(10, help="progress line period", units="steps", range=AT_LEAST_0)
    report_to: tuple[str, ...] = setting((), help="trackers besides metrics.jsonl: tensorboard (run_dir/tensorboard), "
                                                  "wandb")
    resume: bool = setting(False, help="continue from the latest checkpoint of run_dir")
    overwrite: bool = setting(False, help="start over in a run_dir holding another run: delete that run's files "
                                          "(checkpoints, logs) first")


@dataclasses.dataclass(frozen=True)
class ModelSettings(Section):
    """The model being trained, where it runs, its precision and the shape of a LoRA adapter."""

    model: str | None = setting("tiny-llama", help="tiny-llama / tiny-gpt2 (offline, char tokenizer) or a local path "
                                                   "/ hub name; DDPO: a Stable Diffusion pipeline folder (None: the "
                                                   "tiny denoiser)")
    device: str = setting("cpu", help="where models and batches live (cpu, cuda)")
    gradient_checkpointing: bool = setting(False, help="recompute activations in the backward pass: less memory, "
                                                       "more compute")
    mixed_precision: str | None = setting(None, help="bf16: forwards and the loss under torch.autocast (language "
                                                     "models keep their weights float32; DDPO keeps its frozen "
                                                     "weights in bfloat16)")
    lora_r: int = setting(16, help="LoRA rank r", range=AT_LEAST_1)
    lora_alpha: int = setting(32, help="LoRA scale α: the update is (α/r)·B·A", range=POSITIVE)
    lora_target_modules: tuple[str, ...] | None = setting(None, help="module names, or all-linear (None: peft's "
                                                                     "default for the architecture; DDPO needs "
                                                                     "names: its default, the UNet's attention "
                                                                     "projections)")


@dataclasses.dataclass(frozen=True)
class ShardingSettings(Section):
    """How the models sit on the ranks of a ``torchrun`` job (``loops.recipe.shard_models``)."""

    strategy: str = setting("none", help="none: every rank holds each model whole (update sums the gradients "
                                         "after the backward) | ddp: the same, the gradients all-reduced bucket by "
                                         "bucket while the backward makes them (DDP's overlap) | fsdp2: each "
                                         "model's parameters, gradients and optimiser state sharded over the ranks, "
                                         "a block gathered only while it runs")
    fsdp_reshard_after_forward: bool = setting(True, help="fsdp2: free each block's gathered parameters after its "
                                                          "forward and gather them again for the backward")
    fsdp_cpu_offload: bool = setting(False, help="fsdp2: the shards (parameters, gradients, optimiser state) kept "
                                                 "in CPU memory between uses")
    fsdp_backward_prefetch: bool | None = setting(None, help="fsdp2: gather the block the backward reaches next while "
                                                             "it runs this one (two blocks gathered at once; the "
                                                             "gather overlaps the compute on an accelerator); None: "
                                                             "on unless device is cpu, where gloo gathers "
                                                             "synchronously and the prefetch only holds memory")
    fsdp_param_dtype: str | None = setting(None, help="fsdp2: the dtype a block's gathered parameters and its "
                                                      "forward and backward run in (bfloat16 | float16), the shards "
                                                      "and the optimiser staying in the weights' dtype and the "
                                                      "gradients reduced in float32 (None: the weights' dtype)")
    fsdp_checkpoint: str = setting("sharded", help="fsdp2: sharded: each rank writes its own rows of the weights and "
                                                   "optimiser state (no full tensor gathered; resumes at any world "
                                                   "size; rlcore export writes a plain folder) | full: rank 0 writes "
                                                   "the gathered tensors (models/policy loads with from_pretrained)")


@dataclasses.dataclass(frozen=True)
class LanguageModelSettings(Section):
    """How a language model is built or loaded (``loops.recipe.build_policy``)."""

    hidden_size: int = setting(64, help="tiny models: width", range=AT_LEAST_1)
    num_layers: int = setting(2, help="tiny models: decoder blocks", range=AT_LEAST_1)
    num_heads: int = setting(4, help="tiny models: attention heads", range=AT_LEAST_1)
    max_position_embeddings: int = setting(256, help="tiny models: context length", units="tokens", range=AT_LEAST_1)
    init_from: str | None = setting(None, help="start from the policy weights of a checkpoint or run directory "
                                               "(e.g. an SFT run)")
    dtype: str = setting("float32", help="the weights' dtype: float32 | bfloat16 | float16 | auto")
    attn_implementation: str | None = setting(None, help="eager | sdpa | flash_attention_2 ... (None: transformers' "
                                                         "choice)")
    revision: str | None = setting(None, help="hub revision (branch, tag or commit) of model")
    trust_remote_code: bool = setting(False, help="run code shipped with a hub model (off: such a model is refused)")
    use_peft: bool = setting(False, help="train a LoRA adapter, not the weights; the reference is the base "
                                         "(adapter off)")
    lora_dropout: float = setting(0.05, help="dropout on the adapter's input (only where dropout is on)",
                                  range=BELOW_1)
    lora_modules_to_save: tuple[str, ...] | None = setting(None, help="modules trained in full beside the adapter "
                                                                      "(e.g. lm_head)")
    load_in_4bit: bool = setting(False, help="base weights quantised to 4 bits (bitsandbytes, CUDA; needs use_peft)")
    load_in_8bit: bool = setting(False, help="base weights quantised to 8 bits (bitsandbytes, CUDA; needs use_peft)")


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
    """The training and held-out data (``loops.recipe.load_splits``)."""

    task: str | None = setting("add", help="a built-in task (loops.tasks) when dataset is None")
    dataset: str | None = setting(None, help="local jsonl / json / parquet / csv file or folder, or hub name[:split]")
    eval_dataset: str | None = setting(None, help="held-out file or hub name[:split]; None: num_eval rows split off "
                                                  "dataset")
    num_train: int = setting(256, help="built-in task: training examples (pairs, prompts)", range=AT_LEAST_1)
    num_eval: int = setting(64, help="held-out examples (0: none, every row trains, no evaluation)", range=AT_LEAST_0)
    max_prompt_length: int | None = setting(None, help="prompt tokens kept: the last ones of a longer prompt",
                                            units="tokens", range=AT_LEAST_1)
    eval_batch_size: int = setting(32, help="held-out rows per evaluation batch", range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class OptimSettings(Section):
    """The optimiser and its schedule (``loops.recipe.init_train_state``, ``loops.update.update``)."""

    steps: int = setting(100, help="fold steps (offline: one optimiser step each; online: prompt batches)",
                         range=AT_LEAST_0)
    batch_size: int = setting(16, help="rows per step: examples, pairs, or prompts (online; all ranks)",
                              range=AT_LEAST_1)
    micro_batch_size: int | None = setting(None, help="rows per forward/backward (gradient accumulation); None: all",
                                           range=AT_LEAST_1)
    lr: float = setting(1e-3, help="AdamW peak learning rate", range=AT_LEAST_0)
    weight_decay: float = setting(0.0, help="AdamW decoupled weight decay (matrices only)", range=AT_LEAST_0)
    warmup_steps: int = setting(0, help="optimiser steps of linear warm-up", units="optimiser steps",
                                range=AT_LEAST_0)
    schedule: str = setting("constant", help="learning-rate schedule after warm-up: linear | cosine | constant "
                                             "(loops.update.SCHEDULES)")
    max_grad_norm: float | None = setting(1.0, help="global gradient-norm clip; None: off", range=POSITIVE)


# --- offline (sequence) recipes ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TruncationSettings(Section):
    max_length: int | None = setting(64, help="prompt + completion tokens kept per row (per side of a pair; the "
                                              "packed row length with packing)", units="tokens", range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class DropoutSettings(Section):
    disable_dropout: bool = setting(True, help="dropout set to 0 in the trained model (and its reference); False "
                                               "trains with the model's dropout")


@dataclasses.dataclass(frozen=True)
class ChunkSettings(Section):
    chunked: bool = setting(True, help="log-probs from hidden states in vocabulary chunks (no [B, T, V] logits)")


@dataclasses.dataclass(frozen=True)
class PackingSettings(Section):
    """Padding-free forwards and micro-batches by token budget (DPO, reward modelling, the RL updates)."""

    padding_free: bool = setting(False, help="each forward packs its rows' real tokens into one row, positions "
                                             "restarting per sequence: no padded position is computed (attention "
                                             "kept within each sequence by transformers models)")
    max_tokens_per_micro_batch: int | None = setting(
        None, help="tokens one forward holds: micro-batches cut by this budget (real tokens with padding_free, "
                   "padded width without) and at most micro_batch_size rows; None: micro_batch_size rows",
        units="tokens", range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class AggregationSettings(Section):
    agg: str = setting("token_mean", help="token aggregation of the loss (rlcore.masked.AGGREGATIONS; with "
                                          "packing, a sequence is a packed row)")


# --- online recipes ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineCorrectionSettings(Section):
    """The policy-gradient recipes' correction for an engine with numerics of its own (``engine: vllm``;
    ``loops.online.engine_correction``), TRL's ``vllm_importance_sampling_*``."""

    vllm_importance_sampling_correction: bool = setting(
        True, help="with engine vllm: the clipped ratio against the trainer's own log-probs and the surrogate "
                   "weighted by the trainer's over the engine's probability of each sample")
    vllm_importance_sampling_mode: str = setting(
        "sequence_mask", help="token_truncate | token_mask | sequence_truncate | sequence_mask: per token or per "
                              "sequence, the weight clamped or zeroed outside its bounds")
    vllm_importance_sampling_clip_max: float | None = setting(3.0, help="C_max of the weight; None: no upper bound",
                                                              range=POSITIVE)
    vllm_importance_sampling_clip_min: float | None = setting(None, help="C_min of the weight; None: no lower bound",
                                                              range=AT_LEAST_0)


@dataclasses.dataclass(frozen=True)
class ReferenceSettings(Section):
    """The frozen reference of a KL or a preference loss (``loops.recipe.build_reference``)."""

    ref_model: str | None = setting(None, help="the reference: a model folder or checkpoint (default: a copy of the "
                                               "initial policy; a LoRA policy's base)")
    ref_device: str | None = setting(None, help="where the reference lives (None: device; e.g. cpu beside a policy "
                                                "on cuda); under fsdp2 a reference given a device is whole there on "
                                                "every rank, not sharded")


@dataclasses.dataclass(frozen=True)
class RewardModelSettings(Section):
    reward_model: str | None = setting(None, help="a local sequence-classification reward model (same tokenizer); "
                                                  "DDPO: the aesthetic scorer's folder (None: a small random one)")


@dataclasses.dataclass(frozen=True)
class RewardSettings(RewardModelSettings):
    """What scores a rollout (``loops.reward_fns``, ``loops.score.score_rollout``)."""

    reward_device: str | None = setting(None, help="where the reward model lives (None: device); under fsdp2 a "
                                                   "reward model given a device is whole there on every rank, not "
                                                   "sharded")
    reward_funcs: tuple[str, ...] = setting((), help="package.module:function reward functions to import")
    reward_weights: tuple[float, ...] | None = setting(None, help="one weight per reward function (None: all 1)")
    reward_timeout: float | None = setting(300.0, help="time a reward function call may take; past it the step "
                                                       "fails naming it (None or 0: no limit)", units="seconds",
                                           range=AT_LEAST_0)
    nonfinite_rewards: str = setting("raise", help="a NaN/inf score from a reward function or model: raise (names "
                                                   "the rows) | drop (out of the loss and group statistics)")


@dataclasses.dataclass(frozen=True)
class BudgetSettings(Section):
    max_new_tokens: int = setting(16, help="response budget (SFT: of the greedy evaluation)", units="tokens",
                                  range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class GenerationSettings(BudgetSettings):
    """How responses are sampled (``loops.online.generate_kwargs``, ``loops.engines``)."""

    num_samples: int = setting(1, help="G samples per prompt", range=AT_LEAST_1)
    length_sampler: tuple[int, int] | None = setting(None, help="[low, high): each step's budget drawn from it with "
                                                                "the step's sampling seed; evaluation keeps "
                                                                "max_new_tokens", units="tokens")
    temperature: float = setting(1.0, help="sampling temperature; log-probs are of softmax(logits / temperature)",
                                 range=POSITIVE, divisor=True)
    top_k: int | None = setting(None, help="top-k truncation (None: off)", range=AT_LEAST_1)
    top_p: float | None = setting(None, help="nucleus truncation (None: off)", range=OPEN_UNIT)
    stop_token_ids: tuple[int, ...] = setting((), help="token ids that also end a response (EOS always does)")
    missing_eos_penalty: float | None = setting(None, help="subtracted from the score of a response cut at "
                                                           "max_new_tokens", range=AT_LEAST_0)
    overlong_buffer: int | None = setting(None, help="DAPO soft overlong punishment: responses in the last N tokens "
                                                     "of max_new_tokens lose up to overlong_penalty_factor (None: "
                                                     "off)", units="tokens", range=AT_LEAST_1)
    overlong_penalty_factor: float = setting(1.0, help="the soft overlong penalty at max_new_tokens",
                                             range=AT_LEAST_0)
    engine: str = setting("loop", help="generation engine (loops.engines.ENGINES): loop (the KV-cache decode loop), "
                                       "hf (Hugging Face generate), vllm")
    sampler: str = setting("inverse_cdf", help="the loop engine's sampling rule (loops.engines.SAMPLERS)")
    engine_options: dict = setting(default_factory=dict, help="vllm.LLM keywords when engine=vllm")
    generation_batch_size: int | None = setting(None, help="rollout rows sampled per call, a multiple of "
                                                           "num_samples (None: all)", range=AT_LEAST_1)
    forward_batch_size: int | None = setting(None, help="rows per no-grad scoring forward: reference, values, "
                                                        "reward model (None: all)", range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class AgentSettings(Section):
    """Multi-turn rollouts against an environment (``loops.envs``, ``loops.episodes``): off unless
    ``env`` or ``tools`` is given."""

    env: str | None = setting(None, help="the environment of each episode: a built-in (calculator, lookup, python) or "
                                         "package.module:factory (None: single-turn rollouts)")
    tools: tuple[str, ...] = setting((), help="package.module:function tools the model may call (a ToolEnv of "
                                              "them; give tools or env)")
    tool_format: str = setting("qwen", help="how the model writes a tool call (loops.tools.TOOL_CALL_FORMATS: "
                                            "qwen, llama3)")
    max_turns: int = setting(4, help="assistant turns of an episode", range=AT_LEAST_1)
    max_episode_tokens: int | None = setting(None, help="tokens of a whole trajectory, the model's and the "
                                                        "environment's (None: the model's context less the prompt)",
                                             units="tokens", range=AT_LEAST_1)
    reuse_context: bool = setting(True, help="engine loop: keep each episode's KV cache from one turn to the next, "
                                             "so a turn reads only the new tokens (False: the whole context "
                                             "encoded again each turn, and no cache held between turns)")


@dataclasses.dataclass(frozen=True)
class RolloutSettings(Section):
    """How a rollout is learned from (``loops.update.update``'s sizes and passes) and logged."""

    epochs: int = setting(1, help="passes over each rollout", range=AT_LEAST_1)
    minibatch_size: int | None = setting(None, help="rollout rows per optimiser step (None: the whole rollout)",
                                         range=AT_LEAST_1)
    log_entropy: bool = setting(True, help="the policy's token entropy, from the loss's own forward, logged as "
                                           "entropy (not trained: no bonus)")
    log_completions: int = setting(0, help="held-out prompts whose greedy completions and rewards each evaluation "
                                           "writes to run_dir/completions.jsonl", range=AT_LEAST_0)


# --- the losses ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LossTypeSettings(Section):
    loss_type: str = setting("sigmoid", help="the loss: a key of the recipe's table (GRPO: "
                                             "algorithms.policy_gradient.POLICY_LOSSES; DPO, online DPO: "
                                             "algorithms.preference.PREFERENCE_LOSSES)")


@dataclasses.dataclass(frozen=True)
class KLSettings(Section):
    """The KL to the reference: in the loss (GRPO) or folded into the reward (RLOO, PPO)."""

    kl_coef: float = setting(0.0, help="β of the KL to the reference (GRPO: in the loss, 0 runs no reference; "
                                       "RLOO, PPO: in the reward, PPO's initial β)", range=AT_LEAST_0)
    kl: str = setting("k3", help="the KL estimator (rlcore.kl.KL_ESTIMATORS; PPO also full: exact over the "
                                 "vocabulary)")


@dataclasses.dataclass(frozen=True)
class ClipSettings(Section):
    clip_eps_low: float | None = setting(None, help="ε_low of the ratio clip (GRPO None: the loss preset's)",
                                         range=AT_LEAST_0)
    clip_eps_high: float | None = setting(None, help="ε_high of the ratio clip (GRPO None: the loss preset's)",
                                          range=AT_LEAST_0)


def check_clip_range(clip: ClipSettings) -> None:
    """Refuse a clip range left to a preset (``None``) in a recipe whose loss has none (RLOO, PPO)."""
    for name in ("clip_eps_low", "clip_eps_high"):
        if getattr(clip, name) is None:
            raise ValueError(f"{name}: expected a number >= 0 (this recipe's loss has no preset to fall back on), "
                             "got None")


@dataclasses.dataclass(frozen=True)
class GroupSettings(Section):
    """The group recipes' advantages and sampling (GRPO, RLOO)."""

    advantage: str = setting("grpo", help="a key of rlcore.baselines.ADVANTAGE_ESTIMATORS")
    advantage_kwargs: dict = setting(default_factory=dict, help="the estimator's keywords, e.g. {scale: batch, eps: "
                                                                "1.0e-4}")
    mask_truncated_completions: bool = setting(False, help="a response cut at max_new_tokens with no stop token "
                                                           "leaves the loss (DAPO overlong filtering)")
    dynamic_sampling: bool = setting(False, help="DAPO: drop groups whose scores are all equal, refill with fresh "
                                                 "prompts (loops.filters)")
    max_sampling_rounds: int = setting(3, help="at most this many generations per step when refilling",
                                       range=AT_LEAST_1)


@dataclasses.dataclass(frozen=True)
class PreferenceSettings(Section):
    """A preference loss's settings and a moving reference (DPO, online DPO)."""

    beta: float | None = setting(None, help="β of the preference loss (None: the loss's default, 0.1 for the DPO "
                                            "family)", range=POSITIVE, divisor=True)
    loss_kwargs: dict = setting(default_factory=dict, help="the loss's other keywords, e.g. {label_smoothing: 0.1} "
                                                           "(cDPO), {rpo_alpha: 1.0} (RPO), {gamma: 0.5} (SimPO)")
    sync_ref_model: bool = setting(False, help="TR-DPO: every ref_model_sync_steps steps, ref ← α·policy + "
                                               "(1 − α)·ref")
    ref_model_mixup_alpha: float = setting(0.6, help="α of that update", range=UNIT)
    ref_model_sync_steps: int = setting(512, help="steps between updates", units="steps", range=AT_LEAST_1)
