"""Does GRPO learn to use a calculator? Held-out exact match on `add` and `mul` from one SFT start.

    python benchmarks/agents_learning.py [--tasks add mul] [--seeds 0 1 2] [--steps 160] [--workers 2]
                                         [--out runs/agents-learning] [--tiny]

For each task and seed (a job, one CPU thread each; results in ``OUT/<task>-<seed>.json``):

    sft     a tiny Llama (the learning battery's shape) SFT'd on conversations of the training prompts:
            a fraction ``demo_fraction`` of them call ``calculate`` with the prompt's arithmetic and
            then give the tool's answer, the others answer directly (a partial skill of calling)
    start   held-out exact match of that SFT policy, greedy episodes against the calculator
    tool    GRPO with ``env: calculator`` from the SFT checkpoint for ``steps`` steps; held-out exact
            match at the end
    no-tool GRPO from the same checkpoint with the calculator's opening but no tool result (the
            episode ends after the first turn, so the answer must be computed), the same steps

The goal (issue: tools and environments): ``tool`` lifts held-out exact match by >= 30 points over
``start`` on add and mul, for every seed, in <= 10 minutes of CPU per run. The report prints one row
per job and whether the goal holds; the figures go to benchmarks/RESULTS.md by hand with the CPU named.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import time
from pathlib import Path

GOAL_POINTS = 0.30
MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256)
def conversations(task: str, n: int, seed: int, demo_fraction: float, split: str) -> list[dict]:
    """``loops.envs.calculator_conversations`` of the task's ``split`` prompts."""
    from rlcore.loops.envs import calculator_conversations
    from rlcore.loops.tasks import task_dataset

    data = task_dataset(task, n, seed=seed, split=split)
    return calculator_conversations(data["prompt"], data["answer"], fraction=demo_fraction)


class NoTool:
    """The calculator's opening, but the episode ends after the model's first turn: no tool result."""

    def __init__(self):
        from rlcore.loops.envs import calculator_env

        self.opening = calculator_env()

    def reset(self, row):
        return self.opening.reset(row)

    def step(self, text):
        from rlcore.loops.envs import EnvStep

        return EnvStep(done=True)


def run_job(task: str, seed: int, settings: dict, out: Path) -> dict:
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from rlcore.loops.envs import resolve_env
    from rlcore.loops.evaluate import evaluate_policy
    from rlcore.loops.recipes import grpo, sft

    work = out / f"{task}-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in conversations(task, settings["num_train"], seed,
                                                                    settings["demo_fraction"], "train")))
    started = time.perf_counter()
    sft_config = sft.Config(**MODEL, seed=seed, dataset=str(data), num_eval=0, assistant_only_loss=True,
                            max_length=256, steps=settings["sft_steps"], lr=3e-3, batch_size=32, warmup_steps=10,
                            run_dir=str(work / "sft"), overwrite=True, log_every=0)
    sft.train(sft_config)
    sft_s = time.perf_counter() - started
    common = dict(**MODEL, seed=seed, task=task, num_train=settings["num_train"], num_eval=settings["num_eval"],
                  init_from=str(work / "sft"), max_new_tokens=80, temperature=0.7, lr=5e-4, warmup_steps=5,
                  batch_size=16, num_samples=8, steps=settings["steps"], eval_batch_size=64, log_every=0,
                  max_turns=2, overwrite=True)
    result = {"task": task, "seed": seed, "sft_s": sft_s}
    for name, env in (("tool", resolve_env("calculator")), ("no-tool", NoTool)):
        config = grpo.Config(**common, run_dir=str(work / name))
        start_state, _ = grpo.build_state(config)
        start_state = dataclasses.replace(start_state, env=env)
        result["start" if name == "tool" else "start_no_tool"] = evaluate_policy(start_state, config)["exact_match"]
        began = time.perf_counter()
        state, history = grpo.train(config, env=env)
        result[f"{name}_s"] = time.perf_counter() - began
        result[name] = evaluate_policy(state, config)["exact_match"]
        result[f"{name}_turns"] = history[-1].get("rollout/turns", 1.0)
    (out / f"{task}-{seed}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["add", "mul"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--sft_steps", type=int, default=1200)
    parser.add_argument("--demo_fraction", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/agents-learning"))
    parser.add_argument("--tiny", action="store_true", help="a smoke run: few prompts and steps")
    args = parser.parse_args()
    settings = dict(num_train=512, num_eval=128, steps=args.steps, sft_steps=args.sft_steps,
                    demo_fraction=args.demo_fraction)
    if args.tiny:
        settings.update(num_train=32, num_eval=8, steps=1, sft_steps=2)
    jobs = [(t, s) for t in args.tasks for s in args.seeds if not (args.out / f"{t}-{s}.json").exists()]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        futures = [pool.submit(run_job, t, s, settings, args.out) for t, s in jobs]
        for f in concurrent.futures.as_completed(futures):
            r = f.result()
            print(json.dumps(r), flush=True)
    rows = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
    print("| task | seed | SFT start (tool) | GRPO + tool | lift | GRPO no tool (start) | tool run s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['task']} | {r['seed']} | {r['start']:.3f} | {r['tool']:.3f} | {r['tool'] - r['start']:+.3f} | "
              f"{r['no-tool']:.3f} ({r['start_no_tool']:.3f}) | {r['tool_s']:.0f} |")
    met = rows and all(r["tool"] - r["start"] >= GOAL_POINTS and r["tool_s"] <= 600 for r in rows)
    print(f"goal (lift >= {GOAL_POINTS * 100:.0f} points, <= 10 min, every job): {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
