"""mkdocs hook: the API reference reads the package as it is installed, ``rlcore`` with
``rlcore.algorithms`` and ``rlcore.loops`` inside it, while the sources live in three top-level
folders (``pyproject.toml``'s ``package-dir``). Before the build, ``build/api-src/rlcore`` is laid
out with links to them, and mkdocstrings reads from there."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LAYOUT = ROOT / "build" / "api-src" / "rlcore"


def on_startup(**kwargs) -> None:
    shutil.rmtree(LAYOUT.parent, ignore_errors=True)
    LAYOUT.mkdir(parents=True)
    for source in (ROOT / "rlcore").glob("*.py"):
        (LAYOUT / source.name).symlink_to(source)
    for name in ("algorithms", "loops"):
        (LAYOUT / name).symlink_to(ROOT / name, target_is_directory=True)
