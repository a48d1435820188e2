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

Every ``eval_every`` epochs, ``evaluate`` samples ``num_eval_images`` images from fixed noise
(``eval/reward_mean`` in the metrics) and saves their grid to ``run_dir/images/epoch-N.png``;
checkpoints, JSONL logs and resuming are ``loops.recipe.run``'s.

References: Black et al., "Training Diffusion Models with Reinforcement Learning",
https://arxiv.org/abs/2305.13301
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.algorithms.ddpo import batch_advantages, ddpo_loss, prompt_stats
from rlcore.loops.checkpoint import latest_checkpoint, load_checkpoint
from rlcore.loops.diffusion import (build_denoiser, ddim_schedule, pretrain_denoiser, sample_trajectories,
                                    step_logprobs, timestep_rows)
from rlcore.loops.images import get_reward_fn, latents_to_images, save_image_grid, score_images
from rlcore.loops.recipe import run
from rlcore.loops.state import TrainState, advance, copy_generator, init_state, with_transforms
from rlcore.loops.update import make_optimizer, update
from rlcore.transforms import StateTransform

__all__ = ["Config", "build_state", "collect", "score", "train_epoch", "step", "evaluate", "train",
           "checkpoint_state"]


@dataclasses.dataclass(frozen=True)
class Config:
    """DDPO settings, named and defaulted as DDPO's trainer options (``configs/ddpo.yaml`` holds
    the tiny model's); each comment says what the field feeds.

    ``train_gradient_accumulation_steps`` is derived: ``sample_batch_size // train_batch_size``
    train batches (each over all its kept steps) per optimiser step. DDPO's ``train_cfg`` is
    always on: the training log-probs use the sampling guidance, so the first ratio is exactly 1.
    """

    prompts: tuple[str, ...] = ("stripes", "checkers", "blob")  # class names -> ids 0..P-1 (P: the null class)
    sample_size: int = 16                  # build_denoiser(sample_size=): images [3, H, W], pixel space
    block_out_channels: tuple[int, ...] = (16, 32)  # build_denoiser(block_out_channels=)
    pretrain_steps: int = 0                # pretrain_denoiser(steps=) on synthetic prompts first (0: none)
    pretrain_learning_rate: float = 1e-3   # pretrain_denoiser(lr=)
    num_train_timesteps: int = 1000        # ddim_schedule(num_train_timesteps=)
    beta_schedule: str = "linear"          # ddim_schedule(beta_schedule=)
    prediction_type: str = "epsilon"       # ddim_schedule(prediction_type=): epsilon, sample, v_prediction
    device: str = "cpu"                    # model, trajectories and generators
    sample_num_steps: int = 50             # ddim_schedule(num_inference_steps=): S
    sample_eta: float = 1.0                # ddim_step(eta=), > 0
    sample_guidance_scale: float = 5.0     # predict_noise(guidance_scale=), in sampling and training
    sample_batch_size: int = 1             # trajectories per sample batch (and per optimiser step)
    sample_num_batches_per_epoch: int = 2  # sample batches per epoch
    reward_fn: str = "jpeg_compressibility"  # get_reward_fn(): a REWARD_FUNCTIONS name
    async_reward_computation: bool = False  # rewards in a thread pool while the next batch samples
    max_workers: int = 2                   # threads of that pool
    per_prompt_stat_tracking: bool = False  # algorithms.ddpo.prompt_stats instead of batch_advantages
    per_prompt_stat_tracking_buffer_size: int = 16  # algorithms.ddpo.prompt_stats(buffer_size=)
    per_prompt_stat_tracking_min_count: int = 16    # algorithms.ddpo.prompt_stats(min_count=)
    train_batch_size: int = 1              # update(micro_batch_size=): rows per forward/backward
    train_learning_rate: float = 3e-4      # make_optimizer(lr=)
    train_adam_beta1: float = 0.9          # make_optimizer(betas=)
    train_adam_beta2: float = 0.999        # make_optimizer(betas=)
    train_adam_weight_decay: float = 1e-4  # make_optimizer(weight_decay=)
    train_adam_epsilon: float = 1e-8       # make_optimizer(eps=)
    train_max_grad_norm: float = 1.0       # update(max_grad_norm=)
    train_num_inner_epochs: int = 1        # passes over each epoch's samples
    train_adv_clip_max: float = 5.0        # ddpo_loss(adv_clip_max=)
    train_clip_range: float = 1e-4         # ddpo_loss(clip_range=)
    train_timestep_fraction: float = 1.0   # timestep_rows(timestep_fraction=)
    seed: int = 0                          # model init, init_state(seed=): prompts, noise, shuffling
    num_epochs: int = 100                  # fold steps (one DDPO epoch each)
    num_eval_images: int = 16              # evaluate(): images sampled, prompts in turn
    eval_seed: int = 1234                  # evaluate(): the seed of their fixed noise
    run_dir: str | None = "runs/ddpo"      # checkpoints, metrics.jsonl, images/ (None: write nothing)
    save_every: int = 1                    # checkpoint every N epochs (DDPO save_freq)
    keep_last: int | None = 5              # checkpoints kept (DDPO num_checkpoint_limit)
    eval_every: int = 1                    # evaluate (and save an image grid) every N epochs (0: never)
    log_every: int = 1                     # progress line every N epochs
    report_to: tuple[str, ...] = ()           # trackers besides metrics.jsonl: tensorboard, wandb (TRL report_to)
    resume: bool = False                   # continue from the latest checkpoint of run_dir

    def __post_init__(self):
        if self.sample_batch_size % self.train_batch_size:
            raise ValueError(f"sample_batch_size ({self.sample_batch_size}) must be a multiple of "
                             f"train_batch_size ({self.train_batch_size})")
        if not 0 < self.train_timestep_fraction <= 1 or int(self.sample_num_steps * self.train_timestep_fraction) < 1:
            raise ValueError(f"train_timestep_fraction: expected (0, 1] keeping at least one of the "
                             f"{self.sample_num_steps} steps, got {self.train_timestep_fraction}")
        if self.sample_eta <= 0:
            raise ValueError(f"sample_eta: DDPO needs stochastic steps (eta > 0), got {self.sample_eta}")

    @property
    def train_gradient_accumulation_steps(self) -> int:
        return self.sample_batch_size // self.train_batch_size


