"""Reward functions: calling them (TRL's convention), checking what they return, importing them
by name, weighting several into one, and the response-level penalties added to their scores.

A reward function is fn(prompts, completions, **columns) -> scores: one score (or None,
no opinion) per completion; columns are the dataset's other columns, one value per completion."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.checks import check_mask, check_ndim, check_same_shape
from rlcore.loops.tasks import task_reward

__all__ = ["make_reward_fn", "repeat_columns", "RewardFn", "call_reward_fn", "MAX_ABS_REWARD", "check_reward_range",
           "reward_columns", "import_reward_fn", "combine_rewards", "missing_eos_penalty"]


RewardFn = Callable[..., "Sequence[float | None] | torch.Tensor"]


def _by_keyword(fn: RewardFn) -> bool:
    """Whether ``fn`` names ``completions`` as a keyword it accepts (TRL's calling convention)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and C callables: positional
        return False
    param = parameters.get("completions")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], **columns) -> torch.Tensor:
    """Call a reward function and return its ``[B]`` scores as float32.

    A function that names a ``completions`` parameter is called by keyword as TRL calls one,
    ``fn(prompts=..., completions=..., **columns)`` (``prompts`` and columns it does not accept are
    left out when it takes no ``**kwargs``), so ``def correct(completions, answer, **kw)`` works;
    any other is called positionally, ``fn(prompts, completions, **columns)``.

    ``fn`` returns ``B`` scores: a list whose ``None`` entries mean "no opinion" (returned as NaN:
    the online recipes leave such samples out of training and of the group statistics, and count
    them), or a ``[B]`` tensor (detached). Raises ``ValueError`` naming the function for another
    number or shape of scores, and for a NaN or infinite score (return ``None`` for no opinion).

    >>> call_reward_fn(lambda p, c: [len(x) for x in c], ["q", "q"], ["ab", ""])
    tensor([2., 0.])
    >>> def correct(completions, answer, **kwargs):
    ...     return [float(c == a) for c, a in zip(completions, answer)]
    >>> call_reward_fn(correct, ["1+1=", "2+2="], ["2", "5"], answer=["2", "4"])
    tensor([1., 0.])
    """
    if _by_keyword(fn):
        kwargs = {"prompts": list(prompts), "completions": list(completions), **columns}
        parameters = inspect.signature(fn).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in parameters}
        out = fn(**kwargs)
    else:
        out = fn(list(prompts), list(completions), **columns)
    name = f"reward function {getattr(fn, '__name__', repr(fn))}"
    if isinstance(out, torch.Tensor):
        scores = out.detach().to(torch.float32)
        opinion = torch.ones_like(scores, dtype=torch.bool)
    else:
        try:
            values = list(out)
        except TypeError:
            raise ValueError(f"{name}: expected a list of {len(completions)} scores or a [B] tensor, got "
                             f"{type(out).__name__}") from None
        opinion = torch.tensor([v is not None for v in values], dtype=torch.bool)
        try:
            scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: every score must be a number or None, got {values[:4]!r}... ({e})") from None
    if scores.shape != (len(completions),):
        raise ValueError(f"{name}: expected {len(completions)} scores [B], got shape {list(scores.shape)}")
    bad = (~torch.isfinite(scores) & opinion).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{name}: non-finite scores {scores[bad[:4]].tolist()} at rows {bad[:8]}; return None "
                         "for a sample it has no opinion on")
    check_reward_range(scores[opinion], name)
    return torch.where(opinion, scores, math.nan)


# The largest reward magnitude the recipes take: squares (value losses, variances) and sums over a
# rollout of such rewards stay far inside float32's range (3.4e38).
MAX_ABS_REWARD = 1e10


def check_reward_range(scores: torch.Tensor, name: str) -> None:
    """A ``ValueError`` naming ``name`` for a finite score beyond ``±MAX_ABS_REWARD``: a loss built
    on it (a squared value error, a variance over the group) would overflow to inf or NaN."""
    big = (scores.abs() > MAX_ABS_REWARD).nonzero().flatten().tolist()
    if big:
        raise ValueError(f"{name}: scores {scores[big[:4]].tolist()} at rows {big[:8]} exceed ±{MAX_ABS_REWARD:g}, "
                         "where the losses' squares and sums overflow float32; rescale the rewards")


