"""A `"slackswap"` section is honoured however the job is launched: `deepspeed.initialize` is
watched from the moment DeepSpeed is imported.

The package installs `slackswap_ds-autoroute.pth` into site-packages (setup.py), which Python runs
at start-up. It loads this file by its path (not the package: numpy and the rest wait until a
config with a section arrives) and calls `install_hook()`, which puts a finder on `sys.meta_path`
that waits for `import deepspeed` and, once DeepSpeed's module has run, binds
`deepspeed.initialize` to a thin guard (`_guard`). The guard looks at the config it is given:
without a `"slackswap"` section it is DeepSpeed's own `initialize`, untouched; with one, it routes
DeepSpeed through SlackSwap (`ss.install()`, as `python -m slackswap_ds.run` does) and calls
SlackSwap's `initialize`. So a plain `deepspeed train.py --deepspeed_config slackswap.json`, the HF
`Trainer`, Accelerate and Lightning (which look `deepspeed.initialize` up when they build the
engine) all get their plan.

`SLACKSWAP_AUTOROUTE=0` opts out: the section is then not acted on, and the guard says so (a
warning from rank 0), so that a job with a section never trains without SlackSwap unannounced.

Everything here runs in every Python process of the environment, so it imports nothing but the
standard library until a config with a section reaches `deepspeed.initialize`, and never raises.
"""

from __future__ import annotations

import os
import sys
import threading

SECTION = "slackswap"
ENV = "SLACKSWAP_AUTOROUTE"
# the attributes that mark the guard and SlackSwap's own initialize (deepspeed_api.py has them too: this
# file imports nothing of the package at start-up; tests/test_autoroute.py holds the copies equal)
GUARD_MARK = "__slackswap_autoroute__"
INITIALIZE_MARK = "__slackswap_initialize__"
_OFF = ("0", "false", "off", "no")
_LOCK = threading.Lock()
_warned = False


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def install_hook() -> None:
    """Bind the guard now if DeepSpeed is imported, else when it is (called by the .pth file)."""
    try:
        module = sys.modules.get("deepspeed")
        if module is not None:
            _bind(module)
        elif not any(isinstance(f, _WaitForDeepSpeed) for f in sys.meta_path):
            sys.meta_path.insert(0, _WaitForDeepSpeed())
    except Exception:  # noqa: BLE001 - never break a Python start-up over this
        pass


class _WaitForDeepSpeed:  # a meta path finder (the protocol needs no base class)
    """Finds nothing itself: when `deepspeed` is imported, it wraps the real loader so that the guard
    is bound as soon as DeepSpeed's module has run, before the importer gets the module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        import importlib.machinery

        # (stays on meta_path until DeepSpeed's module has run: `importlib.util.find_spec("deepspeed")`,
        # how transformers and accelerate ask whether it is installed, comes here too, and loads nothing)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        for finder in sys.meta_path:  # an editable install's finder, say
            if spec is not None:
                break
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None and finder is not self else None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _BindAfter(spec.loader)
        return spec


class _BindAfter:  # a loader
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WaitForDeepSpeed)]
            _bind(module)
        except Exception:  # noqa: BLE001 - DeepSpeed stays as it is
            pass

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, name)


def _bind(deepspeed) -> None:
    with _LOCK:
        current = getattr(deepspeed, "initialize", None)
        if current is None or getattr(current, GUARD_MARK, False) or getattr(current, INITIALIZE_MARK, False):
            return  # guarded already, or SlackSwap's is bound (ss.install() before the import)
        deepspeed.initialize = _guard(current)


def _guard(original):
    import functools

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if not _has_section(args, kwargs):
            return original(*args, **kwargs)
        if not enabled():
            _say_off()
            return original(*args, **kwargs)
        from . import routing
        from .engine import initialize as slackswap_initialize

        routing.install()  # deepspeed.initialize is SlackSwap's from now on, checkpointing routed too
        out = slackswap_initialize(*args, **kwargs)
        _say_routed()  # (after: SlackSwap's logging is set up by then)
        return out

    setattr(initialize, GUARD_MARK, True)
    return initialize


def _has_section(args: tuple, kwargs: dict) -> bool:
    """Whether the config given to `deepspeed.initialize(args=None, ..., config=None,
    config_params=None)` has a "slackswap" section (a dict, or the path of a JSON file)."""
    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    if config is None:
        namespace = kwargs.get("args", args[0] if args else None)
        config = getattr(namespace, "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)):
        import json

        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return False  # not ours to judge: DeepSpeed says what is wrong with it
    return isinstance(config, dict) and SECTION in config


def _say_routed() -> None:
    from .logs import log

    log.info("slackswap: the DeepSpeed config has a \"slackswap\" section: deepspeed.initialize ran through "
             "SlackSwap (%s=0 turns this off)", ENV)


def _say_off() -> None:
    global _warned
    if not _warned and os.environ.get("RANK", "0") == "0":  # once per job: rank 0's process
        _warned = True
        print(f"slackswap: WARNING: the DeepSpeed config has a \"slackswap\" section, but {ENV}="
              f"{os.environ.get(ENV)} turned SlackSwap's routing off: this job trains as plain DeepSpeed "
              f"(unset {ENV}, or launch with `python -m slackswap_ds.run`, to have the section acted on)",
              file=sys.stderr, flush=True)
