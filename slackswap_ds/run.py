"""Run a training script with SlackSwap installed, without changing a line of it.

    python -m slackswap_ds.run train.py --deepspeed_config slackswap.json [script args]
    python -m slackswap_ds.run -m my_package.train [module args]

`ss.install()` runs first (DeepSpeed's `initialize` and `checkpointing` routed through SlackSwap;
see routing.py), after the start-up hook's `install_hook()` (autoroute.py: Accelerate then leaves the
section's "auto" values to SlackSwap) for a Python that did not run the hook (`python -S`, `pip
install --target`); then the script runs as ``__main__``, exactly as ``python train.py`` would run it
(its own directory first on sys.path, sys.argv as it expects). The `"slackswap"` section of the
DeepSpeed config it hands to `deepspeed.initialize` (directly, or through Hugging Face's Trainer,
Accelerate or PyTorch Lightning) decides the rest. Every launcher can start it:

    deepspeed --num_gpus 8 --module slackswap_ds.run train.py --deepspeed_config slackswap.json
    torchrun --nproc_per_node 8 -m slackswap_ds.run train.py --deepspeed_config slackswap.json
    accelerate launch -m slackswap_ds.run train.py ...
    mpirun -n 8 python -m slackswap_ds.run train.py ...

DeepSpeed's launcher puts ``--local_rank=N`` before the script's name when it starts a module; it is
handed on to the script where a script started directly would get it (first).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m slackswap_ds.run [--local_rank=N] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []  # launcher arguments that come before the script (DeepSpeed's --local_rank)
    while argv and argv[0].startswith("--local_rank"):
        passed.append(argv.pop(0))
        if passed[-1] == "--local_rank" and argv:
            passed.append(argv.pop(0))
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        raise SystemExit(0)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(_usage_error("give a script or -m module to run"))
    from .autoroute import install_hook
    from .routing import install

    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        if not _module_exists(module):
            raise SystemExit(_usage_error(f"no module named {module!r} (is it installed, or on PYTHONPATH?)"))
        install_hook()
        install()
        sys.argv = [module] + passed + rest
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = argv[0], argv[1:]
    if not os.path.exists(script):
        raise SystemExit(_usage_error(f"no such script {script!r}"))
    if os.path.isdir(script) and not os.path.exists(os.path.join(script, "__main__.py")):
        raise SystemExit(_usage_error(f"{script!r} is a folder without a __main__.py to run"))
    install_hook()
    install()
    sys.argv = [script] + passed + rest
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _usage_error(what: str) -> int:
    """Say what is wrong and how to call this (stderr); the exit status of a usage error."""
    print(f"slackswap_ds.run: error: {what}\n{USAGE}", file=sys.stderr)
    return 2


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return False


if __name__ == "__main__":
    main()
