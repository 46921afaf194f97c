"""Route DeepSpeed's entry points through SlackSwap: `ss.install()` / `ss.uninstall()`.

After `install()`, code that never heard of SlackSwap gets it from its DeepSpeed JSON alone:

* `deepspeed.initialize` becomes `slackswap_ds.engine.initialize`, which reads the config's
  `"slackswap"` section and calls DeepSpeed's own `initialize` (the original, captured here, so
  there is no recursion however often `install()` runs). Hugging Face's `Trainer`, Accelerate and
  PyTorch Lightning look `deepspeed.initialize` up when they prepare the engine, so they are routed
  too, as long as `install()` runs before that (`python -m slackswap_ds.run` does it first thing).
* `deepspeed.checkpointing.*` goes through `slackswap_ds.checkpointing` (see its `install`).

`install()` is idempotent; `uninstall()` puts back exactly the objects that were there.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

_LOCK = threading.RLock()
_ORIGINAL: Callable | None = None  # DeepSpeed's own initialize while installed
_SEEN: Callable | None = None  # DeepSpeed's own initialize, as last seen unpatched
MARK = "__slackswap_initialize__"  # set on slackswap_ds.engine.initialize


def is_installed() -> bool:
    return _ORIGINAL is not None


def remember_original() -> None:
    """Keep DeepSpeed's `initialize` if it is imported and not yet rebound (the engine module calls
    this when it is imported: evaluating ``ss.initialize`` in ``deepspeed.initialize =
    ss.initialize`` imports it before the assignment happens)."""
    global _SEEN
    module = sys.modules.get("deepspeed")
    current = getattr(module, "initialize", None)
    if current is not None and not getattr(current, MARK, False):
        _SEEN = current


def original_initialize() -> Callable:
    """DeepSpeed's own `initialize`, whatever `deepspeed.initialize` is bound to now (a binding to
    SlackSwap's made by hand instead of `install()` included)."""
    import deepspeed  # noqa: F401

    remember_original()
    found = _ORIGINAL or _SEEN
    if found is None:
        raise RuntimeError("deepspeed.initialize was rebound to slackswap_ds.initialize before SlackSwap could "
                           "keep DeepSpeed's own function; use ss.install() instead of assigning it by hand")
    return found


def install() -> bool:
    """Route `deepspeed.initialize` and `deepspeed.checkpointing` through SlackSwap. Returns True if
    it changed anything."""
    global _ORIGINAL
    import deepspeed

    from . import checkpointing
    from .engine import initialize

    with _LOCK:
        changed = checkpointing.install()
        if _ORIGINAL is None:
            _ORIGINAL = original_initialize()
            deepspeed.initialize = initialize
            changed = True
        return changed


def uninstall() -> bool:
    """Undo `install()`. Returns True if something was installed."""
    global _ORIGINAL
    import deepspeed

    from . import checkpointing

    with _LOCK:
        changed = checkpointing.uninstall()
        if _ORIGINAL is not None:
            deepspeed.initialize, _ORIGINAL = _ORIGINAL, None
            changed = True
        return changed
