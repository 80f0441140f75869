"""Start each role (store, PS, replica, worker) as a real OS process (via ``boot.py``).

Separate processes (not threads) so the failure injector's SIGKILL is a real crash: memory gone,
sockets closed by the kernel, nothing flushed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.store import KeyValueStore, RetryingStore, TCPStoreClient, parse_address

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")


def client_factory(address: str):
    """A function that opens a fresh client of the store at ``address``."""
    if address.startswith("redis://"):
        from stalwart.ps.redis_store import RedisStore

        return lambda: RedisStore(address)
    host, port = parse_address(address)
    return lambda: TCPStoreClient(host, port)


def connect(config: PSConfig, name: str) -> RetryingStore:
    """A retrying client of the run's store."""
    assert config.store_address is not None
    return RetryingStore(
        client_factory(config.store_address), patience=config.store_patience, name=name,
        address=config.store_address,
    )  # fmt: skip


def spawn(role: str, config_path: str, *args: str, log_path: str) -> subprocess.Popen:
    """Start ``role`` in a new process whose output goes to ``log_path``."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        STALWART_PS_PARENT=str(os.getpid()),
        # The workload may be a user's class: the child must import what the parent can.
        STALWART_PS_SYS_PATH=json.dumps(sys.path),
    )  # fmt: skip
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    try:
        return subprocess.Popen(
            [sys.executable, BOOT, role, config_path, *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    finally:
        log.close()


def _wait_for_role(store: KeyValueStore, spare: str) -> tuple[str, list[str]]:
    """A spare process: libraries imported, store connected; wait to be given a role.

    The runner keeps spares ready so that a restart after the downtime costs what restarting a
    process on a machine with a warm worker pool costs, not an ``import torch`` on a busy host.
    """
    import time

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
    if str(os.getppid()) != os.environ.get("STALWART_PS_PARENT"):
        os._exit(1)  # the runner died before the request took effect


def _main(argv: list[str]) -> int:
    _die_with_parent()
    role, config_path, *args = argv
    if role == "store":
        from stalwart.ps.store import serve_tcpstore

        serve_tcpstore(port_file=config_path)
        return 0
    import torch

    torch.set_num_threads(1)
    with open(config_path) as handle:
        config = PSConfig.from_json(handle.read())
    if role == "worker":
        from stalwart.ps import worker

        index = int(args[0])
        return worker.main(config, connect(config, f"worker {index}"), index)
    store: KeyValueStore = connect(config, role)
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


def run_role(argv: list[str]) -> None:
    """Run one role and leave at once."""
    code = _main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (seconds with torch loaded on a busy host): all state is stored.
    os._exit(code)
