"""Run logging, as fold callbacks: metrics JSONL, a progress line, TensorBoard / wandb, samples.

Every logger is a callback ``cb(state, metrics)`` (``metrics`` already plain floats, see
``rlcore.loops.fold``) with optional ``on_start(state)`` / ``on_end(state)``:

- :class:`JsonlLogger` appends one JSON object per step to ``run_dir/metrics.jsonl``;
- :class:`ProgressDisplay` redraws one line on a terminal and prints plain periodic lines
  otherwise (logs, CI);
- :class:`TensorBoardLogger` and :class:`WandbLogger` write where those packages are installed;
  asking for one that is not installed raises ``ImportError`` saying what to install;
- :class:`SampleTable` writes a table of sample generations every ``n`` steps to
  ``run_dir/samples.jsonl`` and ``run_dir/samples.md``;
- :class:`PeakMemory` hands the loggers each step's peak memory (process RSS; CUDA's
  ``max_memory_allocated`` when the run is on a GPU) beside its metrics.
- :class:`TrlNames` hands them each metric under TRL's name too (:data:`TRL_METRIC_NAMES`,
  :func:`trl_names`: ``clip_ratio/low_mean``, ``reward``, ``num_tokens``, ...), so a dashboard
  built for TRL's trainers finds its curves; docs/metrics.md explains every name.

The trackers group the tags as TRL's trainers do: ``train/<name>`` for a step's metrics and
``eval/<name>`` for a held-out evaluation's (which the metrics already carry as ``eval/<key>``);
``metrics.jsonl`` keeps the names as they are (:func:`tracker_tag`).

:func:`make_loggers` builds the usual set in one call.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["JsonlLogger", "ProgressDisplay", "TensorBoardLogger", "WandbLogger", "SampleTable", "make_loggers",
           "markdown_table", "CompletionsToTrackers", "ImagesToTrackers", "TRACKERS", "check_trackers", "read_jsonl", "PeakMemory",
           "peak_memory", "TRL_METRIC_NAMES", "trl_names", "TrlNames", "tracker_tag"]

_GIB = 2.0 ** 30


def _peak_rss_bytes() -> tuple[float, bool]:
    """``(peak resident set size of this process in bytes, whether it can be reset)``: Linux's
    ``VmHWM``, else ``getrusage``'s ``ru_maxrss`` (the peak since the process started)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib * 1024.0, os.access("/proc/self/clear_refs", os.W_OK)
    except (OSError, StopIteration, ValueError, IndexError):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * float(scale), False


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # Linux >= 4.0: VmHWM back to the current RSS
    except OSError:
        pass


