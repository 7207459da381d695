"""``ddp_core.runtime``: the helper a user's own training script imports in script mode (its public name).

Everything is ``ddp_core.script.runtime``, whose ``__all__`` this re-exports; importing this installs the
warning-signal handlers, as that does.
"""

from ddp_core.script import runtime as implementation
from ddp_core.script.runtime import *  # noqa: F403 (its __all__)

__all__ = implementation.__all__
