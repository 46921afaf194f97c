"""Everything about the package is in setup.cfg; this file only adds `slackswap_ds-autoroute.pth` to
what is installed, beside the package in site-packages, for regular and editable installs alike.
Python runs it at start-up: it watches for `import deepspeed`, so that a DeepSpeed config with a
"slackswap" section is honoured however the job is launched (slackswap_ds/autoroute.py).
setup.cfg has no way to place a file at the root of site-packages, hence the two commands here.
(`setup()` runs only as a script, as pip and `python setup.py` run it: tests/test_startup_hook.py
imports `pth_line` from here.)"""

from pathlib import Path

PTH = "slackswap_ds-autoroute.pth"
PACKAGE = "slackswap_ds"


def pth_line(package_dir: str | None) -> str:
    """The .pth file's one line, run by site.py at every interpreter start: it loads the installed
    package's `autoroute.py` by its path and calls its install_hook(). The package is imported only
    once a config with a section arrives (numpy and all), and only this file is run at start-up:
    never a `slackswap_ds/` folder that PYTHONPATH or the working directory would put first.

    `package_dir`: where the installed package is, known when the .pth is written (an editable
    install: the source folder); None for a wheel, whose install location is not known when it is
    built: the package beside the .pth, in the first folder of sys.path that holds the .pth (a
    site-packages folder: site.py adds it before it runs the folder's .pth files).

    It costs a millisecond or two (tests/test_startup_hook.py measures it). A package that is gone does
    nothing; one whose hook cannot be loaded says so on one line, without a traceback."""
    code = f"""f = ''
try:
    import os
    d = {package_dir!r}
    if d is None:
        d = next((os.path.join(p, {PACKAGE!r}) for p in sys.path if p and os.path.isfile(os.path.join(p, {PTH!r}))), '')
    f = os.path.join(d, 'autoroute.py') if d else ''
    n = {PACKAGE + '.autoroute'!r}
    m = sys.modules.get(n)
    if m is None and f and os.path.isfile(f):
        import importlib.machinery as im
        l = im.SourceFileLoader(n, f)
        s = im.ModuleSpec(n, l, origin=f)
        s.has_location = True
        m = type(sys)(n)
        m.__spec__, m.__loader__, m.__file__, m.__package__, m.__cached__ = s, l, f, {PACKAGE!r}, s.cached
        sys.modules[n] = m
        try:
            l.exec_module(m)
        except BaseException:
            del sys.modules[n]
            raise
    if m is not None:
        m.install_hook()
except Exception as e:
    sys.stderr.write('slackswap: the start-up hook ' + repr(f) + ' did not load (' + type(e).__name__ + ': ' + str(e)
                     + '): a DeepSpeed config\\'s "slackswap" section is not acted on; reinstall slackswap_ds\\n')
"""
    return f"import sys; exec({code!r}, {{'sys': sys}})\n"


def main() -> None:
    from setuptools import setup
    from setuptools.command.build_py import build_py
    from setuptools.command.editable_wheel import editable_wheel

    class build_py_with_pth(build_py):
        """A regular install (a wheel): the .pth at the root of the build, so at the root of site-packages,
        finding the package beside it."""

        def run(self):
            super().run()
            if not self.editable_mode:
                Path(self.build_lib, PTH).write_text(pth_line(None))

        def get_outputs(self, include_bytecode=True):
            outputs = super().get_outputs(include_bytecode)
            return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH))]

    class editable_wheel_with_pth(editable_wheel):
        """`pip install -e`: the .pth written into the editable wheel beside setuptools' own, naming the
        source folder. (Its one extension point for extra files is this method, which writes the
        namespace-package .pth files.)"""

        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            source = Path(self.project_dir, self.package_dir.get("", ".")).resolve() / PACKAGE
            Path(installation_dir, PTH).write_text(pth_line(str(source)))

    setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})


if __name__ == "__main__":
    main()
