"""Route DeepSpeed's entry points through SlackSwap: `ss.install()` / `ss.uninstall()`.

After `install()`, code that never heard of SlackSwap gets it from its DeepSpeed JSON alone:

* `deepspeed.initialize` becomes `slackswap_ds.engine.initialize`, which reads the config's
  `"slackswap"` section and calls DeepSpeed's own `initialize` (the original, kept by
  deepspeed_api.py, so there is no recursion however often `install()` runs). Hugging Face's
  `Trainer`, Accelerate and PyTorch Lightning look `deepspeed.initialize` up when they prepare the
  engine, so they are routed too, as long as `install()` runs before that (`python -m
  slackswap_ds.run` does it first thing).
* `deepspeed.checkpointing.*` goes through `slackswap_ds.checkpointing` (see its `install`).

`install()` is idempotent; `uninstall()` puts back exactly the objects that were there.
"""

from __future__ import annotations

import threading

from .deepspeed_api import initialize_is_routed, route_initialize, unroute_initialize

_LOCK = threading.RLock()


def is_installed() -> bool:
    return initialize_is_routed()


def install() -> bool:
    """Route `deepspeed.initialize` and `deepspeed.checkpointing` through SlackSwap. Returns True if
    it changed anything."""
    from . import checkpointing
    from .engine import initialize

    with _LOCK:
        changed = checkpointing.install()
        return route_initialize(initialize) or changed


def uninstall() -> bool:
    """Undo `install()`. Returns True if something was installed."""
    from . import checkpointing

    with _LOCK:
        changed = checkpointing.uninstall()
        return unroute_initialize() or changed
