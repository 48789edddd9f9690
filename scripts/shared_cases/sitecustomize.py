"""Run the reproducers in ``../shared/cases`` against today's package layout.

The shared cases were written when the sample photos and the emulated origin lived in the
product package (``stoker.sample_data``, ``stoker.bench.origin``). They now live in the lab
package (``stoker_lab``). The case files are read-only here, so this module, put on
``PYTHONPATH``, aliases the old names to the new modules in every interpreter the cases start:

    PYTHONPATH=src:scripts/shared_cases .venv/bin/python ../shared/cases/lifecycle/<name>/repro.py

It is never imported by stoker itself.
"""

import importlib
import importlib.machinery
import sys


class _Alias:
    """Meta-path finder that loads an old module name as the lab module it moved to."""

    moved = {
        "stoker.sample_data": "stoker_lab.sample_data",
        "stoker.bench": "stoker_lab.bench",
        "stoker.bench.origin": "stoker_lab.bench.origin",
    }

    def find_spec(self, name, path=None, target=None):
        new = self.moved.get(name)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return importlib.import_module(self.moved[spec.name])

    def exec_module(self, module):
        pass  # the lab module is already executed


sys.meta_path.insert(0, _Alias())
