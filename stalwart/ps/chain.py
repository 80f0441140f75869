"""Chain replication of the parameter server (the paper's relaxed variant).

A chain of >= 3 replica processes. The head is the PS; every ``replicate_every`` updates it sends
its weights to its successor and waits only for that successor's acknowledgement. Each replica
keeps the newest weights it received *in memory*, acknowledges at once and forwards them to its own
successor from a background thread. Replicas talk over ``multiprocessing.connection`` sockets (no
disk, no store). A SIGKILLed process closes its sockets, so a replica learns that its predecessor
died from the end of its upstream connection, and then takes over as head from the weights in its
memory. When head and secondary die together, the tertiary sees its upstream (the secondary) close
and takes over with its (older) copy. A restarted replica joins at the tail: it publishes its
address in the store, and the current tail connects to it.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.server import ParameterServer
from stalwart.ps.store import KeyValueStore

AUTHKEY = b"stalwart-ps-chain"

log = logging.getLogger(__name__)


class Successor:
    """The connection from one replica to the next live one in the chain.

    Args:
        store: where replicas publish their addresses.
        index: this replica's position in the join order.

    Example:
        >>> Successor(store, 0).send(blob)  # doctest: +SKIP
        True
    """

    def __init__(self, store: KeyValueStore, index: int) -> None:
        self.store = store
        self.index = index
        self.conn: Connection | None = None
        self.successor: int | None = None

    def find(self) -> bool:
        """Connect to the first live replica after this one; True when connected."""
        if self.conn is not None:
            return True
        joined = self.store.add(layout.CHAIN_COUNT, 0)
        for j in range(self.index + 1, joined):
            port = self.store.get(layout.chain_address(j))
            if port is None:
                continue
            try:
                self.conn = Client(("127.0.0.1", int(port)), authkey=AUTHKEY)
            except OSError:
                continue  # that replica is dead: try the next one
            self.successor = j
            self.store.set(layout.chain_successor(self.index), str(j).encode())
            return True
        return False

    def send(self, blob: bytes) -> bool:
        """Forward ``blob`` and wait for the acknowledgement; False if no successor took it."""
        for _ in range(3):
            if not self.find():
                return False
            try:
                assert self.conn is not None
                self.conn.send_bytes(blob)
                if self.conn.recv_bytes() == b"ack":
                    return True
            except (EOFError, OSError):
                pass
            self.conn = None  # the successor died: the next find() skips past it
        return False


class Replica:
    """One replica process: receives, acknowledges, forwards; takes over when its upstream dies.

    Args:
        config: the run.
        store: the shared store.
        index: position in the join order (0 is the first head).

    Example:
        >>> Replica(config, store, index=1).run(head=False)  # doctest: +SKIP
    """

    def __init__(self, config: PSConfig, store: KeyValueStore, index: int) -> None:
        self.config = config
        self.store = store
        self.index = index
        self.successor = Successor(store, index)
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        self.snapshot: bytes | None = None
        self._fresh = threading.Event()
        self._lock = threading.Lock()
        self._forwarding = True

    def _forward_loop(self) -> None:
        # Also runs when nothing new arrived: a tail must link up with a replica that joined
        # after it (and hand it the weights) without waiting for the head's next replication,
        # or the chain stays one copy short exactly when the next failure may come.
        sent: bytes | None = None
        while self._forwarding:
            self._fresh.wait(0.2)
            self._fresh.clear()
            with self._lock:
                if not self._forwarding:
                    return
                blob = self.snapshot
                linked = self.successor.conn is not None
                fresh = blob is not None and (blob is not sent or not linked)
                if fresh and self.successor.send(blob):
                    sent = blob

    def _follow(self) -> float:
        """Receive snapshots until the upstream connection ends; when it ended."""
        forwarder = threading.Thread(target=self._forward_loop, daemon=True)
        forwarder.start()
        upstream = self.listener.accept()
        try:
            while True:
                blob = upstream.recv_bytes()
                first = self.snapshot is None
                self.snapshot = blob
                upstream.send_bytes(b"ack")
                self._fresh.set()
                if first:  # the chain counts this replica as a copy from now on
                    self.store.set(layout.chain_held(self.index), b"1")
        except (EOFError, OSError):
            detected = time.time()
        with self._lock:
            self._forwarding = False
        self._fresh.set()
        forwarder.join()
        return detected

    def run(self, head: bool) -> None:
        """Serve as head (``head=True``) or follow until the upstream dies, then take over."""
        self.store.set(layout.chain_address(self.index), str(self.listener.address[1]).encode())
        server = ParameterServer(self.config, self.store, replicate=self.successor.send)
        if head:
            # The initial chain is 0 -> 1 -> ... in order: wait until the others listen.
            for index in range(1, self.config.replicas):
                while self.store.get(layout.chain_address(index)) is None:
                    time.sleep(0.01)
            blob = server.recover("store", index=self.index)
        else:
            detected = self._follow()
            if self.store.get(layout.STOP) is not None:
                return  # the run is over and the head exited: nothing to take over
            log.warning("replica %d: upstream gone, taking over from memory", self.index)
            blob = server.recover(
                "memory", snapshot=self.snapshot, detected_at=detected, index=self.index
            )
        self.store.set(layout.chain_held(self.index), b"1")
        self.store.set(layout.CHAIN_HEAD, str(self.index).encode())
        # The successor starts from the weights we serve, before any update.
        self.successor.send(blob)
        server.serve()
