"""Reward functions: calling them (TRL's convention), checking what they return, importing them
by name, weighting several into one, and the response-level penalties added to their scores.

A reward function is called as TRL calls one, every argument by keyword::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> scores

one score (or None, no opinion) per completion. ``prompts`` and ``completions`` have the data's
shape: for conversational data (a prompt is a list of ``{"role", "content"}`` messages) each prompt
is its message list and each completion ``[{"role": "assistant", "content": text}]``; for standard
data both are strings (the prompt as the dataset holds it). ``completion_ids`` are the completions'
token ids (lists of ints, up to and including the stop token); ``columns`` are the dataset's other
columns, one value per completion; ``trainer_state`` a ``transformers.TrainerState`` with
``global_step`` and ``max_steps`` (:func:`trainer_state`). A function takes the keywords it names
and ignores the rest through ``**kwargs`` (one without ``**kwargs`` gets only those it names); an
``async def`` function is awaited.

Scores are untrusted: what a function returns is checked for its type and length
(:func:`call_reward_fn`), each call may be bounded in time (``reward_timeout``), and a NaN or
infinite score, from a function or a reward model, goes through one policy
(:func:`check_finite_scores`, ``nonfinite_rewards``: refuse naming the rows, or drop those samples)."""

from __future__ import annotations

import functools
import asyncio
import importlib
import inspect
import math
import numbers
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rlcore.checks import check_mask, check_ndim, check_same_shape
from rlcore.loops.tasks import task_reward
from rlcore.loops.tokenization import is_conversation

__all__ = ["make_reward_fn", "repeat_columns", "RewardFn", "call_reward_fn", "MAX_ABS_REWARD", "check_reward_range",
           "NONFINITE_REWARDS", "check_finite_scores", "reward_columns", "import_reward_fn", "combine_rewards",
           "missing_eos_penalty", "reward_settings", "PASSED_TO_ALL", "check_reward_fn", "repeat_prompts",
           "as_completions", "trainer_state", "reward_fn_names", "call_reward_terms", "import_callable"]


RewardFn = Callable[..., "Sequence[float | None] | torch.Tensor"]


# The keywords every reward function receives besides the dataset's columns (TRL's).
PASSED_TO_ALL = ("prompts", "completions", "completion_ids", "trainer_state", "trajectories")


