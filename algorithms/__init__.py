"""rlcore.algorithms: one module of pure losses per family."""

__all__: list[str] = []
