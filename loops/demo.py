"""The offline demo: SFT a tiny model to a partial skill, then RL raises its held-out accuracy.

``rlcore demo [--algo grpo|rloo|ppo|online_dpo|dpo] [--task reverse|sort|add] [--steps N]
[--sft-steps N] [--out DIR] [--seed S] [--quick] [--env calculator]`` reads top to bottom (:func:`run_demo`)::

    baseline  a tiny Llama built from a config with the character tokenizer: nothing downloaded
    sft       loops.recipes.sft for a few steps on a built-in task with a verifiable answer (loops.tasks):
              a partial skill, some held-out prompts right, most wrong
    rl        loops.<algo> from the SFT checkpoint (init_from), the SFT policy as the frozen
              reference: grpo (default), rloo, ppo, online_dpo (sampled answers scored by the
              task's reward) or dpo (offline, on the task's near-miss preference pairs)
    report    per stage, on the same held-out prompts: exact-match accuracy of greedy answers,
              mean reward, KL to the SFT policy (loops.evaluate.evaluate_policy); printed and
              written to OUT/table.md, OUT/results.json and OUT/curves.png (needs matplotlib)

With ``--env calculator`` (an arithmetic task), SFT learns from conversations of which half call
the calculator (``loops.envs.calculator_conversations``) and RL plays two-turn episodes with the tool
(``loops.episodes``); every stage is evaluated in episodes, exact match grading the last turn.

``OUT/sft`` and ``OUT/<algo>`` hold each stage's checkpoints and ``metrics.jsonl`` (the held-out
evaluations in it as ``eval/*``). A live line per stage shows step, reward, KL, accuracy and the
time left. The settings below are tuned so that RL clearly beats SFT on reverse and sort
(docs/demo.md has the measured margins); ``--quick`` is a shorter run with the same settings.

References:
    Shao et al., "DeepSeekMath" (GRPO), https://arxiv.org/abs/2402.03300; Pang et al., "Iterative
    Reasoning Preference Optimization" (DPO + NLL of the chosen answer), https://arxiv.org/abs/2404.19733
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlcore.checks import lookup
from rlcore.loops.recipes import dpo, grpo, online_dpo, ppo, rloo, sft
from rlcore.loops.logging import ProgressDisplay
from rlcore.loops.online import OnlineConfig
from rlcore.loops.envs import calculator_conversations
from rlcore.loops.evaluate import evaluate_policy
from rlcore.loops.recipe import build_policy, load_splits
from rlcore.loops.config import config_dict
from rlcore.loops.state import init_state
from rlcore.loops.tasks import BUILTIN_TASKS, task_dataset

__all__ = ["Config", "ALGOS", "SFT_STEPS", "LIVE", "stage_steps", "add_arguments", "config_from_args", "run_demo",
           "evaluate_stage", "format_table", "write_table", "plot_curves", "main"]

# algo -> (recipe module, fields of its Config tuned for the demo, over Config's lr, batch_size, ...)
ALGOS: dict[str, tuple[Any, dict[str, Any]]] = {
    "grpo": (grpo, {"num_samples": 8}),
    "rloo": (rloo, {"num_samples": 8}),
    "ppo": (ppo, {"batch_size": 32, "num_samples": 2, "epochs": 2, "minibatch_size": 32}),
    "online_dpo": (online_dpo, {"num_samples": 4}),
    "dpo": (dpo, {"loss_kwargs": {"rpo_alpha": 1.0}}),  # + NLL of the chosen answer: plain DPO's accuracy fades (docs/demo.md)
}
CURVE_KEYS = ("loss", "rollout/score", "rollout/kl_ref")  # per-step metrics kept in results.json, besides eval/*
# task -> SFT steps that leave a partial skill (20-50 % held-out exact match) with the default model
SFT_STEPS: dict[str, int] = {"reverse": 90, "sort": 60, "add": 300}


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the demo (each ``--flag`` of ``rlcore demo`` sets the field of that name)."""

    algo: str = "grpo"               # RL stage: a key of ALGOS
    task: str = "reverse"            # built-in task (loops.tasks.BUILTIN_TASKS)
    steps: int | None = None         # RL steps (None: 300, or 100 with quick)
    sft_steps: int | None = None     # SFT steps (None: SFT_STEPS[task])
    out: str = "runs/demo"           # run directory: stage folders, table.md, results.json, curves.png
    seed: int = 0                    # model init, data, sampling
    quick: bool = False              # a shorter run: fewer RL steps, fewer evaluations
    hidden_size: int = 64            # tiny Llama width
    num_layers: int = 2              # tiny Llama blocks
    num_heads: int = 4               # tiny Llama heads
    num_train: int = 512             # training prompts
    num_eval: int = 256              # held-out prompts (disjoint from the training ones)
    max_new_tokens: int = 8          # answer budget
    temperature: float = 0.7         # RL sampling temperature (also of the KL estimate)
    sft_lr: float = 3e-3             # SFT learning rate
    sft_batch_size: int = 32         # SFT examples per step
    lr: float = 5e-4                 # RL learning rate
    warmup_steps: int = 10           # RL linear warm-up (Adam's first steps are the riskiest)
    batch_size: int = 16             # RL prompts (dpo: pairs) per step
    eval_every: int | None = None    # held-out evaluation period in steps (None: ~10 per stage)
    env: str | None = None           # "calculator": SFT on some tool-call demonstrations, RL in episodes with the tool (ENV_DEMO)


