"""Silence, by their exact text, the log records of third-party packages that say nothing to a user
of rlcore; imported first by ``rlcore.loops``. Every other record passes."""

import logging


class Unsaid(logging.Filter):
    """Drop log records whose message contains one of ``texts``."""

    def __init__(self, *texts: str):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


# transformers.utils.import_utils logs it once per class (``CLIPImageProcessor``, ``SiglipImageProcessor``,
# named by diffusers' Stable Diffusion pipeline on import) through its own logger; the filter sits on that
# logger only.
logging.getLogger("transformers.utils.import_utils").addFilter(
    Unsaid("requires torchvision (not installed); falling back to"))
