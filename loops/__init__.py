"""rlcore.loops: collect, score, update and the fold; the only code that touches models and data."""

__all__: list[str] = []
