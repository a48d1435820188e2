"""TRL's config names as input: one table per recipe of TRL 1.16's field name → what it does here.

Every field of TRL's ``SFTConfig`` / ``DPOConfig`` / ``RewardConfig`` / ``GRPOConfig`` / ``RLOOConfig`` /
``PPOConfig`` (with the ``TrainingArguments`` they inherit) and of the ``ModelConfig`` /
``ScriptArguments`` a TRL script's YAML holds is, for the matching recipe, one of:

- :class:`Accept`: read with TRL's meaning and translated to rlcore's fields, units converted
  (``per_device_train_batch_size`` × ``gradient_accumulation_steps`` × world size → ``batch_size``
  in the recipe's unit; ``warmup_ratio`` → ``warmup_steps``; ``beta`` → ``kl_coef``);
- :class:`Default`: accepted at the values that change nothing here (TRL's default, as a YAML
  written out in full carries it); any other value is refused with the reason;
- :class:`Ignore`: accepted and without effect, where that is TRL's meaning too here (a DeepSpeed
  option without DeepSpeed, a worker count for data rlcore reads in process);
- :class:`Refuse`: refused, naming why it does not apply and what to use instead.

A name that is also one of the recipe's own fields (``max_length``, ``seed``, ``lora_r``) is the
field; where TRL writes its value differently (``top_k: 0``, ``report_to: none``) the entry
converts it. :func:`translate` applies a recipe's table once, in ``loops.config.load_config``,
before the config is built and checked; a TRL name and the rlcore name it translates to, given
with different values, are an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

__all__ = ["Accept", "Default", "Ignore", "Refuse", "TABLES", "EXTRA_NAMES", "translate", "table_for",
           "trl_names_by_field", "markdown_table"]


@dataclasses.dataclass(frozen=True)
class Accept:
    """Read with TRL's meaning: ``convert(value, ctx)`` returns the rlcore fields it sets."""
    to: tuple[str, ...]
    convert: Callable[[Any, Context], dict[str, Any]]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Default:
    """Accepted at ``values`` (they change nothing here); any other value is refused with ``reason``."""
    values: tuple[Any, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class Ignore:
    """Accepted and without effect; ``note`` says why that is TRL's meaning too."""
    note: str


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Refused: ``reason`` says why it does not apply and what to use instead."""
    reason: str


Entry = Accept | Default | Ignore | Refuse


@dataclasses.dataclass(frozen=True)
class Context:
    """What a converter may read: the TRL names given (``trl``), the recipe's own fields given
    (``given``), the recipe's defaults, the world size (``WORLD_SIZE``) and the recipe's name."""
    recipe: str
    trl: Mapping[str, Any]
    given: Mapping[str, Any]
    defaults: Mapping[str, Any]
    world_size: int
    coerce: Callable[[str, Any], Any]

    def value(self, name: str, trl_default: Any, tp: Any = int) -> Any:
        """A TRL name's value as ``tp`` (its TRL default when not given)."""
        return _as(tp, self.trl[name], name) if name in self.trl else trl_default

    def field(self, name: str) -> Any:
        """An rlcore field's value as its type: given, else its default."""
        return self.coerce(name, self.given[name]) if name in self.given else self.defaults.get(name)

    def steps(self) -> int:
        """The run's optimiser steps / fold steps, as the config will have them."""
        if "max_steps" in self.trl and _as(int, self.trl["max_steps"], "max_steps") > 0:
            return _as(int, self.trl["max_steps"], "max_steps")
        return self.field("steps")


def _as(tp: Any, value: Any, name: str) -> Any:
    try:
        return TypeAdapter(tp).validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{name}: cannot read {value!r} as {getattr(tp, '__name__', tp)}: "
                         f"{e.errors()[0]['msg']}") from None


def _ratio(name: str, steps: Callable[[Context], int] = Context.steps) -> Callable[[Any, Context], int]:
    """TRL's step count that may be a ratio: a float in (0, 1) is that fraction of the run's steps."""
    def convert(value: Any, ctx: Context) -> int:
        number = _as(float, value, name)
        return math.ceil(number * steps(ctx)) if 0 < number < 1 else int(number)
    return convert


def _to(field: str, tp: Any = None, fn: Callable[[Any], Any] | None = None) -> Callable[[Any, Context], dict]:
    def convert(value: Any, ctx: Context) -> dict[str, Any]:
        if tp is not None:
            value = _as(tp, value, field)
        return {field: fn(value) if fn else value}
    return convert


def rename(field: str, note: str = "", tp: Any = None, fn: Callable[[Any], Any] | None = None) -> Accept:
    return Accept((field,), _to(field, tp, fn), note)


def same(field: str, note: str = "the same field and meaning", tp: Any = None,
         fn: Callable[[Any], Any] | None = None) -> Accept:
    return Accept((field,), _to(field, tp, fn), note)


def _unless_none(field: str) -> Callable[[Any, Context], dict[str, Any]]:
    """``{field: value}``, or nothing for ``None`` (TRL's way of leaving an older alias unset)."""
    def convert(value: Any, ctx: Context) -> dict[str, Any]:
        return {} if value is None else {field: value}
    return convert


def _none_if(*values: Any) -> Callable[[Any], Any]:
    return lambda v: None if v in values else v


