"""The external key-value store that outlives the parameter server.

Everything the processes share goes through a :class:`KeyValueStore`: the published weights, the
worker gradient queues and the audit log. The embedded default is a c10d ``TCPStore`` hosted by a
process of its own (:mod:`stalwart.store_host`), so killing the PS never takes the store with it.
A real server (Redis) drops in through :class:`stalwart.ps.redis_store.RedisStore`.

:class:`RetryingStore` wraps any store so that a store that vanishes mid-run makes its callers
retry with exponential backoff (and log it) instead of failing at the first broken socket; after
``patience`` seconds without an answer it raises :class:`StoreUnavailableError`.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from datetime import timedelta

from stalwart.errors import ConfigurationError, StoreUnavailableError

log = logging.getLogger(__name__)


class KeyValueStore(abc.ABC):
    """The operations the parameter server needs; every write is idempotent or a compare-and-set.

    Example:
        >>> store = TCPStoreClient("127.0.0.1", 29555)  # doctest: +SKIP
        >>> store.set("k", b"v"); store.get("k")  # doctest: +SKIP
        b'v'
    """

    address: str

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` under ``key`` (overwrites)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None when there is none (never blocks waiting for it)."""

    @abc.abstractmethod
    def get_many(self, keys: list[str]) -> list[bytes]:
        """Values of keys that are known to exist, in one round trip."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 if absent); the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bool:
        """Set ``key`` to ``desired`` only if it holds ``expected``; True when it was set."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    def close(self) -> None:  # noqa: B027 - optional for stores without a connection to close
        """Drop the connection."""


class TCPStoreClient(KeyValueStore):
    """A client of a c10d ``TCPStore`` hosted elsewhere (by :func:`stalwart.store_host.serve`).

    Args:
        host: the store server's host.
        port: its port.
        timeout: seconds one operation (or the connection) may take before it fails.

    Example:
        >>> store = TCPStoreClient("127.0.0.1", port)  # doctest: +SKIP
    """

    def __init__(self, host: str, port: int, timeout: float = 2.0) -> None:
        from torch.distributed import TCPStore

        self.address = f"{host}:{port}"
        self._store = TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )  # fmt: skip

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes | None:
        # TCPStore.get waits for a missing key until the timeout; check first so we never block.
        if not self._store.check([key]):
            return None
        return self._store.get(key)

    def get_many(self, keys: list[str]) -> list[bytes]:
        return list(self._store.multi_get(keys)) if keys else []

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bool:
        return bytes(self._store.compare_set(key, expected, desired)) == desired

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def close(self) -> None:
        del self._store


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, or a ConfigurationError saying how to write it."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigurationError(
            f"store address {address!r}: write it as host:port, e.g. 127.0.0.1:29555"
        )
    return host, int(port)


class RetryingStore(KeyValueStore):
    """Retry every operation with exponential backoff across reconnects, up to ``patience`` seconds.

    A failed operation may or may not have reached the server, so this wrapper relies on every
    write being idempotent (``set``/``delete``) or a compare-and-set the caller re-checks.

    Args:
        connect: makes a fresh client (called again after every failure).
        patience: seconds of continuous failure before :class:`StoreUnavailableError` is raised.
        name: who is calling, for the retry messages (logged as warnings).
        first_delay: the first backoff delay; it doubles up to ``max_delay``.

    Example:
        >>> connect = lambda: TCPStoreClient("127.0.0.1", port)  # doctest: +SKIP
        >>> store = RetryingStore(connect, patience=10)  # doctest: +SKIP
    """

    def __init__(
        self,
        connect: Callable[[], KeyValueStore],
        *,
        patience: float = 10.0,
        name: str = "client",
        first_delay: float = 0.05,
        max_delay: float = 1.0,
        address: str = "?",
    ) -> None:
        self._connect = connect
        self.patience = patience
        self.name = name
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.address = address
        #: How many times an operation was retried, and the seconds spent without a store.
        self.retries = 0
        self.outage_seconds = 0.0
        self._client: KeyValueStore | None = None
        self._call(lambda client: None, "connect")

    def _call(self, op: Callable[[KeyValueStore], object], what: str):
        started = None
        delay = self.first_delay
        while True:
            try:
                if self._client is None:
                    self._client = self._connect()
                    self.address = self._client.address
                result = op(self._client)
                if started is not None:
                    self.outage_seconds += time.monotonic() - started
                    log.warning("%s: store %s answers again", self.name, self.address)
                return result
            except StoreUnavailableError:
                raise
            except (RuntimeError, OSError, TimeoutError, ConnectionError) as exc:
                # c10d raises DistStoreError/DistNetworkError (RuntimeError subclasses).
                self._client = None
                now = time.monotonic()
                started = now if started is None else started
                if now - started + delay > self.patience:
                    self.outage_seconds += now - started
                    raise StoreUnavailableError(
                        f"{self.name}: the store at {self.address} did not answer for "
                        f"{now - started:.1f}s ({what}; {self.retries} retries with backoff; last "
                        f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). "
                        "Check that the store process is running and reachable, or raise the "
                        "patience."
                    ) from None
                self.retries += 1
                log.warning(
                    "%s: store %s unreachable during %s; retry %d in %.2fs",
                    self.name, self.address, what, self.retries, delay,
                )  # fmt: skip
                time.sleep(delay)
                delay = min(delay * 2, self.max_delay)

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda c: c.set(key, value), f"set {key}")

    def get(self, key: str) -> bytes | None:
        return self._call(lambda c: c.get(key), f"get {key}")

    def get_many(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda c: c.get_many(keys), f"get {len(keys)} keys")

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda c: c.add(key, amount), f"add {key}")

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bool:
        # A compare-and-set whose answer was lost may have succeeded: re-read on retry.
        def attempt(client: KeyValueStore) -> bool:
            return client.compare_set(key, expected, desired) or client.get(key) == desired

        return self._call(attempt, f"compare_set {key}")

    def delete(self, key: str) -> None:
        self._call(lambda c: c.delete(key), f"delete {key}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def client_factory(address: str) -> Callable[[], KeyValueStore]:
    """A function that opens a fresh client of the store at ``address`` (``host:port`` of a
    TCPStore, or a ``redis://`` URL)."""
    if address.startswith("redis://"):
        from stalwart.ps.redis_store import RedisStore

        return lambda: RedisStore(address)
    host, port = parse_address(address)
    return lambda: TCPStoreClient(host, port)


def connect(address: str, patience: float, name: str) -> RetryingStore:
    """A :class:`RetryingStore` client of the store at ``address``, called ``name`` in its logs."""
    return RetryingStore(client_factory(address), patience=patience, name=name, address=address)
