"""Learning that transfers: every RL recipe on every task of the battery, and side by side with TRL.

``python benchmarks/learning.py [--workers 2] [--tasks ...] [--seeds ...] [--recipes ...]
[--seconds S] [--no-trl] [--out DIR] [--write]`` runs, with the settings of
``benchmarks/learning.yaml`` (one file for every task: nothing is tuned per task):

    for each task of the battery and each seed (a job; jobs run in parallel, one CPU thread each)
      sft      a tiny Llama from a config, SFT on the task until greedy exact match on training
               prompts reaches the target (a partial skill), its checkpoint saved
      rl       each recipe from that checkpoint (the SFT policy the frozen reference) for a fixed
               wall-clock budget of training; held-out exact match at 0 s, every few seconds and
               at the end, evaluation time excluded from the budget
      trl      on the side-by-side tasks, TRL's GRPOTrainer and RLOOTrainer from the same
               checkpoint with the same tokenizer, reward, prompts, group size, learning rate,
               warm-up, temperature and answer budget, timed and evaluated the same way

The recipes: GRPO, Dr. GRPO, DAPO (clip-higher, token-level loss, dynamic sampling, soft overlong
punishment), RLOO, PPO, online DPO, and offline DPO on pairs sampled from the SFT policy (the
sampling counts against its budget). Each job's results go to ``OUT/<task>-<seed>.json`` as soon
as the job ends; a rerun skips the jobs whose file exists, so an interrupted run continues.

The report: per recipe, the held-out exact-match gain over SFT averaged over the battery (mean
over seeds, then over tasks; the spread over seeds), the tasks where it lost accuracy, and the
goal (≥ 20 points on average, no task losing); per side-by-side task, held-out accuracy against
training seconds of rlcore and TRL (means over seeds, one plot), with the goals: at equal
wall-clock rlcore's accuracy ≥ TRL's, and TRL's final accuracy reached in ≤ 0.5× TRL's time.
``--write`` puts the tables into docs/learning.md (between its markers) and the plot into
docs/learning_trl.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "benchmarks" / "learning.yaml"
DOC, PLOT = ROOT / "docs" / "learning.md", ROOT / "docs" / "learning_trl.png"
BEGIN, END = "<!-- learning-results:begin -->", "<!-- learning-results:end -->"
GOAL_GAIN, GOAL_TIME = 0.20, 0.5


def load_settings(path: str | Path = SETTINGS, **overrides) -> dict[str, Any]:
    import yaml

    settings = yaml.safe_load(Path(path).read_text())
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return settings


# --- timing: a fold callback with a wall-clock budget -------------------------------------------------
class Budget:
    """Stop a run after ``seconds`` of training, evaluation excluded; evaluate every ``every`` seconds.

    As a fold callback (``cb(state, metrics)``): the time since the previous call is training time;
    when it passes the next evaluation mark (or the budget) ``evaluate(model)`` runs, outside the
    clock, and the point ``{seconds, step, exact_match, reward}`` joins ``curve``. ``spent`` starts
    at what was already spent before the fold (pair sampling, for offline DPO).
    """

    def __init__(self, seconds: float, every: float, evaluate: Callable[[Any], dict[str, float]], *,
                 model: Callable[[Any], Any] = lambda state: state.model("policy"), spent: float = 0.0):
        self.seconds, self.every, self.evaluate, self.model = seconds, every, evaluate, model
        self.spent, self.next_mark, self.curve = spent, every * (int(spent // every) + 1), []
        self._last = time.perf_counter()

    def on_start(self, state) -> None:
        self._last = time.perf_counter()

    def tick(self, state, step: int) -> bool:
        """Count the time since the last call; evaluate when due. True when the budget is spent."""
        self.spent += time.perf_counter() - self._last
        done = self.spent >= self.seconds
        if done or self.spent >= self.next_mark:
            point = self.evaluate(self.model(state))
            self.curve.append({"seconds": round(self.spent, 3), "step": step, **point})
            while self.next_mark <= self.spent:
                self.next_mark += self.every
        self._last = time.perf_counter()
        return done

    def __call__(self, state, metrics):
        return "stop" if self.tick(state, state.step) else None


# --- the pieces of a job -----------------------------------------------------------------------------
def _quiet():
    return contextlib.redirect_stderr(io.StringIO())


def _shared(settings, task: str, seed: int) -> dict[str, Any]:
    return dict(model="tiny-llama", **settings["model"], task=task, seed=seed, num_train=settings["num_train"],
                num_eval=settings["num_eval"], log_every=10**9)


def _evaluator(settings, task: str, seed: int, reference) -> Callable[[Any], dict[str, float]]:
    """Greedy held-out exact match and mean reward of a policy (``loops.evaluate``), fixed seeds."""
    from rlcore.loops.evaluate import evaluate_policy
    from rlcore.loops.online import OnlineConfig
    from rlcore.loops.recipe import load_splits
    from rlcore.loops.state import init_state
    from rlcore.loops.tasks import task_dataset

    config = OnlineConfig(task=task, seed=seed, num_train=settings["num_train"], num_eval=settings["num_eval"],
                          max_new_tokens=settings["max_new_tokens"], temperature=settings["common"]["temperature"],
                          eval_batch_size=settings["num_eval"])
    held_out = load_splits(config, task_dataset)[1]
    cache: dict = {}

    def evaluate(policy) -> dict[str, float]:
        was_training = policy.training
        policy.eval()
        state = init_state({"policy": policy, "ref": reference}, seed=seed)
        out = evaluate_policy(state, config, dataset=held_out, reference_cache=cache)
        policy.train(was_training)
        return {"exact_match": out["exact_match"], "reward": out["reward"]}
    return evaluate


def run_sft(settings, task: str, seed: int, out: Path) -> dict[str, Any]:
    """SFT until greedy exact match on ``probe`` prompts reaches ``target``: prompts of the training
    split that SFT does not train on (the held-out split stays unseen; a tiny model memorises its
    training prompts long before it generalises, so those would overstate its skill)."""
    from rlcore.loops.evaluate import evaluate_policy
    from rlcore.loops.online import OnlineConfig
    from rlcore.loops.recipes import sft
    from rlcore.loops.state import init_state
    from rlcore.loops.tasks import task_dataset

    s = settings["sft"]
    n = settings["num_train"]
    probe = task_dataset(task, n + s["probe"], seed=seed).select(range(n, n + s["probe"]))  # the first n: SFT's
    probe_config = OnlineConfig(task=task, seed=seed, max_new_tokens=settings["max_new_tokens"],
                                eval_batch_size=s["probe"])
    skill = []

    def check(state, metrics):
        if state.step % s["check_every"]:
            return None
        policy = state.model("policy")
        found = evaluate_policy(init_state({"policy": policy, "ref": policy}, seed=seed), probe_config,
                                dataset=probe)["exact_match"]
        skill.append((state.step, found))
        return "stop" if found >= s["target"] else None

    config = sft.Config(**_shared(settings, task, seed), steps=s["max_steps"], batch_size=s["batch_size"],
                        lr=s["lr"], max_new_tokens=settings["max_new_tokens"], run_dir=str(out))
    start = time.perf_counter()
    with _quiet():
        state, _ = sft.train(config, callbacks=[check])
    return {"steps": state.step, "sft_seconds": round(time.perf_counter() - start, 1), "probe": skill[-1][1] if skill else None}


def sampled_pairs(policy, tokenizer, dataset, reward_fn, *, num_samples: int, max_new_tokens: int,
                  temperature: float, seed: int) -> list[dict[str, str]]:
    """Preference pairs from the policy's own answers: ``num_samples`` per prompt, scored by the
    reward; where the scores differ, the best answer chosen and the worst rejected (empty answers left out)."""
    import torch

    from rlcore import keys as K
    from rlcore.loops.collect import generate_rollout

    prompts = list(dataset["prompt"])
    rollout = generate_rollout(policy, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                               num_samples=num_samples, generator=torch.Generator().manual_seed(seed), engine="loop")
    ids = rollout[K.RESPONSE_IDS].masked_fill(~rollout[K.RESPONSE_MASK].bool(), tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    answers = [a for a in dataset["answer"] for _ in range(num_samples)]
    scores = torch.tensor(reward_fn([p for p in prompts for _ in range(num_samples)], texts, answer=answers),
                          dtype=torch.float64).view(len(prompts), num_samples)
    empty = torch.tensor([not t for t in texts]).view(len(prompts), num_samples)  # the answers as scored
    pairs = []
    for i, prompt in enumerate(prompts):  # an empty answer cannot be a side (the DPO data check refuses it)
        best = int(scores[i].masked_fill(empty[i], -torch.inf).argmax())
        worst = int(scores[i].masked_fill(empty[i], torch.inf).argmin())
        if scores[i, best] > scores[i, worst] and not empty[i, best] and not empty[i, worst]:
            pairs.append({"prompt": prompt, "chosen": texts[i * num_samples + best],
                          "rejected": texts[i * num_samples + worst]})
    return pairs


def run_recipe(settings, name: str, task: str, seed: int, sft_dir: Path, evaluate, start_point: dict,
               seconds: float, work: Path) -> dict[str, Any]:
    """One recipe from the SFT checkpoint for ``seconds`` of training; its curve of held-out points."""
    import torch

    from rlcore.loops.recipe import build_policy, load_splits
    from rlcore.loops.recipes import dpo, grpo, online_dpo, ppo, rloo
    from rlcore.loops.tasks import task_dataset, task_reward

    modules = {"grpo": grpo, "rloo": rloo, "ppo": ppo, "online_dpo": online_dpo, "dpo": dpo}
    fields = dict(settings["recipes"][name])
    module = modules[fields.pop("recipe")]
    common = {**_shared(settings, task, seed), **settings["common"], "init_from": str(sft_dir), "run_dir": None,
              "steps": 10**9}
    spent = 0.0
    if module is dpo:  # offline: pairs sampled from the SFT policy, timed as part of the run
        num_samples = fields.pop("num_samples")
        common.pop("temperature")
        t0 = time.perf_counter()
        config = dpo.Config(**{**common, **fields})
        policy, tokenizer = build_policy(config)
        train = load_splits(config, task_dataset)[0]
        pairs = sampled_pairs(policy, tokenizer, train, task_reward(task), num_samples=num_samples,
                              max_new_tokens=settings["max_new_tokens"], temperature=settings["common"]["temperature"],
                              seed=seed)
        path = work / f"pairs-{task}-{seed}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        if len(pairs) < config.batch_size + 1:
            return {"curve": [start_point], "steps": 0, "pairs": len(pairs), "note": "too few pairs"}
        config = dataclasses.replace(config, dataset=str(path), task=None, num_eval=1)
        spent = time.perf_counter() - t0
    else:
        config = module.Config(**{**common, "max_new_tokens": settings["max_new_tokens"], **fields})
    budget = Budget(seconds, settings["eval_seconds"], evaluate, spent=spent)
    with _quiet():
        state, history = module.train(config, callbacks=[budget])
    extra = {"pairs": len(pairs)} if module is dpo else {}
    keep = ("rollout/sampling_rounds", "rollout/dropped_groups", "rollout/truncated", "entropy")
    counters = {k: statistics.fmean(h[k] for h in history if k in h) for k in keep if any(k in h for h in history)}
    del state
    torch.set_num_threads(1)
    return {"curve": [start_point, *budget.curve], "steps": len(history), **counters, **extra}


def run_trl(settings, kind: str, task: str, seed: int, sft_dir: Path, evaluate, start_point: dict,
            seconds: float, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer / RLOOTrainer from the SFT checkpoint, timed and evaluated like ``run_recipe``."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from rlcore.loops.models import build_tokenizer
    from rlcore.loops.recipe import checkpoint_model_dir
    from rlcore.loops.tasks import task_dataset, task_reward

    recipe = settings["recipes"][settings["trl"]["pairs"][kind]]
    c, G = settings["common"], recipe["num_samples"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint_model_dir(sft_dir))
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    budget = Budget(seconds, settings["eval_seconds"], evaluate, model=lambda _: model)

    class Timed(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            budget.on_start(state)

        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = budget.tick(None, state.global_step)

    Config, Trainer = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    own = {"loss_type": "grpo", "beta": 0.0} if kind == "grpo" else {}  # rlcore's GRPO: sequence-mean loss, no KL
    args = Config(output_dir=str(work / f"trl-{kind}"), report_to=[], use_cpu=True, bf16=False, seed=seed,
                  per_device_train_batch_size=c["batch_size"] * G, num_generations=G, learning_rate=c["lr"],
                  warmup_steps=c["warmup_steps"], lr_scheduler_type="constant_with_warmup", max_steps=10**6,
                  temperature=c["temperature"], max_completion_length=settings["max_new_tokens"], save_strategy="no",
                  logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, **own)
    train = task_dataset(task, settings["num_train"], seed=seed).select_columns(["prompt", "answer"])
    with _quiet(), contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(model=model, reward_funcs=task_reward(task), args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Timed()])
        trainer.train()
    return {"curve": [start_point, *budget.curve], "steps": trainer.state.global_step}


def run_job(settings, task: str, seed: int, out: Path, recipes: Sequence[str], trl: bool) -> dict[str, Any]:
    """SFT, then every recipe (and TRL on its tasks) for one (task, seed): the job's results."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from rlcore.loops.recipe import checkpoint_model_dir

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix=f"rlcore-learning-{task}-{seed}-"))
    try:
        sft = run_sft(settings, task, seed, work / "sft")
        reference = AutoModelForCausalLM.from_pretrained(checkpoint_model_dir(work / "sft")).eval()
        evaluate = _evaluator(settings, task, seed, reference)
        start = {"seconds": 0.0, "step": 0, **evaluate(reference)}
        side = trl and task in settings["trl"]["tasks"]
        runs = {}
        for name in recipes:
            seconds = settings["trl"]["seconds"] if side and name in settings["trl"]["pairs"].values() else settings["seconds"]
            runs[name] = run_recipe(settings, name, task, seed, work / "sft", evaluate, start, seconds, work)
            _say(task, seed, name, runs[name])
        if side:
            for kind in settings["trl"]["pairs"]:
                runs[f"trl_{kind}"] = run_trl(settings, kind, task, seed, work / "sft", evaluate, start,
                                              settings["trl"]["seconds"], work)
                _say(task, seed, f"trl_{kind}", runs[f"trl_{kind}"])
        return {"task": task, "seed": seed, "sft": {**sft, **start}, "runs": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _say(task: str, seed: int, name: str, run: Mapping[str, Any]) -> None:
    curve = run["curve"]
    print(f"  {task} seed {seed} {name}: {curve[0]['exact_match']:.3f} -> {curve[-1]['exact_match']:.3f} "
          f"in {curve[-1]['seconds']:.0f} s, {run['steps']} steps", file=sys.stderr, flush=True)


def _job(args) -> tuple[str, dict]:
    settings, task, seed, out, recipes, trl = args
    result = run_job(settings, task, seed, out, recipes, trl)
    path = out / f"{task}-{seed}.json"
    path.write_text(json.dumps(result, indent=1))
    return str(path), result


# --- the report --------------------------------------------------------------------------------------
def final(run: Mapping[str, Any], seconds: float) -> float:
    """The held-out exact match a run reached within the battery's budget of ``seconds``: its
    first evaluation at or past that time (a longer side-by-side run), else its last."""
    past = [p for p in run["curve"] if p["seconds"] >= seconds]
    return (past[0] if past else run["curve"][-1])["exact_match"]


def battery_table(results: Sequence[Mapping[str, Any]], recipes: Sequence[str], seconds: float) -> tuple[str, dict]:
    """Per recipe: the gain over SFT per task (mean over seeds), its mean over tasks and the spread
    over seeds of that mean, the tasks that lost, and the goal's verdict."""
    tasks = sorted({r["task"] for r in results}, key=lambda t: [r["task"] for r in results].index(t))
    seeds = sorted({r["seed"] for r in results})
    by = {(r["task"], r["seed"]): r for r in results}
    sft = {t: statistics.fmean(by[t, s]["sft"]["exact_match"] for s in seeds if (t, s) in by) for t in tasks}
    lines = ["| recipe | " + " | ".join(tasks) + " | mean gain | seeds' spread | tasks lost | goal |",
             "| --- |" + " ---: |" * (len(tasks) + 3) + " --- |",
             "| SFT (exact match) | " + " | ".join(f"{sft[t]:.3f}" for t in tasks) + " | | | | |"]
    summary = {}
    for name in recipes:
        gains = {t: [final(by[t, s]["runs"][name], seconds) - by[t, s]["sft"]["exact_match"]
                     for s in seeds if (t, s) in by and name in by[t, s]["runs"]] for t in tasks}
        if not all(gains.values()):
            continue
        per_task = {t: statistics.fmean(g) for t, g in gains.items()}
        per_seed = [statistics.fmean(gains[t][i] for t in tasks) for i in range(min(len(g) for g in gains.values()))]
        mean, lost = statistics.fmean(per_task.values()), [t for t, g in per_task.items() if g < 0]
        met = mean >= GOAL_GAIN and not lost
        spread = f"{min(per_seed) * 100:+.1f} … {max(per_seed) * 100:+.1f}"
        summary[name] = {"mean_gain": mean, "per_task": per_task, "per_seed": per_seed, "lost": lost, "met": met}
        lines.append(f"| {name} | " + " | ".join(f"{per_task[t] * 100:+.1f}" for t in tasks)
                     + f" | **{mean * 100:+.1f}** | {spread} | {', '.join(lost) or 'none'} | "
                     + ("met" if met else "missed") + " |")
    return "\n".join(lines) + "\n", summary


def mean_curve(runs: Sequence[Mapping[str, Any]], grid: Sequence[float], every: float) -> list[float]:
    """The seeds' mean held-out exact match on the evaluation grid (multiples of ``every`` up to its
    last time, the budget). A run evaluates at the first step past each mark (``Budget``), so each
    point counts at the mark it was taken for; the last, at the budget."""
    end = grid[-1]

    def mark(p):
        return end if p["seconds"] >= end else (p["seconds"] + 1e-9) // every * every

    def value(curve, t):
        return [p for p in curve if mark(p) <= t + 1e-9][-1]["exact_match"]
    return [statistics.fmean(value(r["curve"], t) for r in runs) for t in grid]


def trl_table(results: Sequence[Mapping[str, Any]], settings) -> tuple[str, dict]:
    """Per side-by-side task and pair: accuracy at equal times, TRL's final accuracy and when rlcore
    first reached it (seeds' means), and the two goals' verdicts."""
    total, step = settings["trl"]["seconds"], settings["eval_seconds"]
    grid = sorted({*(i * step for i in range(int(total // step) + 1)), total})
    lines = ["| task | rlcore / TRL | rlcore ≥ TRL at every time | TRL final | rlcore reaches it at | ratio | goals |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    summary, curves = {}, {}
    for task in settings["trl"]["tasks"]:
        for kind, name in settings["trl"]["pairs"].items():
            ours = [r["runs"][name] for r in results if r["task"] == task and name in r["runs"]]
            theirs = [r["runs"][f"trl_{kind}"] for r in results if r["task"] == task and f"trl_{kind}" in r["runs"]]
            if not ours or not theirs:
                continue
            a, b = mean_curve(ours, grid, step), mean_curve(theirs, grid, step)
            curves[task, name] = (grid, a, b)
            ahead = all(x >= y - 1e-9 for x, y in zip(a, b))
            target = b[-1]
            reach = next((t for t, x in zip(grid, a) if x >= target - 1e-9), None)
            ratio = reach / total if reach is not None else None
            met = ahead and ratio is not None and ratio <= GOAL_TIME
            summary[task, name] = {"ahead": ahead, "trl_final": target, "reach": reach, "ratio": ratio, "met": met,
                                   "rlcore": a, "trl": b}
            lines.append(f"| {task} | {name} / TRL {kind} | {'yes' if ahead else 'no'} | {target:.3f} | "
                         + (f"{reach:.0f} s | {ratio:.2f}×" if reach is not None else "not reached | —")
                         + f" | {'met' if met else 'missed'} |")
    return "\n".join(lines) + "\n", {"summary": summary, "curves": curves}


def plot_trl(curves: Mapping[tuple[str, str], tuple], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tasks = sorted({t for t, _ in curves}, key=lambda t: [k[0] for k in curves].index(t))
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.0), dpi=80, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, ((_, name), (grid, a, b)) in enumerate((k, v) for k, v in curves.items() if k[0] == task):
            ax.plot(grid, a, color=f"C{i}", marker=".", label=f"rlcore {name}")
            ax.plot(grid, b, color=f"C{i}", ls="--", marker=".", label=f"TRL {name}")
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("training seconds (1 thread)", fontsize=8)
        ax.set_ylabel("held-out exact match", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report(results: Sequence[Mapping[str, Any]], settings, recipes: Sequence[str], *, write: bool) -> str:
    """The battery table and the side-by-side table as markdown (with the CPU, the versions and the
    settings' budget); with ``write``, into docs/learning.md between its markers, and the plot."""
    from machine import cpu_identity
    from reporting import versions

    cpu = cpu_identity()
    battery, summary = battery_table(results, recipes, settings["seconds"])
    side, trl = trl_table(results, settings)
    seeds = sorted({r["seed"] for r in results})
    v = versions(("torch", "transformers", "trl"))
    head = (f"Measured on {cpu['model']} ({cpu['isa']}), one CPU thread per run, "
            f"{', '.join(f'{k} {x}' for k, x in v.items())}; {len(seeds)} seeds, "
            f"{settings['seconds']} s of RL training per run (evaluation excluded).\n\n")
    text = (head + "### Held-out exact-match gain over SFT, points (mean over seeds)\n\n" + battery
            + f"\nGoal: every recipe ≥ {GOAL_GAIN * 100:.0f} points on average over the battery, no task "
            "losing accuracy. *seeds' spread*: the lowest and highest seed's battery mean.\n\n"
            + "### Side by side with TRL (held-out exact match, means over seeds)\n\n" + side
            + f"\nGoals: rlcore's accuracy ≥ TRL's at every evaluation time, and TRL's final accuracy (at "
            f"{settings['trl']['seconds']} s) reached in ≤ {GOAL_TIME}× TRL's time.\n")
    if write:
        plot = plot_trl(trl["curves"], PLOT)
        text += f"\n![held-out accuracy against training time, rlcore and TRL]({PLOT.name})\n" if plot else ""
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            raise ValueError(f"{DOC}: expected the markers {BEGIN} and {END}")
        DOC.write_text(doc[:doc.index(BEGIN) + len(BEGIN)] + "\n" + text + doc[doc.index(END):])
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=str(SETTINGS), help="the settings file [benchmarks/learning.yaml]")
    parser.add_argument("--workers", type=int, default=2, help="jobs run at once, one CPU thread each [2]")
    parser.add_argument("--tasks", nargs="+", help="a subset of the battery")
    parser.add_argument("--seeds", nargs="+", type=int, help="a subset of the seeds")
    parser.add_argument("--recipes", nargs="+", help="a subset of the recipes")
    parser.add_argument("--seconds", type=float, help="RL budget per run (and TRL's, if lower)")
    parser.add_argument("--no-trl", action="store_true", help="skip the side by side with TRL")
    parser.add_argument("--out", default=str(ROOT / "runs" / "learning"), help="per-job results")
    parser.add_argument("--write", action="store_true", help="update docs/learning.md and docs/learning_trl.png")
    args = parser.parse_args(argv)
    settings = load_settings(args.settings, tasks=args.tasks, seeds=args.seeds, seconds=args.seconds)
    if args.seconds is not None:
        settings["trl"]["seconds"] = min(settings["trl"]["seconds"], args.seconds)
    recipes = args.recipes or list(settings["recipes"])
    unknown = sorted(set(recipes) - set(settings["recipes"]))
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; the settings have {sorted(settings['recipes'])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs, results = [], []
    for task in settings["tasks"]:
        for seed in settings["seeds"]:
            path = out / f"{task}-{seed}.json"
            if path.is_file():
                results.append(json.loads(path.read_text()))
            else:
                jobs.append((settings, task, seed, out, recipes, not args.no_trl))
    print(f"{len(results)} jobs done before, {len(jobs)} to run on {args.workers} workers", file=sys.stderr)
    start = time.monotonic()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        for path, result in pool.map(_job, jobs):
            results.append(result)
            print(f"[{time.monotonic() - start:6.0f} s] {path}", file=sys.stderr)
    print(report(results, settings, recipes, write=args.write))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
