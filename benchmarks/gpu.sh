#!/usr/bin/env bash
# Everything a CUDA machine runs for rlcore, in one go, on a machine whose python3 holds a CUDA torch:
#   bash benchmarks/gpu.sh        (from the repository root; logs and reports go to $OUT)
#
# 1. the wheels in .whl/ (if any: packages that machine lacks) into /tmp/site;
# 2. rlcore installed editable without compiling (the CPU kernels are then built on first use, in
#    the background, by `python -m rlcore.kernels`, which reports where they came from);
# 3. the tests marked gpu (what `make test-gpu` runs), with the pure-PyTorch CPU path so that they
#    do not wait for that build;
# 4. benchmarks/gpu.py (ceilings, the LM-head log-prob path, generation at the 0.5B shape);
# 5. benchmarks/realistic.py --device cuda (GRPO and DPO with LoRA at the 0.5B shape, rlcore and TRL).
# Each stage has its own time limit (seconds, from the environment) so that one hang cannot eat the rest.
set -u
OUT=${OUT:-/tmp/rlcore-gpu}
PY=${PY:-python3}
TESTS_S=${TESTS_S:-220} BENCH_S=${BENCH_S:-100} REALISTIC_S=${REALISTIC_S:-170}
REALISTIC_CASES=${REALISTIC_CASES:-grpo_lora,dpo_lora} REALISTIC_IMPLS=${REALISTIC_IMPLS:-rlcore,trl}
TESTS_K=${TESTS_K:-}  # a pytest -k filter, to rerun some of the gpu tests
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RLCORE_KERNEL_CACHE=/tmp/rlcore-kernels
stamp() { echo "== $(date +%T) $*"; }

stamp wheels
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu.sh: installing the carried wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv

stamp "install rlcore (editable; torch hidden from setup.py, so no kernels are compiled at install)"
mkdir -p /tmp/no-torch/torch
echo 'raise ImportError("hidden from setup.py by benchmarks/gpu.sh")' >/tmp/no-torch/torch/__init__.py
PYTHONPATH=/tmp/no-torch:${PYTHONPATH:-} "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
"$PY" - <<'EOF'
from importlib.metadata import version
import torch
names = ("torch", "transformers", "tensordict", "peft", "trl", "datasets", "diffusers", "accelerate")
print(", ".join(f"{n} {version(n)}" for n in names), f"| CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF
(stamp "kernels: first-use build"; "$PY" -m rlcore.kernels) >"$OUT/kernels.log" 2>&1 &
kernels=$!

status=0
stamp "tests marked gpu (limit ${TESTS_S} s)"
RLCORE_PURE_TORCH=1 timeout "$TESTS_S" "$PY" -m pytest -m gpu ${TESTS_K:+-k "$TESTS_K"} tests -p no:cacheprovider -q --tb=short \
    --continue-on-collection-errors -o addopts="-ra --strict-markers" -W ignore::DeprecationWarning \
    >"$OUT/tests.log" 2>&1 || status=1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -40

stamp "benchmarks/gpu.py (limit ${BENCH_S} s)"
timeout "$BENCH_S" "$PY" benchmarks/gpu.py --out "$OUT/gpu.md" >"$OUT/gpu.log" 2>&1 || status=1
cat "$OUT/gpu.log" | tail -60

stamp "benchmarks/realistic.py --device cuda --cases $REALISTIC_CASES (limit ${REALISTIC_S} s)"
timeout "$REALISTIC_S" "$PY" benchmarks/realistic.py --device cuda --cases "$REALISTIC_CASES" --impls "$REALISTIC_IMPLS" \
    --steps 3 \
    >"$OUT/realistic.md" 2>"$OUT/realistic.log" || status=1
tail -5 "$OUT/realistic.log"; cat "$OUT/realistic.md"

wait "$kernels"
tail -8 "$OUT/kernels.log"
stamp "done (status $status)"
exit $status