# The calculator demo (``--env calculator``): SFT on conversations of which half call the tool, then
# RL in two-turn episodes with it; a tool call is about 75 characters, so turns get that budget.
ENV_DEMO = {"tasks": ("add", "sub", "mul", "radd"), "sft_steps": 800, "steps": 40, "quick_steps": 20,
            "demo_fraction": 0.5, "max_new_tokens": 80, "max_turns": 2, "max_length": 256}


def stage_steps(config: Config) -> tuple[int, int]:
    """``(SFT steps, RL steps)`` of a demo config, its ``None`` fields resolved."""
    if config.env is not None:
        return (config.sft_steps if config.sft_steps is not None else ENV_DEMO["sft_steps"],
                config.steps if config.steps is not None else
                ENV_DEMO["quick_steps" if config.quick else "steps"])
    return (config.sft_steps if config.sft_steps is not None else SFT_STEPS.get(config.task, 100),
            config.steps if config.steps is not None else (100 if config.quick else 300))


def _episodes(config: Config) -> dict[str, Any]:
    """The fields of the calculator demo's episodes (``{}`` without ``env``)."""
    if config.env is None:
        return {}
    return dict(env=config.env, max_turns=ENV_DEMO["max_turns"], max_new_tokens=ENV_DEMO["max_new_tokens"],
                max_position_embeddings=ENV_DEMO["max_length"])


# --- evaluation and the live line -------------------------------------------------------------
def _eval_config(config: Config) -> OnlineConfig:
    return OnlineConfig(**{"task": config.task, "seed": config.seed, "num_train": config.num_train,
                           "num_eval": config.num_eval, "max_new_tokens": config.max_new_tokens,
                           "temperature": config.temperature, "eval_batch_size": config.num_eval,
                           **_episodes(config)})


def evaluate_stage(policy, reference, config: Config, held_out=None) -> dict[str, float]:
    """Held-out metrics of ``policy`` against ``reference``: ``loops.evaluate.evaluate_policy``.

    ``exact_match`` and ``reward`` of greedy answers, ``kl_ref = mean_b Σ_t (log π − log π_ref)`` of
    answers sampled at ``config.temperature``, ``win_rate`` against the reference's greedy answers,
    ... Sampling uses fixed seeds: evaluating changes no training randomness, no gradient is taken.

    Args:
        policy, reference: causal LMs sharing the character tokenizer.
        held_out: the held-out split (default: ``config.num_eval`` prompts of ``config.task``).
    Returns:
        ``dict[str, float]``, means over the held-out prompts.
    """
    state = init_state({"policy": policy, "ref": reference}, seed=config.seed)
    return evaluate_policy(state, _eval_config(config), dataset=held_out)


