"""What SlackSwap can run beside, declared in one place: refusals that name both switches, and
options ignored where they are not supported yet (said once).

    check_compile_section   DeepCompile's `offload_activation` and SlackSwap both place the saved
                            activations: never both (ConfigError)
    take_compiled_model     the engine's model in SlackSwap's compile layout (each block compiled on
                            its own); DeepCompile and compiled autograd refused by name
    for_pipeline            the config as per-stage plans run it: plan files, Chrome traces and input
                            padding are not supported under pipeline parallelism yet (said once; the
                            plan file is not read or written)
"""

from __future__ import annotations

from .config import ConfigError, SlackSwapConfig
from .deepspeed_api import compiled_autograd_enabled, deepcompile_active
from .logs import job_rank, log, said_once_per_job
from .runtime.compiled import CompiledCodeError, check_model

PIPELINE_UNSUPPORTED = (("plan_file", "plan files"), ("trace_file", "Chrome traces"),
                        ("pad_to_multiple", "input padding (pipeline inputs come from its data iterator)"))


def check_compile_section(ds_config: dict) -> None:
    """DeepCompile's `offload_activation` and SlackSwap both decide where saved activations live:
    never both at once (ConfigError naming the two switches)."""
    compile_section = ds_config.get("compile")
    if isinstance(compile_section, dict) and compile_section.get("deepcompile") and \
            compile_section.get("offload_activation"):
        raise ConfigError(['"compile": {"deepcompile": true, "offload_activation": true} and an enabled "slackswap" '
                           'section both place the saved activations. Choose one: "offload_activation": false (the '
                           'plan decides), or "slackswap": {"enabled": false} (DeepCompile decides)'])


def take_compiled_model(engine) -> frozenset[str]:
    """The engine's model in SlackSwap's compile layout (runtime/compile_layout.py: each block compiled
    on its own, said in the log if that changed anything), at initialize, again at the first step
    (engine.compile() may come in between) and whenever its compilation changes later; returns its
    compiled parts then. What it cannot take stops the job, said once."""
    try:
        if deepcompile_active(engine):
            raise CompiledCodeError('DeepCompile ("compile": {"deepcompile": true} and engine.compile()) compiles the '
                                    'whole model through its own graph passes, and SlackSwap carries its plans out '
                                    'per compiled block: use one of them. Without "deepcompile", engine.compile() '
                                    'works with SlackSwap (each block compiled on its own)')
        if compiled_autograd_enabled(engine):
            raise CompiledCodeError("engine.compile(compiled_autograd_enabled=True) compiles backward, where SlackSwap "
                                    "brings saved tensors back and runs blocks again: leave compiled autograd off "
                                    "under SlackSwap")
        return check_model(engine.module)
    except CompiledCodeError as e:
        raise said_once_per_job(e) from None


def for_pipeline(cfg: SlackSwapConfig) -> SlackSwapConfig:
    """`cfg` as per-stage plans run it: what they do not support yet (PIPELINE_UNSUPPORTED) said once
    for the job if it was set, and no plan file (traces are recorded by the engine's lifecycle only,
    and inputs come from the pipeline's data iterator, unpadded)."""
    unsupported = {name: what for name, what in PIPELINE_UNSUPPORTED if getattr(cfg, name)}
    if job_rank() == 0:  # one line per job: every rank has the same config
        for name, what in unsupported.items():
            log.warning("slackswap: %s is ignored under pipeline parallelism (%s are not supported with per-stage "
                        "plans yet)", name, what)
    return cfg.model_copy(update={"plan_file": None})


__all__ = ["PIPELINE_UNSUPPORTED", "check_compile_section", "for_pipeline", "take_compiled_model"]
