"""Host a c10d ``TCPStore`` in a process of its own, so it outlives every trainer and server.

The pipeline's failure reports and membership, and the parameter server's log and counters, go
through a ``TCPStore``. Hosted by a trainer (or by the PS), losing that process would lose the
store and the whole job with it; hosted here, it survives any of them. At scale an etcd store
would take this role.

Run ``python -m stalwart.store_host --port 29600`` (until SIGTERM/SIGINT), or give
``--port-file F`` with ``--port 0`` to take a free port and publish it atomically in ``F``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import sys

from stalwart import durable

log = logging.getLogger(__name__)


def serve(
    port: int = 0,
    host: str = "0.0.0.0",
    *,
    port_file: str | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Host a ``TCPStore`` on ``port`` (0: a free one) until SIGTERM or SIGINT.

    Args:
        port: the port to listen on; 0 picks a free one (publish it with ``port_file``).
        host: the interface to listen on.
        port_file: if given, the port actually bound is written there atomically, so a reader
            never sees half a number.
        timeout_s: the store's operation timeout.
    """
    from torch.distributed import TCPStore

    # Blocked before the store exists, so a SIGTERM sent as soon as the port appears is waited
    # for below instead of killing the process by default action mid-setup.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    store = TCPStore(
        host, port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s), use_libuv=False,
    )  # fmt: skip
    if port_file is not None:
        durable.write_text(port_file, str(store.port))
    log.info("store listening on %s:%d", host, store.port)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port-file", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    serve(args.port, args.host, port_file=args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
