"""Host the rendezvous store in a process of its own, so it survives every trainer.

The pipeline's failure reports, membership decisions, losses and checkpoints-ready markers go
through a c10d ``TCPStore``. If a trainer hosted it, losing that trainer would lose the store
and with it the whole job; hosted here (or by the one-machine agent), it outlives any of them.

Run: ``python -m stalwart.pipeline.store --port 29600`` (until killed). At scale, an etcd store
would take this role.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys

from torch.distributed import TCPStore


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Host a TCPStore on ``port`` until SIGTERM/SIGINT."""
    store = TCPStore(
        host, port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    print(f"pipeline store listening on {host}:{store.port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args(argv)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    serve(args.port, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
