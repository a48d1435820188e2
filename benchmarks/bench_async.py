"""Samples per second of asynchronous (generation in its own process, N = 1) vs synchronous GRPO.

    python benchmarks/bench_async.py [--tiny] [--steps N] [--threads T]

prints one line per setting: wall time and rollout samples per second of the synchronous recipe
(``loops.recipes.grpo.train``) and of ``loops.scale.async_rl.train_async`` with ``max_lag`` 0 and 1, on the
offline tiny Llama and a digit-counting reward. Also follows the harness protocol
(``cases``), so ``benchmarks/run.py --only async`` times it beside the other benchmarks.
``split``: the learner and the generator on half of the threads each (disjoint cores).

The gain of ``N = 1`` is the overlap of generation with the update: on ``c`` free cores it is
bounded by ``(t_gen + t_learn) / max(t_gen, t_learn)``; with both processes on the same few
cores (a shared machine) they compete for them and the gain shrinks or vanishes.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch


def _digits(prompts, completions, **_):
    return [sum(c.isdigit() for c in x) / max(1, len(x)) for x in completions]


def _config(tiny: bool, steps: int | None = None):
    from rlcore.loops.recipes import grpo
    size = dict(hidden_size=16, num_layers=1, num_heads=2, max_new_tokens=8, batch_size=2, num_samples=4) if tiny \
        else dict(hidden_size=64, num_layers=2, num_heads=4, max_new_tokens=24, batch_size=4, num_samples=4)
    return grpo.Config(**size, steps=steps or (6 if tiny else 24), lr=1e-2, num_train=64, num_eval=4, run_dir=None,
                       log_every=0)


def _run(kind: str, config, split: bool = False) -> float:
    """Train once; returns the wall time in seconds. ``split``: the learner and the generator get
    half of this process's threads each (disjoint cores), instead of all of them each."""
    from rlcore.loops.recipes import grpo
    from rlcore.loops.scale.async_rl import train_async
    threads = torch.get_num_threads()
    half = max(1, threads // 2)
    start = time.perf_counter()
    try:
        if kind == "sync":
            grpo.train(config, reward_fn=_digits)
        else:
            if split:
                torch.set_num_threads(half)
            train_async(config, max_lag=int(kind[-1]), reward_fn=_digits, start_method="forkserver",
                        generator_threads=half if split else threads)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def cases(tiny: bool) -> dict:
    """The harness protocol: one case, three implementations (the synchronous recipe first)."""
    config = _config(tiny)
    return {f"grpo_{config.steps}_steps": {
        "rlcore": lambda: functools.partial(_run, "sync", config),
        "rlcore-async-N0": lambda: functools.partial(_run, "async0", config),
        "rlcore-async-N1": lambda: functools.partial(_run, "async1", config),
        "rlcore-async-N1-split": lambda: functools.partial(_run, "async1", config, split=True),
    }}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and few steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each process")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _config(args.tiny, args.steps)
    samples = config.steps * config.batch_size * config.num_samples
    _run("async0", _config(True, 1))  # start the fork server (imports rlcore.loops once) outside the timings
    print(f"GRPO, {config.steps} steps x {config.batch_size} prompts x {config.num_samples} samples, "
          f"hidden {config.hidden_size}, {config.max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    for kind, split, label in (("sync", False, "synchronous recipe"), ("async0", False, "async, max_lag=0"),
                               ("async1", False, "async, max_lag=1"), ("async1", True, "async, max_lag=1, split")):
        seconds = _run(kind, config, split)
        print(f"  {label:20s} {seconds:7.2f} s   {samples / seconds:8.1f} samples/s")


if __name__ == "__main__":
    main()
