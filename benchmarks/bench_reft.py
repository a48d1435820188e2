"""LoReFT against LoRA (peft) and full fine-tuning: trainable parameters, step time, loss reached.

The same frozen tiny Llama-style model (built from a config, offline), the same batches of the
built-in ``sort`` task, the same loss and optimiser step (``loops.recipes.sft``'s loss through
``loops.update``, AdamW); only what trains differs:

- ``rlcore`` LoReFT: rank-4 interventions on the residual stream after blocks 1 and 2 at the
  first 3 and last 3 prompt tokens (``loops.recipes.reft.reft_sft_step``);
- ``peft_lora``: LoRA rank 4 on ``q_proj`` / ``v_proj`` of every block (``peft``, optional:
  ``pip install peft``);
- ``full``: every weight.

Harness cases (``benchmarks/run.py``): ``sft step …`` times one optimiser step (forward, backward,
AdamW) on one batch. Run alone, ``python benchmarks/bench_reft.py [--tiny] [--threads N]`` trains each
method for a few steps and prints a Markdown table: trainable parameters, median step time, the
loss reached, and the steps (and seconds) each needs to reach the loss LoReFT ends at.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from rlcore.loops.tokenization import tokenize_dataset
from rlcore.loops.models import build_model, build_tokenizer
from rlcore.loops.recipes.reft import init_reft_state, reft_sft_step, trainable_fraction
from rlcore.loops.reft_data import ReftSpec, collate_reft
from rlcore.loops.recipes.sft import sft_step
from rlcore.loops.state import init_state
from rlcore.loops.tasks import task_dataset
from rlcore.loops.update import make_optimizer

SPEC = ReftSpec(layers=(1, 2), positions="f3+l3", rank=4)
LR = {"rlcore": 1e-2, "peft_lora": 1e-2, "full": 1e-3}


def _sizes(tiny: bool) -> dict[str, int]:
    if tiny:
        return dict(hidden=32, layers=4, heads=4, batch=4, batches=4, steps=12)
    return dict(hidden=256, layers=4, heads=8, batch=16, batches=16, steps=150)


def _setup(tiny: bool):
    s = _sizes(tiny)
    tokenizer = build_tokenizer()
    model = build_model("llama", tokenizer=tokenizer, hidden_size=s["hidden"], num_layers=s["layers"],
                        num_heads=s["heads"], seed=0)
    data = tokenize_dataset(task_dataset("sort", s["batch"] * s["batches"], seed=0), tokenizer, max_length=64)
    batches = [collate_reft("prompt_completion", data[i * s["batch"]:(i + 1) * s["batch"]], pad_id=0, spec=SPEC)
               for i in range(s["batches"])]
    return model, batches


def _reft(model):
    state = init_reft_state(model, SPEC, lr=LR["rlcore"], seed=0)
    return state, reft_sft_step, trainable_fraction(state)


def _lora(model):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("peft is not installed (pip install peft)", name="peft") from err
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    params = [p for p in lora.parameters() if p.requires_grad]
    total = sum(p.numel() for p in lora.parameters())
    state = init_state({"policy": lora}, optimizer=make_optimizer(params, lr=LR["peft_lora"]), seed=0)
    return state, sft_step, (sum(p.numel() for p in params), total)


def _full(model):
    state = init_state({"policy": model}, optimizer=make_optimizer(model, lr=LR["full"]), seed=0)
    n = sum(p.numel() for p in model.parameters())
    return state, sft_step, (n, n)


METHODS = {"rlcore": _reft, "peft_lora": _lora, "full": _full}


def _step_builder(method, tiny: bool):
    def builder():
        model, batches = _setup(tiny)
        state, step, _ = METHODS[method](model)
        return functools.partial(step, state, batches[0])  # the state's models are trained in place
    return builder


def cases(tiny: bool) -> dict[str, dict]:
    s = _sizes(tiny)
    name = f"sft step llama H={s['hidden']} L={s['layers']} B={s['batch']}"
    return {name: {m: _step_builder(m, tiny) for m in METHODS}}


def _train(method: str, tiny: bool) -> dict:
    model, batches = _setup(tiny)
    state, step, (trainable, total) = METHODS[method](model)
    losses, times = [], []
    for i in range(_sizes(tiny)["steps"]):
        start = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - start)
    smooth = [statistics.fmean(losses[max(0, i - 3):i + 1]) for i in range(len(losses))]
    return dict(trainable=trainable, total=total, step_s=statistics.median(times[1:]), losses=smooth)


def main(tiny: bool, threads: int) -> None:
    torch.set_num_threads(threads)
    results = {}
    for method in METHODS:
        try:
            results[method] = _train(method, tiny)
        except ImportError as err:
            print(f"{method}: skipped ({err})")
    target = results["rlcore"]["losses"][-1]
    print(f"\nSFT on `sort`, {_sizes(tiny)['steps']} steps; target loss = LoReFT's final (smoothed) {target:.3f}\n")
    print("| method | trainable params | % of model | step time (ms) | final loss | steps to target "
          "| time to target (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for method, r in results.items():
        hit = next((i + 1 for i, v in enumerate(r["losses"]) if v <= target + 1e-9), None)
        reach = "— | —" if hit is None else f"{hit} | {hit * r['step_s']:.2f}"
        print(f"| {method} | {r['trainable']:,} | {100 * r['trainable'] / r['total']:.2f} | {1e3 * r['step_s']:.1f} | "
              f"{r['losses'][-1]:.3f} | {reach} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main("--tiny" in args, int(args[args.index("--threads") + 1]) if "--threads" in args else 2)