def _parameters(fn: RewardFn) -> Mapping[str, inspect.Parameter]:
    """``fn``'s parameters; a ``ValueError`` naming it when they cannot be read or one cannot be given
    by keyword (positional-only, without a default), as every reward function is called."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ValueError(f"{_reward_name(fn)}: its signature cannot be read, and reward functions are called by "
                         "keyword (prompts=, completions=, completion_ids=, each dataset column); wrap it in a "
                         "def taking those names and **kwargs") from None
    positional = [p.name for p in parameters.values() if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ValueError(f"{_reward_name(fn)}: positional-only parameters {positional}, but reward functions are "
                         "called by keyword as TRL calls them: fn(prompts=..., completions=..., completion_ids=..., "
                         "**columns); name its parameters after those, e.g. def reward(completions, **kwargs)")
    return parameters


def check_reward_fn(fn: RewardFn) -> RewardFn:
    """``fn`` if it can be called by keyword, as every reward function is; else a ``ValueError``
    naming it and the fix (a function that takes none of the keywords it would be given and no
    ``**kwargs``, e.g. ``lambda p, c: ...``, is refused too).

    >>> check_reward_fn(lambda p, c: [0.0] * len(c))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: reward function <lambda>: its parameters ['p', 'c'] name none of prompts, completions, ...
    """
    if getattr(fn, "reward_scores", None) is not None:  # combine_rewards: its functions were checked
        return fn
    parameters = _parameters(fn)
    keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if not keyword and not set(parameters) & set(PASSED_TO_ALL):
        raise ValueError(f"{_reward_name(fn)}: its parameters {list(parameters)} name none of "
                         f"{', '.join(PASSED_TO_ALL)} and it takes no **kwargs: reward functions are called by "
                         "keyword, as TRL calls them; e.g. def reward(prompts, completions, **kwargs)")
    return fn


def _reward_name(fn: RewardFn) -> str:
    return f"reward function {getattr(fn, '__name__', repr(fn))}"


def _invoke(fn: RewardFn, prompts: Sequence, completions: Sequence, columns: Mapping[str, Any]) -> Any:
    """``fn``'s raw return, every argument by keyword (TRL's convention); a function without
    ``**kwargs`` gets only the keywords it names."""
    kwargs = {"prompts": list(prompts), "completions": list(completions), **columns}
    parameters = _parameters(check_reward_fn(fn))
    missing = [k for k, p in parameters.items() if k not in kwargs and p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        given = sorted(set(columns) - set(PASSED_TO_ALL))
        raise ValueError(f"{_reward_name(fn)}: requires {missing}, which it is not given: reward functions receive "
                         f"{', '.join(PASSED_TO_ALL)} and the dataset's columns ({given}) by keyword, as TRL calls "
                         "them; name its parameters after those (e.g. def reward(completions, **kwargs))")
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in parameters}
    out = fn(**kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out  # an `async def` function: awaited


def _within(call: Callable[[], Any], timeout: float | None, name: str) -> Any:
    """``call()``, or a ``TimeoutError`` naming ``name`` when it has not returned after ``timeout``
    seconds (``None`` or 0: no limit, called in this thread).

    The call runs in a daemon thread (with this thread's grad mode) that this one joins with the
    limit. Python cannot stop a thread: a call past the limit keeps running in the background until
    it returns (its result is then discarded), and a daemon thread does not keep the process alive.
    """
    if not timeout:
        return call()
    outcome: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad):
                outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=target, name=f"rlcore {name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"{name}: no result after reward_timeout={timeout:g} s; the step fails here (the call "
                           "goes on in a background thread, which Python cannot stop). Make the function return "
                           "sooner (e.g. bound its own work), or raise reward_timeout (null or 0: no limit)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _is_real(value: Any) -> bool:
    """A real number a score may be: bool, int, float and NumPy's, or a 0-d real tensor / array
    holding data (a dense tensor not on the meta device; an array that is not masked)."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.dtype.is_complex and _tensor_fault(value) is None
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "biuf" and not isinstance(value, np.ma.MaskedArray)
    return isinstance(value, (numbers.Real, np.bool_))


def _tensor_fault(out: torch.Tensor) -> str | None:
    """Why a tensor holds no scores to read, or ``None``: a sparse (or other non-strided) layout, a
    meta tensor (shapes without data), a quantized or nested one."""
    if out.is_meta:
        return "a meta tensor (a shape without data)"
    if out.layout != torch.strided:
        return f"a tensor of layout {out.layout} (convert it with .to_dense())"
    if out.is_quantized or out.is_nested:
        return f"a {'quantized' if out.is_quantized else 'nested'} tensor"
    return None


def _as_float64(values: Sequence, name: str) -> torch.Tensor:
    """``values`` (real numbers, ``None`` read as 0) as a float64 tensor; an integer too large for a
    float (``2**1100``) is the magnitude error of :func:`check_reward_range`."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(0.0 if v is None else float(v))
        except OverflowError:
            raise ValueError(f"{name}: score {i} is an integer of {int(v).bit_length()} bits, beyond "
                             f"±{MAX_ABS_REWARD:g}, where the losses' squares and sums overflow float32; "
                             "rescale the rewards") from None
    return torch.tensor(out, dtype=torch.float64)


def _as_scores(out: Any, n: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [n] float32, opinion [n] bool)`` of a reward function's return, non-finite values
    kept: a sequence (list, tuple) of real numbers or ``None`` (no opinion), or a 1-D tensor or
    NumPy array of ``n`` real numbers. Anything else is a ``ValueError`` naming the function, what
    it returned and what was expected: text or bytes (``bytearray`` and ``memoryview`` too, which
    would read as byte values), a mapping, a NumPy masked array (its mask would be lost), a sparse,
    meta, quantized or nested tensor. Scores are read in float64 and a finite one beyond
    ``±MAX_ABS_REWARD`` refused (:func:`check_reward_range`) before the float32 cast, so ``1e39`` is
    too large, not "non-finite"."""
    if isinstance(out, np.ma.MaskedArray):
        raise ValueError(f"{name}: expected {n} real scores, got a NumPy masked array (its mask would be ignored); "
                         "return None where a score is masked")
    if isinstance(out, np.ndarray):
        if out.dtype.kind not in "biuf":
            raise ValueError(f"{name}: expected {n} real scores, got a NumPy array of dtype {out.dtype}")
        out = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float64))
    if isinstance(out, torch.Tensor):
        if out.dtype.is_complex:
            raise ValueError(f"{name}: expected {n} real scores, got a tensor of dtype {out.dtype}")
        if (fault := _tensor_fault(out)) is not None:
            raise ValueError(f"{name}: expected {n} real scores [B], got {fault}")
        scores = out.detach().cpu().to(torch.float64)
        if scores.shape != (n,):
            raise ValueError(f"{name}: expected {n} scores [B], got shape {list(scores.shape)}")
        return _in_range(scores, name), torch.ones(n, dtype=torch.bool)
    if isinstance(out, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(out, Sequence):
        hint = " (a mapping is not read by position: return a list in the order of the completions)" \
            if isinstance(out, Mapping) else " (bytes are not scores)" \
            if isinstance(out, (bytes, bytearray, memoryview)) else ""
        raise ValueError(f"{name}: expected a list of {n} scores or a [B] tensor, got {type(out).__name__}{hint}")
    values = list(out)
    if len(values) != n:
        raise ValueError(f"{name}: expected {n} scores [B], got shape [{len(values)}] (a {type(out).__name__} "
                         f"of {len(values)}; one score per completion)")
    for i, v in enumerate(values):
        if v is not None and not _is_real(v):
            raise ValueError(f"{name}: every score must be a number or None (int, float or bool); score {i} is "
                             f"{type(v).__name__} {v!r:.60}")
    opinion = torch.tensor([v is not None for v in values], dtype=torch.bool)
    return _in_range(_as_float64(values, name), name), opinion


def _in_range(scores: torch.Tensor, name: str) -> torch.Tensor:
    """float64 ``scores`` range-checked (``check_reward_range``, non-finite ones left for
    ``check_finite_scores``; a score is shown as its float32 value where it has one), then cast to
    float32, where every accepted finite score fits."""
    narrow = scores.to(torch.float32)
    shown = torch.where(torch.isfinite(narrow), narrow.to(torch.float64), scores)
    check_reward_range(torch.where(torch.isfinite(scores), shown, torch.zeros_like(scores)), name)
    return narrow


def call_reward_fn(fn: RewardFn, prompts: Sequence, completions: Sequence, *,
                   reward_timeout: float | None = None, nonfinite_rewards: str = "raise", **columns) -> torch.Tensor:
    """Call a reward function and return its ``[B]`` scores as float32.

    Every argument goes by keyword, as TRL calls one: ``fn(prompts=..., completions=...,
    **columns)``, ``columns`` holding ``completion_ids`` and ``trainer_state`` when the caller has
    them (``loops.score.score_rollout`` does) and the dataset's other columns; a function without
    ``**kwargs`` gets only the keywords it names, so ``def correct(completions, answer)`` works.
    A function that cannot be called so is a ``ValueError`` (:func:`check_reward_fn`).

    ``fn`` returns ``B`` scores, one per completion in their order: a list or tuple whose entries
    are real numbers (``int``, ``float``, ``bool`` (1 / 0), NumPy scalars) or ``None`` ("no
    opinion": returned as NaN; the online recipes leave such samples out of training and of the
    group statistics, and count them), or a 1-D ``[B]`` tensor or NumPy array of real numbers
    (detached). A dict, a string, nested lists, another length or shape is a ``ValueError`` naming
    the function, what was expected and what it returned.

    Args:
        reward_timeout: seconds the call may take (``None`` or 0: no limit); past it a
            ``TimeoutError`` names the function and the limit (the call runs in a daemon thread,
            which goes on in the background: Python cannot stop it). A function that needs the main
            thread (``signal.alarm``) needs ``None``.
        nonfinite_rewards: a NaN or infinite score: ``"raise"`` (a ``ValueError`` naming the function
            and the rows) or ``"drop"`` (returned as NaN, as ``None``: those samples leave training).
            ``check_finite_scores``.

    >>> call_reward_fn(lambda completions, **kw: [len(x) for x in completions], ["q", "q"], ["ab", ""])
    tensor([2., 0.])
    >>> def correct(completions, answer, **kwargs):
    ...     return [float(c == a) for c, a in zip(completions, answer)]
    >>> call_reward_fn(correct, ["1+1=", "2+2="], ["2", "5"], answer=["2", "4"])
    tensor([1., 0.])
    """
    own = getattr(fn, "reward_scores", None)
    if own is not None:  # combine_rewards: each of its functions called, timed and checked by its own name
        return own(prompts, completions, reward_timeout=reward_timeout, nonfinite_rewards=nonfinite_rewards, **columns)
    name = _reward_name(fn)
    out = _within(lambda: _invoke(fn, prompts, completions, columns), reward_timeout, name)
    scores, opinion = _as_scores(out, len(completions), name)
    return check_finite_scores(torch.where(opinion, scores, math.nan), name, nonfinite_rewards=nonfinite_rewards,
                               opinion=opinion)


# What a NaN or infinite score (from a reward function or a reward model) does: ``raise`` refuses it
# naming the rows; ``drop`` leaves those samples out of training, as a reward function's ``None``.
NONFINITE_REWARDS = ("raise", "drop")


def check_finite_scores(scores: torch.Tensor, name: str, *, nonfinite_rewards: str = "raise",
                        opinion: torch.Tensor | None = None) -> torch.Tensor:
    """``scores [B]`` under the one policy for NaN and infinite scores, whatever their source.

    Rows where ``opinion`` is False (a reward function's ``None``) are NaN already and stay so. A
    non-finite score elsewhere is, with ``nonfinite_rewards="raise"``, a ``ValueError`` naming
    ``name`` (the reward function or model), the values and the rows; with ``"drop"`` it becomes
    NaN, which the online recipes treat as "no opinion" (``loops.filters.exclude_unscored``): the
    sample's tokens leave the loss, it leaves its group's statistics (a group of its own, advantage
    0) and ``rollout/unscored`` counts it. Finite scores are then range-checked
    (``check_reward_range``).

    >>> check_finite_scores(torch.tensor([1.0, float("inf")]), "judge", nonfinite_rewards="drop")
    tensor([1., nan])
    """
    if nonfinite_rewards not in NONFINITE_REWARDS:
        raise ValueError(f"nonfinite_rewards: expected one of {list(NONFINITE_REWARDS)}, got {nonfinite_rewards!r}")
    opinion = torch.ones_like(scores, dtype=torch.bool) if opinion is None else opinion.to(scores.device)
    bad = ~torch.isfinite(scores) & opinion
    rows = bad.nonzero().flatten().tolist()
    if rows and nonfinite_rewards == "raise":
        more = f" ({len(rows)} of {scores.shape[0]} rows)" if len(rows) > 8 else ""
        raise ValueError(f"{name}: non-finite scores {scores[rows[:4]].tolist()} at rows {rows[:8]}{more}; return "
                         "None for a sample it has no opinion on, or set nonfinite_rewards: drop to leave such "
                         "samples out of training")
    check_reward_range(torch.where(opinion & ~bad, scores, torch.zeros_like(scores)), name)
    return torch.where(bad | ~opinion, torch.full_like(scores, math.nan), scores)


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
    requires besides those every function receives (``PASSED_TO_ALL``: ``prompts``, ``completions``,
    ``completion_ids``, ``trainer_state``, ``trajectories``), with no default, not ``*args`` / ``**kwargs``.

    >>> def correct(completions, answer, **kwargs): ...
    >>> reward_columns(correct)
    ('answer',)
    """
    if hasattr(fn, "required_columns"):
        return tuple(fn.required_columns)
    return tuple(p.name for p in _parameters(fn).values() if p.default is p.empty and p.name not in PASSED_TO_ALL
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


# the names TRL's CLI (`trl grpo`, `trl rloo`) gives its own reward functions, with the arguments it calls
# a factory with
TRL_CLI_REWARDS: dict[str, dict[str, int] | None] = {
    "accuracy_reward": None, "reasoning_accuracy_reward": None, "think_format_reward": None,
    "get_soft_overlong_punishment": {"max_completion_len": 1280, "soft_punish_cache": 256}}


def import_reward_fn(spec: str) -> RewardFn:
    """The reward function ``"package.module:function"`` names (a config's ``reward_funcs``): an
    installed module, or one in the working directory (as ``python -m`` would find it). TRL's CLI
    forms work too: a dotted path ``package.module.function`` and the bare names of TRL's own
    functions (``accuracy_reward``, ``think_format_reward``, ... from ``trl.rewards``;
    ``get_soft_overlong_punishment`` built with the values TRL's CLI uses).

    Naming a function in a config runs that code, as a script would: pass only configs you trust.
    Raises ``ValueError`` naming the spec when it is malformed, the module cannot be imported or
    the attribute is missing or not callable.
    """
    module_name, sep, attr = str(spec).partition(":")
    if not sep and str(spec) in TRL_CLI_REWARDS:
        factory_args = TRL_CLI_REWARDS[str(spec)]
        fn = import_reward_fn(f"trl.rewards:{spec}")
        return fn(**factory_args) if factory_args is not None else fn
    if not sep and "." in str(spec):  # TRL's CLI: module path, then the function after the last dot
        module_name, sep, attr = str(spec).rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_funcs: expected 'package.module:function', got {spec!r} (or TRL's "
                         f"'package.module.function', or one of {', '.join(TRL_CLI_REWARDS)})")
    return import_callable(module_name, attr, spec=str(spec), what="reward_funcs")


def import_callable(module_name: str, attr: str, *, spec: str, what: str) -> Callable[..., Any]:
    """``module_name``'s attribute ``attr`` (dotted: ``Class.method``), a module of the working
    directory found as ``python -m`` finds one; ``ValueError`` naming ``what`` and ``spec`` when it
    does not import or is not callable (reward functions, ``--env`` factories and ``--tools``)."""
    cwd = os.getcwd()
    added = cwd not in sys.path  # a module of the working directory, as `python -m` finds it
    try:
        if added:
            sys.path.insert(0, cwd)
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot load {spec!r} ({type(e).__name__}: {e})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not callable(obj):
        raise ValueError(f"{what}: {spec!r} is not callable (a {type(obj).__name__})")
    return obj


def reward_fn_names(funcs: Sequence[RewardFn]) -> list[str]:
    """The names the metrics give ``funcs`` (``rewards/<name>/mean``, as TRL): a function's
    ``__name__`` (through ``functools.partial``), else its class's name; a name taken by an earlier
    function gets ``_2``, ``_3``, ...

    >>> def correct(completions, **kw): ...
    >>> reward_fn_names([correct, functools.partial(correct), len])
    ['correct', 'correct_2', 'len']
    """
    names: list[str] = []
    for fn in funcs:
        while isinstance(fn, functools.partial):
            fn = fn.func
        base = getattr(fn, "__name__", type(fn).__name__)
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def call_reward_terms(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], **kwargs
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``call_reward_fn``'s ``[B]`` scores and, beside them, each reward function's own unweighted
    scores by name (``reward_fn_names``; NaN where it had no opinion): those of every function of a
    ``combine_rewards``, or ``{name: scores}`` for a single function."""
    own = getattr(fn, "reward_terms", None)
    if own is not None:
        return own(prompts, completions, **kwargs)
    scores = call_reward_fn(fn, prompts, completions, **kwargs)
    return scores, {reward_fn_names([fn])[0]: scores}


def combine_rewards(funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> RewardFn:
    """A reward function returning ``Σ_k w_k r_k`` over ``funcs`` (``None`` terms left out; ``None`` if all are).

    A function that returns ``None`` for a row abstains there (weight renormalisation is not
    applied: the other terms are summed as they are). ``weights`` default to 1.
    ``call_reward_fn`` calls each function on its own (its ``reward_scores`` attribute): each
    checked, timed with ``reward_timeout`` and named in errors; with ``nonfinite_rewards="drop"``
    a row where any term is NaN or infinite is dropped whole (NaN), not summed without it.

    Returns:
        A reward function with the same signature, returning ``B`` floats (``None``: no opinion).

    References:
        Lambert et al., "Tülu 3" (verifiable rewards as Python checks),
        https://arxiv.org/abs/2411.15124
    """
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"weights: expected {len(funcs)} weights (one per function), got {len(weights)}")
    names = reward_fn_names(funcs)

    def reward_terms(prompts, completions, *, reward_timeout: float | None = None, nonfinite_rewards: str = "raise",
                     **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms, dropped = [], torch.zeros(len(completions), dtype=torch.bool)
        for f in funcs:
            name = _reward_name(f)
            out = _within(lambda f=f: _invoke(f, prompts, completions, columns), reward_timeout, name)
            scores, opinion = _as_scores(out, len(completions), name)
            dropped |= opinion & ~torch.isfinite(scores)
            terms.append(check_finite_scores(torch.where(opinion, scores, math.nan), name, opinion=opinion,
                                             nonfinite_rewards=nonfinite_rewards))
        r = torch.stack(terms)  # [K, B]
        missing = torch.isnan(r)
        total = torch.where(missing, 0.0, torch.tensor(weights, dtype=r.dtype)[:, None] * r).sum(0)
        total = torch.where(missing.all(0) | dropped, math.nan, total)
        check_reward_range(torch.nan_to_num(total, nan=0.0), "combine_rewards")
        return total, dict(zip(names, terms))

    def reward_scores(prompts, completions, **kwargs) -> torch.Tensor:
        return reward_terms(prompts, completions, **kwargs)[0]

    def combined(prompts, completions, **columns) -> list[float | None]:
        return [None if math.isnan(v) else v for v in reward_scores(prompts, completions, **columns).tolist()]

    combined.reward_scores = reward_scores
    combined.reward_terms = reward_terms  # (total [B], {name: unweighted scores [B]}): the per-function metrics
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
    instead (then ``None``). Built once per run: training and evaluation score with the same value
    (``train_online`` keeps it in the state, ``TrainState.reward_fn``). Each function must take its
    arguments by keyword (:func:`check_reward_fn`)."""
    given = [] if reward_fn is None else list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    funcs = [check_reward_fn(f) for f in given + [import_reward_fn(spec) for spec in getattr(config, "reward_funcs", ())]]
    weights = getattr(config, "reward_weights", None)
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"reward_weights: expected one weight per reward function ({len(funcs)}), got "
                         f"{len(weights)}: {list(weights)}")
    if not funcs:
        return None if config.reward_model else task_reward(config.task)
    return funcs[0] if len(funcs) == 1 and weights is None else combine_rewards(funcs, weights)


def repeat_columns(rows: Mapping[str, Sequence], num_samples: int, *,
                   skip: Sequence[str] = ("prompt", "completion", "completion_ids", "trainer_state", "trajectories")
                   ) -> dict[str, list]:
    """Each column but ``skip`` with every value repeated ``num_samples`` times in place
    (``[a, b] → [a, a, b, b]``), aligned with the prompt-major rows of a rollout (the columns a
    reward function receives by keyword; the skipped ones it receives as TRL gives them)."""
    return {k: [v for v in col for _ in range(num_samples)] for k, col in rows.items() if k not in skip}


def repeat_prompts(rows: Mapping[str, Sequence], num_samples: int) -> list | None:
    """The batch's ``prompt`` column as the data holds it (text, or message lists), each repeated
    ``num_samples`` times: the ``prompts`` a reward function receives (``None`` without the column)."""
    return None if "prompt" not in rows else [p for p in rows["prompt"] for _ in range(num_samples)]


def as_completions(prompts: Sequence | None, texts: Sequence[str]) -> list:
    """Completions in the shape of the data (TRL's): ``[{"role": "assistant", "content": text}]``
    each where the prompts are conversations (message lists), the texts themselves otherwise.

    >>> as_completions([[{"role": "user", "content": "2+2="}]], ["4"])
    [[{'role': 'assistant', 'content': '4'}]]
    >>> as_completions(["2+2="], ["4"])
    ['4']
    """
    if prompts and is_conversation(prompts[0]):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def trainer_state(step: int, max_steps: int | None) -> Any:
    """What a reward function receives as ``trainer_state``: a ``transformers.TrainerState`` (the
    type TRL passes) with ``global_step = step`` (loop steps done) and ``max_steps`` (the run's
    ``steps``), so ``trainer_state.global_step / trainer_state.max_steps`` is the run's progress;
    its other fields keep their defaults. A fresh value per call."""
    from transformers import TrainerState
    return TrainerState(global_step=int(step), max_steps=int(max_steps or 0))


def reward_settings(config: Any) -> dict[str, Any]:
    """The config's ``reward_timeout`` and ``nonfinite_rewards`` as keywords of ``score_rollout`` /
    ``call_reward_fn`` (a config without them: no time limit, non-finite scores refused)."""
    return {"reward_timeout": getattr(config, "reward_timeout", None),
            "nonfinite_rewards": getattr(config, "nonfinite_rewards", "raise")}