def _schedule(config: Config):
    return ddim_schedule(config.sample_num_steps, num_train_timesteps=config.num_train_timesteps,
                         beta_schedule=config.beta_schedule, prediction_type=config.prediction_type)


def _sampling(config: Config) -> dict:
    return dict(eta=config.sample_eta, guidance_scale=config.sample_guidance_scale, null_class=len(config.prompts))


def _names(config: Config, labels: torch.Tensor) -> list[str]:
    return [config.prompts[i] for i in labels.tolist()]


def _prompt_stats(config: Config) -> StateTransform:
    """The per-prompt statistics of the run, hyper-parameters bound (``algorithms.ddpo.prompt_stats``)."""
    return prompt_stats(config.per_prompt_stat_tracking_buffer_size, config.per_prompt_stat_tracking_min_count)


def build_state(config: Config, *, pretrain: bool = True) -> TrainState:
    """The denoiser (pre-trained when ``pretrain_steps``), AdamW, empty prompt statistics, the rng."""
    model = build_denoiser(len(config.prompts), sample_size=config.sample_size,
                           block_out_channels=config.block_out_channels, seed=config.seed).to(config.device)
    if pretrain and config.pretrain_steps:
        pretrain_denoiser(model, _schedule(config), config.prompts, steps=config.pretrain_steps,
                          lr=config.pretrain_learning_rate, seed=config.seed)
    optimizer = make_optimizer(model, lr=config.train_learning_rate, weight_decay=config.train_adam_weight_decay,
                               betas=(config.train_adam_beta1, config.train_adam_beta2), eps=config.train_adam_epsilon)
    stats = _prompt_stats(config).init()
    return init_state(model, optimizer=optimizer, transforms={"prompt_stats": stats}, seed=config.seed,
                      device=config.device)


class _Inline:
    """An executor that runs at once (synchronous reward computation)."""

    def submit(self, fn, *args) -> Future:
        future = Future()
        future.set_result(fn(*args))
        return future


def collect(state: TrainState, config: Config, reward_fn: Callable, executor=None):
    """Sample the epoch's trajectories with ``state.rng``, score their images: ``(state, rollout [B])``.
    ``executor``: where the reward function runs (``submit``), default inline."""
    executor = executor if executor is not None else _Inline()
    g, schedule = copy_generator(state.rng), _schedule(config)
    batches, futures = [], []
    for _ in range(config.sample_num_batches_per_epoch):
        labels = torch.randint(len(config.prompts), (config.sample_batch_size,), generator=g, device=g.device)
        batch = sample_trajectories(state.model(), labels, schedule, generator=g, **_sampling(config))
        images = latents_to_images(batch.get(K.LATENTS)[:, -1]).cpu()
        futures.append(executor.submit(score_images, reward_fn, images, _names(config, labels)))
        batches.append(batch)
    rewards = torch.cat([f.result() for f in futures]).to(config.device)
    return dataclasses.replace(state, rng=g), torch.cat(batches).update({K.SCORE: rewards})


def score(state: TrainState, rollout, config: Config):
    """Advantages ``[B]`` from the batch's rewards, or per prompt (updating ``prompt_stats``)."""
    rewards = rollout.get(K.SCORE)
    if config.per_prompt_stat_tracking:
        names = _names(config, rollout.get(K.CLASS_LABELS))
        stats, advantages = _prompt_stats(config).update(state.transforms["prompt_stats"], names, rewards)
        state = with_transforms(state, prompt_stats=stats)
    else:
        advantages = batch_advantages(rewards)
    return state, rollout.copy().update({K.ADVANTAGES: advantages})


