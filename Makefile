# Two entry points on a fresh machine:
#   make demo   sets up .venv and runs the built-in offline demo
#   make test   sets up .venv and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: setup demo test bench clean
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

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
