"""Per-rank peak memory of full-parameter GRPO and DPO: one rank unsharded against FSDP2 on 2 and 4 ranks.

    python benchmarks/sharding.py [--recipes grpo dpo] [--ranks 1 2 4] [--hidden 1536] [--layers 8] [--shape qwen2.5-0.5b]
                                  [--steps 2] [--out runs/sharding] [--built] [--tiny]

Each (recipe, world size) runs in fresh processes (``rlcore.loops.dist.spawn``, gloo): world size 1
with ``strategy: none``, larger ones with ``strategy: fsdp2``. The policy is the tiny-llama at the
given width and depth, saved once as a ``from_pretrained`` folder that every run loads, as a real
model is (under fsdp2 each rank reads only its rows of the weights onto a model built on the meta
device); ``--built`` builds it from its config in every rank instead (whole, then sharded). Every
rank trains ``steps`` steps of the recipe on it (character vocabulary,
float32, AdamW, no LoRA: parameters, gradients and optimiser state dominate) and reports its
resident-set high-water mark (``getrusage``), the resident set after the imports (the baseline every
process pays), and the run's losses. The report prints one row per run: the largest rank's peak,
the peak above the baseline, both as fractions of the one-rank run, and the losses.

Goals (issue: shard what does not fit): per-rank peak at 2 ranks ≤ 0.6× and at 4 ranks ≤ 0.4× the
1-rank peak, with the losses of 2 and 4 ranks equal to 1 rank's within a stated tolerance.
What the figures include: with ``--built`` each rank builds the policy whole before sharding it, so
one full float32 copy is in every rank's high-water mark; from the folder no rank holds it whole.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

RECIPES = ("grpo", "dpo")
QWEN = "qwen2.5-0.5b"  # benchmarks/realistic.py's model: Qwen2.5-0.5B's geometry, its vocabulary, tied embeddings


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _settings(recipe: str, hidden: int, layers: int, steps: int) -> dict:
    common = dict(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64), max_position_embeddings=128,
                  steps=steps, eval_every=0, run_dir=None, seed=1, lr=1e-4, num_train=32, num_eval=0)
    if recipe == "grpo":
        return dict(common, batch_size=4, num_samples=2, max_new_tokens=8)
    return dict(common, batch_size=8, max_length=32)


def _save_policy(folder: Path, hidden: int, layers: int, shape: str = "tiny-llama") -> Path:
    """The policy as a ``from_pretrained`` folder (weights and tokenizer), in a child process so that
    this one never holds it: the tiny-llama of the run's size, or the Qwen2.5-0.5B shape in float32."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_write_policy, args=(str(folder), hidden, layers, shape))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"writing the policy folder {folder} failed (exit code {child.exitcode})")
    return folder


def _write_policy(folder: str, hidden: int, layers: int, shape: str = "tiny-llama") -> None:
    from rlcore.loops.models import build_model, build_tokenizer

    if shape == QWEN:
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        from realistic import save_model

        save_model(Path(folder), tiny=False, dtype="float32")
        return

    tokenizer = build_tokenizer()
    build_model("llama", tokenizer=tokenizer, hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64),
                max_position_embeddings=128, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def worker(recipe: str, settings: dict, strategy: str, out: str) -> None:
    import torch

    from rlcore.loops.dist import dist_info
    from rlcore.loops.recipes import dpo, grpo

    torch.set_num_threads(1)
    base = _rss_mib()
    module = {"grpo": grpo, "dpo": dpo}[recipe]
    kwargs = {"reward_fn": length_reward} if recipe == "grpo" else {}
    start = time.time()
    _, history = module.train(module.Config(**settings, strategy=strategy), **kwargs)
    info = dist_info()
    result = {"rank": info.rank, "world_size": info.world_size, "baseline_mib": base,
              "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": time.time() - start,
              "loss": [h.get("loss") for h in history]}
    Path(out, f"{recipe}-{info.world_size}-{info.rank}.json").write_text(json.dumps(result))


def run(recipe: str, world_size: int, settings: dict, out: Path, rank_fn=None) -> list[dict]:
    """``rank_fn`` (default :func:`worker`) on ``world_size`` fresh gloo ranks; each rank's JSON report."""
    from rlcore.loops.dist import spawn

    strategy = "none" if world_size == 1 else "fsdp2"
    spawn(rank_fn or worker, world_size, recipe, settings, strategy, str(out), backend="gloo")
    return [json.loads(out.joinpath(f"{recipe}-{world_size}-{r}.json").read_text()) for r in range(world_size)]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/sharding"))
    parser.add_argument("--built", action="store_true", help="build the policy from its config in every rank "
                                                               "(whole, then sharded) instead of loading a folder")
    parser.add_argument("--shape", choices=["tiny-llama", QWEN], default="tiny-llama",
                        help=f"{QWEN}: Qwen2.5-0.5B's geometry and vocabulary (494M parameters, tied embeddings; "
                             "--hidden and --layers ignored), read from a folder")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: width 64, 2 blocks, 1 and 2 ranks")
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.ranks, args.steps = 64, 2, [1, 2], 1
    if args.shape == QWEN and args.built:
        parser.error(f"--built builds tiny-llama; --shape {QWEN} is read from its folder")
    args.out.mkdir(parents=True, exist_ok=True)
    folder = None if args.built else _save_policy(args.out / f"policy-{args.shape}", args.hidden, args.layers,
                                                  args.shape)
    params = 12 * args.hidden ** 2 * args.layers
    model = (f"{QWEN} (24 blocks of width 896, vocabulary 151,936, 494M parameters)" if args.shape == QWEN else
             f"tiny-llama, width {args.hidden}, {args.layers} blocks (about {params / 1e6:.0f}M parameters in the "
             "blocks)")
    lines = [f"Model: {model}, float32, AdamW, {args.steps} steps",
             "", "| recipe | ranks | strategy | peak MiB (largest rank) | × 1 rank | above baseline MiB | × 1 rank "
             "| losses | s |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for recipe in args.recipes:
        settings = _settings(recipe, args.hidden, args.layers, args.steps) | ({"model": str(folder)} if folder else {})
        one = None
        for world_size in args.ranks:
            ranks = run(recipe, world_size, settings, args.out)
            peak = max(r["peak_mib"] for r in ranks)
            extra = max(r["peak_mib"] - r["baseline_mib"] for r in ranks)
            one = one or (peak, extra)
            losses = ", ".join(f"{x:.6f}" for x in ranks[0]["loss"] if x is not None)
            lines.append(f"| {recipe} | {world_size} | {'none' if world_size == 1 else 'fsdp2'} | {peak:.0f} | "
                         f"{peak / one[0]:.2f} | {extra:.0f} | {extra / one[1]:.2f} | {losses} | "
                         f"{max(r['seconds'] for r in ranks):.0f} |")
            print(lines[-1], flush=True)
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
