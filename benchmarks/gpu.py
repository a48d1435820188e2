"""rlcore on a CUDA GPU: the log-prob kernels at an LLM's vocabulary and generation at the 0.5B shape.

    python benchmarks/gpu.py [--tiny] [--out FILE]
    bash benchmarks/gpu.sh          # everything a lent GPU machine runs: make test-gpu, this, realistic.py

Not part of ``make bench`` (which measures the CPU). Every case runs here, in one process, on
``cuda:0``; times are CUDA-event medians over repeated runs after warm-ups, peaks are
``torch.cuda.max_memory_allocated`` above what the inputs already hold.

- ``ceilings``: a device-to-device copy (bytes read + written per second) and an 8192³ bf16 matrix
  product on random data, so each figure below can be read against what this card does.
- ``lm head``: label log-probs from hidden states ``[N, H]`` and an LM head ``[V, H]`` at
  Qwen2.5-0.5B's width and vocabulary (H 896, V 151,936), forward + backward to both inputs, in
  bfloat16 and float32: rlcore ``hidden_logprobs`` (vocabulary-chunked, no logits tensor) against
  the head matmul then ``log_softmax``-gather in float32, the matmul then ``cross_entropy``, the
  matmul then rlcore ``token_logprobs``, and TRL's chunked function where trl is installed. Each
  is checked against the float32 ``log_softmax`` path (max abs difference of the log-probs).
- ``generate``: the Qwen2.5-0.5B-shaped model (random weights, bfloat16), 8 prompts of 64 tokens
  × 8 samples × 128 new tokens: rlcore's KV-cache loop (``engines.sample_responses``) against
  Hugging Face ``generate`` sampling the same lengths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from rlcore.lm_head import hidden_logprobs
from rlcore.logprobs import token_logprobs

GIB = 2.0 ** 30


def _time(fn, *, warmup: int = 2, reps: int = 10) -> tuple[float, list[float]]:
    """Median milliseconds of ``fn()`` by CUDA events, and every timed run."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def _peak_extra(fn) -> float:
    """GiB allocated by one ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def ceilings(tiny: bool) -> list[str]:
    n = (1 << 20) if tiny else (1 << 30)  # bytes copied
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms, _ = _time(lambda: dst.copy_(src))
    m = 512 if tiny else 8192
    a, b = (torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms, _ = _time(lambda: a @ b)
    bw = 2 * n / (copy_ms / 1e3) / 1e12
    flops = 2 * m ** 3 / (mm_ms / 1e3) / 1e12
    return ["| ceiling | figure |", "| --- | ---: |", f"| device copy, TB/s (read + write) | {bw:.2f} |",
            f"| bf16 matmul {m}³, TFLOP/s | {flops:.0f} |"]


def _trl_chunked():
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return lambda h, w, y: ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 4096, None, 1.0, ())[0]


def _lm_head_rows(impls: dict, dtype: torch.dtype, n: int, hdim: int, vocab: int) -> list[str]:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hdim, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, device="cuda", generator=g) / hdim ** 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    go = torch.rand(n, device="cuda", generator=g)
    with torch.no_grad():
        ref = (h.float() @ w.float().T).log_softmax(-1).gather(-1, y[:, None])[:, 0]
    got: dict[str, tuple[float, float, float, float] | str] = {}
    for name, fn in impls.items():
        def step(fn=fn):
            out = fn(h, w, y)
            return torch.autograd.grad(out, (h, w), go.to(out.dtype))

        try:
            with torch.no_grad():
                delta = (fn(h, w, y).float() - ref).abs().max().item()
            med, times = _time(step, reps=6)
            q = statistics.quantiles(times, n=4)
            got[name] = (med, (q[2] - q[0]) / med, _peak_extra(step), delta)
        except Exception as err:  # noqa: BLE001 - a failing implementation is a row, not the end of the run
            got[name] = f"failed: {type(err).__name__}: {str(err)[:100]}"
    base = got.get("matmul + float32 log_softmax")
    rows = []
    for name, r in got.items():
        if isinstance(r, str):
            rows.append(f"| {str(dtype)[6:]} | {name} | {r} | | | | | |")
            continue
        vs = ("—", "—") if isinstance(base, str) or base is None else (f"{r[0] / base[0]:.2f}×",
                                                                      f"{r[2] / max(base[2], 1e-9):.2f}×")
        rows.append(f"| {str(dtype)[6:]} | {name} | {r[0]:.2f} | {r[1]:.0%} | {r[2]:.3f} | {vs[0]} | {vs[1]} | "
                    f"{r[3]:.2e} |")
    return rows


def lm_head(tiny: bool) -> list[str]:
    n, hdim, vocab = (256, 64, 1000) if tiny else (8192, 896, 151_936)
    impls = {
        "rlcore hidden_logprobs": lambda h, w, y: hidden_logprobs(h, w, y),
        "matmul + float32 log_softmax": lambda h, w, y: (h @ w.T).float().log_softmax(-1).gather(-1, y[:, None])[:, 0],
        "matmul + cross_entropy": lambda h, w, y: -F.cross_entropy(h @ w.T, y, reduction="none"),
        "matmul + rlcore token_logprobs": lambda h, w, y: token_logprobs(h @ w.T, y),
    }
    trl = _trl_chunked()
    if trl is not None:
        impls["trl ChunkedLogProbFunction"] = trl
    rows = [f"N {n} rows, H {hdim}, V {vocab}; forward + backward to hidden and head; "
            "peak: GiB above the inputs; |Δ|: max abs difference from the float32 log_softmax path", "",
            "| dtype | impl | median ms | spread (IQR/median) | peak extra GiB | vs matmul+log_softmax time | "
            "peak vs it | max abs Δ |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dtype in (torch.bfloat16, torch.float32):
        rows += _lm_head_rows(impls, dtype, n, hdim, vocab)
        torch.cuda.empty_cache()
    return rows


def generate(tiny: bool) -> list[str]:
    from rlcore.loops.engines import sample_responses
    from rlcore.loops.shapes import build_family_model

    prompts, samples, plen, new = (2, 2, 8, 8) if tiny else (8, 8, 64, 128)
    with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute of CPU init
        model = build_family_model("qwen2.5", "tiny" if tiny else "0.5b", dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(4, vocab, (prompts, plen), device="cuda", generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    never = [vocab + 7]  # no stop token: every row runs the whole budget in both

    def ours():
        return sample_responses(model, ids, mask, max_new_tokens=new, stop_token_ids=never, pad_token_id=0,
                                num_samples=samples, generator=g)[0]

    def hf():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=True, top_k=0, top_p=1.0,
                                  num_return_sequences=samples, pad_token_id=0, eos_token_id=None)

    rows = [f"{prompts} prompts × {samples} samples, prompt {plen} tokens, {new} new tokens, bfloat16",
            "", "| impl | median ms | tokens/s | speed-up over HF generate |", "| --- | ---: | ---: | ---: |"]
    got = {}
    for name, fn in (("rlcore KV-cache loop", ours), ("HF generate", hf)):
        med, _ = _time(fn, warmup=1, reps=3 if not tiny else 2)
        got[name] = med
    for name, med in got.items():
        rows.append(f"| {name} | {med:.0f} | {prompts * samples * new / (med / 1e3):.0f} | "
                    f"{got['HF generate'] / med:.2f}× |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device visible to torch", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    lines = [f"GPU: {props.name}, {props.total_memory / GIB:.0f} GiB, {props.multi_processor_count} SMs; "
             f"torch {torch.__version__}, CUDA {torch.version.cuda}", ""]
    print(lines[0], flush=True)
    failed = False
    for title, section in (("ceilings", ceilings), ("lm head", lm_head), ("generate", generate)):
        part = [f"#### {title}", ""]
        try:
            part += section(args.tiny)
        except Exception:  # noqa: BLE001 - report the failure and go on with the next section
            failed = True
            part.append("```\n" + traceback.format_exc()[-2000:] + "```")
        lines += [*part, ""]
        print("\n".join(part), "", sep="\n", flush=True)
    text = "\n".join(lines)
    if args.out:
        args.out.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
