"""Suite-wide settings: nothing downloads, no progress bars, a few threads per worker."""

import os

# Read by huggingface_hub / transformers / datasets at import time: set before any test imports them.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS",
             "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "false" if _var == "TOKENIZERS_PARALLELISM" else "1")

import torch  # noqa: E402

# Tests run as two xdist workers on small tensors: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where no CUDA device is visible (``make test-gpu`` runs them)."""
    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
