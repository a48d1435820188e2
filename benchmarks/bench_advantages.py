"""Advantage estimators side by side: rlcore against TRL-style loops and torchrl, in one process.

Harness protocol: ``cases(tiny)`` maps a case name to ``{impl name: builder}``; a builder makes
the inputs (untimed) and returns a zero-argument thunk (timed). ``floors(tiny)`` gives, per case,
the bytes any implementation must at least read and write (inputs + outputs).

Cases (float32, random right-padded masks):
- ``gae B×T`` for ``[256, 512]`` and ``[64, 4096]``: rlcore's chunked scan; the reversed Python
  loop over T that TRL's legacy PPO runs (``lastgaelam``); torchrl's
  ``vec_generalized_advantage_estimate`` and ``generalized_advantage_estimate``.
- ``grpo`` / ``rloo`` on ``[4096, 16]`` scores: rlcore's grouped view and ``group_id`` forms, and
  the reshape-and-reduce formula TRL's trainers use.
- ``masked_whiten`` on ``[256, 512]``: rlcore against the legacy TRL formula (multiply by mask).

Run alone for a quick look: ``python benchmarks/bench_advantages.py [--tiny]``.
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

import torch

from rlcore.baselines import grpo_advantage, rloo_advantage
from rlcore.masked import masked_whiten
from rlcore.returns import gae

Thunk = Callable[[], object]
GAMMA, LAM = 1.0, 0.95


def _gae_inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    return rewards, values, mask


def trl_style_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = GAMMA,
                  lam: float = LAM) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as TRL's legacy PPO computes it: mask by multiplication, then a reversed loop over T."""
    values, rewards = values * mask, rewards * mask
    T = rewards.shape[-1]
    lastgaelam, reversed_adv = 0, []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def _torchrl_layout(rewards, values, mask):
    """``[B, T, 1]`` tensors, done (= terminated) on the last valid token of each row."""
    B, T = rewards.shape
    done = torch.arange(T) == (mask.sum(-1) - 1)[:, None]
    next_values = torch.cat([values[:, 1:], torch.zeros(B, 1)], 1)
    return values[..., None], next_values[..., None], rewards[..., None], done[..., None]


def _gae_impls(B: int, T: int) -> dict[str, Callable[[], Thunk]]:
    def rlcore_gae() -> Thunk:
        r, v, m = _gae_inputs(B, T)
        return lambda: gae(r, v, m, gamma=GAMMA, lam=LAM)

    def trl_loop() -> Thunk:
        r, v, m = _gae_inputs(B, T)
        return lambda: trl_style_gae(r, v, m)

    def torchrl_impl(name: str) -> Callable[[], Thunk]:
        def build() -> Thunk:
            from torchrl.objectives.value import functional
            fn = getattr(functional, name)
            args = _torchrl_layout(*_gae_inputs(B, T))
            return lambda: fn(GAMMA, LAM, *args, time_dim=-2)
        return build

    impls = {"rlcore": rlcore_gae, "trl_loop": trl_loop}
    try:
        from torchrl.objectives.value import functional  # noqa: F401  (pure-Python part of torchrl)
    except ImportError:
        return impls
    impls["torchrl_vec"] = torchrl_impl("vec_generalized_advantage_estimate")
    impls["torchrl_loop"] = torchrl_impl("generalized_advantage_estimate")
    return impls


def _scores(P: int, G: int) -> torch.Tensor:
    return torch.rand(P, G, generator=torch.Generator().manual_seed(1))


def trl_style_grpo(rewards: torch.Tensor, G: int, eps: float = 1e-4) -> torch.Tensor:
    """TRL's GRPO advantage: view as ``[-1, G]``, repeat group mean / std back to ``[B]``."""
    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G, dim=0)
    std = rewards.view(-1, G).std(dim=1).repeat_interleave(G, dim=0)
    return (rewards - mean) / (std + eps)


