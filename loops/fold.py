"""The fold: a training run is ``state, history = fold(step, state, source)``.

``step(state, item) -> (state, metrics)`` chains collect -> score -> update for one item of the
source (a batch of prompts, of preference pairs, of text). ``fold`` calls it once per item,
counts the items in ``state.step``, turns each step's metrics into plain floats (the one place
where ``.item()``-style synchronisation happens), and hands them to the callbacks.

Callbacks are plain callables ``cb(state, metrics) -> None | "stop" | Mapping``:

- ``None``: nothing to report;
- ``"stop"``: end the fold after this step (every callback of the step still runs);
- a mapping of scalars (an evaluation's results): merged into this step's metrics, which the
  later callbacks and the history see (so put evaluation before logging).

``metrics`` is a ``dict[str, float]``. A callback object may also define ``on_start(state)``
(called once before the first step) and ``on_end(state)`` (called once after the last step,
also after an early stop or an exhausted source; not after an exception). :func:`every` runs a
callback every ``n`` steps, :func:`stop_when` turns a predicate into an early stop.

Distributed (``loops.scale.distributed``): every rank runs the same fold on its shard of each item
(``shard_source``); each step's metrics are averaged over the ranks (one all-reduce) before the
callbacks see them, so every rank logs, evaluates and stops on the same numbers. Every rank must
report the same metric names.

Resuming: ``state.step`` is the number of items already consumed. A resumed fold skips exactly
that many items of ``source`` before the first step, so with a deterministic source (a list, a
seeded shuffle, a ``datasets`` split) the resumed run sees the items the uninterrupted run would
have seen. ``source`` is either an iterable, replayed from its start and advanced past the
consumed items, or a callable ``source(start) -> iterable`` that begins at item ``start`` itself
(cheap for indexable data).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlcore.loops.scale.distributed import reduce_metrics

__all__ = ["fold", "to_floats", "every", "stop_when", "STOP"]

STOP = "stop"

Metrics = Mapping[str, Any] | TensorDictBase
Callback = Callable[[Any, dict], Any]


def to_floats(metrics: Metrics) -> dict[str, float]:
    """Plain floats from a TensorDict (or mapping) of scalars, with one device synchronisation.

    Nested TensorDict keys are joined with ``/`` (``("chosen", "logps")`` -> ``"chosen/logps"``).
    Values may be 0-d (or one-element) tensors of any dtype, Python numbers or bools.

    Args:
        metrics: ``TensorDict`` with ``batch_size=[]`` or a ``Mapping[str, tensor | number]``.
    Returns:
        ``dict[str, float]`` in the metrics' key order.
    Raises:
        ValueError naming the key of a tensor with more than one element.

    >>> to_floats({"loss": torch.tensor(0.5), "n": 3})
    {'loss': 0.5, 'n': 3.0}
    """
    if isinstance(metrics, TensorDictBase):
        items = metrics.items(include_nested=True, leaves_only=True)
    else:
        items = metrics.items()
    names, values = [], []
    for key, value in items:
        name = "/".join(key) if isinstance(key, tuple) else str(key)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"metrics[{name!r}]: expected a scalar tensor (shape []), got shape "
                             f"{list(value.shape)}")
        names.append(name)
        values.append(value)
    out = dict.fromkeys(names, 0.0)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[names[i]] = float(v)
    for device, idx in by_device.items():  # one transfer per device, not one per metric
        dtype = torch.float32 if device.type == "mps" else torch.float64
        stacked = torch.stack([values[i].detach().reshape(()).to(dtype) for i in idx]).tolist()
        for i, f in zip(idx, stacked):
            out[names[i]] = f
    return out


def _items(source: Iterable | Callable[[int], Iterable], start: int) -> Iterator:
    if callable(source) and not hasattr(source, "__iter__"):
        return iter(source(start))
    it = iter(source)
    skipped = sum(1 for _ in itertools.islice(it, start))
    if skipped < start:
        raise ValueError(f"source: the state has consumed {start} items (state.step) but the source "
                         f"holds only {skipped}; resuming needs the source the run started with")
    return it


def _hook(callbacks: Sequence, name: str, state: Any) -> None:
    for cb in callbacks:
        hook = getattr(cb, name, None)
        if hook is not None:
            hook(state)


def fold(step: Callable[[Any, Any], tuple[Any, Metrics]], state: Any,
         source: Iterable | Callable[[int], Iterable], *, num_steps: int | None = None,
         callbacks: Sequence[Callback] = ()) -> tuple[Any, list[dict[str, float]]]:
    """Run ``state, metrics = step(state, item)`` over the items of ``source``.

    ``state_{k+1} = replace(step(state_k, item_k).state, step=state_k.step + 1)``; stops when
    ``state.step == num_steps``, when the source is exhausted, or when a callback returns
    ``"stop"``.

    Args:
        step: ``(state, item) -> (state, metrics)``; ``metrics`` a TensorDict (``batch_size=[]``)
            or mapping of scalars. It must not touch ``state.step``: the fold counts items.
        state: a frozen dataclass with an int field ``step`` (e.g. ``TrainState``).
        source: an iterable of items, or a callable ``start -> iterable`` (see the module doc).
            The first ``state.step`` items are skipped (resume).
        num_steps: the total the run is heading for (a value of ``state.step``, not a number of
            further steps), so a resumed call with the same arguments finishes the same run.
            ``None``: until the source is exhausted.
        callbacks: called in order after every step, see the module doc.
    Returns:
        ``(state, history)``: the final state and one ``dict[str, float]`` per step taken by this
        call (the step's metrics plus what callbacks merged in).

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class S:
    ...     step: int = 0
    ...     total: int = 0
    >>> s, hist = fold(lambda s, x: (dataclasses.replace(s, total=s.total + x), {"x": x}), S(), [1, 2, 3, 4],
    ...                num_steps=3)
    >>> s, hist
    (S(step=3, total=6), [{'x': 1.0}, {'x': 2.0}, {'x': 3.0}])
    """
    if not (dataclasses.is_dataclass(state) and isinstance(getattr(state, "step", None), int)):
        raise TypeError(f"state: expected a dataclass with an int field 'step', got {type(state).__name__}")
    items = _items(source, state.step)
    _hook(callbacks, "on_start", state)
    history: list[dict[str, float]] = []
    stop = False
    while not stop and (num_steps is None or state.step < num_steps):
        try:
            item = next(items)
        except StopIteration:
            break
        new_state, metrics = step(state, item)
        state = dataclasses.replace(new_state, step=state.step + 1)
        logged = to_floats(reduce_metrics(metrics))  # the mean over ranks under torch.distributed
        for cb in callbacks:
            out = cb(state, logged)
            if isinstance(out, str):
                if out != STOP:
                    raise ValueError(f"callback {cb!r} returned {out!r}; expected None, {STOP!r} or a mapping")
                stop = True
            elif out is not None:
                logged.update(to_floats(out))
        history.append(logged)
    _hook(callbacks, "on_end", state)
    return state, history


class every:  # noqa: N801 -- reads as a function at the call site: every(100, evaluate)
    """Run ``callback`` only when ``state.step`` is a multiple of ``n`` (and, with ``at_end``, at
    the final step of the fold, with that step's metrics). ``on_start`` / ``on_end`` of the
    wrapped callback are forwarded.

    ``callbacks=[every(100, evaluate), every(500, checkpointer, at_end=True), logger]``.
    """

    def __init__(self, n: int, callback: Callback, *, at_end: bool = False):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive int, got {n!r}")
        self.n, self.callback, self.at_end = n, callback, at_end
        self._last: int | None = None
        self._metrics: dict = {}

    def __call__(self, state: Any, metrics: dict) -> Any:
        self._metrics = metrics
        if state.step % self.n:
            return None
        self._last = state.step
        return self.callback(state, metrics)

    def on_start(self, state: Any) -> None:
        _hook([self.callback], "on_start", state)

    def on_end(self, state: Any) -> None:
        if self.at_end and self._last != state.step and state.step > 0:
            self.callback(state, self._metrics)
        _hook([self.callback], "on_end", state)

    def __repr__(self) -> str:
        return f"every({self.n}, {self.callback!r})"


def stop_when(predicate: Callable[[Any, dict], bool]) -> Callback:
    """A callback returning ``"stop"`` once ``predicate(state, metrics)`` is true.

    >>> cb = stop_when(lambda s, m: m.get("reward", 0.0) > 0.9)
    >>> cb(None, {"reward": 0.95})
    'stop'
    """
    def callback(state: Any, metrics: dict) -> str | None:
        return STOP if predicate(state, metrics) else None
    return callback