def _a_model(name: str) -> Callable[[Any], Any]:
    """A model name or folder: TRL's ``None`` (no model given) refused, naming TRL's field."""
    def check(value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected a model name or folder, got {value!r}")
        return value
    return check


# --- batch sizes ------------------------------------------------------------------------------------
def _batch(value: Any, ctx: Context) -> dict[str, Any]:
    """TRL's per-device batch, accumulation and world size → ``batch_size`` (the recipe's unit, all
    ranks), ``micro_batch_size`` (rows per forward on a rank) and, online, ``minibatch_size``."""
    per_device = ctx.value("per_device_train_batch_size", 8)
    accum = ctx.value("gradient_accumulation_steps", 1)
    rows = per_device * accum * ctx.world_size  # rows per optimiser step, all ranks
    out: dict[str, Any] = {"micro_batch_size": per_device}
    if ctx.recipe in ("grpo", "rloo"):  # TRL counts completions, rlcore's batch_size prompts
        group = ctx.value("num_generations", None) or ctx.field("num_samples")
        generation = per_device * ctx.world_size * ctx.value("steps_per_generation", accum)
        if generation % group:
            raise ValueError(
                f"per_device_train_batch_size: TRL's batch counts completions; {per_device} per device × "
                f"{ctx.world_size} rank(s) × {ctx.value('steps_per_generation', accum)} steps per generation = "
                f"{generation} completions is not a whole number of groups of num_generations={group}; "
                f"choose sizes whose product is a multiple of {group}")
        out["batch_size"] = generation // group
        out["minibatch_size"] = None if rows == generation else per_device * accum
    elif ctx.recipe == "ppo":  # one response per prompt; num_mini_batches splits the batch
        minis = ctx.value("num_mini_batches", 1)
        out["batch_size"] = rows
        out["minibatch_size"] = None if minis == 1 else per_device * accum // minis
    else:  # rows (SFT), pairs (DPO, reward)
        out["batch_size"] = rows
    return out


BATCH = Accept(("batch_size", "micro_batch_size", "minibatch_size"), _batch,
               "per_device_train_batch_size × gradient_accumulation_steps × WORLD_SIZE rows per optimiser step → "
               "batch_size (SFT rows, DPO / reward pairs, PPO prompts; GRPO / RLOO: completions ÷ num_generations = "
               "prompts); micro_batch_size = per_device_train_batch_size")


def _steps(value: Any, ctx: Context) -> dict[str, Any]:
    steps = _as(int, value, "max_steps")
    if steps > 0 or "num_train_epochs" in ctx.trl or "steps" in ctx.given:
        return {"steps": steps} if steps > 0 else {}  # -1 with epochs: num_train_epochs' entry decides
    raise ValueError(f"max_steps: got {steps}; rlcore counts steps, not epochs: set max_steps >= 1 (TRL's -1 hands "
                     "the count to num_train_epochs)")


def _epochs(value: Any, ctx: Context) -> dict[str, Any]:
    if "max_steps" in ctx.trl and _as(int, ctx.trl["max_steps"], "max_steps") > 0:
        return {}  # TRL: max_steps overrides num_train_epochs
    if "steps" in ctx.given:
        return {}
    raise ValueError(f"num_train_epochs: got {value!r} without max_steps; rlcore counts steps, not epochs: set "
                     "max_steps (or steps) to epochs × rows ÷ batch size")


def _warmup_ratio(value: Any, ctx: Context) -> dict[str, Any]:
    return {"warmup_steps": math.ceil(_as(float, value, "warmup_ratio") * ctx.steps())}


SCHEDULE_NAMES = {"linear": "linear", "cosine": "cosine", "constant_with_warmup": "constant", "constant": "constant"}


def _schedule(value: Any, ctx: Context) -> dict[str, Any]:
    if value not in SCHEDULE_NAMES:
        raise ValueError(f"lr_scheduler_type: expected one of {sorted(SCHEDULE_NAMES)}, got {value!r}; set schedule "
                         "(linear | cosine | constant) to one rlcore has")
    out = {"schedule": SCHEDULE_NAMES[value]}
    if value == "constant":  # TRL's constant has no warm-up
        out["warmup_steps"] = 0
    return out


def _report_to(value: Any, ctx: Context) -> dict[str, Any]:
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value or ())  # the command line's "a,b"
    if "all" in names:
        raise ValueError("report_to: got 'all'; name the trackers: tensorboard, wandb (or none)")
    return {"report_to": tuple(n for n in names if n != "none")}


def _bf16(value: Any, ctx: Context) -> dict[str, Any]:
    return {"mixed_precision": "bf16"} if value is not None and _as(bool, value, "bf16") else {}


def _use_cpu(value: Any, ctx: Context) -> dict[str, Any]:
    return {"device": "cpu"} if _as(bool, value, "use_cpu") else {}


def _resume(value: Any, ctx: Context) -> dict[str, Any]:
    if isinstance(value, str) and value.lower() not in ("true", "false"):
        raise ValueError(f"resume_from_checkpoint: got the path {value!r}; rlcore resumes from the latest "
                         "checkpoint of run_dir: set output_dir to that run and resume_from_checkpoint: true")
    return {"resume": bool(value is not None and _as(bool, value, "resume_from_checkpoint"))}


def _is_no(value: Any) -> bool:
    """TRL's strategy ``"no"``, also as YAML 1.1 reads a bare ``no`` (``False``)."""
    return value is False or (isinstance(value, str) and value.strip().lower() == "no")


def _eval_strategy(value: Any, ctx: Context) -> dict[str, Any]:
    if _is_no(value):  # TRL trains on every row then: nothing is held out, unless the config says what to hold out
        held_out = "num_eval" in ctx.given or ctx.field("eval_dataset") is not None
        return {"eval_every": 0} if held_out else {"eval_every": 0, "num_eval": 0}
    if value != "steps":
        raise ValueError(f"eval_strategy: expected 'no' or 'steps', got {value!r}; rlcore evaluates every "
                         "eval_steps steps")
    steps = ctx.trl.get("eval_steps", ctx.trl.get("logging_steps", 10))  # TRL: eval_steps defaults to logging_steps
    return {"eval_every": _ratio("eval_steps")(steps, ctx)}


def _eval_steps(value: Any, ctx: Context) -> dict[str, Any]:
    # TRL evaluates only under eval_strategy: steps; with it, eval_strategy's entry reads eval_steps
    return {}


def _save_strategy(value: Any, ctx: Context) -> dict[str, Any]:
    if _is_no(value):
        return {"save_every": 0}
    if value != "steps":
        raise ValueError(f"save_strategy: expected 'steps' or 'no', got {value!r}; rlcore saves every save_steps "
                         "steps and at the end")
    return {}


def _dataset(value: Any, ctx: Context) -> dict[str, Any]:
    name = ctx.trl.get("dataset_name")
    if name is None:
        return {}
    if os.path.isfile(str(name)):  # a local file has no splits: the held-out rows are num_eval of its own
        named = [k for k in ("dataset_train_split", "dataset_test_split") if k in ctx.trl]
        if named:
            raise ValueError(f"{named[0]}: {name} is a local file, which has no splits; give the held-out file as "
                             "eval_dataset, or let num_eval rows of this one be held out")
        return {"dataset": name}
    split = ctx.trl.get("dataset_train_split", "train")
    out = {"dataset": name if split == "train" else f"{name}:{split}"}
    if not _is_no(ctx.trl.get("eval_strategy", "no")):  # TRL's scripts evaluate on the test split only then
        out["eval_dataset"] = f"{name}:{ctx.trl.get('dataset_test_split', 'test')}"
    return out


def _stop_token_id(value: Any, ctx: Context) -> dict[str, Any]:
    return {} if value is None else {"stop_token_ids": (_as(int, value, "stop_token_id"),)}


def _epsilon(value: Any, ctx: Context) -> dict[str, Any]:
    eps = _as(float, value, "epsilon")
    out = {"clip_eps_low": eps}
    if ctx.trl.get("epsilon_high") is None:  # TRL: epsilon_high defaults to epsilon
        out["clip_eps_high"] = eps
    return out


