"""A `"slackswap"` section is honoured however the job is launched: `deepspeed.initialize` is
watched from the moment DeepSpeed is imported.

The package installs `slackswap_ds-autoroute.pth` into site-packages (setup.py), which Python runs
at start-up in every process of the environment. It loads this file, the installed package's (never a
`slackswap_ds/` folder found on PYTHONPATH or in the working directory), by its path (not the package:
numpy and the rest wait until a config with a section arrives) and calls `install_hook()`, which puts a
finder on `sys.meta_path` that waits for two imports:

* `deepspeed`: once its module has run, `deepspeed.initialize` is bound to a thin guard (`_guard`).
  The guard reads the config it is given once, as DeepSpeed reads it (ds_config.py: a dict, an hjson
  file, a pipe such as `<(cat ds.json)` or /dev/stdin, base64 text, `args.deepspeed_config` or
  `args.deepscale_config`). Without a `"slackswap"` section it is DeepSpeed's own `initialize`,
  untouched (a pipe's text, which DeepSpeed can no longer read, is handed to it as the dict that was
  read); with one, it routes DeepSpeed through SlackSwap (`ss.install()`, as `python -m
  slackswap_ds.run` does) and calls SlackSwap's `initialize` with the config read. So a plain
  `deepspeed train.py --deepspeed_config slackswap.json`, the HF `Trainer`, Accelerate and Lightning
  (which look `deepspeed.initialize` up when they build the engine) all get their plan.
* `accelerate.utils.dataclasses`: Accelerate's DeepSpeed plugin fills every `"auto"` of the DeepSpeed
  config from its own arguments and raises for one it has no value for, so a section with `"auto"`
  (`activation_budget`, `hardware`, `sync`) would stop every Trainer and Accelerate job. Its
  `DeepSpeedPlugin.fill_match` is wrapped to leave the section's keys alone (`_leave_section_alone`):
  they are SlackSwap's to resolve, not Accelerate's placeholders. A config without a section has no
  such key: nothing changes for it.

`SLACKSWAP_AUTOROUTE` (`routing_on`): unset, or one of ON, routes a section; one of OFF does not (the
section is then not acted on, and the guard says so: a warning from rank 0, so that a job with a
section never trains without SlackSwap unannounced); any other value stops a job with a section at
`initialize`, naming the value and the choices, and leaves a job without one alone.

Everything here runs in every Python process of the environment, so at start-up it imports nothing
but the standard library's built-in modules (`_thread`; its cost: tests/test_startup_hook.py), and
nothing else until a config reaches `deepspeed.initialize` (then hjson, to read it, and the package
once the config has a section).
"""

import _thread
import os
import sys

SECTION = "slackswap"
ENV = "SLACKSWAP_AUTOROUTE"
ON = ("1", "true", "on", "yes")  # SLACKSWAP_AUTOROUTE's values (any case, spaces around ignored); unset: ON
OFF = ("0", "false", "off", "no")
# the attributes that mark the guard and SlackSwap's own initialize (deepspeed_api.py has them too: this
# file imports nothing of the package at start-up; tests/test_autoroute.py holds the copies equal)
GUARD_MARK = "__slackswap_autoroute__"
INITIALIZE_MARK = "__slackswap_initialize__"
ACCELERATE = "accelerate.utils.dataclasses"  # where Accelerate's DeepSpeedPlugin is defined
_LOCK = _thread.allocate_lock()
_said: set[str] = set()  # what this process has said once


def routing_on() -> bool:
    """Whether SLACKSWAP_AUTOROUTE lets the guard route a section: unset or ON, True; OFF, False;
    anything else (`disable`, `n`, `0x0`, an empty value) a ValueError that names it and the choices."""
    value = os.environ.get(ENV)
    word = "1" if value is None else value.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    raise ValueError(f"{ENV}={value!r} is not one of its values, and this job's DeepSpeed config has a \"{SECTION}\" "
                     f"section. Fix: unset {ENV} or set it to one of {', '.join(ON)} (the section routes "
                     f"deepspeed.initialize through SlackSwap), or to one of {', '.join(OFF)} (the job trains as plain "
                     "DeepSpeed, the section not acted on)")


def install_hook() -> None:
    """Bind the guard now if DeepSpeed is imported, else when it is, and leave the section out of
    Accelerate's "auto" filling likewise (called by the .pth file; idempotent)."""
    try:
        waiting = {}
        for name, then in (("deepspeed", _bind), (ACCELERATE, _leave_section_alone)):
            module = sys.modules.get(name)
            if module is not None:
                then(module)
            else:
                waiting[name] = then
        if waiting and not any(isinstance(f, _WaitFor) for f in sys.meta_path):
            sys.meta_path.insert(0, _WaitFor(waiting))
    except Exception:  # noqa: BLE001 - never break a Python start-up over this
        pass