# the live line: short name -> the first metric present (a stage's rollouts, else its evaluation)
LIVE = {"reward": ("rollout/score", "eval/reward"), "kl": ("rollout/kl_ref", "eval/kl_ref"),
        "acc": ("eval/exact_match",), "loss": ("loss",)}


def _stage(train, config, *, stage: str, total: int, eval_fn, every: int, stream):
    """``train(config, callbacks=[...])`` with a held-out evaluation every ``every`` steps and at
    the last (merged into the step's metrics as ``eval/*``) and a live line of ``LIVE`` (last values
    kept; ``loss`` only without rollouts: an on-policy policy-gradient loss is ≈ 0 by design). The
    recipe's own progress line is silenced; its ``metrics.jsonl`` gets every metric."""
    display, shown = ProgressDisplay(total, stage=stage, keys=list(LIVE), stream=stream, every=every), {}

    def evaluate_and_show(state, metrics):
        due = state.step % every == 0 or state.step == total
        evaluated = {f"eval/{k}": v for k, v in eval_fn(state).items()} if due else {}
        seen = {**metrics, **evaluated}
        for short, keys in LIVE.items():
            value = next((seen[k] for k in keys if k in seen), None)
            if value is not None and not (short == "loss" and "rollout/score" in seen):
                shown[short] = value
        display(state, shown)
        return evaluated

    with contextlib.redirect_stderr(io.StringIO()):
        state, history = train(config, callbacks=[evaluate_and_show])
    display.on_end(state)
    return state, history


