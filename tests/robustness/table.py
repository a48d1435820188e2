"""The fuzz table: every public name of ``rlcore`` and ``rlcore.algorithms`` is fuzzed or exempt."""

from tests.robustness import entries_algorithms, entries_rlcore

FUZZ = {**entries_rlcore.FUZZ, **entries_algorithms.FUZZ}
EXEMPT = {**entries_rlcore.EXEMPT, **entries_algorithms.EXEMPT}
EXEMPT_MODULES = {**entries_rlcore.EXEMPT_MODULES, **entries_algorithms.EXEMPT_MODULES}
