"""Diffusion pieces of DDPO: DDIM schedules, a tiny class-conditional denoiser, trajectories with
per-step log-probs, image rewards (JPEG compressibility) and image grids.

The tiny model works in **pixel space**: it denoises ``[3, 16, 16]`` images directly, there is no
VAE. A latent diffusion model fits the same pieces with its latents in place of the images and a
decode before the reward. Prompts are class names mapped to ids (their position in the run's
prompt list); the id ``num_classes`` is the unconditional ("null") class of classifier-free
guidance.

The DDIM step itself, its log-density and the DDPO loss are the pure functions of
``rlcore.algorithms.ddpo``; this module runs them through a model. diffusers and pillow are
optional (``pip install 'rlcore[diffusion]'``): importing this module works without them, and
the functions that need them say so.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlcore import keys as K
from rlcore.algorithms.ddpo import ddim_step
from rlcore.checks import check_float, check_ndim, lookup, require_keys
from rlcore.loops.fold import fold
from rlcore.loops.images import require_extra
from rlcore.loops.state import copy_generator, init_state
from rlcore.loops.update import make_optimizer, update

try:
    from diffusers import UNet2DModel
except ImportError:  # optional extra
    UNet2DModel = None

__all__ = ["DDIMSchedule", "BETA_SCHEDULES", "ddim_schedule", "schedule_from_scheduler", "build_denoiser",
           "CONDITION_KEYS", "predict_noise", "sample_trajectories", "step_logprobs", "timestep_rows",
           "row_condition", "SYNTHETIC_PATTERNS", "synthetic_images", "pretrain_denoiser"]


# --- DDIM schedules ------------------------------------------------------------------------
class DDIMSchedule(NamedTuple):
    """The noise schedule and the DDIM timesteps of a sampler.

    Attributes:
        alphas_cumprod: ``[T_train]`` float32, ``ᾱ_t = Π_{s≤t} (1 − β_s)``.
        final_alpha_cumprod: ``[]`` float32, ``ᾱ`` past the first training step.
        timesteps: ``[S]`` long, the DDIM timesteps, descending.
        num_train_timesteps: ``T_train``.
        prediction_type: what the model predicts (a key of ``DDIM_PREDICTIONS``).
    """

    alphas_cumprod: torch.Tensor
    final_alpha_cumprod: torch.Tensor
    timesteps: torch.Tensor
    num_train_timesteps: int
    prediction_type: str = "epsilon"

    def step_kwargs(self) -> dict[str, Any]:
        """The schedule's keyword arguments of ``rlcore.algorithms.ddpo.ddim_step``."""
        return dict(alphas_cumprod=self.alphas_cumprod, final_alpha_cumprod=self.final_alpha_cumprod,
                    num_train_timesteps=self.num_train_timesteps,
                    num_inference_steps=int(self.timesteps.shape[0]), prediction_type=self.prediction_type)


def _cosine_betas(n: int, beta_start: float, beta_end: float) -> torch.Tensor:
    def alpha_bar(t: float) -> float:  # no beta_start / beta_end in this schedule
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)],
                        dtype=torch.float32)


# β_1..β_T of each schedule, one signature: (n, beta_start, beta_end) -> [n] float32.
BETA_SCHEDULES: dict[str, Callable[[int, float, float], torch.Tensor]] = {
    # DDPM (Ho et al., https://arxiv.org/abs/2006.11239)
    "linear": lambda n, beta_start, beta_end: torch.linspace(beta_start, beta_end, n, dtype=torch.float32),
    # Stable Diffusion: linear in √β
    "scaled_linear": lambda n, beta_start, beta_end: torch.linspace(
        beta_start ** 0.5, beta_end ** 0.5, n, dtype=torch.float32) ** 2,
    "squaredcos_cap_v2": _cosine_betas,     # Nichol & Dhariwal, https://arxiv.org/abs/2102.09672
}


