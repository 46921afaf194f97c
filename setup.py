"""Everything about the package is in setup.cfg; this file only adds `slackswap_ds-autoroute.pth` to
what is installed, beside the package in site-packages, for regular and editable installs alike.
Python runs it at start-up: it watches for `import deepspeed`, so that a DeepSpeed config with a
"slackswap" section is honoured however the job is launched (slackswap_ds/autoroute.py).
setup.cfg has no way to place a file at the root of site-packages, hence the two commands here."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "slackswap_ds-autoroute.pth"
# one line, run by site.py at every start-up: it loads slackswap_ds/autoroute.py by its path (the
# package itself, numpy and all, is imported only once a config with a section arrives) and calls
# its install_hook(); it does nothing if the package is gone
LINE = ('import sys, importlib.util as u; p = u.find_spec("slackswap_ds"); '
        's = p and p.submodule_search_locations and u.spec_from_file_location('
        '"slackswap_ds.autoroute", p.submodule_search_locations[0] + "/autoroute.py"); '
        'm = s and sys.modules.setdefault("slackswap_ds.autoroute", u.module_from_spec(s)); '
        's and (s.loader.exec_module(m), m.install_hook())\n')


class build_py_with_pth(build_py):
    """A regular install (a wheel): the .pth at the root of the build, so at the root of site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:
            Path(self.build_lib, PTH).write_text(LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH))]


class editable_wheel_with_pth(editable_wheel):
    """`pip install -e`: the .pth written into the editable wheel beside setuptools' own. (Its one
    extension point for extra files is this method, which writes the namespace-package .pth files.)"""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        Path(installation_dir, PTH).write_text(LINE)


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