def train_epoch(state: TrainState, rollout, config: Config):
    """``train_num_inner_epochs`` passes of ``ddpo_loss``; one optimiser step per sample batch (impure)."""
    schedule, loss = _schedule(config), functools.partial(
        ddpo_loss, clip_range=config.train_clip_range, adv_clip_max=config.train_adv_clip_max)

    def loss_fn(state, rows):
        logprobs = step_logprobs(state.model(), rows, schedule, **_sampling(config))
        return loss(rows.copy().update({K.LOGPROBS: logprobs}))

    b, sb, history = rollout.batch_size[0], config.sample_batch_size, []
    for _ in range(config.train_num_inner_epochs):
        g = copy_generator(state.rng)
        perm = torch.randperm(b, generator=g, device=g.device)
        rows = timestep_rows(rollout[perm], timestep_fraction=config.train_timestep_fraction, generator=g)
        n = rows.batch_size[1]  # step-major within each sample batch: a micro-batch = samples at one step index
        order = torch.arange(b * n, device=perm.device).reshape(b // sb, sb, n).transpose(1, 2).reshape(-1)
        state, metrics = update(dataclasses.replace(state, rng=g), rows.reshape(-1)[order], loss_fn,
                                minibatch_size=sb * n, micro_batch_size=config.train_batch_size,
                                max_grad_norm=config.train_max_grad_norm, shuffle=False)
        history.append(metrics)
    return state, torch.stack(history).mean(0)  # metrics averaged over the inner epochs


def step(state: TrainState, _, *, config: Config, reward_fn: Callable, executor=None):
    """One DDPO epoch: collect → score → train_epoch."""
    state, rollout = collect(state, config, reward_fn, executor)
    state, rollout = score(state, rollout, config)
    state, metrics = train_epoch(state, rollout, config)
    rewards, n = rollout.get(K.SCORE), rollout.batch_size[0]
    state = advance(state, samples_seen=n, episodes=n)
    rewards = TensorDict({"reward_mean": rewards.mean(), "reward_std": rewards.std(correction=0)}, [])
    return state, rewards.update(metrics)  # the reward first: the progress line shows the first metrics


@torch.no_grad()
def evaluate(state: TrainState, config: Config, *, reward_fn: Callable | None = None,
             save_to: str | Path | None = None) -> dict[str, float]:
    """Mean and std reward of ``num_eval_images`` samples from fixed noise (``eval_seed``); their
    grid is written to ``save_to`` (a PNG path) when given."""
    g = torch.Generator(device=config.device).manual_seed(config.eval_seed)
    labels = torch.arange(config.num_eval_images, device=config.device) % len(config.prompts)
    batch = sample_trajectories(state.model(), labels, _schedule(config), generator=g, **_sampling(config))
    images = latents_to_images(batch.get(K.LATENTS)[:, -1]).cpu()
    rewards = score_images(get_reward_fn(reward_fn or config.reward_fn), images, _names(config, labels))
    if save_to is not None:
        save_image_grid(images, save_to)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(correction=0))}


def train(config: Config, *, reward_fn: Callable | None = None,
          callbacks: Sequence[Callable] = ()) -> tuple[TrainState, list[dict[str, float]]]:
    """Train with DDPO from ``config``; ``reward_fn(images, prompts) -> [B]`` overrides ``config.reward_fn``."""
    reward_fn = get_reward_fn(config.reward_fn if reward_fn is None else reward_fn)
    resuming = bool(config.resume and config.run_dir and latest_checkpoint(config.run_dir))
    state = build_state(config, pretrain=not resuming)  # a resumed run loads its weights instead

    def eval_fn(state):
        grid = Path(config.run_dir) / "images" / f"epoch-{state.step:05d}.png" if config.run_dir else None
        return evaluate(state, config, reward_fn=reward_fn, save_to=grid)

    pool = ThreadPoolExecutor(config.max_workers) if config.async_reward_computation else None
    try:
        bound = functools.partial(step, config=config, reward_fn=reward_fn, executor=pool or _Inline())
        return run(bound, state, itertools.repeat(None), config=config, num_steps=config.num_epochs,
                   eval_fn=eval_fn, name="ddpo", callbacks=callbacks)
    finally:
        if pool is not None:
            pool.shutdown()


def checkpoint_state(config: Config, path: str | Path) -> TrainState:
    """The ``TrainState`` saved in checkpoint ``path`` (for ``rlcore eval ddpo``)."""
    return load_checkpoint(path, build_state(config, pretrain=False), restore_global_rng=False)