def peak_memory(device: Any = "cpu", *, reset: bool = True) -> dict[str, float]:
    """The peak memory since the last reset, in GiB: ``memory/peak_rss_gib`` (this process's
    resident set: weights, activations, optimiser state and everything else on the CPU) and, for
    a CUDA ``device``, ``memory/peak_cuda_gib`` (``torch.cuda.max_memory_allocated``). With
    ``reset``, both peaks then restart from the current use. Where the RSS peak cannot be reset
    (not Linux), it is the peak since the process started."""
    rss, resettable = _peak_rss_bytes()
    out = {"memory/peak_rss_gib": rss / _GIB}
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["memory/peak_cuda_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
            if reset:
                torch.cuda.reset_peak_memory_stats(device)
    if reset and resettable:
        _reset_peak_rss()
    return out


class _Wrapped:
    """Loggers wrapped so each sees the step's metrics as :meth:`metrics` rewrites them (their
    ``on_start`` / ``on_end`` passed through). The history ``fold`` returns is left as it is."""

    def __init__(self, loggers: Sequence[Callable]):
        self.loggers = list(loggers)

    def on_start(self, state: Any) -> None:
        for logger in self.loggers:
            if hasattr(logger, "on_start"):
                logger.on_start(state)

    def on_end(self, state: Any) -> None:
        for logger in self.loggers:
            if hasattr(logger, "on_end"):
                logger.on_end(state)

    def metrics(self, state: Any, metrics: Mapping[str, float]) -> Mapping[str, float]:
        return metrics

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        metrics = self.metrics(state, metrics)
        for logger in self.loggers:
            logger(state, metrics)


class PeakMemory(_Wrapped):
    """Loggers wrapped so each sees the step's metrics plus its peak memory (:func:`peak_memory`,
    reset when the run starts and after every step): the peak of the step, its evaluation and its
    checkpoint of the step before. The history ``fold`` returns is left as it is (memory differs
    from run to run; the metrics there are the run's maths)."""

    def __init__(self, loggers: Sequence[Callable], device: Any = "cpu"):
        super().__init__(loggers)
        self.device = device

    def on_start(self, state: Any) -> None:
        peak_memory(self.device)
        super().on_start(state)

    def metrics(self, state: Any, metrics: Mapping[str, float]) -> Mapping[str, float]:
        return {**metrics, **peak_memory(self.device)}


# rlcore's metric -> TRL's name for the same quantity, added beside it at the logging boundary (the
# losses keep their own keys). clip_ratio/region_mean is the sum of the two clip fractions (a token
# is clipped below or above, never both); num_tokens is the state's tokens_seen counter (trl_names).
TRL_METRIC_NAMES: dict[str, str] = {
    "rollout/score": "reward",
    "rollout/score_std": "reward_std",
    "clipfrac_low": "clip_ratio/low_mean",
    "clipfrac_high": "clip_ratio/high_mean",
    "clipfrac_low_min": "clip_ratio/low_min",
    "clipfrac_high_max": "clip_ratio/high_max",
    "kl_ref": "kl",
    "lr": "learning_rate",
}


def trl_names(metrics: Mapping[str, float], state: Any = None) -> dict[str, float]:
    """``metrics`` plus TRL's name of each one :data:`TRL_METRIC_NAMES` maps, ``clip_ratio/region_mean``
    (``clipfrac_low + clipfrac_high``) and, from a ``state`` that has counted tokens, ``num_tokens``
    (``state.tokens_seen``: cumulative prompt + completion tokens, checkpointed, so a resumed run
    continues the count). A name the metrics already hold is left as it is.

    >>> trl_names({"clipfrac_low": 0.25, "clipfrac_high": 0.5})["clip_ratio/region_mean"]
    0.75
    """
    out = dict(metrics)
    for ours, theirs in TRL_METRIC_NAMES.items():
        if ours in metrics and theirs not in metrics:
            out[theirs] = metrics[ours]
    if "clipfrac_low" in metrics and "clipfrac_high" in metrics and "clip_ratio/region_mean" not in metrics:
        out["clip_ratio/region_mean"] = metrics["clipfrac_low"] + metrics["clipfrac_high"]
    if getattr(state, "tokens_seen", 0) and "num_tokens" not in metrics:
        out["num_tokens"] = float(state.tokens_seen)
    return out


class TrlNames(_Wrapped):
    """Loggers wrapped so each sees the step's metrics with TRL's names added (:func:`trl_names`).
    The history ``fold`` returns is left as it is."""

    def metrics(self, state: Any, metrics: Mapping[str, float]) -> Mapping[str, float]:
        return trl_names(metrics, state)


def tracker_tag(name: str) -> str:
    """A metric's tag in TensorBoard and wandb, grouped as TRL's trainers group theirs: ``eval/<key>``
    stays, anything else goes under ``train/``.

    >>> tracker_tag("loss"), tracker_tag("eval/reward")
    ('train/loss', 'eval/reward')
    """
    return name if name.startswith(("eval/", "train/")) else f"train/{name}"


def _json_number(v: float) -> float | None:
    # Strict JSON has no NaN/inf: non-finite values are written as null.
    return v if math.isfinite(v) else None


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a JSONL file, one per non-empty line (``[]`` if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _append(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


class JsonlLogger:
    """Append ``{"step": N, "time": unix_seconds, **metrics}`` to ``run_dir/<filename>`` per step.

    Values are floats (``null`` for NaN/inf, so every line is strict JSON). On start, lines with a
    step beyond ``state.step`` (written by a crashed run after its last checkpoint) are dropped, so
    a resumed run does not log those steps twice. Each line is written and closed at once: a
    killed run loses at most the line being written, and a last line that is no such object (torn
    by a kill) is dropped on start. Any earlier line that is not a JSON object with a numeric
    ``"step"`` is refused on start with a ``ValueError`` naming the file and the line: the file is
    rewritten on start, and a line it cannot place is never dropped silently.
    """

    def __init__(self, run_dir: str | Path, *, filename: str = "metrics.jsonl", every: int = 1):
        self.path, self.every = Path(run_dir) / filename, every

    def on_start(self, state: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        keep = []
        for n, line in numbered:
            step = _step_of(line)
            if step is None:
                if n == numbered[-1][0]:
                    continue  # the torn last line of a killed run
                shown = line if len(line) <= 80 else line[:77] + "..."
                raise ValueError(f"{self.path}: line {n}: expected a JSON object with a numeric \"step\" (one line "
                                 f"per logged step), got {shown!r}; correct or delete that line, then resume")
            if step <= state.step:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8", errors="surrogateescape")
        os.replace(tmp, self.path)

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        if state.step % self.every == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _append(self.path, {"step": state.step, "time": time.time(),
                                **{k: _json_number(float(v)) for k, v in metrics.items()}})


def _step_of(line: str) -> float | None:
    """The ``"step"`` of a metrics line, or ``None`` for a line that is no JSON object with a
    numeric step (a torn line, another file's text, nesting too deep to parse)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return step


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressDisplay:
    """One status line: ``stage step/total  key=value ...  rate, time left``.

    On a TTY the line is redrawn in place every step; elsewhere a plain line is printed every
    ``every`` steps and at the last step (``total``). Shown metrics: ``keys``, each with the last
    value seen (a held-out metric stays on the line between evaluations); default: the first
    ``max_keys`` metrics of the step.

    Why not tqdm or rich (both installed): written to a stream that is not a terminal (a CI log, a
    file, a notebook's captured output), 300 steps of ``tqdm(mininterval=0)`` with a postfix gave
    one 24,019-byte line of 302 carriage-return redraws, and ``rich.progress.Progress`` printed
    nothing until its final line (59 bytes); a log needs a readable line every ``every`` steps.

    Args:
        total: the step the run is heading for (``num_steps`` of the fold), or ``None``.
        stage: a label (``"sft"``, ``"ppo"``, ``"eval"``).
        every: period of the plain lines when not on a TTY.
        stream: where to write (default ``sys.stderr``).
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, total: int | None = None, *, stage: str = "train", keys: Sequence[str] | None = None,
                 max_keys: int = 4, every: int = 10, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.stage, self.keys, self.max_keys, self.every = total, stage, keys, max_keys, every
        self.stream, self.clock = stream, clock
        self._start: tuple[float, int] | None = None
        self._width = 0
        self._last: dict[str, float] = {}

    @property
    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    def on_start(self, state: Any) -> None:
        self._start = (self.clock(), state.step)

    def format(self, state: Any, metrics: Mapping[str, float]) -> str:
        """The status line for ``state`` and ``metrics``."""
        if self._start is None:
            self.on_start(state)
        t0, s0 = self._start
        if self.keys is not None:  # the last value of each: held-out metrics arrive every eval_every steps
            self._last.update({k: metrics[k] for k in self.keys if k in metrics})
            shown = " ".join(f"{k}={self._last[k]:.4g}" for k in self.keys if k in self._last)
        else:
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in list(metrics)[:self.max_keys])
        elapsed, done = self.clock() - t0, state.step - s0
        rate = done / elapsed if elapsed > 0 else math.nan
        position = f"{state.step}/{self.total}" if self.total else f"{state.step}"
        left = _duration((self.total - state.step) / rate) if self.total and rate > 0 else "?"
        return "  ".join(p for p in (f"{self.stage} {position}", shown, f"{rate:.3g} it/s, {left} left") if p)

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        line, out = self.format(state, metrics), self._out
        if out.isatty():
            out.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif state.step % self.every == 0 or state.step == self.total:
            out.write(line + "\n")
        out.flush()

    def on_end(self, state: Any) -> None:
        if self._width and self._out.isatty():
            self._out.write("\n")
            self._out.flush()


class TensorBoardLogger:
    """Scalars to TensorBoard (``torch.utils.tensorboard``), one point per metric and step, tagged
    ``train/<name>`` or ``eval/<key>`` (:func:`tracker_tag`)."""

    def __init__(self, log_dir: str | Path, *, every: int = 1):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardLogger needs the 'tensorboard' package (pip install tensorboard)") from e
        self.writer, self.every = SummaryWriter(str(log_dir)), every

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        if state.step % self.every == 0:
            for k, v in metrics.items():
                self.writer.add_scalar(tracker_tag(k), v, state.step)

    def log_table(self, name: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """``rows`` as a markdown table in TensorBoard's text tab."""
        self.writer.add_text(name, markdown_table(rows), step)

    def log_image(self, name: str, image: Any, step: int) -> None:
        """A PIL image in TensorBoard's images tab."""
        import numpy as np

        self.writer.add_image(name, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def on_end(self, state: Any) -> None:
        self.writer.close()


class WandbLogger:
    """Metrics to Weights & Biases, tagged as :class:`TensorBoardLogger`'s:
    ``wandb.init(project=..., config=..., **init_kwargs)`` at once."""

    def __init__(self, project: str | None = None, *, config: Any = None, every: int = 1, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbLogger needs the 'wandb' package (pip install wandb)") from e
        self.run, self.every = wandb.init(project=project, config=config, **init_kwargs), every

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        if state.step % self.every == 0:
            self.run.log({tracker_tag(k): v for k, v in metrics.items()}, step=state.step)

    def log_table(self, name: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """``rows`` as a ``wandb.Table`` (the union of their keys as columns)."""
        import wandb

        columns = list(dict.fromkeys(k for r in rows for k in r))
        self.run.log({name: wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])}, step=step)

    def log_image(self, name: str, image: Any, step: int) -> None:
        """A PIL image as a ``wandb.Image``."""
        import wandb

        self.run.log({name: wandb.Image(image)}, step=step)

    def on_end(self, state: Any) -> None:
        self.run.finish()


def markdown_table(rows: Sequence[Mapping[str, Any]], *, max_chars: int = 200) -> str:
    """``rows`` as a markdown table: the union of their keys as columns, cells cut at ``max_chars``
    (pipes and newlines escaped)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, ""), max_chars) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


class CompletionsToTrackers:
    """After each step, the rows appended to ``path`` (``run_dir/completions.jsonl``: the prompts,
    greedy completions and rewards an evaluation writes with ``log_completions``) since the last
    step, as a table in each tracker (``log_table``: TensorBoard text, a wandb Table). Rows
    written before the run started (a resumed run's) are not sent again."""

    def __init__(self, path: str | Path, trackers: Sequence[Any], *, name: str = "completions"):
        self.path, self.trackers, self.name, self._offset = Path(path), list(trackers), name, 0

    def on_start(self, state: Any) -> None:
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            lines = f.readlines()
            self._offset = f.tell()
        rows = [json.loads(line) for line in lines if line.strip()]
        if rows:
            for tracker in self.trackers:
                tracker.log_table(self.name, rows, state.step)


class ImagesToTrackers:
    """After each step, the PNG images written under ``directory`` (``run_dir/images``: DDPO's sample
    and evaluation grids) since the last step, to each tracker (``log_image``), named by their file
    name without its number (``images/samples``, ``images/epoch``). Images there before the run
    started (a resumed run's) are not sent again."""

    def __init__(self, directory: str | Path, trackers: Sequence[Any]):
        self.directory, self.trackers, self._seen = Path(directory), list(trackers), set()

    def _files(self) -> set[Path]:
        return set(self.directory.glob("*.png")) if self.directory.is_dir() else set()

    def on_start(self, state: Any) -> None:
        self._seen = self._files()

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        new = sorted(self._files() - self._seen)
        if not new:
            return
        from PIL import Image

        for path in new:
            with Image.open(path) as image:
                image.load()
                for tracker in self.trackers:
                    tracker.log_image(f"images/{path.stem.rsplit('-', 1)[0]}", image, state.step)
        self._seen.update(new)


def _cell(value: Any, max_chars: int) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    text = text if len(text) <= max_chars else text[:max_chars - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


class SampleTable:
    """Every ``every`` steps, a table of sample generations to ``samples.jsonl`` and ``samples.md``.

    ``sample_fn(state) -> list[dict]`` produces the rows (e.g. ``{"prompt": ..., "completion":
    ..., "reward": ...}``, typically by generating with ``state.model("policy")``); the columns
    are the union of the rows' keys. The JSONL gets ``{"step": N, "samples": rows}`` (full text),
    the markdown file a ``## step N`` section with the first ``max_rows`` rows, cells cut at
    ``max_chars``.
    """

    def __init__(self, run_dir: str | Path, sample_fn: Callable[[Any], list[Mapping[str, Any]]], *,
                 every: int = 100, max_rows: int = 8, max_chars: int = 200):
        self.run_dir, self.sample_fn = Path(run_dir), sample_fn
        self.every, self.max_rows, self.max_chars = every, max_rows, max_chars

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        if state.step % self.every:
            return
        rows = [dict(r) for r in self.sample_fn(state)]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _append(self.run_dir / "samples.jsonl", {"step": state.step, "samples": rows})
        table = markdown_table(rows[:self.max_rows], max_chars=self.max_chars)
        with open(self.run_dir / "samples.md", "a", encoding="utf-8") as f:
            f.write(f"## step {state.step}\n\n{table}\n\n")


# The trackers ``report_to`` names, with the module each needs.
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(report_to: Sequence[str]) -> None:
    """A ``ValueError`` for a name in ``report_to`` that is not a tracker, an ``ImportError`` naming
    the package of one that is not installed (before any model is built). ``"none"`` stands for no
    tracker, as in TRL."""
    for name in report_to:
        if name == "none":
            continue
        if name not in TRACKERS:
            raise ValueError(f"report_to: expected names from {sorted(TRACKERS)} (or 'none'), got {name!r}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ImportError(f"report_to: {name!r} needs the '{TRACKERS[name]}' package "
                              f"(pip install 'rlcore[trackers]' or pip install {TRACKERS[name]})")


def make_loggers(run_dir: str | Path, *, total: int | None = None, stage: str = "train", progress: bool = True,
                 progress_every: int = 10, progress_keys: Sequence[str] | None = None,
                 report_to: Sequence[str] = (), config: Mapping[str, Any] | None = None,
                 wandb_kwargs: Mapping[str, Any] | None = None, stream: IO[str] | None = None,
                 device: Any = "cpu") -> list:
    """The usual logging callbacks: JSONL in ``run_dir``, a progress line (of ``progress_keys``:
    ``ProgressDisplay``'s ``keys``), and the trackers named in
    ``report_to``: ``"tensorboard"`` writes ``run_dir/tensorboard``; ``"wandb"`` starts a run named
    after ``run_dir`` with ``config`` as its config (the project, mode and entity come from
    ``wandb_kwargs``, else wandb's environment: ``WANDB_PROJECT``, ``WANDB_MODE``, ...). With a
    tracker, the completions evaluations write to ``run_dir/completions.jsonl`` go to it as tables
    (``CompletionsToTrackers``) and the PNGs written to ``run_dir/images`` as images
    (``ImagesToTrackers``). The JSONL lines and the trackers carry each step's peak memory
    (``PeakMemory`` on ``device``) and TRL's names of the metrics (``TrlNames``); the trackers tag
    them ``train/<name>`` / ``eval/<key>``."""
    check_trackers(report_to)
    callbacks: list = [JsonlLogger(run_dir)]
    trackers: list = []
    if "tensorboard" in report_to:
        trackers.append(TensorBoardLogger(Path(run_dir) / "tensorboard"))
    if "wandb" in report_to:
        trackers.append(WandbLogger(config=dict(config or {}), **{"name": Path(run_dir).name, "dir": str(run_dir),
                                                                   **(wandb_kwargs or {})}))
    measured = PeakMemory([TrlNames(callbacks + trackers)], device)
    display = [ProgressDisplay(total, stage=stage, keys=progress_keys, every=progress_every, stream=stream)
               ] if progress else []
    to_trackers = [CompletionsToTrackers(Path(run_dir) / "completions.jsonl", list(trackers)),
                   ImagesToTrackers(Path(run_dir) / "images", list(trackers))] if trackers else []
    return [measured, *display, *to_trackers]  # an evaluation's completions and images go to the trackers too
