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

Distributed (``rlcore.loops.dist``): every rank runs the same fold on its shard of each item
(``shard_source``); each step's metrics are averaged over the ranks (one all-reduce) before the
callbacks see them, so every rank logs, evaluates and stops on the same numbers. Every rank must
report the same metric names.

Signals: while a fold runs in the main thread, SIGINT (Ctrl-C) and SIGTERM stop it at the next step
boundary: the step in progress finishes, its callbacks run, then every ``on_end`` (a
``Checkpointer`` saves the step), and the fold raises :class:`Interrupted` (a ``KeyboardInterrupt``)
with the signal, the step and the exit code (``128 + signal``: 130, 143). A second signal stops at
once, the step in progress lost; a signal during the last step ends the run as usual. Signals the
process ignores stay ignored, and the previous handlers are restored when the fold returns.

Memory: on Linux with glibc a recipe's run (``loops.recipe.run``, before its fold) fixes the
allocator's mmap threshold at 64 KiB (:func:`follow_live_memory`; a fold of your own can call it
too), for the rest of the process, unless ``MALLOC_MMAP_THRESHOLD_`` or
``GLIBC_TUNABLES`` already choose one: blocks from 64 KiB up are then mapped on allocation and
unmapped on release, so the resident set follows the live tensors. With glibc's default, dynamic
threshold (raised, up to 32 MiB, each time a mapped block is freed) a step's activations and
gradients come from the heap, which keeps their pages: DPO with LoRA on a 0.5B model (8 pairs of
512 tokens, 2-core Xeon) peaked at 4.3 to 7.0 GiB resident with at most 1.1 GiB of it live, 2.3 GiB
with the threshold fixed, at the same step time (docs/scale.md has the FSDP2 case).

Resuming: ``state.step`` is the number of items already consumed. A resumed fold skips exactly
that many items of ``source`` before the first step, so with a deterministic source (a list, a
seeded shuffle, a ``datasets`` split) the resumed run sees the items the uninterrupted run would
have seen. ``source`` is either an iterable, replayed from its start and advanced past the
consumed items, or a callable ``source(start) -> iterable`` that begins at item ``start`` itself
(cheap for indexable data).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import platform
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlcore.loops.dist import all_reduce_sum, dist_info, reduce_metrics

__all__ = ["fold", "to_floats", "every", "stop_when", "follow_live_memory", "STOP", "Interrupted", "STOP_SIGNALS",
           "MMAP_THRESHOLD"]

STOP = "stop"

Metrics = Mapping[str, Any] | TensorDictBase
Callback = Callable[[Any, dict], Any]


MMAP_THRESHOLD = 65536  # bytes: glibc maps every block from this size up (``follow_live_memory``)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, <malloc.h>


def follow_live_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (``mallopt(M_MMAP_THRESHOLD, ...)``), for
    the process: blocks from that size up are mapped on allocation and unmapped on release, and the
    threshold no longer rises (glibc raises it, up to 32 MiB, each time a mapped block is freed, after
    which such blocks come from the heap, which keeps their pages once they are freed). Returns
    whether it was set: not where the environment chose already (``MALLOC_MMAP_THRESHOLD_``, or
    ``GLIBC_TUNABLES`` naming ``glibc.malloc.mmap_threshold``), nor off Linux with glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # stop a fold at its next step boundary


class Interrupted(KeyboardInterrupt):  # noqa: N818 -- a KeyboardInterrupt: code catching Exception lets it pass
    """A fold stopped by a signal (SIGINT, SIGTERM): at a step boundary, or at once on a second signal.

    Attributes:
        signum: the signal's number.  step: ``state.step`` when the fold stopped (at a boundary:
            its steps all done, every ``on_end`` run) or at the start of the step lost (at once).
        at_once: stopped inside a step by a second signal; that step is lost.
        exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM), a shell's code for the signal.
        run_dir, checkpoint: the run's folder and the checkpoint a resume starts from (``None``:
            nothing saved), set by ``loops.recipe.run``.
    """

    def __init__(self, signum: int, step: int | None, *, at_once: bool = False, total: int | None = None):
        super().__init__(signum, step)
        self.signum, self.step, self.at_once, self.total = signum, step, at_once, total
        self.exit_code = 128 + signum
        self.run_dir: str | None = None
        self.checkpoint: str | None = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def summary(self) -> str:
        """Where the run stopped and what a resume starts from."""
        of = f" of {self.total}" if self.total is not None else ""
        if self.at_once:
            head = f"stopped at once by a second {self.signal_name} during step {(self.step or 0) + 1}{of} (lost)"
        else:
            head = f"stopped by {self.signal_name} after step {self.step}{of}"
        if not self.run_dir:
            return f"{head}; no run_dir: nothing saved"
        if self.checkpoint is None:
            return f"{head}; {self.run_dir} holds no checkpoint: a resume starts over"
        return f"{head}; a resume continues from {self.checkpoint}"

    def __str__(self) -> str:
        if not self.run_dir:
            return self.summary
        return f"{self.summary} (resume=True, run_dir={str(self.run_dir)!r}; --resume true on the command line)"


class _StopSignals:
    """While active: SIGINT / SIGTERM set ``received`` (the fold stops at its next step boundary); a
    second one raises :class:`Interrupted` at once. Installed only in the main thread and for
    signals not ignored; the previous handlers are restored on exit."""

    def __init__(self, total: int | None):
        self.total, self.step = total, 0
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise Interrupted(signum, self.step, at_once=True, total=self.total)
        self.received = signum
        name = signal.Signals(signum).name
        print(f"rlcore: {name}: stopping after step {self.step + 1} (its checkpoint saved where there is a "
              f"run_dir); {name} again stops at once", file=sys.stderr, flush=True)

    def stop(self) -> bool:
        """Whether to stop now: a signal received here (or, under torch.distributed, on any rank)."""
        if not dist_info().distributed:
            return self.received is not None
        flag = all_reduce_sum(torch.tensor([0.0 if self.received is None else 1.0]))
        if flag.item() > 0 and self.received is None:
            self.received = signal.SIGTERM  # another rank's signal: every rank stops at the same step
        return self.received is not None


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
    with _StopSignals(num_steps) as signals:
        signals.step = state.step
        _hook(callbacks, "on_start", state)
        history: list[dict[str, float]] = []
        stop = cut = False
        while not stop and (num_steps is None or state.step < num_steps):
            if signals.stop():
                cut = True
                break
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
            signals.step = state.step
        _hook(callbacks, "on_end", state)
        if cut:  # a signal during the last step or on_end: the run is complete
            raise Interrupted(signals.received, state.step, total=num_steps)
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
