"""DDPO: policy-gradient fine-tuning of a diffusion model, one denoising step at a time.

Each DDIM step with ``η > 0`` is a Gaussian policy ``x_{t-1} ~ N(μ_θ(x_t, t), σ_t²)``; DDPO scores the
final image, turns the reward into an advantage (batch or per-prompt normalisation) and applies
a PPO-style clipped ratio loss to the log-density of every step.

- ``ddim_step`` / ``ddim_step_logprob``: the DDIM update and the log-density of the step taken.
- ``ddpo_ratio_loss`` / ``ddpo_loss``: the clipped surrogate for one timestep's batch.
- ``batch_advantages`` and the ``(prompt_stats_init, prompt_stats_update)`` pair (``prompt_stats``:
  the pair with its hyper-parameters bound): advantages.

References:
    Black et al., "Training Diffusion Models with Reinforcement Learning",
    https://arxiv.org/abs/2305.13301;
    Song et al., "Denoising Diffusion Implicit Models", https://arxiv.org/abs/2010.02502.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from rlcore import keys as K
from rlcore.checks import check_float, check_ndim, check_number, check_same_shape, lookup, require_keys
from rlcore.masked import in_float64, masked_mean, masked_var, saturate, wide, wide_mean
from rlcore.transforms import StateTransform

__all__ = [
    "ddim_step_logprob",
    "ddim_step",
    "DDIM_PREDICTIONS",
    "ddpo_ratio_loss",
    "ddpo_loss",
    "batch_advantages",
    "PromptStats",
    "prompt_stats",
    "prompt_stats_init",
    "prompt_stats_update",
]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _event_shape(name: str, x: torch.Tensor, event_dims: int) -> None:
    check_ndim(name, x, min_ndim=event_dims, layout="[..., C, H, W]")


def _broadcast_std(std: torch.Tensor | float, sample: torch.Tensor, event_dims: int) -> torch.Tensor:
    """``std`` as a tensor broadcastable to ``sample``: a scalar, ``[...]`` (leading dims), or full."""
    std = torch.as_tensor(std, device=sample.device)
    if std.ndim != sample.ndim:
        if std.ndim > sample.ndim - event_dims:
            raise ValueError(f"std: expected a scalar, the leading shape {list(sample.shape[:-event_dims])} "
                             f"or the sample shape {list(sample.shape)}, got {list(std.shape)}")
        std = std.reshape(*std.shape, *([1] * event_dims))
    try:
        fits = torch.broadcast_shapes(std.shape, sample.shape) == sample.shape  # std may not widen sample
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"std: shape {list(std.shape)} does not broadcast to the sample shape "
                         f"{list(sample.shape)}")
    return std


def ddim_step_logprob(sample_prev: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, *,
                      event_dims: int = 3) -> torch.Tensor:
    """Log-density of a DDIM step's Gaussian, averaged over the latent dimensions (as DDPO does).

    ``log p = mean_{C,H,W} [ −(x' − μ)² / (2σ²) − log σ − log √(2π) ]``

    The average (not the sum) over latent dimensions is DDPO's convention: it keeps the
    log-probs of large latents O(1) and sets the scale of ``clip_range``.

    Args:
        sample_prev: ``[..., C, H, W]`` float, the sample ``x_{t-1}`` whose density is wanted.
        mean: ``[..., C, H, W]`` float, ``μ_θ(x_t, t)``.
        std: float, ``[...]`` (one σ per sample) or ``[..., C, H, W]``; must be > 0.
        event_dims: how many trailing dims are latent dims (3 for ``[C, H, W]``).
    Returns:
        ``[...]``; ``−inf``/NaN where ``std`` is 0 (a deterministic step has no density).

    >>> ddim_step_logprob(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 1.0)
    tensor([-0.9189])

    Gradient: flows to ``sample_prev``, ``mean`` and ``std``; ``ddim_step`` detaches
    ``sample_prev`` (the action is data, not a function of the parameters).
    References: Black et al., https://arxiv.org/abs/2305.13301 (DDPO).
    """
    check_float("sample_prev", sample_prev)
    _event_shape("sample_prev", sample_prev, event_dims)
    check_same_shape("sample_prev", sample_prev, mean=mean)
    std = _broadcast_std(std, sample_prev, event_dims)
    dtype = torch.promote_types(torch.promote_types(sample_prev.dtype, mean.dtype), std.dtype)
    # float64, cast back saturating (rlcore.masked.saturate): samples far from the mean stay finite
    z = (wide(sample_prev) - wide(mean)) / wide(std)
    logp = -0.5 * z.square() - torch.log(wide(std)) - _LOG_SQRT_2PI
    return saturate(logp.mean(dim=tuple(range(-event_dims, 0))), dtype)


# --- DDIM ------------------------------------------------------------------------------------
# Each entry turns the model output into (predicted x_0, predicted ε) given ᾱ_t; one signature;
# computed in float64 and cast back saturating (dividing by √ᾱ near the range's edge stays finite).
@in_float64
def _from_epsilon(model_output, sample, alpha_t):
    return (sample - (1 - alpha_t).sqrt() * model_output) / alpha_t.sqrt(), model_output


@in_float64
def _from_sample(model_output, sample, alpha_t):
    return model_output, (sample - alpha_t.sqrt() * model_output) / (1 - alpha_t).sqrt()


@in_float64
def _from_v(model_output, sample, alpha_t):
    a, s = alpha_t.sqrt(), (1 - alpha_t).sqrt()
    return a * sample - s * model_output, a * model_output + s * sample


DDIM_PREDICTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "epsilon": _from_epsilon,        # the model predicts the noise ε
    "sample": _from_sample,          # the model predicts x_0
    "v_prediction": _from_v,         # v = √ᾱ·ε − √(1−ᾱ)·x_0 (Salimans & Ho, https://arxiv.org/abs/2202.00512)
}


def _alphas(timestep, sample: torch.Tensor, alphas_cumprod: torch.Tensor, final_alpha_cumprod,
            stride: int, event_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ᾱ_t, ᾱ_prev) shaped ``[..., 1, 1, 1]``; ᾱ_prev = final_alpha_cumprod when t − stride < 0."""
    alphas = alphas_cumprod.to(sample.device)
    t = torch.as_tensor(timestep, device=sample.device)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"timestep: expected an integer tensor or int, got dtype {t.dtype}")
    lead = sample.shape[:-event_dims]
    if t.ndim > len(lead) or any(n not in (1, m) for n, m in zip(t.shape[::-1], lead[::-1])):
        raise ValueError(f"timestep: expected a scalar or the leading shape {list(lead)}, got {list(t.shape)}")
    prev = t - stride
    final = torch.as_tensor(final_alpha_cumprod, dtype=alphas.dtype, device=alphas.device)
    if final.ndim:
        raise ValueError(f"final_alpha_cumprod: expected a float or a 0-d tensor, got shape {list(final.shape)}")
    a_t = alphas[t]
    a_prev = torch.where(prev >= 0, alphas[prev.clamp(min=0)], final)
    tail = [1] * event_dims
    return (a_t.expand(lead).reshape(*lead, *tail), a_prev.expand(lead).reshape(*lead, *tail))


def ddim_step(model_output: torch.Tensor, timestep, sample: torch.Tensor, *, alphas_cumprod: torch.Tensor,
              final_alpha_cumprod, num_train_timesteps: int, num_inference_steps: int, eta: float = 1.0,
              prediction_type: str = "epsilon", prev_sample: torch.Tensor | None = None,
              generator: torch.Generator | None = None, event_dims: int = 3
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DDIM step ``x_t → x_{t−1}`` with its log-probability (DDIM eq. 12 and 16).

    ``t' = t − num_train_timesteps // num_inference_steps``;  ``ᾱ' = ᾱ_{t'}`` (``final_alpha_cumprod``
    when ``t' < 0``);  ``x̂_0, ε̂`` from the model output (``DDIM_PREDICTIONS``);
    ``σ_t = η·√((1 − ᾱ')/(1 − ᾱ_t))·√(1 − ᾱ_t/ᾱ')``;
    ``μ = √ᾱ'·x̂_0 + √(1 − ᾱ' − σ_t²)·ε̂``;  ``x_{t−1} = μ + σ_t·z``, ``z ~ N(0, I)`` from ``generator``,
    unless ``prev_sample`` is given: then only its log-probability is computed (the ratio of the
    DDPO update re-scores stored samples under the current model).

    The behaviour is diffusers' ``DDIMScheduler.step`` without clipping or thresholding. DDPO's
    own sampler clamps ``t'`` at 0, i.e. uses ``ᾱ_0`` at the last step; pass
    ``final_alpha_cumprod=alphas_cumprod[0]`` (diffusers' ``set_alpha_to_one=False``, Stable
    Diffusion's setting) to get exactly that. With ``final_alpha_cumprod=1`` the last step is
    deterministic (σ = 0) and has no density; so is a step from ``t = 0`` with
    ``final_alpha_cumprod = alphas_cumprod[0]`` (``ᾱ' = ᾱ_t``): its log-prob is NaN. Schedules
    with ``steps_offset = 1`` (Stable Diffusion's) never take that step. ``1 − ᾱ' − σ²`` is clamped at 0 against rounding.

    Args:
        model_output: ``[..., C, H, W]`` float, the model's ε, x_0 or v prediction.
        timestep: int or integer tensor ``[]`` / ``[...]`` (one timestep per sample).
        sample: ``[..., C, H, W]`` float, ``x_t``.
        alphas_cumprod: ``[T_train]`` float, ``ᾱ`` of the training schedule.
        final_alpha_cumprod: float or ``[]``, ``ᾱ`` used past the first training step.
        num_train_timesteps, num_inference_steps: the step stride is their integer quotient.
        eta: ``η``, 0 for deterministic DDIM, 1 for DDPM-like ancestral noise (DDPO's default).
        prediction_type: a key of ``DDIM_PREDICTIONS``.
        prev_sample: ``[..., C, H, W]``, a sample to score instead of drawing one.
        generator: ``torch.Generator`` for the noise; exactly one of it and ``prev_sample``.
        event_dims: number of trailing latent dims.
    Returns:
        ``(prev_sample [..., C, H, W]`` in ``sample``'s dtype, ``logprob [...]``, ``mean
        [..., C, H, W]``, ``std [...]``); statistics in the promoted dtype of ``sample`` and
        ``alphas_cumprod`` (keep ``alphas_cumprod`` float32 or wider: ᾱ near 1 rounds to 1 in bf16).
        The log-prob is of the returned (cast) sample, so re-scoring it later with the same
        model gives the same value.

    Gradient: ``logprob``, ``mean`` and ``std`` are differentiable in ``model_output``; the sample
    inside ``logprob`` is detached (it is the action taken).
    References: Song et al., https://arxiv.org/abs/2010.02502; Black et al., https://arxiv.org/abs/2305.13301.
    """
    check_float("sample", sample)
    _event_shape("sample", sample, event_dims)
    check_same_shape("sample", sample, model_output=model_output, prev_sample=prev_sample)
    check_ndim("alphas_cumprod", alphas_cumprod, ndim=1, layout="[T_train]")
    if (prev_sample is None) == (generator is None):
        raise ValueError("ddim_step: pass exactly one of prev_sample (to score it) and generator "
                         "(to draw the noise)")
    to_x0_eps = lookup(DDIM_PREDICTIONS, prediction_type, what="prediction_type")
    a_t, a_prev = _alphas(timestep, sample, alphas_cumprod, final_alpha_cumprod,
                          num_train_timesteps // num_inference_steps, event_dims)
    dtype = torch.promote_types(torch.promote_types(sample.dtype, model_output.dtype), a_t.dtype)
    # float64, cast back saturating (rlcore.masked.saturate): outputs near the range's edge stay finite
    x0, eps = to_x0_eps(wide(model_output), wide(sample), wide(a_t))
    a_prev = wide(a_prev)
    std = eta * ((1 - a_prev) / (1 - wide(a_t)) * (1 - wide(a_t) / a_prev)).sqrt()
    mean = a_prev.sqrt() * x0 + (1 - a_prev - std.square()).clamp(min=0).sqrt() * eps
    if prev_sample is None:
        noise = torch.randn(mean.shape, generator=generator, dtype=dtype, device=mean.device)
        prev_sample = saturate(mean + std * wide(noise), sample.dtype)
    logprob = ddim_step_logprob(wide(prev_sample.detach()), mean, std, event_dims=event_dims)
    return (prev_sample.to(sample.dtype), saturate(logprob, dtype), saturate(mean, dtype),
            saturate(std.reshape(std.shape[:-event_dims]), dtype))


# --- the clipped surrogate -------------------------------------------------------------------
_LOG_MAX64 = math.log(torch.finfo(torch.float64).max)  # the largest log-ratio whose exp is finite in float64


def ddpo_ratio_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                    clip_range: float = 1e-4, adv_clip_max: float = 5.0) -> torch.Tensor:
    """Per-sample clipped surrogate of DDPO: ``max(−Âρ, −Â·clip(ρ, 1 − ε, 1 + ε))``.

    ``ρ = exp(logprobs − old_logprobs)``, ``Â = clip(A, −adv_clip_max, adv_clip_max)``. DDPO's
    default ``ε = 1e-4`` is tiny because its log-probs are per-latent-dim averages.

    Finite log-probs give a finite loss and gradient, whatever their difference. The ratio is
    taken in float64 of a log-ratio bounded where the bound changes nothing: for ``Â ≥ 0`` above
    ``log(1 + ε) + 1`` (there ``ρ > 1 + ε``, the clipped branch ``−Â(1 + ε)`` is the maximum: same
    value, no gradient), for ``Â < 0`` below ``log(1 − ε) − 1`` (the clipped branch ``−Â(1 − ε)``,
    likewise) and above ``log`` of float64's largest value (where ``exp`` itself overflows). The
    loss is cast back saturating (``rlcore.masked.saturate``): ``|Â|·ρ`` past the dtype's range is
    its largest value, with no gradient. Wherever the formula is finite in float64 the value and
    the gradient are the formula's, bit for bit.

    Args:
        logprobs: ``[...]`` float, step log-probs under the model being trained.
        old_logprobs: ``[...]`` float, the same under the sampling model.
        advantages: ``[...]`` float.
        clip_range: ``ε``, finite and ``≥ 0``.  adv_clip_max: bound on ``|A|``, ``≥ 0`` (inf: no bound).
    Returns:
        ``[...]`` unreduced losses, in the dtype of ``logprobs``.
    Raises:
        ValueError: ``clip_range`` or ``adv_clip_max`` out of range (NaN, negative), named.

    >>> ddpo_ratio_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -9.0]))
    tensor([-1.,  5.])
    >>> ddpo_ratio_loss(torch.tensor([100.0, 100.0]), torch.zeros(2), torch.tensor([1.0, -1.0]))
    tensor([-1.0001e+00,  3.4028e+38])

    Gradient: through ``logprobs`` only (``old_logprobs`` and ``advantages`` are detached); at
    ``ρ = 1`` it is ``−Â·∇logprobs``.
    References: Black et al., https://arxiv.org/abs/2305.13301; Schulman et al., "Proximal
    Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347.
    """
    check_float("logprobs", logprobs)
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_number("clip_range", clip_range, low=0.0)
    check_number("adv_clip_max", adv_clip_max, low=0.0, allow_inf=True)
    lo, hi = 1.0 - clip_range, 1.0 + clip_range
    adv = wide(advantages.detach().clamp(-adv_clip_max, adv_clip_max))
    log_ratio = wide(logprobs - old_logprobs.detach())
    above = math.log(hi) + 1.0                             # exp(above) > 1 + ε
    below = math.log(lo) - 1.0 if lo > 0 else -math.inf    # exp(below) < 1 − ε (none when ε ≥ 1)
    bounded = torch.where(adv >= 0, log_ratio.clamp(max=above), log_ratio.clamp(min=below, max=_LOG_MAX64))
    ratio = torch.exp(bounded)
    return saturate(torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi)), logprobs.dtype)


def ddpo_loss(batch: TensorDictBase, *, clip_range: float = 1e-4,
              adv_clip_max: float = 5.0) -> tuple[torch.Tensor, TensorDict]:
    """DDPO loss of one timestep's batch: the mean of ``ddpo_ratio_loss`` over samples.

    Reads ``keys.LOGPROBS``, ``keys.OLD_LOGPROBS`` and ``keys.ADVANTAGES``, each ``[B]`` float
    (any shape works as long as the three agree; the mean is over all entries, accumulated in
    float64 and cast back saturating).

    Returns:
        ``(loss [], metrics)``; metrics (detached): ``loss_policy`` (= loss), ``approx_kl``
        ``= ½·mean((lp − old)²)``, ``clipfrac = mean(|ρ − 1| > clip_range)``; finite for finite
        log-probs (the KL saturates at the dtype's largest value).

    >>> b = TensorDict({"logprobs": torch.zeros(2), "old_logprobs": torch.zeros(2),
    ...                 "advantages": torch.tensor([1.0, 3.0])}, [2])
    >>> ddpo_loss(b)[0]
    tensor(-2.)

    Gradient: through ``keys.LOGPROBS`` only.
    References: Black et al., https://arxiv.org/abs/2305.13301.
    """
    require_keys(batch, [K.LOGPROBS, K.OLD_LOGPROBS, K.ADVANTAGES], where="ddpo_loss",
                 layouts={K.LOGPROBS: "[B]", K.OLD_LOGPROBS: "[B]", K.ADVANTAGES: "[B]"})
    lp, old = batch.get(K.LOGPROBS), batch.get(K.OLD_LOGPROBS)
    per_sample = ddpo_ratio_loss(lp, old, batch.get(K.ADVANTAGES), clip_range=clip_range,
                                 adv_clip_max=adv_clip_max)
    loss = wide_mean(per_sample)
    log_ratio = wide(lp.detach()) - wide(old.detach())
    metrics = TensorDict({
        "loss_policy": loss.detach(),
        "approx_kl": saturate(0.5 * log_ratio.square().mean(), lp.dtype),
        "clipfrac": ((log_ratio.exp() - 1).abs() > clip_range).to(lp.dtype).mean(),
    }, batch_size=[])
    return loss, metrics


# --- advantages ------------------------------------------------------------------------------
def batch_advantages(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Rewards normalised over the batch: ``(r − mean(r)) / (std(r) + eps)``.

    ``std`` is the biased one (divides by ``n``, numpy's default), as in DDPO's trainer.

    Args:
        rewards: ``[...]`` float (usually ``[B]``); statistics over all entries.
    Returns:
        ``[...]``, detached.

    >>> batch_advantages(torch.tensor([1.0, 3.0]))
    tensor([-1.,  1.])

    References: Black et al., https://arxiv.org/abs/2305.13301.
    """
    check_float("rewards", rewards)
    r = wide(rewards.detach())  # float64, cast back saturating: rewards near the range's edge stay finite
    return saturate((r - r.mean()) / (r.std(correction=0) + eps), rewards.dtype)


class PromptStats(NamedTuple):
    """Per-prompt reward history of DDPO's advantage normalisation.

    Attributes:
        prompts: the ``P`` prompts seen, in order of first appearance (row ``i`` is ``prompts[i]``).
        rewards: ``[P, S]`` float64 ring buffer of each prompt's last ``S = buffer_size`` rewards.
        counts: ``[P]`` long, rewards seen per prompt so far (the buffer holds ``min(count, S)``).
        min_count: below this many buffered rewards a prompt uses the batch's statistics.
    """

    prompts: tuple[str, ...]
    rewards: torch.Tensor
    counts: torch.Tensor
    min_count: int


def prompt_stats(buffer_size: int = 16, min_count: int = 16, *, dtype: torch.dtype = torch.float64) -> StateTransform:
    """The per-prompt statistics as a ``rlcore.transforms.StateTransform``, its hyper-parameters
    bound: ``init() -> PromptStats`` (:func:`prompt_stats_init`) and ``update(state, prompts,
    rewards) -> (state, advantages)`` (:func:`prompt_stats_update`)."""
    prompt_stats_init(buffer_size, min_count, dtype=dtype)  # the hyper-parameters checked now
    return StateTransform(functools.partial(prompt_stats_init, buffer_size, min_count, dtype=dtype),
                          prompt_stats_update)


def prompt_stats_init(buffer_size: int = 16, min_count: int = 16, *,
                      dtype: torch.dtype = torch.float64) -> PromptStats:
    """An empty per-prompt statistics state (no prompt seen yet).

    Args:
        buffer_size: ``S``, rewards kept per prompt (the most recent ones).
        min_count: buffered rewards needed before a prompt's own statistics are used; with
            ``min_count > buffer_size`` they never are.
        dtype: of the buffer (float64 by default, so statistics are exact for float32 rewards).
    """
    if buffer_size < 1 or min_count < 0:
        raise ValueError(f"buffer_size must be >= 1 and min_count >= 0, got {buffer_size} and {min_count}")
    return PromptStats((), torch.zeros(0, buffer_size, dtype=dtype), torch.zeros(0, dtype=torch.long),
                       int(min_count))


def _push(state: PromptStats, prompts: Sequence[str], rewards: torch.Tensor
          ) -> tuple[PromptStats, torch.Tensor]:
    """Append each reward to its prompt's ring buffer (batch order); return (state, row index [B])."""
    index = {p: i for i, p in enumerate(state.prompts)}
    new = tuple(dict.fromkeys(p for p in prompts if p not in index))
    index.update({p: len(index) + j for j, p in enumerate(new)})
    dev, size = rewards.device, state.rewards.shape[-1]
    row = torch.tensor([index[p] for p in prompts], dtype=torch.long, device=dev)
    buf = torch.cat([state.rewards.to(dev), state.rewards.new_zeros(len(new), size, device=dev)])
    counts = torch.cat([state.counts.to(dev), torch.zeros(len(new), dtype=torch.long, device=dev)])
    same = row[:, None] == row[None, :]
    rank = (same & torch.ones_like(same).tril(-1)).sum(-1)       # earlier samples of the same prompt
    keep = rank >= same.sum(-1) - size                            # only the last S of a batch survive
    col = torch.where(keep, (counts[row] + rank) % size, torch.full_like(rank, size))
    buf = torch.cat([buf, buf.new_zeros(len(buf), 1)], dim=-1)    # column S collects the overwritten
    buf = buf.index_put((row, col), rewards.to(buf.dtype))[:, :size]
    counts = counts.index_add(0, row, torch.ones_like(row))
    return PromptStats(state.prompts + new, buf, counts, state.min_count), row


def prompt_stats_update(state: PromptStats, prompts: Sequence[str], rewards: torch.Tensor, *,
                        eps: float = 1e-6) -> tuple[PromptStats, torch.Tensor]:
    """Add a batch of rewards to the per-prompt buffers and return the advantages.

    The batch's rewards are first appended to their prompts' buffers (in batch order, oldest
    dropped past ``buffer_size``); then each sample gets ``A = (r − μ)/(σ + eps)`` with ``μ, σ`` the
    mean and biased (numpy-default) std of its prompt's buffer once that holds ``≥ min_count``
    rewards, else of the whole batch. This is DDPO's per-prompt stat tracker.

    Args:
        state: from ``prompt_stats_init`` or a previous update; not modified.
        prompts: ``B`` strings, the prompt of each sample.
        rewards: ``[B]`` float.
        eps: added to the std.
    Returns:
        ``(new_state, advantages [B])`` in ``rewards``' dtype, detached.

    >>> s = prompt_stats_init(buffer_size=4, min_count=2)
    >>> s, a = prompt_stats_update(s, ["a", "a", "b"], torch.tensor([1.0, 3.0, 5.0]))
    >>> a, s.counts
    (tensor([-1.0000,  1.0000,  1.2247]), tensor([2, 1]))

    References: Black et al., https://arxiv.org/abs/2305.13301 (per-prompt stat tracking).
    """
    check_float("rewards", rewards)
    check_ndim("rewards", rewards, ndim=1, layout="[B]")
    if len(prompts) != rewards.shape[0]:
        raise ValueError(f"prompts: expected {rewards.shape[0]} prompts (the shape of rewards "
                         f"{list(rewards.shape)}), got {len(prompts)}")
    r = rewards.detach()
    state, row = _push(state, prompts, r)
    size = state.rewards.shape[-1]
    held = state.counts.clamp(max=size)
    valid = torch.arange(size, device=r.device) < held[:, None]
    mean_p = masked_mean(state.rewards, valid, dim=-1)[row]
    std_p = masked_var(state.rewards, valid, dim=-1, unbiased=False).sqrt()[row]
    # float64 (whatever the buffer's dtype), cast back saturating: rewards near the range's edge
    rb, mean_p, std_p = wide(r), wide(mean_p), wide(std_p)
    own = held[row] >= state.min_count
    mean = torch.where(own, mean_p, rb.mean())
    std = torch.where(own, std_p, rb.std(correction=0))
    return state, saturate((rb - mean) / (std + eps), rewards.dtype)
