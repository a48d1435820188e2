# Two entry points on a fresh machine, both on the locked, tested set (constraints.txt):
#   make demo   sets up .venv and runs the built-in offline demo
#   make test   sets up .venv, lints and type-checks (make lint), builds the docs (make docs), runs the test suite
# and, for the optional vLLM engine (loops/vllm_engine.py), on requirements/vllm-lock.txt:
#   make test-vllm    sets up .venv-vllm (vLLM's CPU build) and runs the tests that need vLLM
# and, on a machine with a CUDA device and a CUDA build of torch==2.13.0 in .venv:
#   make test-gpu     the tests marked gpu (every recipe on CUDA: bf16, LoRA, autocast, memory metrics)
# Keeping the lock current:
#   make test-latest  resolves the newest versions pyproject.toml allows into .venv-latest and runs the suite
#   make lock         rewrites both locks from fresh resolves (then run make test and make test-vllm)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?= -n 2
EXTRAS  = dev,docs,bench,diffusion,peft,notebooks,demo,ray,trackers
LOCK    = constraints.txt
VLLM_VENV ?= .venv-vllm
VLLM_LOCK  = requirements/vllm-lock.txt
LATEST_VENV ?= .venv-latest
VLLM_LATEST_VENV ?= .venv-vllm-latest
# torch==2.13.0 (the CPU build) is in every install command that could otherwise resolve torch on its own.
LOCKED_INSTALL = -m pip install --quiet --no-deps -r

.PHONY: setup demo test test-gpu lint docs test-vllm latest-env vllm-latest-env test-latest lock bench bench-realistic bench-learning clean
setup: $(VENV)/.installed

# The lock holds every dependency, so --no-deps installs exactly its lines; the check confirms it.
# The editable install also compiles the CPU kernels (setup.py, rlcore/_kernel_build.py, rlcore/csrc): editing them reinstalls.
$(VENV)/.installed: pyproject.toml setup.py rlcore/_kernel_build.py $(wildcard rlcore/csrc/*) $(LOCK) requirements/lock.py
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) $(LOCKED_INSTALL) $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) requirements/lock.py check $(LOCK)
	touch $@

demo: setup
	$(VENV)/bin/rlcore demo

test: setup
	$(PY) requirements/lock.py check $(LOCK)
	$(MAKE) --no-print-directory lint docs
	$(PY) -m pytest $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: no CUDA device visible to torch')"
	$(PY) -m pytest -m gpu -p no:cacheprovider tests

# ruff over the code, mypy over rlcore/ and algorithms/ (settings in pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check rlcore algorithms loops benchmarks tests
	$(VENV)/bin/mypy

# the documentation site with the API reference from the docstrings (build/site; warnings fail it)
docs: setup
	$(VENV)/bin/mkdocs build --quiet

# vLLM's CPU build pins transformers below the main venv's, so it gets a venv of its own, with
# rlcore installed without its pins. The torchvision / torchaudio wheels vLLM asks for are built for
# another torch and fail at import (transformers imports torchvision when present): the lock leaves
# them out.
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_LOCK) requirements/lock.py
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/python $(LOCKED_INSTALL) $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python requirements/lock.py check $(VLLM_LOCK)
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python requirements/lock.py check $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/loops/test_vllm_engine.py

# Fresh resolves of the ranges (pyproject.toml, requirements/vllm.in) to the newest versions allowed.
latest-env:
	$(PYTHON) -m venv --clear $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet "torch==2.13.0" -e ".[$(EXTRAS)]"

vllm-latest-env:
	$(PYTHON) -m venv --clear $(VLLM_LATEST_VENV)
	$(VLLM_LATEST_VENV)/bin/python -m pip install --quiet -r requirements/vllm.in
	$(VLLM_LATEST_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec

test-latest: latest-env
	$(LATEST_VENV)/bin/python requirements/lock.py diff $(LOCK)
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

lock: latest-env vllm-latest-env
	$(LATEST_VENV)/bin/python requirements/lock.py freeze --header "make setup installs exactly this set (make lock writes it)" > $(LOCK).new
	$(VLLM_LATEST_VENV)/bin/python requirements/lock.py freeze --header "make test-vllm installs exactly this set (make lock writes it from requirements/vllm.in)" > $(VLLM_LOCK).new
	mv $(LOCK).new $(LOCK)
	mv $(VLLM_LOCK).new $(VLLM_LOCK)

bench: setup
	$(PY) benchmarks/run.py

# rlcore and TRL at 0.5B scale (LoRA and full-parameter bf16 steps, each run in its own process): an hour on 2 cores
bench-realistic: setup
	$(PY) benchmarks/realistic.py --write

# every RL recipe on the task battery, and GRPO / RLOO side by side with TRL (docs/learning.md): 75 minutes on 2 cores
bench-learning: setup
	$(PY) benchmarks/learning.py --workers 2 --write

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) $(VLLM_LATEST_VENV) build *.egg-info