def _epsilon_high(value: Any, ctx: Context) -> dict[str, Any]:
    return {} if value is None else {"clip_eps_high": _as(float, value, "epsilon_high")}


def _cliprange(value: Any, ctx: Context) -> dict[str, Any]:
    eps = _as(float, value, "cliprange")
    return {"clip_eps_low": eps, "clip_eps_high": eps}


def _scale_rewards(value: Any, ctx: Context) -> dict[str, Any]:
    scale = {True: "group", False: "none", "true": "group", "false": "none"}.get(value, value)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: expected group, batch, none (or true / false), got {value!r}")
    kwargs = dict(ctx.field("advantage_kwargs") or {})
    if kwargs.get("scale", scale) != scale:
        raise ValueError(f"scale_rewards: got {value!r} but advantage_kwargs.scale is {kwargs['scale']!r}; give one")
    return {"advantage_kwargs": {**kwargs, "scale": scale}}


def _log_completions(value: Any, ctx: Context) -> dict[str, Any]:
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        on = _as(bool, value, "log_completions")
        return {"log_completions": (ctx.value("num_completions_to_print", None) or 1) if on else 0}
    return {"log_completions": _as(int, value, "log_completions")}


def _num_completions_to_print(value: Any, ctx: Context) -> dict[str, Any]:
    return {}  # read by log_completions' entry


def _dpo_loss_type(value: Any, ctx: Context) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value)
    if len(names) != 1:
        raise ValueError(f"loss_type: got {value!r}; rlcore's DPO trains one loss: name one (a key of "
                         "PREFERENCE_LOSSES)")
    return {"loss_type": names[0]}


def _loss_kwarg(name: str, keyword: str, trl_default: Any) -> Accept:
    def convert(value: Any, ctx: Context) -> dict[str, Any]:
        if value == trl_default:
            return {}  # the loss's own default
        kwargs = dict(ctx.field("loss_kwargs") or {})
        if keyword in kwargs and kwargs[keyword] != value:
            raise ValueError(f"{name}: got {value!r} but loss_kwargs.{keyword} is {kwargs[keyword]!r}; give one")
        return {"loss_kwargs": {**kwargs, keyword: value}}
    return Accept(("loss_kwargs",), convert, f"loss_kwargs.{keyword} (the loss's keyword; TRL's default: the loss's own)")


def _engine_option(name: str, option: str) -> Accept:
    def convert(value: Any, ctx: Context) -> dict[str, Any]:
        if not ctx.value("use_vllm", False, bool) or value is None:
            return {}  # TRL reads it with use_vllm only
        options = dict(ctx.field("engine_options") or {})
        return {"engine_options": {**options, option: value}}
    return Accept(("engine_options",), convert, f"engine_options.{option} with use_vllm (vllm.LLM's keyword)")


def _use_vllm(value: Any, ctx: Context) -> dict[str, Any]:
    return {"engine": "vllm"} if _as(bool, value, "use_vllm") else {}