# --- the demo ---------------------------------------------------------------------------------
def run_demo(config: Config, *, stream=None) -> dict[str, Any]:
    """Baseline → SFT → RL on ``config.task``, then the report.

    Writes ``config.out``: ``sft/`` and ``<algo>/`` (checkpoints, ``metrics.jsonl``; a rerun into
    the same directory replaces them), ``results.json``, ``table.md`` and ``curves.png``. The live
    lines go to ``stream`` (default ``sys.stderr``), the table to ``sys.stdout``.

    Returns:
        ``{"config", "rows" (one dict per stage: stage, steps, exact_match, reward, kl_ref, ...),
        "curves" (stage -> per-step metrics), "seconds", "table", "plot"}``.
    """
    module, tuned = lookup(ALGOS, config.algo, what="algo")
    if config.env is not None and (config.env != "calculator" or config.task not in ENV_DEMO["tasks"]
                                   or module is dpo):
        raise ValueError(f"env: the demo plays the calculator on an arithmetic task ({', '.join(ENV_DEMO['tasks'])}) "
                         f"with an online algo, got env={config.env!r}, task={config.task!r}, algo={config.algo!r}")
    stream = stream if stream is not None else sys.stderr
    out, start = Path(config.out), time.monotonic()
    n_sft, n_rl = stage_steps(config)
    if n_sft < 1 or n_rl < 1:
        raise ValueError(f"sft_steps, steps: expected at least 1 step per stage, got {n_sft}, {n_rl}")
    if config.num_eval < 1:  # every stage is scored on the held-out prompts
        raise ValueError(f"num_eval: expected >= 1 (the demo evaluates every stage on held-out prompts), "
                         f"got {config.num_eval}")
    for stage in ("sft", config.algo):  # init_from reads the latest checkpoint: never a stale one
        shutil.rmtree(out / stage, ignore_errors=True)
    shared = dict(model="tiny-llama", hidden_size=config.hidden_size, num_layers=config.num_layers,
                  num_heads=config.num_heads, task=config.task, seed=config.seed, num_train=config.num_train,
                  num_eval=config.num_eval, log_every=10**9)
    episodes = _episodes(config)
    if episodes:
        shared["max_position_embeddings"] = episodes.pop("max_position_embeddings")
    held_out = load_splits(_eval_config(config), task_dataset)[1]
    print(f"rlcore demo: {config.task}, baseline -> sft ({n_sft} steps) -> {config.algo} ({n_rl} steps), "
          f"writing {out}", file=stream)

    # 1. baseline and SFT to a partial skill
    sft_data = {}
    if episodes:  # demonstrations: half the training prompts call the calculator, half answer alone
        train = task_dataset(config.task, config.num_train, seed=config.seed, split="train")
        out.mkdir(parents=True, exist_ok=True)
        (out / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in calculator_conversations(
            train["prompt"], train["answer"], fraction=ENV_DEMO["demo_fraction"])))
        sft_data = dict(dataset=str(out / "sft.jsonl"), num_eval=0, assistant_only_loss=True,
                        max_length=ENV_DEMO["max_length"])
    sft_config = sft.Config(**{**shared, **sft_data}, steps=n_sft, batch_size=config.sft_batch_size,
                            lr=config.sft_lr, max_new_tokens=config.max_new_tokens, run_dir=str(out / "sft"))
    baseline, _ = build_policy(sft_config)  # the very initialisation SFT starts from (same seed)
    sft_state, sft_history = _stage(
        sft.train, sft_config, stage="sft", total=n_sft, every=_period(config, n_sft), stream=stream,
        eval_fn=lambda s: {k: v for k, v in evaluate_stage(s.model("policy"), s.model("policy"), config,
                                                           held_out).items() if k != "kl_ref"})  # no reference yet
    sft_policy = sft_state.model("policy")

    # 2. RL from the SFT checkpoint; the recipe's frozen reference is the SFT policy
    sampling = {} if module is dpo else {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                                         "eval_batch_size": config.num_eval, **episodes}
    rl_config = module.Config(**{**shared, **sampling, "init_from": str(out / "sft"), "run_dir": str(out / config.algo),
                                 "steps": n_rl, "batch_size": config.batch_size, "lr": config.lr,
                                 "warmup_steps": config.warmup_steps, **tuned})
    rl_state, rl_history = _stage(
        module.train, rl_config, stage=config.algo, total=n_rl, every=_period(config, n_rl), stream=stream,
        eval_fn=lambda s: evaluate_stage(s.model("policy"), sft_policy, config, held_out))

    # 3. report: every stage on the same held-out prompts, KL to the SFT policy
    stages = (("baseline", 0, baseline), ("sft", n_sft, sft_policy), (config.algo, n_rl, rl_state.model("policy")))
    rows = [{"stage": name, "steps": steps, **evaluate_stage(policy, sft_policy, config, held_out)}
            for name, steps, policy in stages]
    curves = {stage: [{k: v for k, v in h.items() if k in CURVE_KEYS or k.startswith("eval/")} for h in history]
              for stage, history in (("sft", sft_history), (config.algo, rl_history))}
    seconds = round(time.monotonic() - start, 1)
    note = (f"task {config.task}, {config.algo}, seed {config.seed}, {config.num_eval} held-out prompts, "
            f"{seconds:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": config_dict(config), "rows": rows, "curves": curves, "seconds": seconds}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = write_table(rows, out / "table.md", note=note)
    plot = plot_curves(curves, out / "curves.png", baseline=rows[0], title=note)
    print("\n" + table + f"wrote {out / 'table.md'}, {out / 'results.json'} and "
          + (str(plot) if plot else "no plot (pip install matplotlib for curves.png)"))
    return {**results, "table": table, "plot": plot}


