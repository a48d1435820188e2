"""``strategy: ddp`` against ``strategy: none``: the gradients' all-reduce overlapped with the backward, or after it.

    python benchmarks/overlap.py [--hidden 1024] [--layers 8] [--rows 4] [--tokens 128] [--repeats 7] [--tiny]

Two gloo ranks (``rlcore.loops.dist.spawn``), each with one torch thread, train a float32 tiny-llama
of the given width and depth (AdamW, every weight trained) with ``update`` on their own rows of a
GRPO-style rollout (``rows`` rows of ``tokens`` response tokens per rank, the chunked trunk → LM-head
log-probs of the recipes, one micro-batch). In the same processes the two reductions alternate:
``none`` (``wrap_model(strategy=None)``: ``update`` sums the gradients in flat buckets after the
backward) and ``ddp`` (``strategy="bucketed"``: buckets of about 25 MiB sent while the backward makes
them). The report gives each one's median step (rank 0's clock, after one warm-up step each), their
ratio, how many of the ``ddp`` buckets were sent before the backward ended, for scale the time of one
blocking all-reduce of all the gradients (what ``none`` waits for after its backward), and how far
apart the two runs' weights end (the same steps: float summation order only).

Overlap gains at most that all-reduce time: over two ranks on one machine with gloo it is small next
to the CPU backward, and the ranks' communication threads compete for the same cores; it is the
multi-GPU (NCCL) case the strategy is for. The ratio is reported, not a goal.
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
import time
from pathlib import Path


def worker(settings: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlcore import keys as K
    from rlcore.algorithms.policy_gradient import grpo_loss
    from rlcore.loops.dist import dist_info, shard_batch, wrap_model
    from rlcore.loops.dist import sync
    from rlcore.loops.models import build_model
    from rlcore.loops.online import with_policy_logprobs
    from rlcore.loops.state import init_state
    from rlcore.loops.update import update
    from rlcore.testing import make_rollout

    torch.set_num_threads(1)
    info = dist_info()
    vocab, world = 2048, info.world_size
    g = torch.Generator().manual_seed(5)
    batch = make_rollout(settings["rows"] * world, settings["tokens"], 16, vocab_size=vocab, group_size=2, generator=g)
    batch = shard_batch(batch.update({K.ADVANTAGES: torch.randn(batch.batch_size[0], settings["tokens"], generator=g)}))

    def loss(state, mb, **denominators):
        return grpo_loss(with_policy_logprobs(state.model("policy"), mb), **denominators)

    def state_for(strategy):
        policy = build_model("llama", vocab_size=vocab, hidden_size=settings["hidden"], num_layers=settings["layers"],
                             num_heads=max(1, settings["hidden"] // 64), seed=0)
        policy = wrap_model(policy, strategy=strategy)
        return init_state({"policy": policy}, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-5), seed=3)

    states = {"none": state_for(None), "ddp": state_for("bucketed")}
    sent: list[list[int]] = []
    finish = sync.OverlappedReduction.finish

    def recorded(self):
        finish(self)
        sent.append([self.sent_in_backward, len(self.buckets)])

    sync.OverlappedReduction.finish = recorded
    times: dict[str, list[float]] = {name: [] for name in states}
    for repeat in range(settings["repeats"] + 1):  # the first of each: a warm-up, dropped
        for name in states:
            dist.barrier()
            start = time.perf_counter()
            states[name], _ = update(states[name], batch, loss, mask_key=K.RESPONSE_MASK)
            dist.barrier()
            if repeat:
                times[name].append(time.perf_counter() - start)
    apart = max((a - b).abs().max().item() for a, b in zip(states["none"].model("policy").parameters(),
                                                             states["ddp"].model("policy").parameters()))
    grads = sum(p.numel() for p in states["none"].model("policy").parameters())
    flat = torch.zeros(grads)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(flat)
    all_reduce_s = time.perf_counter() - start
    result = {"rank": info.rank, "times": times, "sent": sent, "params": grads, "all_reduce_s": all_reduce_s,
              "apart": apart}
    Path(out, f"overlap-{info.rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("runs/overlap"))
    parser.add_argument("--tiny", action="store_true", help="a smoke run: width 64, 2 blocks, 2 repeats")
    args = parser.parse_args(argv)
    settings = dict(hidden=args.hidden, layers=args.layers, rows=args.rows, tokens=args.tokens, repeats=args.repeats)
    if args.tiny:
        settings.update(hidden=64, layers=2, rows=2, tokens=8, repeats=2)
    args.out.mkdir(parents=True, exist_ok=True)

    import machine  # benchmarks/ is on the path when run as a script

    from rlcore.loops.dist import spawn

    before = machine.read_sample()
    spawn(worker, 2, settings, str(args.out), backend="gloo")
    cond = machine.conditions(before, machine.read_sample())
    cpu = machine.cpu_identity()
    others = "unknown" if cond.others_cores is None else f"{cond.others_cores:.2f}"
    load = (f"{cpu['model']} ({cpu['isa']}), {os.cpu_count()} cores; load average "
            f"{cond.load_before}→{cond.load_after}, cores other processes kept busy {others}")
    rank0 = json.loads((args.out / "overlap-0.json").read_text())
    none, ddp = (statistics.median(rank0["times"][k]) for k in ("none", "ddp"))
    sent = rank0["sent"]
    early = statistics.median(s[0] for s in sent) if sent else 0
    lines = [f"Run: `python benchmarks/overlap.py --hidden {settings['hidden']} --layers {settings['layers']} "
             f"--rows {settings['rows']} --tokens {settings['tokens']} --repeats {settings['repeats']}`  ",
             f"Machine: {load}  ",
             f"Model: {rank0['params'] / 1e6:.1f}M float32 parameters; 2 gloo ranks, one torch thread each", "",
             "| reduction | median step s | steps s |", "| --- | ---: | --- |"]
    for name, median in (("none (after the backward)", none), ("ddp (during the backward)", ddp)):
        key = name.split()[0]
        lines.append(f"| {name} | {median:.3f} | {', '.join(f'{t:.3f}' for t in rank0['times'][key])} |")
    lines += ["", f"- ddp / none: {ddp / none:.3f} (below 1: ddp faster)",
              f"- ddp buckets sent before the backward ended: {early:g} of {sent[0][1] if sent else 0}",
              f"- one blocking all-reduce of every gradient: {rank0['all_reduce_s']:.3f} s",
              f"- the two runs' weights after {settings['repeats'] + 1} steps differ by at most {rank0['apart']:.2e}"]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
