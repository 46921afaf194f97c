"""The start-up hook (slackswap_ds/autoroute.py): installed with the package, it binds a guard to
`deepspeed.initialize` when DeepSpeed is imported; the guard routes a config with a "slackswap"
section through SlackSwap, leaves every other config to DeepSpeed, and with SLACKSWAP_AUTOROUTE=0
says that the section is not acted on. (A plain `deepspeed script.py` launch planned through it:
tests/test_run.py, `plain-deepspeed-launch`; the hook's contract in every process, configs in pipes,
hjson and base64, what runs at start-up and what it costs: tests/test_startup_hook.py.)"""

import argparse
import base64
import json
import subprocess
import sys

import pytest

from jobs import ROOT, checkout_autoroute, cpu_env

autoroute = checkout_autoroute()  # (this checkout's, whichever the environment's .pth loaded)

SECTION = {"train_micro_batch_size_per_gpu": 1, "slackswap": {"activation_budget": 0.5}}


def test_this_environment_has_the_hook_and_deepspeed_gets_the_guard_at_import():
    """setup.py put slackswap_ds-autoroute.pth in site-packages (the suite runs on an editable
    install, as the README's commands make it); a fresh interpreter's `import deepspeed`, after
    `importlib.util.find_spec("deepspeed")` (how transformers asks whether it is installed: the hook
    waited for that and missed the import), finds its `initialize` guarded, DeepSpeed's own behind it, and imports none of SlackSwap's modules but
    the hook (not even the package) until a config with a section arrives."""
    code = ("import sys, json, importlib.util; importlib.util.find_spec('deepspeed'); "  # (as transformers asks)
            "import deepspeed; f = deepspeed.initialize; "
            "print(json.dumps([getattr(f, '__slackswap_autoroute__', False), f.__wrapped__.__module__, "
            "sorted(m for m in sys.modules if m.startswith('slackswap_ds'))]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    guarded, module, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert guarded and module == "deepspeed" and loaded == ["slackswap_ds.autoroute"]


def deepspeeds(calls: list):
    """A stand-in for DeepSpeed's own initialize, with its signature (0.19.8): it records its calls."""

    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
                   config=None, mesh_param=None, config_params=None):
        calls.append((args, model, config, config_params))
        return "deepspeed's"

    return initialize


@pytest.mark.parametrize("call, expected", [
    (((), {"config": SECTION}), True),
    (((), {"config_params": SECTION}), True),
    (((), {"config": None, "config_params": SECTION}), True),
    (((argparse.Namespace(deepspeed_config="FILE"),), {}), True),
    (((), {"args": argparse.Namespace(deepspeed_config="FILE")}), True),
    (((argparse.Namespace(deepspeed_config=None, deepscale_config="FILE"),), {}), True),
    (((None, "model", None, None, None, None, 29500, None, None, None, SECTION), {}), True),
    (((), {"config": "BASE64"}), True),
    (((), {"config": "HJSON"}), True),
    (((), {"config": {"train_micro_batch_size_per_gpu": 1}}), False),
    (((), {"config": "/nonexistent/ds.json"}), False),  # DeepSpeed says what is wrong with it
    (((None,), {}), False),
], ids=["config", "config_params", "config-None", "args", "args-keyword", "deepscale_config", "positional",
        "base64", "hjson", "no-section", "unreadable", "nothing"])
def test_the_guard_finds_the_section_wherever_deepspeed_takes_its_config(tmp_path, monkeypatch, capsys, call,
                                                                          expected):
    """Opted out (SLACKSWAP_AUTOROUTE=0), the guard says when it found a section, and hands DeepSpeed's
    own initialize the call as it was made (a file DeepSpeed can read again, a dict, base64 text)."""
    (tmp_path / "ds.json").write_text(json.dumps(SECTION))
    (tmp_path / "ds.hjson").write_text('{"train_micro_batch_size_per_gpu": 1, // hjson\n "slackswap": {},}')
    real = {"FILE": str(tmp_path / "ds.json"), "HJSON": str(tmp_path / "ds.hjson"),
            "BASE64": base64.urlsafe_b64encode(json.dumps(SECTION).encode()).decode()}

    def filled(value):
        if isinstance(value, argparse.Namespace):
            return argparse.Namespace(**{k: real.get(v, v) for k, v in vars(value).items()})
        return real.get(value, value) if isinstance(value, str) else value

    args, kwargs = tuple(filled(a) for a in call[0]), {k: filled(v) for k, v in call[1].items()}
    monkeypatch.setenv(autoroute.ENV, "0")
    monkeypatch.setattr(autoroute, "_said", set())
    calls = []
    guard = autoroute._guard(deepspeeds(calls))
    assert guard(*args, **kwargs) == "deepspeed's"
    assert ("a \"slackswap\" section, but SLACKSWAP_AUTOROUTE=0" in capsys.readouterr().err) is expected
    untouched = []
    deepspeeds(untouched)(*args, **kwargs)
    assert calls == untouched


def test_without_a_section_the_guard_is_deepspeeds_own_and_opted_out_it_says_so(monkeypatch, capsys):
    calls = []
    own = deepspeeds(calls)
    guard = autoroute._guard(own)
    assert guard.__wrapped__ is own and getattr(guard, autoroute.GUARD_MARK)
    assert guard(config={"train_micro_batch_size_per_gpu": 1}) == "deepspeed's"
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(autoroute.ENV, "0")
    monkeypatch.setattr(autoroute, "_said", set())
    assert guard(config=SECTION) == guard(config=SECTION) == "deepspeed's" and len(calls) == 3
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "SLACKSWAP_AUTOROUTE=0" in err and "trains as plain DeepSpeed" in err


def test_binding_is_idempotent_and_routing_puts_the_guard_back():
    """The guard is bound once; `ss.install()` replaces it with SlackSwap's `initialize` (keeping
    DeepSpeed's own as the original) and `ss.uninstall()` puts the guard back, not DeepSpeed's own."""
    import deepspeed

    import slackswap_ds as ss
    from slackswap_ds.deepspeed_api import original_initialize

    bound = deepspeed.initialize
    autoroute.install_hook()  # deepspeed is imported: binds now, or finds it bound
    guard = deepspeed.initialize
    assert getattr(guard, autoroute.GUARD_MARK) and (guard is bound or bound is guard.__wrapped__)
    autoroute.install_hook()
    assert deepspeed.initialize is guard
    try:
        assert ss.install() and deepspeed.initialize is ss.initialize
        assert original_initialize() is guard.__wrapped__
    finally:
        ss.uninstall()
    assert deepspeed.initialize is guard


def test_the_marks_autoroute_writes_are_the_ones_deepspeed_api_reads():
    """autoroute.py imports nothing of the package at start-up, so it writes the two marks itself."""
    from slackswap_ds import deepspeed_api

    assert (autoroute.GUARD_MARK, autoroute.INITIALIZE_MARK) == (deepspeed_api.GUARD_MARK, deepspeed_api.INITIALIZE_MARK)