def _period(config: Config, steps: int) -> int:
    return config.eval_every or max(1, steps // (5 if config.quick else 10))


# --- table and plot -----------------------------------------------------------------------------
COLUMNS = {"stage": "stage", "steps": "steps", "exact_match": "held-out exact match", "reward": "mean reward",
           "kl_ref": "KL to SFT policy"}


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table, one row per stage: steps, held-out exact match, mean reward, KL to SFT
    (floats to 3 decimals; a rounded −0 prints as 0)."""
    def cell(v: Any) -> str:
        return f"{round(v, 3) + 0.0:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + " --- |" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(row[k]) for k in COLUMNS) + " |" for row in rows])


def write_table(rows: Sequence[Mapping[str, Any]], path: str | Path, *, note: str = "") -> str:
    """Write :func:`format_table` (with ``note`` under it) to ``path``; returns the text."""
    text = format_table(rows) + (f"\n\n{note}" if note else "") + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    return text


def plot_curves(curves: Mapping[str, Sequence[Mapping[str, float]]], path: str | Path, *,
                baseline: Mapping[str, float] | None = None, title: str = "") -> Path | None:
    """Held-out exact match, mean reward and KL to the reference against the step, stages end to end.

    ``curves``: stage -> per-step metric dicts (``eval/*`` where evaluated, ``rollout/score`` of
    the training samples); ``baseline``: the untrained policy's ``exact_match`` and ``reward``
    (step 0). Each stage starts where the previous one ended (KL at 0: a stage starts at its
    reference). Returns ``path``, or ``None`` when matplotlib is not installed (nothing written).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = {"eval/exact_match": "held-out exact match", "eval/reward": "held-out mean reward",
              "eval/kl_ref": "KL to the reference (nats / answer)"}
    start = {f"eval/{k}": baseline[k] for k in ("exact_match", "reward")} if baseline else {}
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.0), dpi=80)
    offset = 0
    for color, (stage, history) in enumerate(curves.items()):
        for ax, (key, label) in zip(axes, panels.items()):
            points = [(offset, start[key])] if key in start else []
            points += [(offset + i + 1, h[key]) for i, h in enumerate(history) if key in h]
            if points:
                ax.plot(*zip(*points), marker=".", color=f"C{color}", label=stage)
                start[key] = points[-1][1]
            ax.set_title(label, fontsize=9)
        scores = [(offset + i + 1, h["rollout/score"]) for i, h in enumerate(history) if "rollout/score" in h]
        if scores:
            axes[1].plot(*zip(*scores), color=f"C{color}", alpha=0.3, lw=0.8, label=f"{stage}: training samples")
        offset, start["eval/kl_ref"] = offset + len(history), 0.0
    for ax in axes:
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


# --- the command --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``rlcore demo`` (defaults: ``Config``)."""
    d = Config()
    parser.add_argument("--algo", choices=sorted(ALGOS), default=d.algo, help=f"RL stage [default: {d.algo}]")
    parser.add_argument("--task", choices=sorted(BUILTIN_TASKS), default=d.task,
                        help=f"built-in task [default: {d.task}]")
    parser.add_argument("--steps", type=int, default=None, help="RL steps [default: 300, 100 with --quick]")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help=f"SFT steps [default per task: {SFT_STEPS}]")
    parser.add_argument("--out", default=d.out, help=f"run directory [default: {d.out}]")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed [default: {d.seed}]")
    parser.add_argument("--quick", action="store_true", help="a shortened run (fewer RL steps and evaluations)")
    parser.add_argument("--env", choices=["calculator"], default=None,
                        help="SFT on some calculator calls, then RL in episodes with the tool (an arithmetic task: "
                             f"{', '.join(ENV_DEMO['tasks'])})")


def config_from_args(args: argparse.Namespace) -> Config:
    """The demo ``Config`` of parsed ``rlcore demo`` options."""
    return Config(algo=args.algo, task=args.task, steps=args.steps, sft_steps=args.sft_steps, out=args.out,
                  seed=args.seed, quick=args.quick, env=args.env)


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed options (on one CPU thread: tiny models run fastest so); 0 on success."""
    torch.set_num_threads(1)
    run_demo(config_from_args(args))
    return 0
