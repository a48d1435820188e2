"""rlcore.loops: collect, score, update and the fold; the only code that touches models and data."""

from rlcore.loops.checkpoint import *  # noqa: F401,F403
from rlcore.loops.checkpoint import __all__ as _checkpoint_all
from rlcore.loops.fold import *  # noqa: F401,F403
from rlcore.loops.fold import __all__ as _fold_all
from rlcore.loops.logging import *  # noqa: F401,F403
from rlcore.loops.logging import __all__ as _logging_all
from rlcore.loops.state import *  # noqa: F401,F403
from rlcore.loops.state import __all__ as _state_all
from rlcore.loops.update import *  # noqa: F401,F403
from rlcore.loops.update import __all__ as _update_all

__all__ = [*_checkpoint_all, *_fold_all, *_logging_all, *_state_all, *_update_all]