def _total_episodes(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return {}
    batch = _batch(None, ctx)["batch_size"] if ("per_device_train_batch_size" in ctx.trl or
                                                  "gradient_accumulation_steps" in ctx.trl) else ctx.field("batch_size")
    return {"steps": math.ceil(_as(int, value, "total_episodes") / batch)}


# --- the shared surface: TrainingArguments, ModelConfig, ScriptArguments ----------------------------
_NO_HUB = "rlcore writes checkpoints to run_dir and pushes nothing; upload a run with `huggingface-cli upload`"
_NO_DS = ("rlcore runs DDP / FSDP2 itself under torchrun (rlcore.loops.dist), not through DeepSpeed, FSDP "
          "plugins or accelerate configs")
_IN_PROCESS = "rlcore reads batches in the training process (no DataLoader workers): "
_EXACT_RESUME = "rlcore's checkpoints always hold the optimiser, schedule, RNG and data position (exact resume)"
_ONE_SEED = "one seed orders the data and seeds the model and sampling: set seed"

COMMON: dict[str, Entry] = {
    # the run
    "output_dir": rename("run_dir", "checkpoints and metrics.jsonl"),
    "overwrite_output_dir": Default((False, None), "rlcore's overwrite: true deletes the previous run's files in "
                                                  "run_dir; set overwrite explicitly"),
    "logging_dir": Default((None,), "TensorBoard events go to run_dir/tensorboard"),
    "seed": same("seed"),
    "data_seed": Default((None,), _ONE_SEED),
    "full_determinism": Default((False,), "rlcore runs are seeded; the deterministic cuDNN / CUDA switches are "
                                         "torch's own (torch.use_deterministic_algorithms)"),
    "resume_from_checkpoint": Accept(("resume",), _resume, "true: continue from the latest checkpoint of run_dir"),
    "do_train": Ignore("a flag for scripts; TRL's trainer does not read it"),
    "do_eval": Ignore("a flag for scripts; TRL's trainer does not read it (eval_strategy decides)"),
    "do_predict": Ignore("a flag for scripts; TRL's trainer does not read it"),
    "local_rank": Ignore("set by the launcher; rlcore reads LOCAL_RANK from torchrun's environment"),
    "run_name": Default((None,), "the wandb run is named after run_dir"),
    "project": Default(("huggingface",), "set the wandb project with WANDB_PROJECT"),
    "trackio_space_id": Default((None,), "trackio is not a tracker here: report_to tensorboard or wandb"),
    "trackio_bucket_id": Default((None,), "trackio is not a tracker here: report_to tensorboard or wandb"),
    "trackio_static_space_id": Default((None,), "trackio is not a tracker here: report_to tensorboard or wandb"),
    # steps and batches
    "per_device_train_batch_size": BATCH,
    "gradient_accumulation_steps": BATCH,
    "auto_find_batch_size": Default((False,), "batch sizes are fixed by the config"),
    "max_steps": Accept(("steps",), _steps, "optimiser steps (online: prompt batches); -1: num_train_epochs decides"),
    "num_train_epochs": Accept(("steps",), _epochs, "ignored under max_steps > 0 (TRL's rule); alone it is "
                                                    "refused: rlcore counts steps"),
    # optimiser and schedule
    "learning_rate": rename("lr", "AdamW peak learning rate"),
    "lr_scheduler_type": Accept(("schedule", "warmup_steps"), _schedule,
                                "linear, cosine; constant_with_warmup → constant; constant → constant with no warm-up"),
    "lr_scheduler_kwargs": Default((None, {}), "the schedules take no keywords here (linear, cosine, constant)"),
    "warmup_steps": Accept(("warmup_steps",), lambda v, ctx: {"warmup_steps": _ratio("warmup_steps")(v, ctx)},
                           "optimiser steps of linear warm-up; a float in (0, 1) is that fraction of the steps"),
    "warmup_ratio": Accept(("warmup_steps",), _warmup_ratio, "ceil(warmup_ratio × steps)"),
    "optim": Default(("adamw_torch", "adamw_torch_fused", "adamw_hf"), "the optimiser is AdamW (torch.optim.AdamW)"),
    "optim_args": Default((None, ""), "the optimiser is AdamW with its defaults besides lr and weight_decay"),
    "optim_target_modules": Default((None,), "AdamW updates every trainable parameter"),
    "weight_decay": same("weight_decay", "AdamW decoupled weight decay (matrices only)"),
    "adam_beta1": Default((0.9,), "AdamW's β1 is 0.9 here"),
    "adam_beta2": Default((0.999,), "AdamW's β2 is 0.999 here"),
    "adam_epsilon": Default((1e-8,), "AdamW's ε is 1e-8 here"),
    "max_grad_norm": same("max_grad_norm", "global gradient-norm clip; 0 → None (off)", fn=_none_if(0, 0.0)),
    "average_tokens_across_devices": Default((True,), "token counts are always summed over the ranks before the loss"),
    "label_smoothing_factor": Default((0, 0.0), "no label smoothing of the language-model loss here"),
    # precision and memory
    "bf16": Accept(("mixed_precision",), _bf16, "true → mixed_precision: bf16 (autocast; weights stay float32)"),
    "fp16": Default((False, None), "float16 autocast needs loss scaling, which is not offered: use bf16"),
    "bf16_full_eval": Default((False,), "evaluation runs in the weights' dtype under the same autocast as training"),
    "fp16_full_eval": Default((False,), "evaluation runs in the weights' dtype under the same autocast as training"),
    "tf32": Default((None, False), "set torch.backends.cuda.matmul.allow_tf32 in your own launcher"),
    "gradient_checkpointing": same("gradient_checkpointing", "null → false", fn=lambda v: False if v is None else v),
    "gradient_checkpointing_kwargs": Default((None, {}, {"use_reentrant": False}),
                                             "checkpointing is non-reentrant here"),
    "activation_checkpointing": Default((None, False), "use gradient_checkpointing"),
    "activation_checkpointing_kwargs": Default((None, {}), "use gradient_checkpointing"),
    "activation_offloading": Default((False,), "activations stay on the device"),
    "torch_compile": Default((False,), "models run eagerly"),
    "torch_compile_backend": Default((None,), "models run eagerly"),
    "torch_compile_mode": Default((None,), "models run eagerly"),
    "use_liger_kernel": Default((False,), "Liger kernels are not used; the chunked losses bound memory"),
    "liger_kernel_config": Default((None,), "Liger kernels are not used"),
    "use_cache": Ignore("training forwards keep no KV cache (TRL's meaning); generation uses one"),
    "neftune_noise_alpha": Default((None,), "NEFTune noise is not offered"),
    "torch_empty_cache_steps": Ignore("allocator housekeeping only; results are the same"),
    # logging, evaluation, saving
    "logging_strategy": Default(("steps",), "rlcore logs every logging_steps steps"),
    "logging_steps": Accept(("log_every",), lambda v, ctx: {"log_every": _ratio("logging_steps")(v, ctx)},
                            "progress-line period in steps (a float in (0, 1): that fraction of the steps)"),
    "logging_first_step": Ignore("metrics.jsonl holds every step's metrics, the first included"),
    "log_on_each_node": Ignore("console output only: rank 0 logs"),
    "logging_nan_inf_filter": Ignore("console output only"),
    "include_num_input_tokens_seen": Default(("no", False), "token counts are logged by the recipes themselves"),
    "log_level": Ignore("console verbosity only"),
    "log_level_replica": Ignore("console verbosity only"),
    "disable_tqdm": Ignore("console output only: rlcore prints a progress line every log_every steps"),
    "report_to": Accept(("report_to",), _report_to, "tensorboard, wandb; none → no tracker"),
    "eval_strategy": Accept(("eval_every", "num_eval"), _eval_strategy,
                            "steps → eval_every = eval_steps (TRL: else logging_steps); no → eval_every 0 and, "
                            "unless num_eval or eval_dataset is given, num_eval 0: every row trains, nothing is held "
                            "out (TRL's meaning)"),
    "evaluation_strategy": Accept(("eval_every", "num_eval"), _eval_strategy, "older name of eval_strategy"),
    "eval_steps": Accept(("eval_every",), _eval_steps, "read with eval_strategy: steps (TRL evaluates only then)"),
    "eval_delay": Default((0, 0.0, None), "evaluation starts at eval_every"),
    "eval_on_start": Default((False,), "the first evaluation is at eval_every"),
    "per_device_eval_batch_size": rename("eval_batch_size", "held-out rows per evaluation batch"),
    "prediction_loss_only": Ignore("evaluation returns the recipe's held-out metrics; no predictions are gathered"),
    "eval_do_concat_batches": Ignore("no predictions are gathered"),
    "eval_use_gather_object": Ignore("no predictions are gathered"),
    "eval_accumulation_steps": Ignore("no predictions are gathered"),
    "include_for_metrics": Default(([], (), None), "there is no compute_metrics hook: the recipe's held-out "
                                                   "metrics are fixed"),
    "batch_eval_metrics": Default((False,), "there is no compute_metrics hook"),
    "save_strategy": Accept(("save_every",), _save_strategy, "steps → save_every = save_steps; no → 0 (the end only)"),
    "save_steps": Accept(("save_every",), lambda v, ctx: {"save_every": _ratio("save_steps")(v, ctx)}
                         if ctx.trl.get("save_strategy", "steps") == "steps" else {},
                         "checkpoint period in steps (a float in (0, 1): that fraction)"),
    "save_total_limit": rename("keep_last", "checkpoints kept"),
    "save_only_model": Default((False,), _EXACT_RESUME),
    "save_on_each_node": Default((False,), "rank 0 writes the checkpoints"),
    "enable_jit_checkpoint": Default((False,), "an interrupted run saves at the step boundary by itself"),
    "restore_callback_states_from_checkpoint": Default((False,), "there are no trainer callbacks with state"),
    "ignore_data_skip": Default((False,), _EXACT_RESUME),
    "load_best_model_at_end": Default((False,), "the last policy is kept; pick a checkpoint with rlcore eval"),
    "metric_for_best_model": Default((None,), "the last policy is kept; pick a checkpoint with rlcore eval"),
    "greater_is_better": Default((None,), "the last policy is kept; pick a checkpoint with rlcore eval"),
    "push_to_hub": Default((False,), _NO_HUB),
    "hub_token": Default((None,), _NO_HUB),
    "hub_private_repo": Default((None,), _NO_HUB),
    "hub_model_id": Default((None,), _NO_HUB),
    "hub_strategy": Default(("every_save",), _NO_HUB),
    "hub_always_push": Default((False,), _NO_HUB),
    "hub_revision": Default((None,), _NO_HUB),
    # devices and distribution
    "use_cpu": Accept(("device",), _use_cpu, "true → device: cpu"),
    "accelerator_config": Default((None,), _NO_DS),
    "parallelism_config": Default((None,), _NO_DS),
    "deepspeed": Default((None,), _NO_DS),
    "fsdp": Default((None, "", []), _NO_DS),
    "fsdp_config": Default((None,), _NO_DS),
    "ddp_find_unused_parameters": Default((None,), _NO_DS),
    "ddp_bucket_cap_mb": Default((None,), _NO_DS),
    "ddp_broadcast_buffers": Default((None,), _NO_DS),
    "ddp_static_graph": Default((None,), _NO_DS),
    "ddp_backend": Default((None,), "the backend is chosen by rlcore.loops.dist (nccl on CUDA, else gloo)"),
    "ddp_timeout": Default((1800,), "the process group keeps torch's timeout"),
    "debug": Default(("", None, []), "no debug modes are offered"),
    "skip_memory_metrics": Ignore("peak memory is logged by the recipes themselves"),
    # data loading
    "dataloader_drop_last": Default((False,), _IN_PROCESS + "every row is used"),
    "dataloader_num_workers": Default((0,), _IN_PROCESS + "no worker processes"),
    "dataloader_pin_memory": Ignore(_IN_PROCESS + "host-memory pinning changes no result"),
    "dataloader_persistent_workers": Default((False,), _IN_PROCESS + "no worker processes"),
    "dataloader_prefetch_factor": Default((None,), _IN_PROCESS + "no worker processes"),
    "dataloader_multiprocessing_context": Default((None,), _IN_PROCESS + "no worker processes"),
    "dataloader_in_order": Default((True,), _IN_PROCESS + "batches come in order"),
    "remove_unused_columns": Ignore("extra columns reach the reward functions (online) and are dropped elsewhere"),
    "label_names": Default((None,), "the recipe fixes its label columns"),
    "train_sampling_strategy": Default(("random",), "rows are visited in a seeded random order each epoch"),
    "length_column_name": Ignore("read by group_by_length sampling only, which is not offered"),
    # ModelConfig
    "model_name_or_path": rename("model", "a local folder or a hub name", fn=_a_model("model_name_or_path")),
    "model_revision": rename("revision", "hub revision; main → None (the default branch)", fn=_none_if("main")),
    "dtype": same("dtype", "float32 | bfloat16 | float16 | auto"),
    "torch_dtype": rename("dtype", "older name of dtype"),
    "attn_implementation": same("attn_implementation"),
    "trust_remote_code": same("trust_remote_code"),
    "use_peft": same("use_peft"),
    "lora_r": same("lora_r"),
    "lora_alpha": same("lora_alpha"),
    "lora_dropout": same("lora_dropout"),
    "lora_target_modules": same("lora_target_modules", "module names, or all-linear"),
    "lora_modules_to_save": same("lora_modules_to_save"),
    "lora_target_parameters": Default((None,), "LoRA targets modules (lora_target_modules), not parameters"),
    "lora_task_type": Default(("CAUSAL_LM",), "the recipe sets the adapter's task type"),
    "use_rslora": Default((False,), "the adapter's scale is α/r (rank-stabilised LoRA is not offered)"),
    "use_dora": Default((False,), "DoRA is not offered"),
    "load_in_4bit": same("load_in_4bit", "bitsandbytes NF4 on CUDA, with use_peft"),
    "load_in_8bit": same("load_in_8bit", "bitsandbytes on CUDA, with use_peft"),
    "bnb_4bit_quant_type": Default(("nf4",), "4-bit quantisation is NF4 here"),
    "use_bnb_nested_quant": Default((False,), "nested quantisation is not offered"),
    "bnb_4bit_quant_storage": Default((None,), "quantised weights keep bitsandbytes' storage dtype"),
    "model_init_kwargs": Default((None, {}), "the model is loaded from the config's fields (dtype, attn_implementation, "
                                             "revision, trust_remote_code)"),
    "router_aux_loss_coef": Default((None,), "no mixture-of-experts auxiliary loss is added"),
    # ScriptArguments
    "dataset_name": Accept(("dataset", "eval_dataset"), _dataset,
                           "a local file or folder, or a hub name; dataset_train_split → name:split; the test split "
                           "becomes eval_dataset when eval_strategy is not no"),
    "dataset_train_split": Accept(("dataset",), _dataset, "read with dataset_name"),
    "dataset_test_split": Accept(("eval_dataset",), _dataset, "read with dataset_name and eval_strategy"),
    "dataset_config": Default((None,), "name a hub dataset's configuration in its path: dataset: namespace/name"),
    "dataset_streaming": Default((False,), "datasets are read whole"),
    "ignore_bias_buffers": Ignore("a DDP workaround for buffers of bool dtype; rlcore syncs parameters only"),
    "dataset_num_proc": Ignore("tokenisation speed only; results are the same"),
    "pad_to_multiple_of": Ignore("padding layout only: padded positions are masked"),
    "pad_token": Default((None,), "the tokenizer's own pad token is used (its EOS where it has none)"),
    "eos_token": Default((None,), "the tokenizer's own EOS token is used"),
    "chat_template_path": Default((None,), "the tokenizer's own chat template renders conversational rows"),
}

# names TRL 1.16's classes lack but YAMLs written for older TRL / transformers carry
EXTRA_NAMES = ("overwrite_output_dir", "logging_dir", "warmup_ratio", "torch_dtype", "evaluation_strategy")

_DROPOUT_RL = Default((True,), "the online recipes always turn dropout off (sampling and training log-probs agree)")
_VLLM_ONLY = Ignore("read with use_vllm in server mode only, which is refused")
_NO_TOOLS = "tool calling during generation is not offered"

_ONLINE: dict[str, Entry] = {
    "disable_dropout": _DROPOUT_RL,
    "num_generations": rename("num_samples", "completions per prompt"),
    "num_generations_eval": Default((None,), "evaluation scores one greedy completion per held-out prompt"),
    "max_completion_length": rename("max_new_tokens", "response token budget"),
    "ds3_gather_for_generation": Ignore("a DeepSpeed ZeRO-3 option; DeepSpeed is not used"),
    "shuffle_dataset": Default((True,), "prompts are visited in a seeded random order each epoch"),
    "generation_batch_size": same("generation_batch_size", "differs: rlcore's rows sampled per call (memory only); "
                                  "the rollout is batch_size × num_samples rows (TRL's generation batch: use "
                                  "steps_per_generation)"),
    "steps_per_generation": BATCH,
    "temperature": same("temperature"),
    "top_p": same("top_p", "1.0 is off"),
    "top_k": same("top_k", "0 → None (off)", fn=_none_if(0, "0")),
    "min_p": Default((None,), "min-p truncation is not offered: top_k, top_p"),
    "generation_kwargs": Default((None, {}), "sampling is set by temperature, top_k, top_p, stop_token_ids"),
    "chat_template_kwargs": Default((None, {}), "the chat template is rendered with its defaults"),
    "repetition_penalty": Default((1.0,), "no repetition penalty: log-probs stay the policy's"),
    "cache_implementation": Ignore("KV-cache layout only; samples are the same"),
    "use_vllm": Accept(("engine",), _use_vllm, "true → engine: vllm"),
    "vllm_mode": Default(("colocate",), "the vllm engine runs in the training process (colocate); server mode "
                                        "is not offered"),
    "vllm_model_impl": Default(("vllm",), "vLLM's own model implementation is used"),
    "vllm_enable_sleep_mode": Default((False,), "vLLM's sleep mode is not used"),
    "vllm_structured_outputs_regex": Default((None,), "structured decoding is not offered"),
    "vllm_server_base_url": _VLLM_ONLY,
    "vllm_server_host": _VLLM_ONLY,
    "vllm_server_port": _VLLM_ONLY,
    "vllm_server_timeout": _VLLM_ONLY,
    "vllm_group_port": _VLLM_ONLY,
    "vllm_gpu_memory_utilization": _engine_option("vllm_gpu_memory_utilization", "gpu_memory_utilization"),
    "vllm_max_model_length": _engine_option("vllm_max_model_length", "max_model_len"),
    "vllm_tensor_parallel_size": _engine_option("vllm_tensor_parallel_size", "tensor_parallel_size"),
    "num_iterations": rename("epochs", "passes over each rollout"),
    "epsilon": Accept(("clip_eps_low", "clip_eps_high"), _epsilon, "ε_low, and ε_high unless epsilon_high is set"),
    "epsilon_high": Accept(("clip_eps_high",), _epsilon_high, "ε_high"),
    "reward_weights": same("reward_weights"),
    "mask_truncated_completions": same("mask_truncated_completions"),
    "sync_ref_model": Default((False,), "the moving reference (TR-DPO) is offered in DPO and online DPO only"),
    "ref_model_mixup_alpha": Ignore("read with sync_ref_model only, which is off here"),
    "ref_model_sync_steps": Ignore("read with sync_ref_model only, which is off here"),
    "log_completions": Accept(("log_completions",), _log_completions,
                              "true → greedy completions of num_completions_to_print (1 if unset) held-out prompts "
                              "at each evaluation"),
    "num_completions_to_print": Accept(("log_completions",), _num_completions_to_print, "read with log_completions"),
    "log_multimodal": Ignore("text recipes log no images"),
    "log_unique_prompts": Ignore("display of logged completions only"),
    "use_transformers_continuous_batching": Default((False,), "generation uses the engine named in engine"),
    "transformers_continuous_batching_config": Default((None,), "generation uses the engine named in engine"),
    "use_transformers_paged": Default((False,), "generation uses the engine named in engine"),
    "max_length": Ignore("the online recipes bound prompts with max_prompt_length and responses with "
                         "max_completion_length"),
}

_LM_OFFLINE: dict[str, Entry] = {
    "disable_dropout": same("disable_dropout"),
    "max_length": same("max_length", "tokens per row; null (no truncation) is not offered: give a number",
                       tp=int),
}

SFT: dict[str, Entry] = {
    **COMMON, **_LM_OFFLINE,
    "dataset_text_field": same("dataset_text_field"),
    "dataset_kwargs": Default((None, {}), "rows are read as they are (text, prompt / completion, messages)"),
    "truncation_mode": Default(("keep_start",), "SFT keeps the start of a long row"),
    "shuffle_dataset": Ignore("rows are visited in a seeded random order each epoch either way"),
    "packing": same("packing"),
    "packing_strategy": Default(("bfd",), "packing is first-fit into rows of max_length, attention kept "
                                          "within each example"),
    "padding_free": Ignore("padding layout only: padded positions are masked"),
    "eval_packing": Default((None,), "evaluation rows are not packed"),
    "completion_only_loss": same("completion_only_loss", "null → true (TRL: on where the data has a completion)",
                                 fn=lambda v: True if v is None else v),
    "assistant_only_loss": same("assistant_only_loss"),
    "loss_type": Default(("nll",), "SFT's loss is the token-mean negative log-likelihood (nll)"),
}

DPO: dict[str, Entry] = {
    **COMMON, **_LM_OFFLINE,
    "truncation_mode": same("truncation_mode", "differs: TRL 1.16 cuts prompt + answer as one sequence; rlcore "
                            "cuts the prompt (keep_end / keep_start of it) only when prompt + the longer answer "
                            "exceed max_length"),
    "padding_free": same("padding_free", "each forward's rows packed into rows of its longest sequence, attention "
                                         "kept within each sequence"),
    "precompute_ref_log_probs": rename("precompute_ref", "reference log-probs computed once before training"),
    "precompute_ref_batch_size": Ignore("memory only: the reference's batch size when precomputing"),
    "loss_type": Accept(("loss_type",), _dpo_loss_type, "one name of PREFERENCE_LOSSES (a list of one is read)"),
    "loss_weights": Default((None,), "one loss is trained; a weighted mix of losses is not offered"),
    "ld_alpha": Default((None,), "LD-DPO's length weighting is not offered"),
    "f_divergence_type": _loss_kwarg("f_divergence_type", "divergence", "reverse_kl"),
    "f_alpha_divergence_coef": _loss_kwarg("f_alpha_divergence_coef", "alpha", 0.5),
    "label_smoothing": _loss_kwarg("label_smoothing", "label_smoothing", 0.0),
    "discopop_tau": _loss_kwarg("discopop_tau", "discopop_tau", 0.05),
    "beta": same("beta"),
    "use_weighting": Default((False,), "WPO's weighting is not offered"),
    "sync_ref_model": same("sync_ref_model"),
    "ref_model_mixup_alpha": same("ref_model_mixup_alpha"),
    "ref_model_sync_steps": same("ref_model_sync_steps"),
    "max_prompt_length": same("max_prompt_length", "rlcore's field (TRL 1.x has none): prompt tokens kept"),
    "max_completion_length": Refuse("not a DPOConfig field of TRL 1.x; rlcore's DPO budget is max_length (prompt + "
                                    "answer) with max_prompt_length: set max_length to prompt + answer tokens"),
}

REWARD: dict[str, Entry] = {
    **COMMON, **_LM_OFFLINE,
    "lora_task_type": Default(("SEQ_CLS", "CAUSAL_LM"), "the reward model's adapter trains with its score head"),
    "center_rewards_coefficient": same("center_rewards_coefficient"),
}

GRPO: dict[str, Entry] = {
    **COMMON, **_ONLINE,
    "cast_lm_head_to_fp32": Default((False,), "the head runs in the weights' dtype"),
    "beta": rename("kl_coef", "β of the KL in the loss"),
    "delta": Default((None,), "INTELLECT-2's upper ratio bound is not offered (clip_eps_high, loss_type cispo)"),
    "sapo_temperature_neg": same("sapo_temperature_neg", "τ_neg of the sapo loss"),
    "sapo_temperature_pos": same("sapo_temperature_pos", "τ_pos of the sapo loss"),
    "vespo_k_pos": same("vespo_k_pos", "k of the vespo loss, positive advantages"),
    "vespo_lambda_pos": same("vespo_lambda_pos", "λ of the vespo loss, positive advantages"),
    "vespo_k_neg": same("vespo_k_neg", "k of the vespo loss, negative advantages"),
    "vespo_lambda_neg": same("vespo_lambda_neg", "λ of the vespo loss, negative advantages"),
    "importance_sampling_level": same("importance_sampling_level", "token | sequence (GSPO): the loss's ratio_level"),
    "multi_objective_aggregation": Default(("sum_then_normalize",), "the weighted reward functions are summed, "
                                                                    "then the advantage normalises the sum"),
    "scale_rewards": Accept(("advantage_kwargs",), _scale_rewards, "advantage_kwargs.scale: group | batch | none "
                                                                   "(true → group, false → none)"),
    "loss_type": same("loss_type", "a key of POLICY_LOSSES (TRL 1.16's names among them)"),
    "top_entropy_quantile": Default((1.0,), "every token is trained (no entropy masking)"),
    "entropy_coef": Default((0.0, 0), "no entropy bonus in the GRPO loss"),
    "use_adaptive_entropy": Default((False,), "no entropy bonus in the GRPO loss"),
    "entropy_coef_min": Ignore("read with use_adaptive_entropy only, which is off"),
    "entropy_coef_max": Ignore("read with use_adaptive_entropy only, which is off"),
    "entropy_coef_delta": Ignore("read with use_adaptive_entropy only, which is off"),
    "entropy_target": Ignore("read with use_adaptive_entropy only, which is off"),
    "max_tool_calling_iterations": Default((None,), _NO_TOOLS),
    "vllm_importance_sampling_correction": same("vllm_importance_sampling_correction", "with engine: vllm "
                                                "(loops.online.engine_correction)"),
    "vllm_importance_sampling_mode": same("vllm_importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": same("vllm_importance_sampling_clip_max"),
    "vllm_importance_sampling_clip_min": same("vllm_importance_sampling_clip_min"),
    "vllm_importance_sampling_cap": Accept(("vllm_importance_sampling_clip_max",), _unless_none(
        "vllm_importance_sampling_clip_max"), "older name of vllm_importance_sampling_clip_max (null: unset)"),
    "off_policy_mask_threshold": Default((None,), "off-policy sequence masking is not offered"),
    "use_bias_correction_kl": Default((False,), "the KL term is not weighted by the engine's importance weight"),
    "log_completions_hub_repo": Default((None,), _NO_HUB),
}

RLOO: dict[str, Entry] = {
    **COMMON, **_ONLINE,
    "beta": rename("kl_coef", "β of the k1 KL penalty in the reward"),
    "normalize_advantages": Default((False,), "the leave-one-out advantages are used as they are"),
    "reward_clip_range": Default((None,), "scores are used as they are"),
}

PPO: dict[str, Entry] = {
    **COMMON,
    "disable_dropout": _DROPOUT_RL,
    "num_mini_batches": BATCH,
    "total_episodes": Accept(("steps",), _total_episodes, "steps = ceil(total_episodes ÷ batch_size)"),
    "local_rollout_forward_batch_size": rename("forward_batch_size", "rows per no-grad scoring forward"),
    "num_sample_generations": Ignore("TRL's debug generations print samples only; see log_completions"),
    "response_length": rename("max_new_tokens", "response token budget"),
    "stop_token": Default(("eos",), "EOS always ends a response here; stop_token_id adds more"),
    "stop_token_id": Accept(("stop_token_ids",), _stop_token_id, "→ stop_token_ids: [id]"),
    "temperature": same("temperature"),
    "missing_eos_penalty": same("missing_eos_penalty"),
    "sft_model_path": rename("model", "the policy (and reference) to start from", fn=_a_model("sft_model_path")),
    "reward_model_path": rename("reward_model", "a local sequence-classification folder"),
    "world_size": Refuse("computed by TRL's trainer: rlcore reads WORLD_SIZE from torchrun"),
    "num_total_batches": Refuse("computed by TRL's trainer: set max_steps or total_episodes"),
    "local_batch_size": Refuse("computed by TRL's trainer: set per_device_train_batch_size and "
                               "gradient_accumulation_steps"),
    "local_mini_batch_size": Refuse("computed by TRL's trainer: set num_mini_batches"),
    "mini_batch_size": Refuse("computed by TRL's trainer: set num_mini_batches"),
    "batch_size": same("batch_size", "rlcore's field: prompts per step, all ranks (TRL computes its own from "
                       "per_device_train_batch_size)"),
    "micro_batch_size": same("micro_batch_size", "rlcore's field: rows per forward/backward on a rank"),
    "exp_name": Ignore("a name for TRL's logs only"),
    "model_adapter_name": Default((None,), "one adapter is trained; the reference is the base with it off"),
    "ref_adapter_name": Default((None,), "one adapter is trained; the reference is the base with it off"),
    "num_ppo_epochs": rename("epochs", "passes over each rollout"),
    "whiten_rewards": same("whiten_rewards"),
    "kl_coef": same("kl_coef"),
    "kl_estimator": rename("kl", "k1 | k3"),
    "cliprange": Accept(("clip_eps_low", "clip_eps_high"), _cliprange, "ε of both sides"),
    "vf_coef": same("vf_coef"),
    "cliprange_value": same("cliprange_value"),
    "gamma": same("gamma"),
    "lam": same("lam"),
    "ds3_gather_for_generation": Ignore("a DeepSpeed ZeRO-3 option; DeepSpeed is not used"),
    **dict.fromkeys(["reward_shaping_enable_length", "reward_shaping_enable_repetition", "reward_shaping_enable_eos"],
                    Default((False,), "reward shaping is not offered: use missing_eos_penalty or a reward function")),
    **dict.fromkeys(["reward_shaping_length_coef", "reward_shaping_repetition_coef", "reward_shaping_repetition_ngram",
                     "reward_shaping_eos_bonus", "reward_shaping_eos_missing_penalty",
                     "reward_shaping_eos_out_of_range_penalty", "reward_shaping_eos_min_len",
                     "reward_shaping_eos_max_len"], Ignore("read with a reward_shaping_enable_* switch only, which "
                                                           "is off")),
}

TABLES: dict[str, dict[str, Entry]] = {"sft": SFT, "dpo": DPO, "reward": REWARD, "grpo": GRPO, "rloo": RLOO,
                                       "ppo": PPO}


def table_for(cls: type) -> tuple[str, dict[str, Entry]] | None:
    """``(recipe, table)`` of a recipe's ``Config`` (its module ``rlcore.loops.recipes.<recipe>``), or ``None``."""
    module = getattr(cls, "__module__", "")
    recipe = module.rsplit(".", 1)[-1]
    return (recipe, TABLES[recipe]) if module.startswith("rlcore.loops.recipes.") and recipe in TABLES else None


def _matches(value: Any, allowed: tuple[Any, ...]) -> bool:
    for a in allowed:
        if isinstance(a, bool) or a is None:
            text = str(value).strip().lower() if isinstance(value, str) else value
            if value is a or (isinstance(value, str) and text == {True: "true", False: "false", None: "null"}[a]) \
                    or (a is None and text in ("none", "~", "")):
                return True
        elif isinstance(a, (int, float)) and not isinstance(value, bool):
            try:
                if float(value) == a:
                    return True
            except (TypeError, ValueError):
                pass
        elif isinstance(a, (list, tuple, dict)):
            if value == a or (isinstance(value, (list, tuple)) and list(value) == list(a)):
                return True
        elif value == a:
            return True
    return False


def translate(cls: type, raw: Mapping[str, Any], coerce: Callable[[str, Any], Any]) -> dict[str, Any]:
    """``raw`` (YAML + overrides) with TRL's names translated to ``cls``'s fields by its recipe's table.

    ``coerce(field, value)`` reads a value as the field's type (to compare a TRL name's translation
    with the rlcore name given beside it). Raises ``ValueError`` naming each refused name with its
    reason, each out-of-range value of a ``Default`` entry, and each rlcore field given both
    directly and through a TRL name with different values (or through two TRL names)."""
    found = table_for(cls)
    if found is None:
        return dict(raw)
    recipe, table = found
    fields = {f.name: f for f in dataclasses.fields(cls)}
    defaults = {name: f.default for name, f in fields.items() if f.default is not dataclasses.MISSING}
    defaults.update({name: f.default_factory() for name, f in fields.items()
                     if f.default_factory is not dataclasses.MISSING})
    trl = {k: v for k, v in raw.items() if k in table}
    given = {k: v for k, v in raw.items() if k in fields}
    ctx = Context(recipe, trl, given, defaults, int(os.environ.get("WORLD_SIZE", "1") or 1), coerce)
    out = {k: v for k, v in raw.items() if k not in table}
    faults: list[str] = []
    derived: dict[str, tuple[Any, str]] = {}
    for name, value in trl.items():
        entry = table[name]
        if isinstance(entry, Refuse):
            faults.append(f"{name}: got {value!r}; {entry.reason}")
        elif isinstance(entry, Default):
            if not _matches(value, entry.values):
                allowed = " or ".join(repr(v) for v in entry.values)
                faults.append(f"{name}: got {value!r}, accepted only as {allowed} (which changes "
                              f"nothing here); {entry.reason}")
        elif isinstance(entry, Accept):
            try:
                produced = entry.convert(value, ctx)
            except ValueError as e:
                faults.append(str(e))
                continue
            for field, result in produced.items():
                if field not in fields:
                    continue
                try:
                    result = coerce(field, result)
                except ValueError as e:
                    faults.append(f"{name}: {e}")
                    continue
                if field in derived and derived[field][0] != result:
                    other, by = derived[field]
                    faults.append(f"{name}: sets {field}={result!r} but {by} sets {field}={other!r}; give one")
                    continue
                derived[field] = (result, name)
    for field, (result, by) in derived.items():
        if field in out and by != field:
            try:
                mine = coerce(field, out[field])
            except ValueError:
                continue  # load_config reports it
            if mine != result and not (isinstance(mine, dict) and isinstance(result, dict) and
                                       {**mine, **result} == result):
                faults.append(f"{field}: got {mine!r}, but TRL's {by} gives {field}={result!r}; give one of them "
                              "(or the same value)")
                continue
        out[field] = result
    if faults:
        raise ValueError(f"{cls.__name__} ({recipe}, TRL names): " + "; ".join(faults))
    return out


def trl_names_by_field(recipe: str) -> dict[str, list[str]]:
    """``rlcore field -> the TRL names that set it`` (other than its own name), for ``--help``."""
    names: dict[str, list[str]] = {}
    for name, entry in TABLES.get(recipe, {}).items():
        if isinstance(entry, Accept):
            for field in entry.to:
                if field != name:
                    names.setdefault(field, []).append(name)
    return names


def _describe(entry: Entry) -> tuple[str, str, str]:
    if isinstance(entry, Accept):
        return "accepted", ", ".join(f"`{f}`" for f in entry.to), entry.note
    if isinstance(entry, Default):
        return "default only", " or ".join(f"`{v!r}`" for v in entry.values), entry.reason
    if isinstance(entry, Ignore):
        return "ignored", "", entry.note
    return "refused", "", entry.reason


def markdown_table() -> str:
    """Every TRL name of every table as a Markdown table (docs/from_trl.md holds it; a test compares)."""
    rows = ["| TRL name | recipes | kind | rlcore | meaning here |", "| --- | --- | --- | --- | --- |"]
    names = sorted({n for t in TABLES.values() for n in t})
    for name in names:
        groups: list[tuple[tuple[str, str, str], list[str]]] = []
        for recipe, table in TABLES.items():
            if name not in table:
                continue
            described = _describe(table[name])
            for seen, recipes in groups:
                if seen == described:
                    recipes.append(recipe)
                    break
            else:
                groups.append((described, [recipe]))
        for (kind, ours, note), recipes in groups:
            where = "all" if len(recipes) == len(TABLES) else ", ".join(recipes)
            note = note.replace("|", "\\|")
            ours = ours.replace("|", "\\|")
            rows.append(f"| `{name}` | {where} | {kind} | {ours} | {note} |")
    return "\n".join(rows) + "\n"