def trl_style_rloo(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """TRL's RLOO advantage: baseline ``(Σ_group − r_i)/(G − 1)``."""
    grouped = rewards.view(-1, G)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (G - 1)
    return (grouped - baseline).reshape(-1)


def _group_impls(P: int, G: int, kernel, peer) -> dict[str, Callable[[], Thunk]]:
    def grouped_view() -> Thunk:
        s = _scores(P, G)
        return lambda: kernel(s)

    def group_id() -> Thunk:
        s = _scores(P, G).reshape(-1)
        gid = torch.arange(P).repeat_interleave(G)[torch.randperm(P * G, generator=torch.Generator().manual_seed(2))]
        return lambda: kernel(s, group_id=gid)

    def trl_style() -> Thunk:
        s = _scores(P, G).reshape(-1)
        return lambda: peer(s, G)

    return {"rlcore": grouped_view, "rlcore_group_id": group_id, "trl_formula": trl_style}


def legacy_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The legacy TRL formula: multiply by the mask, unbiased variance, ``rsqrt(var + 1e-8)``."""
    m = mask.to(values.dtype)
    mean = (values * m).sum() / m.sum()
    centred = values - mean
    var = (centred ** 2 * m).sum() / m.sum()
    var = var * m.sum() / (m.sum() - 1)
    return centred * torch.rsqrt(var + 1e-8)


def _whiten_impls(B: int, T: int) -> dict[str, Callable[[], Thunk]]:
    def ours() -> Thunk:
        x, _, m = _gae_inputs(B, T)
        return lambda: masked_whiten(x, m)

    def legacy() -> Thunk:
        x, _, m = _gae_inputs(B, T)
        return lambda: legacy_masked_whiten(x, m)

    return {"rlcore": ours, "trl_formula": legacy}


def _sizes(tiny: bool):
    if tiny:
        return [(8, 32), (4, 200)], (16, 4), (8, 32)
    return [(256, 512), (64, 4096)], (4096, 16), (256, 512)


def cases(tiny: bool) -> dict[str, dict[str, Callable[[], Thunk]]]:
    gae_sizes, (P, G), (Bw, Tw) = _sizes(tiny)
    out = {f"gae {B}x{T} f32": _gae_impls(B, T) for B, T in gae_sizes}
    out[f"grpo {P}x{G}"] = _group_impls(P, G, grpo_advantage, trl_style_grpo)
    out[f"rloo {P}x{G}"] = _group_impls(P, G, rloo_advantage, trl_style_rloo)
    out[f"masked_whiten {Bw}x{Tw}"] = _whiten_impls(Bw, Tw)
    return out


def floors(tiny: bool) -> dict[str, dict[str, int]]:
    """Bytes read + written at the least: gae reads r, v (4 B each) and the mask (1 B), writes
    two float32 outputs; group estimators read and write ``[P, G]``; whitening reads x and mask,
    writes one output."""
    gae_sizes, (P, G), (Bw, Tw) = _sizes(tiny)
    out = {f"gae {B}x{T} f32": {"bytes": B * T * (4 + 4 + 1 + 4 + 4)} for B, T in gae_sizes}
    out[f"grpo {P}x{G}"] = {"bytes": P * G * 8}
    out[f"rloo {P}x{G}"] = {"bytes": P * G * 8}
    out[f"masked_whiten {Bw}x{Tw}"] = {"bytes": Bw * Tw * (4 + 1 + 4)}
    return out


def goals(tiny: bool) -> dict[str, list[tuple[str, str, float]]]:
    """The project's goals: GAE ≥ 10× TRL's loop and ≥ 5× torchrl's vectorised estimator."""
    gae_sizes = _sizes(tiny)[0]
    B, T = gae_sizes[0]
    return {f"gae {B}x{T} f32": [("speedup", "trl_loop", 10.0), ("speedup", "torchrl_vec", 5.0)]}


if __name__ == "__main__":
    torch.set_num_threads(2)
    tiny = "--tiny" in sys.argv
    for case, impls in cases(tiny).items():
        for name, build in impls.items():
            thunk = build()
            thunk()
            n = 3 if (name == "trl_loop" or name == "torchrl_loop") and not tiny else 10
            best = min(timeit.repeat(thunk, number=n, repeat=3)) / n
            print(f"{case:28s} {name:18s} {best * 1e3:9.3f} ms")
