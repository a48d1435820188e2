"""DDPO recipe: RL fine-tuning of a diffusion model, ``state, history = train(Config())``.

One fold step is one DDPO epoch, read top to bottom:

1. ``collect``: ``sample_num_batches_per_epoch`` batches of ``sample_batch_size`` DDIM chains
   (``sample_eta > 0``, classifier-free guidance) with each step's log-prob; the final images are
   scored by the reward function, in a thread pool while the next batch samples when
   ``async_reward_computation``;
2. ``score``: advantages from the epoch's reward statistics, or per prompt (``PromptStats``, an
   explicit state in ``state.transforms["prompt_stats"]``);
3. ``train_epoch``: ``train_num_inner_epochs`` passes; each shuffles the samples, keeps a random
   ``train_timestep_fraction`` of every sample's steps (``timestep_rows``) and takes one optimiser
   step per ``sample_batch_size`` samples, accumulating the gradients of all their kept steps in
   micro-batches of ``train_batch_size`` rows (``train_batch_size`` samples at one step index, as
   DDPO does). The ratio's log-probs are recomputed with the sampling guidance.

Two kinds of model, one recipe:

- ``model: None`` (the default): a tiny class-conditional denoiser in pixel space
  (``loops.diffusion.build_denoiser``), prompts mapped to class ids;
- ``model: PATH``: a local Stable Diffusion pipeline folder (``loops.sd``): prompts encoded by its
  text encoder (the negative prompt ``negative_prompts`` is the unconditional branch of guidance),
  latents denoised by its UNet with its scheduler's configuration as a DDIM schedule, images
  decoded by its VAE for the reward. ``train_use_lora`` trains a LoRA adapter on the UNet's
  attention projections only: checkpoints hold the adapter, and ``run_dir/lora`` receives it in
  the diffusers LoRA format at the end (``pipeline.load_lora_weights``). ``mixed_precision: bf16``
  keeps the frozen weights in bfloat16 and runs every forward under autocast.

Prompts are drawn from ``prompts`` (or the lines of ``prompt_file``) with the run's generator, or
come from a ``prompt_fn() -> (prompt, metadata)`` given to ``train``; a reward function is
``reward_fn(images, prompts)`` or ``reward_fn(images, prompts, metadata)`` (DDPO's signature).
Every epoch ``image_samples_hook(prompt_image_data, step, run_dir)`` receives the last sample
batch (default: its grid to ``run_dir/images/samples-N.png``; the trackers of ``report_to`` get
every grid written there). Every ``eval_every`` epochs, ``evaluate`` samples ``num_eval_images``
images from fixed noise (``eval/reward_mean`` in the metrics) and saves their grid to
``run_dir/images/epoch-N.png``; checkpoints, JSONL logs and resuming are ``loops.recipe.run``'s.

References: Black et al., "Training Diffusion Models with Reinforcement Learning",
https://arxiv.org/abs/2305.13301
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import random
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from rlcore import keys as K
from rlcore.algorithms.ddpo import batch_advantages, ddpo_loss, prompt_stats
from rlcore.loops.aesthetic import build_aesthetic_scorer, load_aesthetic_scorer
from rlcore.loops.checkpoint import latest_checkpoint, load_checkpoint
from rlcore.loops.diffusion import (build_denoiser, ddim_schedule, pretrain_denoiser, row_condition,
                                    sample_trajectories, step_logprobs, timestep_rows)
from rlcore.loops.images import get_reward_fn, latents_to_images, save_image_grid, score_images
from rlcore.loops.config import coerce_tuples, ensure_checked
from rlcore.loops.dist import all_gather_rows, all_gather_strings, dist_info, is_main
from rlcore.loops.recipe import run, shard_models
from rlcore.loops.sd import (LORA_TARGETS, LatentDecoder, TextEncoder, apply_unet_lora, export_lora,
                             load_pipeline, pipeline_schedule, scheduler_config)
from rlcore.loops.settings import (AT_LEAST_0, AT_LEAST_1, OPEN_UNIT, POSITIVE, UNIT, ModelSettings, RewardModelSettings,
                                   Rule, RunSettings, ShardingSettings, Section, setting)
from rlcore.loops.state import TrainState, advance, copy_generator, init_state, with_transforms
from rlcore.loops.update import chain, clip_by_global_norm, make_optimizer, skip_nonfinite, update
from rlcore.transforms import StateTransform

__all__ = ["Config", "build_state", "collect", "score", "train_epoch", "step", "evaluate", "train",
           "checkpoint_state", "prompt_table", "eval_prompts", "reward_function", "save_sample_grid"]

PromptFn = Callable[[], tuple[str, Any]]


@dataclasses.dataclass(frozen=True)
class DDPOSettings(Section):
    """DDPO's own settings, named and defaulted as DDPO's trainer options; each help says what the
    field feeds."""

    prompts: tuple[str, ...] = setting(("stripes", "checkers", "blob"), help="drawn prompts; the tiny denoiser's classes")
    prompt_file: str | None = setting(None, help="prompts drawn instead: one per line, or JSON lines {\"prompt\", ...metadata}")
    negative_prompts: str = setting("", help="the unconditional branch of guidance (pipeline; \"\" the empty prompt)")
    sample_size: int = setting(16, help="build_denoiser(sample_size=): images [3, H, W], pixel space", range=AT_LEAST_1)
    block_out_channels: tuple[int, ...] = setting((16, 32), help="build_denoiser(block_out_channels=)")
    pretrain_steps: int = setting(0, help="pretrain_denoiser(steps=) on synthetic prompts first (0: none)", range=AT_LEAST_0)
    pretrain_learning_rate: float = setting(1e-3, help="pretrain_denoiser(lr=)", range=AT_LEAST_0)
    num_train_timesteps: int = setting(1000, help="ddim_schedule(num_train_timesteps=) (a pipeline: its scheduler's)", range=AT_LEAST_1)
    beta_schedule: str = setting("linear", help="ddim_schedule(beta_schedule=) (a pipeline: its scheduler's)")
    prediction_type: str = setting("epsilon", help="ddim_schedule(prediction_type=): epsilon, sample, v_prediction")
    allow_tf32: bool = setting(True, help="TF32 matmuls and convolutions on CUDA")
    train_use_lora: bool = setting(False, help="pipeline: train a LoRA adapter on the UNet (apply_unet_lora), not the UNet")
    sample_num_steps: int = setting(50, help="ddim_schedule(num_inference_steps=): S", range=AT_LEAST_1)
    sample_eta: float = setting(1.0, help="ddim_step(eta=): stochastic steps", range=POSITIVE)
    sample_guidance_scale: float = setting(5.0, help="predict_noise(guidance_scale=), in sampling (and training: train_cfg)")
    sample_batch_size: int = setting(1, help="trajectories per sample batch (and per optimiser step)", range=AT_LEAST_1)
    sample_num_batches_per_epoch: int = setting(2, help="sample batches per epoch", range=AT_LEAST_1)
    reward_fn: str = setting("jpeg_compressibility", help="a REWARD_FUNCTIONS name, or \"aesthetic\" (loops.aesthetic)")
    async_reward_computation: bool = setting(False, help="rewards in a thread pool while the next batch samples")
    max_workers: int = setting(2, help="threads of that pool", range=AT_LEAST_1)
    per_prompt_stat_tracking: bool = setting(False, help="algorithms.ddpo.prompt_stats instead of batch_advantages")
    per_prompt_stat_tracking_buffer_size: int = setting(16, help="algorithms.ddpo.prompt_stats(buffer_size=)", range=AT_LEAST_0)
    per_prompt_stat_tracking_min_count: int = setting(16, help="algorithms.ddpo.prompt_stats(min_count=)", range=AT_LEAST_0)
    train_batch_size: int = setting(1, help="update(micro_batch_size=): rows per forward/backward", range=AT_LEAST_1)
    train_learning_rate: float = setting(3e-4, help="make_optimizer(lr=)", range=AT_LEAST_0)
    train_adam_beta1: float = setting(0.9, help="make_optimizer(betas=)", range=UNIT)
    train_adam_beta2: float = setting(0.999, help="make_optimizer(betas=)", range=UNIT)
    train_adam_weight_decay: float = setting(1e-4, help="make_optimizer(weight_decay=)", range=AT_LEAST_0)
    train_adam_epsilon: float = setting(1e-8, help="make_optimizer(eps=)", range=POSITIVE)
    train_max_grad_norm: float = setting(1.0, help="update's clip_by_global_norm(max_norm)", range=POSITIVE)
    train_num_inner_epochs: int = setting(1, help="passes over each epoch's samples", range=AT_LEAST_1)
    train_cfg: bool = setting(True, help="training log-probs with the sampling guidance (else conditional only)")
    train_adv_clip_max: float = setting(5.0, help="ddpo_loss(adv_clip_max=)", range=AT_LEAST_0)
    train_clip_range: float = setting(1e-4, help="ddpo_loss(clip_range=)", range=AT_LEAST_0)
    train_timestep_fraction: float = setting(1.0, help="timestep_rows(timestep_fraction=)", range=OPEN_UNIT)
    num_epochs: int = setting(100, help="fold steps (one DDPO epoch each)", range=AT_LEAST_1)
    num_eval_images: int = setting(16, help="evaluate(): images sampled, prompts in turn")
    eval_seed: int = setting(1234, help="evaluate(): the seed of their fixed noise", range=Rule(lambda v: 0 <= v < 2**32, "in [0, 2**32)"))


@dataclasses.dataclass(frozen=True)
class Config(DDPOSettings, RewardModelSettings, ModelSettings, RunSettings, ShardingSettings,
             defaults={"model": None, "lora_r": 4, "lora_alpha": 4, "lora_target_modules": LORA_TARGETS, "run_dir": "runs/ddpo", "save_every": 1, "keep_last": 5, "eval_every": 1, "log_every": 1}):
    """DDPO settings, named and defaulted as DDPO's trainer options (``configs/ddpo.yaml`` holds
    the tiny model's, ``configs/ddpo_sd.yaml`` a Stable Diffusion pipeline's); each comment says
    what the field feeds.

    ``train_gradient_accumulation_steps`` is derived: ``sample_batch_size // train_batch_size``
    train batches (each over all its kept steps) per optimiser step. With ``train_cfg`` (DDPO's
    default) the training log-probs use the sampling guidance, so the first ratio is exactly 1;
    without it they are the conditional model's alone.
    """

    def __post_init__(self):
        coerce_tuples(self)  # prompts="a cat" is one prompt, lora_target_modules="to_q" one module
        if self.sample_batch_size % self.train_batch_size:
            raise ValueError(f"sample_batch_size ({self.sample_batch_size}) must be a multiple of "
                             f"train_batch_size ({self.train_batch_size})")
        if not 0 < self.train_timestep_fraction <= 1 or int(self.sample_num_steps * self.train_timestep_fraction) < 1:
            raise ValueError(f"train_timestep_fraction: expected (0, 1] keeping at least one of the "
                             f"{self.sample_num_steps} steps, got {self.train_timestep_fraction}")
        if self.lora_target_modules is None:
            raise ValueError("lora_target_modules: expected the UNet's module names (default: "
                             f"{list(LORA_TARGETS)}), got None")
        if self.sample_eta <= 0:
            raise ValueError(f"sample_eta: DDPO needs stochastic steps (eta > 0), got {self.sample_eta}")
        if self.mixed_precision not in (None, "no", "bf16"):
            raise ValueError(f"mixed_precision: expected 'bf16' or None, got {self.mixed_precision!r} (float16 "
                             "training needs loss scaling, which is not offered; bf16 needs none)")
        if not isinstance(self.negative_prompts, str):
            raise ValueError(f"negative_prompts: expected one string (every sample's negative prompt), got "
                             f"{type(self.negative_prompts).__name__} {self.negative_prompts!r}")
        for name in ("train_use_lora", "gradient_checkpointing"):
            if getattr(self, name) and self.model is None:
                raise ValueError(f"{name}: a pipeline's UNet only (set model to a Stable Diffusion folder); the "
                                 "tiny denoiser trains in full")

    @property
    def train_gradient_accumulation_steps(self) -> int:
        return self.sample_batch_size // self.train_batch_size


# --- prompts, conditioning, images -----------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _read_prompt_file(path: str, mtime_ns: int) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"prompt_file: {path} holds no prompt")
    if not lines[0].lstrip().startswith("{"):
        return tuple(lines), ({},) * len(lines)
    prompts, metadata = [], []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            prompts.append(row.pop("prompt"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"prompt_file: {path} line {i}: expected a JSON object with a 'prompt' string, "
                             f"got {line[:80]!r}") from None
        if not isinstance(prompts[-1], str):
            raise ValueError(f"prompt_file: {path} line {i}: 'prompt' must be a string, got {prompts[-1]!r}")
        metadata.append(row)
    return tuple(prompts), tuple(metadata)


def prompt_table(config: Config) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The prompts drawn from and their metadata: ``prompt_file``'s (plain lines, or JSON lines
    whose other fields are the metadata), else ``prompts`` with empty metadata."""
    if config.prompt_file:
        path = Path(config.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt_file: {path} is not a file")
        return _read_prompt_file(str(path), path.stat().st_mtime_ns)  # re-read when the file changes
    return tuple(config.prompts), ({},) * len(config.prompts)


def _draw_prompts(g: torch.Generator | None, config: Config, n: int, prompt_fn: PromptFn | None):
    if prompt_fn is None:
        prompts, metadata = prompt_table(config)
        idx = torch.randint(len(prompts), (n,), generator=g, device=g.device).tolist()
        return [prompts[i] for i in idx], [metadata[i] for i in idx]
    pairs = [prompt_fn() for _ in range(n)]
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ValueError(f"prompt_fn: expected (prompt: str, metadata) pairs, got {pairs[0]!r}")
    return [p for p, _ in pairs], [m for _, m in pairs]


def _condition(state: TrainState, config: Config, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """The conditioning of ``prompts``: the pipeline's text embeddings (and the negative prompt's),
    or the tiny denoiser's class ids."""
    if config.model is not None:
        encode = state.model("text_encoder")
        with _autocast(config):
            negative = encode([config.negative_prompts]).float()  # one prompt for every sample: encoded once
            return {K.PROMPT_EMBEDS: encode(prompts).float(),
                    K.NEGATIVE_PROMPT_EMBEDS: negative.expand(len(prompts), -1, -1)}
    unknown = sorted(set(prompts) - set(config.prompts))
    if unknown:
        raise ValueError(f"prompts: the tiny denoiser's classes are {list(config.prompts)}; got {unknown[:4]} "
                         "(text prompts need a pipeline: set model)")
    return {K.CLASS_LABELS: torch.tensor([config.prompts.index(p) for p in prompts], device=config.device)}


def _decode(state: TrainState, config: Config, latents: torch.Tensor) -> torch.Tensor:
    """Final latents to images in ``[0, 1]`` on the CPU: the pipeline's VAE, or the pixels themselves."""
    if config.model is None:
        return latents_to_images(latents).cpu()
    with _autocast(config), torch.no_grad():
        return state.model("vae")(latents).float().cpu()


def _autocast(config: Config):
    if config.mixed_precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16)


def _autocast_dtype(config: Config) -> torch.dtype | None:
    return torch.bfloat16 if config.mixed_precision == "bf16" else None


@functools.lru_cache(maxsize=8)
def _pipeline_schedule(path: str, steps: int, mtime_ns: int):
    return pipeline_schedule(scheduler_config(path), steps)


def _schedule(config: Config):
    if config.model is not None:
        stamp = (Path(config.model) / "scheduler" / "scheduler_config.json").stat().st_mtime_ns
        return _pipeline_schedule(str(config.model), config.sample_num_steps, stamp)  # re-read when it changes
    return ddim_schedule(config.sample_num_steps, num_train_timesteps=config.num_train_timesteps,
                         beta_schedule=config.beta_schedule, prediction_type=config.prediction_type)


def _sampling(config: Config, *, training: bool = False) -> dict:
    guidance = config.sample_guidance_scale if config.train_cfg or not training else 1.0
    return dict(eta=config.sample_eta, guidance_scale=guidance,
                null_class=len(config.prompts) if config.model is None else None)


def _sample(state: TrainState, config: Config, condition, generator: torch.Generator) -> TensorDict:
    with _autocast(config):
        return sample_trajectories(state.model(), condition, _schedule(config), generator=generator,
                                   dtype=torch.float32 if config.model is not None else None, **_sampling(config))


def reward_function(config: Config, reward_fn: str | Callable | None = None) -> Callable:
    """``reward_fn`` (a callable or a ``REWARD_FUNCTIONS`` name), else ``config.reward_fn``:
    ``"aesthetic"`` is the scorer of ``reward_model`` (``loops.aesthetic``)."""
    name = config.reward_fn if reward_fn is None else reward_fn
    if name == "aesthetic":
        return load_aesthetic_scorer(config.reward_model) if config.reward_model else build_aesthetic_scorer()
    return get_reward_fn(name)


def _prompt_stats(config: Config) -> StateTransform:
    """The per-prompt statistics of the run, hyper-parameters bound (``algorithms.ddpo.prompt_stats``)."""
    return prompt_stats(config.per_prompt_stat_tracking_buffer_size, config.per_prompt_stat_tracking_min_count)


# --- the models -----------------------------------------------------------------------------------------
def _pipeline_models(config: Config) -> dict[str, torch.nn.Module]:
    """The pipeline's UNet (the policy; with a LoRA adapter when ``train_use_lora``), text encoder and
    VAE (frozen; bfloat16 under ``mixed_precision``)."""
    pipeline = load_pipeline(config.model)
    _schedule(config)  # a scheduler ddim_step cannot follow fails here, before any sampling

    def frozen(module: torch.nn.Module) -> torch.nn.Module:  # the pipeline loads in float32
        return module.to(torch.bfloat16) if config.mixed_precision == "bf16" else module

    unet = pipeline.unet
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if config.train_use_lora:
        unet = apply_unet_lora(frozen(unet.requires_grad_(False)), r=config.lora_r, alpha=config.lora_alpha,
                               target_modules=config.lora_target_modules, seed=config.seed)
    return {"policy": unet.to(config.device),
            "text_encoder": TextEncoder(pipeline.tokenizer, frozen(pipeline.text_encoder)).to(config.device),
            "vae": LatentDecoder(frozen(pipeline.vae)).to(config.device)}


def build_state(config: Config, *, pretrain: bool = True) -> TrainState:
    """The policy (the tiny denoiser, pre-trained when ``pretrain_steps``; or a pipeline's UNet
    beside its frozen text encoder and VAE), AdamW over what trains, empty prompt statistics, the rng."""
    ensure_checked(config)  # a bad setting (an unknown strategy...) refused before any model is built
    if config.model is not None:
        models = _pipeline_models(config)
    else:
        model = build_denoiser(len(config.prompts), sample_size=config.sample_size,
                               block_out_channels=config.block_out_channels, seed=config.seed).to(config.device)
        if pretrain and config.pretrain_steps:
            pretrain_denoiser(model, _schedule(config), config.prompts, steps=config.pretrain_steps,
                              lr=config.pretrain_learning_rate, seed=config.seed)
        models = {"policy": model}
    models = shard_models(models, config)  # strategy fsdp2: the UNet's blocks sharded over the ranks
    optimizer = make_optimizer(models["policy"], lr=config.train_learning_rate,
                               weight_decay=config.train_adam_weight_decay,
                               betas=(config.train_adam_beta1, config.train_adam_beta2), eps=config.train_adam_epsilon)
    stats = _prompt_stats(config).init()
    return init_state(models, optimizer=optimizer, transforms={"prompt_stats": stats}, seed=config.seed,
                      device=config.device)


# --- the epoch ---------------------------------------------------------------------------------------
class _Inline:
    """An executor that runs at once (synchronous reward computation)."""

    def submit(self, fn, *args) -> Future:
        future = Future()
        future.set_result(fn(*args))
        return future


def collect(state: TrainState, config: Config, reward_fn: Callable, executor=None, *,
            prompt_fn: PromptFn | None = None):
    """Sample the epoch's trajectories with ``state.rng``, score their images: ``(state, rollout [B])``
    with the trajectories, ``score``, ``images`` and the ``prompt`` / ``prompt_metadata`` of each.
    ``executor``: where the reward function runs (``submit``), default inline; ``prompt_fn``:
    ``() -> (prompt, metadata)``, default drawn from ``prompt_table(config)`` with ``state.rng``."""
    executor = executor if executor is not None else _Inline()
    g = copy_generator(state.rng)
    draw = _rank_generator(g)
    batches, futures = [], []
    for _ in range(config.sample_num_batches_per_epoch):
        prompts, metadata = _draw_prompts(draw, config, config.sample_batch_size, prompt_fn)
        batch = _sample(state, config, _condition(state, config, prompts), draw)
        images = _decode(state, config, batch.get(K.LATENTS)[:, -1])
        futures.append(executor.submit(score_images, reward_fn, images, prompts, metadata))
        batch.set(K.IMAGES, images.to(config.device))
        batch.set(K.PROMPT, NonTensorStack(*prompts))
        batch.set(K.PROMPT_METADATA, NonTensorStack(*metadata))
        batches.append(batch)
    rewards = torch.cat([f.result() for f in futures]).to(config.device)
    return dataclasses.replace(state, rng=g), torch.cat(batches).update({K.SCORE: rewards})


def _rank_generator(g: torch.Generator) -> torch.Generator:
    """The generator this rank samples with: ``g`` in one process; on several ranks one seeded from a
    draw of ``g`` (every rank draws alike, so ``g`` stays the same on all) and the rank, so each
    rank samples its own prompts and noise (DDPO's per-device sampling)."""
    info = dist_info()
    if not info.distributed:
        return g
    seed = int(torch.randint(2**62, (1,), generator=g, device=g.device))
    return torch.Generator(device=g.device).manual_seed(zlib.crc32(f"{seed}:{info.rank}".encode()))


def score(state: TrainState, rollout, config: Config):
    """Advantages ``[B]`` from the batch's rewards, or per prompt (updating ``prompt_stats``). On
    several ranks the rewards (and prompts) of every rank are gathered first, as DDPO gathers them,
    so the statistics are those of the global batch; each rank keeps its rows' advantages."""
    rewards = all_gather_rows(rollout.get(K.SCORE))
    info, b = dist_info(), rollout.batch_size[0]
    if config.per_prompt_stat_tracking:
        names = all_gather_strings(list(rollout.get(K.PROMPT).tolist()))
        stats, advantages = _prompt_stats(config).update(state.transforms["prompt_stats"], names, rewards)
        state = with_transforms(state, prompt_stats=stats)
    else:
        advantages = batch_advantages(rewards)
    advantages = advantages[info.rank * b:(info.rank + 1) * b]  # all of them in one process
    return state, rollout.copy().update({K.ADVANTAGES: advantages})


def train_epoch(state: TrainState, rollout, config: Config):
    """``train_num_inner_epochs`` passes of ``ddpo_loss``; one optimiser step per sample batch (impure)."""
    schedule, loss = _schedule(config), functools.partial(
        ddpo_loss, clip_range=config.train_clip_range, adv_clip_max=config.train_adv_clip_max)
    trajectories = rollout.exclude(K.IMAGES, K.PROMPT, K.PROMPT_METADATA)

    b, sb, history = rollout.batch_size[0], config.sample_batch_size, []
    for _ in range(config.train_num_inner_epochs):
        g = copy_generator(state.rng)
        perm = torch.randperm(b, generator=g, device=g.device)
        shuffled = trajectories[perm]

        def loss_fn(state, rows, shuffled=shuffled):
            rows = row_condition(rows, shuffled)
            logprobs = step_logprobs(state.model(), rows, schedule, **_sampling(config, training=True))
            return loss(rows.copy().update({K.LOGPROBS: logprobs}))

        rows = timestep_rows(shuffled, timestep_fraction=config.train_timestep_fraction, generator=g)
        n = rows.batch_size[1]  # step-major within each sample batch: a micro-batch = samples at one step index
        order = torch.arange(b * n, device=perm.device).reshape(b // sb, sb, n).transpose(1, 2).reshape(-1)
        state, metrics = update(dataclasses.replace(state, rng=g), rows.reshape(-1)[order], loss_fn,
                                minibatch_size=sb * n, micro_batch_size=config.train_batch_size,
                                transform=chain(skip_nonfinite(), clip_by_global_norm(config.train_max_grad_norm)),
                                shuffle=False,
                                autocast_dtype=_autocast_dtype(config))
        history.append(metrics)
    return state, torch.stack(history).mean(0)  # metrics averaged over the inner epochs


def save_sample_grid(prompt_image_data: list, step: int, run_dir: str | Path | None) -> None:
    """The default ``image_samples_hook``: the grid of the epoch's last sample batch to
    ``run_dir/images/samples-N.png`` (the trackers of ``report_to`` pick it up from there)."""
    if run_dir:
        images = prompt_image_data[-1][0]
        save_image_grid(images, Path(run_dir) / "images" / f"samples-{step:05d}.png")


def step(state: TrainState, _, *, config: Config, reward_fn: Callable, executor=None,
         prompt_fn: PromptFn | None = None, image_samples_hook: Callable | None = None):
    """One DDPO epoch: collect → score → train_epoch; then ``image_samples_hook([[images, prompts,
    metadata, rewards]], step, run_dir)`` with the last sample batch."""
    state, rollout = collect(state, config, reward_fn, executor, prompt_fn=prompt_fn)
    state, rollout = score(state, rollout, config)
    state, metrics = train_epoch(state, rollout, config)
    rewards, n = rollout.get(K.SCORE), rollout.batch_size[0]
    state = advance(state, samples_seen=n, episodes=n)
    if image_samples_hook is not None and is_main():  # rank 0's samples, written once
        last = rollout[n - config.sample_batch_size:]
        image_samples_hook([[last.get(K.IMAGES).cpu(), list(last.get(K.PROMPT).tolist()),
                             list(last.get(K.PROMPT_METADATA).tolist()), last.get(K.SCORE).cpu()]],
                           state.step + 1, config.run_dir)
    rewards = TensorDict({"reward_mean": rewards.mean(), "reward_std": rewards.std(correction=0)}, [])
    return state, rewards.update(metrics)  # the reward first: the progress line shows the first metrics


def eval_prompts(config: Config, prompt_fn: PromptFn | None = None) -> tuple[list[str], list[Any]]:
    """The held-out prompts and metadata of ``evaluate``: ``num_eval_images`` of ``prompt_table(config)``
    in turn, or ``prompt_fn`` called that many times with the global RNGs (Python, NumPy, torch)
    seeded by ``eval_seed`` and restored afterwards: the same prompts in every evaluation and run,
    and the training draws untouched."""
    n = config.num_eval_images
    if prompt_fn is None:
        table, meta = prompt_table(config)
        return [table[i % len(table)] for i in range(n)], [meta[i % len(table)] for i in range(n)]
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            random.seed(config.eval_seed)
            np.random.seed(config.eval_seed)
            torch.manual_seed(config.eval_seed)
            return _draw_prompts(None, config, n, prompt_fn)
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@torch.no_grad()
def evaluate(state: TrainState, config: Config, *, reward_fn: Callable | None = None,
             save_to: str | Path | None = None, prompts: tuple[list[str], list[Any]] | None = None) -> dict[str, float]:
    """Mean and std reward of ``num_eval_images`` samples from fixed noise (``eval_seed``) for the
    prompts and metadata ``prompts`` (default ``eval_prompts(config)``); their grid is written to
    ``save_to`` (a PNG path) when given."""
    g = torch.Generator(device=config.device).manual_seed(config.eval_seed)
    names, metadata = prompts if prompts is not None else eval_prompts(config)
    batch = _sample(state, config, _condition(state, config, names), g)
    images = _decode(state, config, batch.get(K.LATENTS)[:, -1])
    rewards = score_images(reward_function(config, reward_fn), images, names, metadata)
    if save_to is not None:
        save_image_grid(images, save_to)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(correction=0))}