def ddim_schedule(num_inference_steps: int, *, num_train_timesteps: int = 1000, beta_start: float = 1e-4,
                  beta_end: float = 0.02, beta_schedule: str = "linear", set_alpha_to_one: bool = False,
                  steps_offset: int = 1, prediction_type: str = "epsilon") -> DDIMSchedule:
    """A DDIM schedule computed directly (diffusers' ``DDIMScheduler`` with "leading" spacing).

    ``ᾱ_t = Π_{s≤t}(1 − β_s)``; timesteps ``t_i = (S − 1 − i)·⌊T_train/S⌋ + steps_offset``,
    ``i = 0..S−1``; ``final_alpha_cumprod = 1`` if ``set_alpha_to_one`` else ``ᾱ_0``. DDPO uses
    ``set_alpha_to_one=False`` and ``steps_offset=1`` (Stable Diffusion's settings): the last step
    goes from ``ᾱ_1`` to ``ᾱ_0``, keeps some noise and has a density (with ``steps_offset=0`` it
    would go from ``ᾱ_0`` to ``ᾱ_0``: σ = 0, no density).

    Args:
        num_inference_steps: ``S``, the sampler's steps.
        num_train_timesteps, beta_start, beta_end: the training schedule.
        beta_schedule: a key of ``BETA_SCHEDULES``.
        set_alpha_to_one, steps_offset, prediction_type: as in diffusers' ``DDIMScheduler``.
    Returns:
        ``DDIMSchedule`` (float32 ``ᾱ``, ``timesteps [S]`` long).

    >>> ddim_schedule(4, num_train_timesteps=100).timesteps
    tensor([76, 51, 26,  1])

    References: Song et al., "Denoising Diffusion Implicit Models", https://arxiv.org/abs/2010.02502
    """
    betas_fn = lookup(BETA_SCHEDULES, beta_schedule, what="beta_schedule")
    if not 1 <= num_inference_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps: expected 1..{num_train_timesteps} (num_train_timesteps), "
                         f"got {num_inference_steps}")
    alphas_cumprod = torch.cumprod(1.0 - betas_fn(num_train_timesteps, beta_start, beta_end), dim=0)
    final = torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0].clone()
    stride = num_train_timesteps // num_inference_steps
    timesteps = torch.arange(num_inference_steps - 1, -1, -1, dtype=torch.long) * stride + steps_offset
    return DDIMSchedule(alphas_cumprod, final, timesteps, num_train_timesteps, prediction_type)


def schedule_from_scheduler(scheduler: Any, num_inference_steps: int) -> DDIMSchedule:
    """The ``DDIMSchedule`` of a diffusers ``DDIMScheduler`` (e.g. a Stable Diffusion pipeline's).

    The scheduler is not modified (a copy sets the timesteps). Clipping and thresholding of
    ``x̂_0`` are not part of ``ddim_step``: a scheduler with ``clip_sample`` or ``thresholding``
    raises ``ValueError``.
    """
    cfg = scheduler.config
    if getattr(cfg, "clip_sample", False) or getattr(cfg, "thresholding", False):
        raise ValueError("scheduler: clip_sample / thresholding are not supported by ddim_step; "
                         "build the scheduler with clip_sample=False, thresholding=False")
    s = copy.deepcopy(scheduler)
    s.set_timesteps(num_inference_steps)
    return DDIMSchedule(s.alphas_cumprod.clone(), torch.as_tensor(s.final_alpha_cumprod).clone(),
                        s.timesteps.clone().long(), int(cfg.num_train_timesteps), cfg.prediction_type)


