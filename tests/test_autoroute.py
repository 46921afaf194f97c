"""The start-up hook (slackswap_ds/autoroute.py): installed with the package, it binds a guard to
`deepspeed.initialize` when DeepSpeed is imported; the guard routes a config with a "slackswap"
section through SlackSwap, leaves every other config to DeepSpeed, and with SLACKSWAP_AUTOROUTE=0
says that the section is not acted on. (A plain `deepspeed script.py` launch planned through it:
tests/test_run.py, `plain-deepspeed-launch`.)"""

import argparse
import json
import subprocess
import sys

import pytest

from slackswap_ds import autoroute

from jobs import ROOT, cpu_env

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


@pytest.mark.parametrize("call, expected", [
    (((), {"config": SECTION}), True),
    (((), {"config_params": SECTION}), True),
    (((), {"config": None, "config_params": SECTION}), True),
    (((argparse.Namespace(deepspeed_config="FILE"),), {}), True),
    (((), {"args": argparse.Namespace(deepspeed_config="FILE")}), True),
    (((), {"config": {"train_micro_batch_size_per_gpu": 1}}), False),
    (((), {"config": "/nonexistent/ds.json"}), False),  # DeepSpeed says what is wrong with it
    (((None,), {}), False),
], ids=["config", "config_params", "config-None", "args", "args-keyword", "no-section", "unreadable", "nothing"])
def test_the_guard_finds_the_section_wherever_deepspeed_takes_its_config(tmp_path, call, expected):
    (tmp_path / "ds.json").write_text(json.dumps(SECTION))

    def real(value):  # "FILE": the JSON written above
        return argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json")) if isinstance(value, argparse.Namespace) \
            else value

    args, kwargs = call
    args, kwargs = tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}
    assert autoroute._has_section(args, kwargs) is expected


def test_without_a_section_the_guard_is_deepspeeds_own_and_opted_out_it_says_so(monkeypatch, capsys):
    calls = []

    def own(*args, **kwargs):
        calls.append((args, kwargs))
        return "deepspeed's"

    guard = autoroute._guard(own)
    assert guard.__wrapped__ is own and getattr(guard, autoroute.GUARD_MARK)
    assert guard(config={"train_micro_batch_size_per_gpu": 1}) == "deepspeed's"
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(autoroute.ENV, "0")
    monkeypatch.setattr(autoroute, "_warned", False)
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
