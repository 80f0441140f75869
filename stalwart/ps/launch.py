"""The entry point of every PS child process: ``python -m stalwart.ps.launch ROLE ARG...``.

Roles: ``store`` (hosts the embedded TCPStore; ARG is the port file), and ``ps``, ``replica``,
``worker`` and ``spare`` (ARG is the run's ``config.json``, then the role's own arguments). The
runner starts them with :func:`stalwart.ps.processes.spawn`. Importing this module imports
torch and the PS core only, never Lightning, so a (re)started process is ready quickly.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.processes import PARENT_ENV, SYS_PATH_ENV
from stalwart.ps.store import KeyValueStore, RetryingStore, connect


def inherit_sys_path() -> None:
    """Append the parent's import paths that this interpreter lacks.

    Appended, after the interpreter's own paths, so nothing of the standard library is shadowed.
    """
    inherited = json.loads(os.environ.get(SYS_PATH_ENV, "[]"))
    sys.path += [entry for entry in inherited if entry not in sys.path]


def _connect(config: PSConfig, name: str) -> RetryingStore:
    assert config.store_address is not None, "the runner sets the address before any child starts"
    return connect(config.store_address, config.store_patience, name)


def _wait_for_role(store: KeyValueStore, spare: str) -> tuple[str, list[str]]:
    """A spare process: libraries imported, store connected; wait to be given a role.

    The runner keeps spares ready so that a restart after the downtime costs what restarting a
    process on a machine with a warm worker pool costs, not an ``import torch`` on a busy host.
    """
    from stalwart.ps import chain, server  # noqa: F401 - imported now, used after the assignment

    store.set(layout.spare_ready(spare), b"1")
    while (assignment := store.get(layout.spare_role(spare))) is None:
        time.sleep(0.01)
    role, *args = json.loads(assignment)
    return role, args


def _die_with_parent() -> None:
    """Linux: get SIGKILLed when the runner dies, so a killed runner leaves no orphans behind.

    (Its own ``finally`` reaps everything on an exception or a timeout; this covers a runner that
    was itself SIGKILLed.)
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if str(os.getppid()) != os.environ.get(PARENT_ENV):
        os._exit(1)  # the runner died before the request took effect


def _serve_role(role: str, config: PSConfig, args: list[str]) -> int:
    """Run ``ps``, ``replica``, ``worker`` or ``spare`` (which becomes one of the first two)."""
    if role == "worker":
        from stalwart.ps import worker

        index = int(args[0])
        return worker.main(config, _connect(config, f"worker {index}"), index)
    store: KeyValueStore = _connect(config, role)
    if role == "spare":
        role, args = _wait_for_role(store, args[0])
    if role == "ps":
        from stalwart.ps.server import ParameterServer

        server = ParameterServer(config, store)
        server.recover(args[0])
        server.serve()
        return 0
    if role == "replica":
        from stalwart.ps.chain import Replica

        index, head = int(args[0]), args[1] == "head"
        Replica(config, store, index).run(head=head)
        return 0
    raise SystemExit(f"unknown role {role}")


def main(argv: list[str]) -> int:
    """Run the role ``argv`` names; the process's exit code."""
    _die_with_parent()
    # The child's stderr is its log file in the run directory.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    role, path, *args = argv
    if role == "store":
        from stalwart import store_host

        store_host.serve(port=0, host="127.0.0.1", port_file=path)
        return 0
    inherit_sys_path()
    import torch

    torch.set_num_threads(1)
    with open(path) as handle:
        config = PSConfig.from_json(handle.read())
    return _serve_role(role, config, args)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (seconds with torch loaded on a busy host): all state is stored.
    os._exit(code)
