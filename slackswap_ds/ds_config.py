"""A DeepSpeed config read as DeepSpeed reads it, once: the one reader of DeepSpeed configs, used by
the start-up hook's section check (autoroute.py, which loads this file by its path: it imports
nothing of the package), `engine.initialize`, `deepspeed_api.initialize_without_section` and
`config.load_config`.

DeepSpeed's `initialize` takes its config from `config=`, `config_params=` (its old name),
`args.deepspeed_config` or `args.deepscale_config` (its deprecated alias, still accepted), in that
order (`config_given`): a dict, the path of a file, or base64-encoded text. A file and base64 text
are hjson to it, JSON with comments and trailing commas allowed, and a file's duplicate keys are
refused (`load_ds_config` in deepspeed/runtime/tensor_parallel/init_utils.py, 0.19.8). `read_config`
reads them the same way, with the same parser, reading a file's text once: a pipe
(`--deepspeed_config <(cat ds.json)`, /dev/stdin) can be read only once, so DeepSpeed must then be
handed the dict that was read (`ReadConfig.again` says whether DeepSpeed could read the given config
again itself).

One text, two views (`ReadConfig`): `config`, what DeepSpeed reads and is handed (hjson makes an
integral number written with a fraction or an exponent, 2.0 or 8e9, an integer); `ours`, what
SlackSwap's section is validated from: where the text is JSON, the dict JSON reads (8e9 a float), as
the HF Trainer and Accelerate, which read the file with `json`, hand it over; else DeepSpeed's.

Standard library only; hjson (DeepSpeed's dependency) is imported when a text is parsed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterator

# where `args` carries a config, in the order DeepSpeed looks (`--deepscale_config`: its deprecated alias)
CONFIG_ARGS = ("deepspeed_config", "deepscale_config")


class UnreadableConfig(ValueError):
    """A config DeepSpeed could not read either: `problem` (one line: what, and the fix), `source`
    (the file, or None), `again` (False: a pipe or device whose text was taken, which DeepSpeed can
    no longer read)."""

    def __init__(self, problem: str, source: str | None = None, again: bool = True):
        super().__init__(problem)
        self.problem, self.source, self.again = problem, source, again


class ReadConfig:
    """A DeepSpeed config as read: `config` (the dict DeepSpeed reads), `ours` (the dict SlackSwap
    validates its section from), `source` (the file it came from, or None), `again` (whether
    DeepSpeed could read what was given once more: False for a pipe or a device)."""

    __slots__ = ("config", "ours", "source", "again")

    def __init__(self, config: dict, ours: dict | None = None, source: str | None = None, again: bool = True):
        self.config, self.ours, self.source, self.again = config, config if ours is None else ours, source, again

    def __repr__(self) -> str:
        return f"ReadConfig(source={self.source!r}, again={self.again}, keys={list(self.config)})"


def config_given(args, config=None, config_params=None):
    """The config a `deepspeed.initialize(args, ..., config=, config_params=)` call gives, where
    DeepSpeed looks for it (a dict, a path, base64 text, a ReadConfig), or None."""
    if config is not None:
        return config
    if config_params is not None:
        return config_params
    for name in CONFIG_ARGS:
        value = getattr(args, name, None) if args is not None else None
        if value is not None:
            return value
    return None


def read_config(given) -> ReadConfig:
    """`given` (a dict, the path of a file, base64 text, or a ReadConfig, returned as it is) read
    once, as DeepSpeed reads it; UnreadableConfig if DeepSpeed could not read it either."""
    if isinstance(given, ReadConfig):
        return given
    if isinstance(given, dict):
        return ReadConfig(given)
    if isinstance(given, os.PathLike):
        given = os.fspath(given)
    if not isinstance(given, str):
        raise UnreadableConfig(f"the DeepSpeed config: found {_shown(given)}; expected a JSON object (a dict), the "
                               "path of a config file, or base64-encoded JSON. Fix: pass a dict or the path of a "
                               "DeepSpeed JSON config file")
    if os.path.exists(given):
        return _read_file(given)
    try:  # DeepSpeed's own order: a path that exists, else base64 text
        import base64

        text = base64.urlsafe_b64decode(given).decode("utf-8")
    except (UnicodeDecodeError, ValueError):
        text = None
    read = _parsed(text, None, True, from_base64=True) if text is not None else None
    if read is None:
        raise UnreadableConfig(f"{given}: file not found (nor base64-encoded JSON). Fix: give the path of a "
                               "DeepSpeed JSON config", given)
    return read


def _read_file(path: str) -> ReadConfig:
    again = True
    try:
        mode = os.stat(path).st_mode
        again = not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode))
        with open(path) as f:  # (DeepSpeed opens it so too: the locale's encoding)
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UnreadableConfig(f"{path}: cannot read the file ({e}). Fix: give a readable DeepSpeed JSON config",
                               path, again or isinstance(e, OSError)) from None
    return _parsed(text, path, again)


def _parsed(text: str, path: str | None, again: bool, from_base64: bool = False) -> ReadConfig | None:
    """The text as DeepSpeed parses it: hjson, a file's duplicate keys refused; base64 text
    (`from_base64`) without that refusal, and None where it is not a JSON object (DeepSpeed then
    says that the config is neither a file nor base64)."""
    import hjson

    try:
        config = hjson.loads(text) if from_base64 else hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except hjson.HjsonDecodeError as e:
        if from_base64:
            return None
        raise UnreadableConfig(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}). Fix: correct "
                               "it (DeepSpeed reads JSON with comments and trailing commas too)", path, again) from None
    except (ValueError, RecursionError) as e:  # a duplicate key, a 100k-digit number, arrays nested 100k deep
        if from_base64:
            return None
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise UnreadableConfig(f"{path}: not a config DeepSpeed can read ({why})", path, again) from None
    if not isinstance(config, dict):
        if from_base64:
            return None
        raise UnreadableConfig(f"{path}: found {_shown(config)}; expected a JSON object. Fix: write the DeepSpeed "
                               'config as an object: {"train_micro_batch_size_per_gpu": 1, ...}', path, again)
    return ReadConfig(config, _as_json(text, config), path, again)


def _no_duplicate_keys(pairs: list) -> dict:
    """DeepSpeed's `dict_raise_error_on_duplicate_keys` (deepspeed/runtime/config_utils.py), the same
    refusal, without importing DeepSpeed (and torch) into `config.load_config`."""
    config = dict(pairs)
    if len(config) != len(pairs):
        keys = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
        raise ValueError(f"Duplicate keys in DeepSpeed config: {keys}")
    return config


def _as_json(text: str, config: dict) -> dict:
    """The text as JSON reads it where it is JSON (numbers keep their JSON types), else `config`."""
    import json

    try:
        ours = json.loads(text)
    except (ValueError, RecursionError):
        return config
    return ours if isinstance(ours, dict) else config


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:57]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


@contextlib.contextmanager
def config_out_of(args) -> Iterator:
    """`args` without its config attributes while DeepSpeed's `initialize` runs (it refuses a config
    both in `args` and in the call; the config then goes in the call), put back afterwards: the
    caller's object stays what it was, and DeepSpeed still sets `args.local_rank` on it."""
    saved = {name: getattr(args, name) for name in CONFIG_ARGS if getattr(args, name, None) is not None} \
        if args is not None else {}
    for name in saved:
        setattr(args, name, None)
    try:
        yield args
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


__all__ = ["CONFIG_ARGS", "ReadConfig", "UnreadableConfig", "config_given", "config_out_of", "read_config"]
