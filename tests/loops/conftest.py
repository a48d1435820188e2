"""Shared fixtures for tests/loops: everything offline, tiny tokenizers and models built from configs."""

import os

import pytest

# Set before any test module imports transformers / datasets / huggingface_hub (they read these
# at import time); the fixture below keeps them set for every test.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Nothing in these tests may download: the hub is switched off."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")


@pytest.fixture(scope="session")
def tokenizer():
    from rlcore.loops.models import build_tokenizer
    return build_tokenizer()


@pytest.fixture(scope="session")
def small_tokenizer():
    """Characters 'a' and 'b' only (9 tokens): a random model emits EOS often."""
    from rlcore.loops.models import build_tokenizer
    return build_tokenizer(vocab="ab")


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def lm(request, tokenizer):
    """A tiny causal LM of each architecture (do not modify it in a test)."""
    from rlcore.loops.models import build_model
    return build_model(request.param, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4).eval()
