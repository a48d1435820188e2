"""Suite-wide settings: nothing downloads, no progress bars, a few threads per worker."""

import os

# Read by huggingface_hub / transformers / datasets at import time: set before any test imports them.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS",
             "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_var, "false" if _var == "TOKENIZERS_PARALLELISM" else "1")