def train(config: Config, *, reward_fn: Callable | None = None, prompt_fn: PromptFn | None = None,
          image_samples_hook: Callable | None = save_sample_grid,
          callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with DDPO from ``config``.

    Args:
        reward_fn: ``(images, prompts[, metadata]) -> [B]``; overrides ``config.reward_fn``.
        prompt_fn: ``() -> (prompt, metadata)``, called once per sample (DDPO's ``prompt_fn``);
            default: ``prompt_table(config)`` drawn with the run's generator. The evaluations use
            ``num_eval_images`` of its prompts drawn once (``eval_prompts``).
        image_samples_hook: ``(prompt_image_data, step, run_dir)`` every epoch (``None``: none).
    """
    reward_fn = reward_function(config, reward_fn)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.allow_tf32
    resuming = bool(config.resume and config.run_dir and latest_checkpoint(config.run_dir))
    state = build_state(config, pretrain=not resuming)  # a resumed run loads its weights instead

    held_out = eval_prompts(config, prompt_fn)

    def eval_fn(state):
        grid = Path(config.run_dir) / "images" / f"epoch-{state.step:05d}.png" if config.run_dir and is_main() \
            else None
        return evaluate(state, config, reward_fn=reward_fn, save_to=grid, prompts=held_out)

    pool = ThreadPoolExecutor(config.max_workers) if config.async_reward_computation else None
    try:
        bound = functools.partial(step, config=config, reward_fn=reward_fn, executor=pool or _Inline(),
                                  prompt_fn=prompt_fn, image_samples_hook=image_samples_hook)
        state, history = run(bound, state, itertools.repeat(None), config=config, num_steps=config.num_epochs,
                             eval_fn=eval_fn, name="ddpo", callbacks=callbacks)
    finally:
        if pool is not None:
            pool.shutdown()
    if config.train_use_lora and config.run_dir:
        export_lora(state.model(), Path(config.run_dir) / "lora")  # every rank (a sharded adapter is gathered)
    return state, history


def checkpoint_state(config: Config, path: str | Path) -> TrainState:
    """The ``TrainState`` saved in checkpoint ``path`` (for ``rlcore eval ddpo``)."""
    return load_checkpoint(path, build_state(config, pretrain=False), restore_global_rng=False)
