"""A plain DeepSpeed script that never imports SlackSwap: `deepspeed.initialize` on a tiny model, once
per case, each case a config given one way (tests/test_startup_hook.py).

    python configs_in_turn.py CASES.json [PIPE ...]

CASES.json is a list of [name, where, value, env]: `where` is how the config reaches
`deepspeed.initialize` (`deepspeed_config` or `deepscale_config`: in `args`, parsed by DeepSpeed's own
`add_config_arguments`; `config` or `config_params`: the call's argument); `value` is a dict, a path,
base64 text, or `"PIPE <i>"` (the i-th path given after CASES.json, a pipe such as `<(cat ds.json)`);
`env` is set in os.environ for that call only (SLACKSWAP_AUTOROUTE). Each case prints one JSON line:
`{"case": name, "routed": whether the engine has SlackSwap's lifecycle, "micro": the micro-batch size
DeepSpeed read, "section": whether DeepSpeed's config kept a "slackswap" key}` or `{"case": name,
"error": "<type>: <message>"}`. Before each case `deepspeed.initialize` is what it was when
DeepSpeed was imported (the start-up hook's guard), as in a job of one case. A first line says
which start-up hook this process loaded: `{"hook": its file, or null}`.
"""

import argparse
import json
import os
import sys

import deepspeed
import torch

GUARD = deepspeed.initialize


def main() -> None:
    cases, pipes = json.loads(open(sys.argv[1]).read()), sys.argv[2:]
    hook = sys.modules.get("slackswap_ds.autoroute")
    print(json.dumps({"hook": getattr(hook, "__file__", None)}), flush=True)
    for name, where, value, env in cases:
        if isinstance(value, str) and value.startswith("PIPE "):
            value = pipes[int(value.split()[1])]
        argv = [f"--{where}", value] if where in ("deepspeed_config", "deepscale_config") else []
        args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(argv)
        kwargs = {where: value} if where in ("config", "config_params") else {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        deepspeed.initialize = GUARD
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        try:
            engine, *_ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(), **kwargs)
            row = {"routed": hasattr(engine, "slackswap"), "micro": engine.train_micro_batch_size_per_gpu(),
                   "section": "slackswap" in engine.config}
        except Exception as e:  # noqa: BLE001 - the case's outcome
            row = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(json.dumps({"case": name, **row}), flush=True)


if __name__ == "__main__":
    main()