# --- the denoiser ---------------------------------------------------------------------------
def build_denoiser(num_classes: int, *, sample_size: int = 16, channels: int = 3,
                   block_out_channels: Sequence[int] = (16, 32), layers_per_block: int = 1,
                   norm_num_groups: int = 8, attention: bool = False, seed: int = 0) -> nn.Module:
    """A tiny class-conditional ``UNet2DModel`` from a config (no download), seeded.

    ``num_classes + 1`` class embeddings: ids ``0..num_classes−1`` are the prompts, id
    ``num_classes`` the unconditional class of classifier-free guidance. The initialisation
    draws from a forked global RNG seeded with ``seed`` (the caller's global RNG is untouched).
    """
    require_extra(UNet2DModel, "build_denoiser", "diffusers")
    n = len(block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet2DModel(sample_size=sample_size, in_channels=channels, out_channels=channels,
                           block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block,
                           down_block_types=("DownBlock2D",) * n, up_block_types=("UpBlock2D",) * n,
                           norm_num_groups=norm_num_groups, add_attention=attention,
                           num_class_embeds=num_classes + 1)


# The conditioning keys of a trajectory: a class id, or a text encoder's embeddings of the prompt
# and of the negative prompt (the unconditional branch of classifier-free guidance).
CONDITION_KEYS = (K.CLASS_LABELS, K.PROMPT_EMBEDS, K.NEGATIVE_PROMPT_EMBEDS)


def _condition(condition: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{class_labels}`` from a ``[B]`` long tensor, or the conditioning keys of a mapping, checked."""
    if isinstance(condition, torch.Tensor):
        condition = {K.CLASS_LABELS: condition}
    cond = {k: condition[k] for k in CONDITION_KEYS if k in condition.keys()}
    if K.CLASS_LABELS in cond:
        check_ndim("class_labels", cond[K.CLASS_LABELS], ndim=1, layout="[B]")
    elif K.PROMPT_EMBEDS in cond:
        for k in (K.PROMPT_EMBEDS, K.NEGATIVE_PROMPT_EMBEDS):
            if k in cond:
                check_float(k, cond[k])
                check_ndim(k, cond[k], ndim=3, layout="[B, L, D]")
    else:
        raise KeyError(f"condition: expected class_labels [B] or prompt_embeds [B, L, D], got keys "
                       f"{sorted(condition.keys())}")
    return cond


def _forward(model: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
             uncond: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The model on ``x`` (the unconditional rows first, then the conditioned ones, when ``uncond``)."""
    if uncond is not None:
        x, t = torch.cat([x, x]), torch.cat([t, t])
        cond = {k: torch.cat([uncond[k], cond[k]]) for k in uncond}
    if K.PROMPT_EMBEDS in cond:  # diffusers' UNet2DConditionModel
        out = model(x, t, encoder_hidden_states=cond[K.PROMPT_EMBEDS])
    else:  # diffusers' UNet2DModel with class embeddings
        out = model(x, t, class_labels=cond[K.CLASS_LABELS])
    return getattr(out, "sample", out)


def predict_noise(model: nn.Module, latents: torch.Tensor, timesteps: torch.Tensor | int,
                  condition: torch.Tensor | Mapping[str, torch.Tensor], *, guidance_scale: float = 1.0,
                  null_class: int | None = None) -> torch.Tensor:
    """The model's output, with classifier-free guidance.

    ``ε̂ = ε(x, t, ∅) + w·(ε(x, t, c) − ε(x, t, ∅))`` with ``w = guidance_scale`` (one batched
    forward of ``2B`` rows, the unconditional ones first, as diffusers' pipelines do); with
    ``w ≤ 1`` just ``ε(x, t, c)`` (one forward of ``B`` rows: guidance runs for ``w > 1`` only, as in
    diffusers' pipelines and DDPO).

    Two kinds of conditioning:

    - class ids: ``condition`` is ``class_labels [B]`` long (or a mapping holding it); the model
      is called as ``model(x, t, class_labels=c)`` (diffusers' ``UNet2DModel``) and ``∅`` is the
      id ``null_class``;
    - text: ``condition`` holds ``prompt_embeds [B, L, D]`` and, for guidance,
      ``negative_prompt_embeds [B, L, D]`` (``∅``: the negative or empty prompt's embeddings);
      the model is called as ``model(x, t, encoder_hidden_states=e)`` (``UNet2DConditionModel``).

    The model's output is a tensor or has ``.sample``.

    Args:
        latents: ``[B, C, H, W]`` float, ``x_t``.
        timesteps: int or ``[]`` / ``[B]`` long.
        condition: ``class_labels [B]``, or a mapping (a TensorDict of rows) holding ``CONDITION_KEYS``.
        guidance_scale: ``w``.  null_class: the unconditional id (class ids with ``w ≠ 1``).
    Returns:
        ``[B, C, H, W]``, differentiable in the model's parameters.

    References: Ho & Salimans, "Classifier-Free Diffusion Guidance", https://arxiv.org/abs/2207.12598
    """
    check_float("latents", latents)
    check_ndim("latents", latents, ndim=4, layout="[B, C, H, W]")
    cond = _condition(condition)
    t = torch.as_tensor(timesteps, device=latents.device).expand(latents.shape[0])
    negative = cond.pop(K.NEGATIVE_PROMPT_EMBEDS, None)
    if guidance_scale <= 1.0:
        return _forward(model, latents, t, cond)
    if K.CLASS_LABELS in cond:
        if null_class is None:
            raise ValueError(f"null_class: classifier-free guidance (guidance_scale={guidance_scale}) needs "
                             f"the unconditional class id")
        uncond = {K.CLASS_LABELS: torch.full_like(cond[K.CLASS_LABELS], null_class)}
    elif negative is not None:
        uncond = {K.PROMPT_EMBEDS: negative}
    else:
        raise KeyError(f"negative_prompt_embeds: classifier-free guidance (guidance_scale={guidance_scale}) "
                       "needs the negative (or empty) prompt's embeddings [B, L, D]")
    uncond_out, cond_out = _forward(model, latents, t, cond, uncond).chunk(2)
    return uncond_out + guidance_scale * (cond_out - uncond_out)


def _model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


@torch.no_grad()
def sample_trajectories(model: nn.Module, condition: torch.Tensor | Mapping[str, torch.Tensor],
                        schedule: DDIMSchedule, *, eta: float = 1.0, guidance_scale: float = 1.0,
                        null_class: int | None = None, generator: torch.Generator,
                        image_shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> TensorDict:
    """Sample DDIM chains ``x_T → x_0`` and record every step and its log-probability.

    ``x_T ~ N(0, I)``; for each ``t`` of ``schedule.timesteps``: ``ε̂ = predict_noise(x_t, t, c)``,
    ``x_{t'} ~ N(μ, σ_t²)`` and ``log p(x_{t'} | x_t, c)`` from ``ddim_step`` (averaged over the
    image dimensions). With ``eta > 0`` every step is stochastic and has a density.

    Args:
        model: the denoiser (see ``predict_noise``); run without gradient (under the caller's
            autocast, if any).
        condition: ``class_labels [B]`` long, or a mapping of ``CONDITION_KEYS`` (prompt
            embeddings), on the model's device.
        schedule: a ``DDIMSchedule`` with ``S`` timesteps.
        eta, guidance_scale, null_class: of ``ddim_step`` and ``predict_noise``.
        generator: a ``torch.Generator`` on the model's device: the initial noise and every step's.
        image_shape: ``(C, H, W)``; default from the model's config (``in_channels``, ``sample_size``).
        dtype: of the latents; default the model's parameters'.
    Returns:
        TensorDict ``[B]``: ``latents [B, S+1, C, H, W]`` (``[:, -1]`` is the sample),
        ``timesteps [B, S]`` long, ``old_logprobs [B, S]`` and the conditioning keys.
    """
    device, model_dtype = _model_device_dtype(model)
    cond = _condition(condition)
    if image_shape is None:
        cfg = model.config
        image_shape = (cfg.in_channels, cfg.sample_size, cfg.sample_size)
    b = next(iter(cond.values())).shape[0]
    x = torch.randn((b, *image_shape), generator=generator, device=device, dtype=dtype or model_dtype)
    latents, logprobs = [x], []
    for t in schedule.timesteps.tolist():
        eps = predict_noise(model, x, t, cond, guidance_scale=guidance_scale, null_class=null_class)
        x, logp, _, _ = ddim_step(eps.to(x.dtype), t, x, eta=eta, generator=generator, **schedule.step_kwargs())
        latents.append(x)
        logprobs.append(logp)
    return TensorDict({K.LATENTS: torch.stack(latents, dim=1),
                       K.TIMESTEPS: schedule.timesteps.to(device).expand(b, -1).clone(),
                       K.OLD_LOGPROBS: torch.stack(logprobs, dim=1), **cond}, batch_size=[b])


def step_logprobs(model: nn.Module, rows: TensorDictBase, schedule: DDIMSchedule, *, eta: float = 1.0,
                  guidance_scale: float = 1.0, null_class: int | None = None) -> torch.Tensor:
    """Log-probabilities of stored DDIM steps under ``model`` (the ratio's numerator in DDPO).

    ``log p_θ(x_{t'} | x_t, c)`` with ``ε̂`` from ``predict_noise`` (same guidance as sampling) and
    the stored ``x_{t'}`` as ``prev_sample`` of ``ddim_step``.

    Args:
        rows: TensorDict ``[N]`` with ``latents``, ``next_latents [N, C, H, W]``, ``timesteps [N]``
            long and the conditioning: ``class_labels [N]`` long (``timestep_rows`` makes them),
            or ``prompt_embeds`` (and ``negative_prompt_embeds``) ``[N, L, D]`` (``row_condition``).
    Returns:
        ``[N]``, differentiable in the model's parameters (the stored samples are data).
    """
    require_keys(rows, [K.LATENTS, K.NEXT_LATENTS, K.TIMESTEPS], where="step_logprobs")
    t, x = rows.get(K.TIMESTEPS), rows.get(K.LATENTS)
    eps = predict_noise(model, x, t, rows, guidance_scale=guidance_scale, null_class=null_class)
    _, logp, _, _ = ddim_step(eps.to(x.dtype), t, x, eta=eta, prev_sample=rows.get(K.NEXT_LATENTS),
                              **schedule.step_kwargs())
    return logp


_STEP_KEYS = (K.LATENTS, K.TIMESTEPS, K.OLD_LOGPROBS)


def timestep_rows(trajectories: TensorDictBase, *, timestep_fraction: float = 1.0,
                  generator: torch.Generator | None = None) -> TensorDict:
    """The training rows of DDPO: ``S' = int(S·timestep_fraction)`` steps of every trajectory.

    Each sample draws its own random order of its ``S`` steps (``generator``) and keeps the first
    ``S'``, as DDPO does; without ``generator`` the first ``S'`` steps in sampling order.

    Args:
        trajectories: TensorDict ``[B]`` of ``sample_trajectories`` plus ``advantages [B]``.
        timestep_fraction: in ``(0, 1]``.
        generator: a ``torch.Generator`` (on the data's device) or ``None``.
    Returns:
        TensorDict ``[B, S']``: ``latents``, ``next_latents`` ``[B, S', C, H, W]``, ``timesteps``,
        ``old_logprobs``, ``sample_index`` (the row's trajectory) and every other per-sample key
        of one value per sample (``advantages``, ``class_labels``) ``[B, S']``. Per-sample keys of
        more dimensions (prompt embeddings ``[B, L, D]``) are not repeated over the steps:
        ``row_condition`` gathers them for the rows of a micro-batch. Flatten the rows as the
        update needs (``rows.reshape(-1)``).
    """
    require_keys(trajectories, [*_STEP_KEYS, K.ADVANTAGES], where="timestep_rows")
    latents, steps = trajectories.get(K.LATENTS), trajectories.get(K.TIMESTEPS)
    check_ndim("trajectories['timesteps']", steps, ndim=2, layout="[B, S]")
    b, s = steps.shape
    n = int(s * timestep_fraction)
    if not 0 < timestep_fraction <= 1 or n < 1:
        raise ValueError(f"timestep_fraction: expected a value in (0, 1] keeping at least one of the "
                         f"{s} steps, got {timestep_fraction}")
    if generator is None:
        order = torch.arange(s, device=steps.device).expand(b, s)
    else:
        order = torch.rand((b, s), generator=generator, device=generator.device).argsort(dim=-1).to(steps.device)
    idx = order[:, :n]
    row = torch.arange(b, device=steps.device)[:, None]
    per_sample = {k: v[:, None].expand(b, n).clone() for k, v in trajectories.items()
                  if k not in _STEP_KEYS and isinstance(v, torch.Tensor) and v.ndim == 1}
    return TensorDict({K.LATENTS: latents[row, idx], K.NEXT_LATENTS: latents[row, idx + 1],
                       K.TIMESTEPS: steps[row, idx], K.OLD_LOGPROBS: trajectories.get(K.OLD_LOGPROBS)[row, idx],
                       K.SAMPLE_INDEX: row.expand(b, n).clone(), **per_sample}, batch_size=[b, n])


def row_condition(rows: TensorDictBase, trajectories: TensorDictBase) -> TensorDictBase:
    """``rows`` with the prompt embeddings of their trajectories (``trajectories[sample_index]``),
    gathered for these rows only; rows conditioned on class ids are returned as they are."""
    keys = [k for k in (K.PROMPT_EMBEDS, K.NEGATIVE_PROMPT_EMBEDS) if k in trajectories.keys()]
    if not keys or K.PROMPT_EMBEDS in rows.keys():
        return rows
    require_keys(rows, [K.SAMPLE_INDEX], where="row_condition")
    index = rows.get(K.SAMPLE_INDEX)
    return rows.copy().update({k: trajectories.get(k)[index] for k in keys})


# --- synthetic data and pre-training ------------------------------------------------------------
def _grid(n: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ax = torch.arange(size, device=device, dtype=torch.float32)
    return ax[None, None, :, None].expand(n, 1, size, size), ax[None, None, None, :].expand(n, 1, size, size)


def _mix(w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Two random colours per image blended by the pattern ``w [n, 1, H, W]`` in ``[0, 1]``."""
    c = torch.rand((2, w.shape[0], 3, 1, 1), generator=generator, device=generator.device) * 2 - 1
    return c[0] + (c[1] - c[0]) * w


def _stripes(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand((3, n, 1, 1, 1), generator=generator, device=generator.device)
    y, x = _grid(n, size, generator.device)
    coord = torch.where(u[0] < 0.5, y, x)
    return _mix(0.5 + 0.5 * torch.sin(2 * math.pi * ((1 + 3 * u[1]) * coord / size + u[2])), generator)


def _checkers(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    cell = 2 ** torch.randint(1, 4, (n, 1, 1, 1), generator=generator, device=generator.device)
    y, x = _grid(n, size, generator.device)
    return _mix((torch.div(y, cell, rounding_mode="floor") + torch.div(x, cell, rounding_mode="floor")) % 2, generator)


def _blob(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand((3, n, 1, 1, 1), generator=generator, device=generator.device)
    y, x = _grid(n, size, generator.device)
    r2 = ((y - size * u[0]) ** 2 + (x - size * u[1]) ** 2) / (size * (0.1 + 0.2 * u[2])) ** 2
    return _mix(torch.exp(-r2), generator)


# Synthetic image classes for pre-training, one signature: (n, size, generator) -> [n, 3, size, size] in [-1, 1].
SYNTHETIC_PATTERNS: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    "stripes": _stripes,
    "checkers": _checkers,
    "blob": _blob,
}


def synthetic_images(class_labels: torch.Tensor, patterns: Sequence[str], *, size: int = 16,
                     generator: torch.Generator) -> torch.Tensor:
    """Images of the synthetic classes: ``class_labels[i]`` indexes ``patterns`` (``SYNTHETIC_PATTERNS``
    names) and each image has random colours, frequency, position.

    Returns: ``[B, 3, size, size]`` float32 in ``[−1, 1]``, on the generator's device.
    """
    unknown = sorted(set(patterns) - set(SYNTHETIC_PATTERNS))
    if unknown:
        raise ValueError(f"patterns: unknown {unknown}; valid: {sorted(SYNTHETIC_PATTERNS)}")
    n = class_labels.shape[0]
    every = torch.stack([SYNTHETIC_PATTERNS[p](n, size, generator) for p in patterns])  # [P, B, 3, H, W]
    return every[class_labels.to(every.device), torch.arange(n, device=every.device)]


# What the model learns to predict, by prediction type: (x_0, ε, ᾱ_t) -> target.
_TARGETS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "epsilon": lambda x0, eps, a: eps,
    "sample": lambda x0, eps, a: x0,
    "v_prediction": lambda x0, eps, a: a.sqrt() * eps - (1 - a).sqrt() * x0,
}


def pretrain_denoiser(model: nn.Module, schedule: DDIMSchedule, patterns: Sequence[str], *, steps: int = 300,
                      batch_size: int = 32, lr: float = 1e-3, cond_drop: float = 0.1, seed: int = 0
                      ) -> list[dict[str, float]]:
    """Train ``model`` (in place) to denoise ``synthetic_images`` of ``patterns`` (DDPM's loss).

    ``x_t = √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε``, ``t ~ U{0..T−1}``, ``loss = mean (f_θ(x_t, t, c) − y)²`` with
    ``y = ε``, ``x_0`` or ``v = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0`` by ``schedule.prediction_type``; the
    label is replaced by the null class ``len(patterns)`` with probability ``cond_drop`` (so
    classifier-free guidance has an unconditional model). Driven by ``fold`` and ``update``.

    Returns: the per-step metrics (``loss``).
    References: Ho et al., "Denoising Diffusion Probabilistic Models", https://arxiv.org/abs/2006.11239
    """
    device, _ = _model_device_dtype(model)
    size = model.config.sample_size
    alphas = schedule.alphas_cumprod.to(device)

    def loss_fn(state, batch):
        a = alphas[batch["t"]][:, None, None, None]
        noisy = a.sqrt() * batch["x0"] + (1 - a).sqrt() * batch["noise"]
        target = _TARGETS[schedule.prediction_type](batch["x0"], batch["noise"], a)
        loss = (_forward(state.model(), noisy, batch["t"], {K.CLASS_LABELS: batch[K.CLASS_LABELS]}) - target).square().mean()
        return loss, {"loss_mse": loss.detach()}

    def step(state, _):
        g = copy_generator(state.rng)
        labels = torch.randint(len(patterns), (batch_size,), generator=g, device=device)
        drop = torch.rand((batch_size,), generator=g, device=device) < cond_drop
        batch = TensorDict({"x0": synthetic_images(labels, patterns, size=size, generator=g),
                            "t": torch.randint(schedule.num_train_timesteps, (batch_size,), generator=g, device=device),
                            "noise": torch.randn((batch_size, 3, size, size), generator=g, device=device),
                            K.CLASS_LABELS: torch.where(drop, len(patterns), labels)}, batch_size=[batch_size])
        return update(dataclasses.replace(state, rng=g), batch, loss_fn)

    state = init_state(model, optimizer=make_optimizer(model, lr=lr), seed=seed, device=device)
    _, history = fold(step, state, itertools.repeat(None), num_steps=steps)
    return history