def reward_columns(fn: RewardFn) -> tuple[str, ...]:
    """The dataset columns ``fn`` cannot run without: its ``required_columns`` attribute when set
    (``combine_rewards`` sets the union of its functions'), else the parameters its signature
    requires besides ``prompts`` and ``completions`` (no default, not ``*args`` / ``**kwargs``).

    >>> def correct(completions, answer, **kwargs): ...
    >>> reward_columns(correct)
    ('answer',)
    """
    if hasattr(fn, "required_columns"):
        return tuple(fn.required_columns)
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    named = parameters if _by_keyword(fn) else parameters[2:]
    return tuple(p.name for p in named if p.default is p.empty and p.name not in ("prompts", "completions")
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def import_reward_fn(spec: str) -> RewardFn:
    """The reward function ``"package.module:function"`` names (a config's ``reward_funcs``): an
    installed module, or one in the working directory (as ``python -m`` would find it).

    Naming a function in a config runs that code, as a script would: pass only configs you trust.
    Raises ``ValueError`` naming the spec when it is malformed, the module cannot be imported or
    the attribute is missing or not callable.
    """
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_funcs: expected 'package.module:function', got {spec!r}")
    cwd = os.getcwd()
    added = cwd not in sys.path  # a module of the working directory, as `python -m` finds it
    try:
        if added:
            sys.path.insert(0, cwd)
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward_funcs: cannot load {spec!r} ({type(e).__name__}: {e})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not callable(obj):
        raise ValueError(f"reward_funcs: {spec!r} is not callable (a {type(obj).__name__})")
    return obj


def combine_rewards(funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> RewardFn:
    """A reward function returning ``Σ_k w_k r_k`` over ``funcs`` (``None`` terms left out; ``None`` if all are).

    A function that returns ``None`` for a row abstains there (weight renormalisation is not
    applied: the other terms are summed as they are). ``weights`` default to 1.

    Returns:
        A reward function with the same signature, returning ``B`` floats (``None``: no opinion).

    References:
        Lambert et al., "Tülu 3" (verifiable rewards as Python checks),
        https://arxiv.org/abs/2411.15124
    """
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"weights: expected {len(funcs)} weights (one per function), got {len(weights)}")

    def combined(prompts, completions, **columns) -> list[float | None]:
        r = torch.stack([call_reward_fn(f, prompts, completions, **columns) for f in funcs])  # [K, B]
        w = torch.tensor(weights, dtype=r.dtype)[:, None]
        missing = torch.isnan(r)
        total = torch.where(missing, 0.0, w * r).sum(0)
        return [None if gone else value for gone, value in zip(missing.all(0).tolist(), total.tolist())]

    combined.required_columns = tuple(dict.fromkeys(c for f in funcs for c in reward_columns(f)))
    return combined


def missing_eos_penalty(score: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor, *,
                        eos_token_id: int | Sequence[int], penalty: float = 1.0) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every response without an EOS among its real tokens.

    ``s'_b = s_b − penalty · 1[no t with mask[b,t] and ids[b,t] ∈ eos]`` (truncated generations).

    Args:
        score: ``[B]`` float.  response_ids: ``[B, R]`` long.  response_mask: ``[B, R]`` bool.
        eos_token_id: one id or several stop ids.
    Returns:
        ``[B]``; gradient flows to ``score`` only.

    References:
        Huang et al., "The N+ Implementation Details of RLHF with PPO",
        https://arxiv.org/abs/2403.17031

    >>> missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([[5, 2], [5, 6]]),
    ...                     torch.ones(2, 2, dtype=torch.bool), eos_token_id=2, penalty=0.5)
    tensor([1.0000, 0.5000])
    """
    check_ndim("score", score, ndim=1, layout="[B]")
    check_ndim("response_ids", response_ids, ndim=2, layout="[B, R]")
    check_mask("response_mask", response_mask, like=response_ids, like_name="response_ids")
    eos = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    has_eos = (torch.isin(response_ids, eos) & response_mask).any(-1)
    check_same_shape("score", score, has_eos=has_eos)
    return torch.where(has_eos, score, score - penalty)


def make_reward_fn(config: Any, reward_fn: RewardFn | Sequence[RewardFn] | None = None) -> RewardFn | None:
    """The reward function of a run: ``reward_fn`` (one function or a list) and the functions the
    config names in ``reward_funcs`` (``import_reward_fn``), summed with ``reward_weights``
    (``combine_rewards``); with none, ``task_reward(config.task)`` unless a ``reward_model`` scores
    instead (then ``None``)."""
    given = [] if reward_fn is None else list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    funcs = given + [import_reward_fn(spec) for spec in getattr(config, "reward_funcs", ())]
    weights = getattr(config, "reward_weights", None)
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"reward_weights: expected one weight per reward function ({len(funcs)}), got "
                         f"{len(weights)}: {list(weights)}")
    if not funcs:
        return None if config.reward_model else task_reward(config.task)
    return funcs[0] if len(funcs) == 1 and weights is None else combine_rewards(funcs, weights)


def repeat_columns(rows: Mapping[str, Sequence], num_samples: int, *,
                   skip: Sequence[str] = ("prompt", "completion")) -> dict[str, list]:
    """Each column but ``skip`` with every value repeated ``num_samples`` times in place
    (``[a, b] → [a, a, b, b]``), aligned with the prompt-major rows of a rollout."""
    return {k: [v for v in col for _ in range(num_samples)] for k, col in rows.items() if k not in skip}