class _WaitFor:  # a meta path finder (the protocol needs no base class)
    """Finds nothing itself: when a module it waits for is imported, it wraps the real loader so that
    `then(module)` runs as soon as the module has run, before the importer gets it; it leaves
    sys.meta_path once it waits for nothing."""

    def __init__(self, waiting: dict):
        self.waiting = waiting  # module name -> then(module)

    def find_spec(self, fullname, path=None, target=None):
        then = self.waiting.get(fullname)
        if then is None:
            return None
        import importlib.machinery

        # (a spec found here stays unused when `importlib.util.find_spec("deepspeed")`, how transformers
        # and accelerate ask whether it is installed, asks: the finder waits on)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        for finder in sys.meta_path:  # an editable install's finder, say
            if spec is not None:
                break
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None and finder is not self else None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenAfter(spec.loader, lambda module: self.done(fullname, then, module))
        return spec

    def done(self, name: str, then, module) -> None:
        self.waiting.pop(name, None)
        if not self.waiting:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        then(module)


class _ThenAfter:  # a loader
    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            if getattr(module, "__spec__", None) is not None:  # the module keeps its own loader
                module.__spec__.loader = self.loader
            module.__loader__ = self.loader
            self.then(module)
        except Exception:  # noqa: BLE001 - the module stays as it is
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
        import inspect

        try:
            call = inspect.signature(original).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return original(*args, **kwargs)  # not a call DeepSpeed takes: it says why
        reader = _reader()
        given = reader.config_given(*(call.arguments.get(k) for k in ("args", "config", "config_params")))
        if given is None:
            return original(*args, **kwargs)
        try:
            read = reader.read_config(given)
        except reader.UnreadableConfig as e:
            if not e.again:  # a pipe whose text was taken: DeepSpeed would read nothing now
                raise
            return original(*args, **kwargs)  # not ours to judge: DeepSpeed reads it and says what is wrong
        if SECTION not in read.config or not _routed_here():
            if read.again:
                return original(*args, **kwargs)
            call.arguments.update(config=read.config, config_params=None)
            with reader.config_out_of(call.arguments.get("args")):
                return original(*call.args, **call.kwargs)
        from . import routing
        from .engine import initialize as slackswap_initialize

        routing.install()  # deepspeed.initialize is SlackSwap's from now on, checkpointing routed too
        call.arguments.update(config=read, config_params=None)  # read once: SlackSwap's reads no file again
        out = slackswap_initialize(*call.args, **call.kwargs)
        _say_routed()  # (after: SlackSwap's logging is set up by then)
        return out

    setattr(initialize, GUARD_MARK, True)
    return initialize


def _routed_here() -> bool:
    """A config with a section: whether SLACKSWAP_AUTOROUTE lets the guard route it (said if not;
    an unknown value stops the job, said once by rank 0)."""
    try:
        on = routing_on()
    except ValueError as e:
        from .logs import said_once_per_job

        raise said_once_per_job(e) from None
    if not on:
        _say_once("off", f"slackswap: WARNING: the DeepSpeed config has a \"{SECTION}\" section, but {ENV}="
                  f"{os.environ.get(ENV)} turned SlackSwap's routing off: this job trains as plain DeepSpeed (unset "
                  f"{ENV}, or launch with `python -m slackswap_ds.run`, to have the section acted on)")
    return on


def _reader():
    """ds_config.py, the one reader of DeepSpeed configs: the package's if the package is imported,
    else loaded by its path beside this file (importing the package would import numpy and pydantic
    for every config, with a section or not)."""
    name = f"{__package__}.ds_config"
    if name not in sys.modules and __package__ in sys.modules:
        from . import ds_config  # noqa: F401
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "ds_config.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module


def _leave_section_alone(accelerate) -> None:
    """Accelerate's `DeepSpeedPlugin.fill_match(ds_key_long, ...)` fills an "auto" value of the
    DeepSpeed config from its own arguments, and raises for one it has none for; its
    `deepspeed_config_process` calls it for every key of the config. Keys of the "slackswap"
    section are left as they are: their "auto" is SlackSwap's (said once, by rank 0). Idempotent;
    other keys, and configs without a section, go to Accelerate's own method. (This method rather than
    `deepspeed_config_process`: it is what raises, and the dict Accelerate processes is never changed,
    not even for the length of a call.)"""
    plugin = getattr(accelerate, "DeepSpeedPlugin", None)
    fill_match = getattr(plugin, "fill_match", None)
    if fill_match is None or getattr(fill_match, GUARD_MARK, False):
        return
    import functools

    @functools.wraps(fill_match)
    def slackswap_fill_match(self, ds_key_long, *args, **kwargs):
        if not (isinstance(ds_key_long, str) and ds_key_long.split(".", 1)[0] == SECTION):
            return fill_match(self, ds_key_long, *args, **kwargs)
        if getattr(self, "get_value", lambda key: None)(ds_key_long) == "auto":
            _say_once("accelerate", f"slackswap: Accelerate's DeepSpeed plugin leaves the \"{SECTION}\" section's "
                      "\"auto\" values to SlackSwap (they are SlackSwap's, not placeholders for Accelerate to fill)")
        return None

    setattr(slackswap_fill_match, GUARD_MARK, True)
    plugin.fill_match = slackswap_fill_match


def _say_routed() -> None:
    from .logs import log

    log.info("slackswap: the DeepSpeed config has a \"slackswap\" section: deepspeed.initialize ran through "
             "SlackSwap (%s=0 turns this off)", ENV)


def _say_once(what: str, line: str) -> None:
    """`line` on stderr, once per process, from rank 0's process only (the logging of SlackSwap's
    package is not set up before its initialize)."""
    if what not in _said and os.environ.get("RANK", "0") == "0":
        _said.add(what)
        print(line, file=sys.stderr, flush=True)
