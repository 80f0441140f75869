"""The entry point of every PS child process; loads only the framework-neutral core.

Run as a script (``python .../stalwart/ps/boot.py ROLE ...``). Importing the ``stalwart`` package
would import Lightning and every other capability first, which costs each process several
seconds on a busy two-core host and makes restarts and test runs slow; the PS core needs none of
it. So this registers a bare ``stalwart`` package (same directory, ``__init__`` not executed)
before importing :mod:`stalwart.ps.launch`.
"""

from __future__ import annotations

import json
import os
import sys
import types

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    package_dir = os.path.dirname(here)
    # sys.path[0] is this script's directory: its module names (config, model, ...) must not
    # shadow anything, so replace it by the directory that holds the package.
    sys.path[0] = os.path.dirname(package_dir)
    # Then whatever the runner could import from (a user's workload module, e.g. a script's
    # directory), after the interpreter's own paths so nothing of the standard library is shadowed.
    inherited = json.loads(os.environ.get("STALWART_PS_SYS_PATH", "[]"))
    sys.path += [entry for entry in inherited if entry not in sys.path]
    package = types.ModuleType("stalwart")
    package.__path__ = [package_dir]
    sys.modules["stalwart"] = package
    from stalwart.ps.launch import run_role

    run_role(sys.argv[1:])
