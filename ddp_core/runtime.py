"""``ddp_core.runtime``: public API, the helper a user's own training script imports in script mode
(``from ddp_core import runtime``; docs/script-mode.md, examples/charlm_script.py).

This is the name users import and the one that stays: its functions are ``ddp_core.script.runtime``'s ``__all__``,
re-exported here, and that module is internal (it may move). Importing this installs the warning-signal handlers,
as that does. Nothing inside ddp_core imports it (the import contracts' top layer, in ``pyproject.toml``).
"""

from ddp_core.script import runtime as implementation
from ddp_core.script.runtime import *  # noqa: F403 (its __all__)

__all__ = implementation.__all__
