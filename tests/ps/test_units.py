"""Fast checks of the pieces: config validation, the update rule, wire format, retry, injector."""

from __future__ import annotations

import dataclasses
import logging
import socket

import pytest
import torch

from stalwart.errors import ConfigurationError, RunDirectoryError, StoreUnavailableError
from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.failure import FailureInjector
from stalwart.ps.runner import PSRun, run_training
from stalwart.ps.store import KeyValueStore, RetryingStore
from stalwart.ps.update import (
    apply_update,
    backlog_scale,
    gradient_sum,
    gradient_sum_with_trails,
)
from stalwart.ps.wire import pack, unpack, vector_view


def test_zero_workers_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigurationError, match="at least one worker"):
        run_training(PSConfig(workers=0, run_dir=str(tmp_path / "r")))


def test_kill_schedule_beyond_the_run_is_a_clear_error(tmp_path):
    config = PSConfig(workers=2, steps=50, kills=[KillEvent(100, 1.0)], run_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="beyond the run: 2 worker.*100 gradients"):
        run_training(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "chain-sync", "replicas": 2}, "at least 3"),
        ({"mode": "nope"}, "choose one of"),
        ({"kills": [KillEvent(10, 1.0), KillEvent(5, 1.0)]}, "increasing"),
        ({"kills": [KillEvent(10, -1.0)]}, "downtime"),
        ({"kills": [KillEvent(10, 1.0, ("head",))]}, "targets"),
        ({"mode": "chain-async", "kills": [KillEvent(10, 1.0, ("secondary",))]}, "with the head"),
        ({"kills": [KillEvent(downtime=1.0)]}, "exactly one of"),
        ({"kills": [KillEvent(10, at_seconds=2.0)]}, "exactly one of"),
        ({"kills": [KillEvent(10), KillEvent(at_seconds=2.0)]}, "all by at_seconds"),
        ({"duration": 5.0, "kills": [KillEvent(at_seconds=6.0)]}, "outside the run"),
        ({"kills": [KillEvent(at_seconds=3.0), KillEvent(at_seconds=2.0)]}, "increasing"),
    ],
)
def test_bad_configurations(changes, message):
    with pytest.raises(ConfigurationError, match=message):
        PSConfig(**changes).validate()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_store_at_start_is_a_clear_error(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    config = PSConfig(store_address=address, store_patience=1.0, run_dir=str(tmp_path / "r"))
    with pytest.raises(StoreUnavailableError, match=f"cannot reach the store at {address}"):
        run_training(config)


def test_run_directory_in_use_is_refused(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"someone else's")
    with pytest.raises(RunDirectoryError, match="not empty"):
        run_training(PSConfig(run_dir=str(tmp_path)))
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"someone else's"


def test_a_run_leaves_the_callers_config_unchanged_and_stops_the_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = PSConfig(mode="stateless", workers=1, steps=20, hidden=32, run_dir="run")
    before = dataclasses.replace(config, kills=list(config.kills))
    runs: list[PSRun] = []

    def keep(run: PSRun) -> None:
        if not runs:
            runs.append(run)

    result = run_training(config, hook=keep)
    assert config == before  # relative run_dir, no store address: as the caller wrote it
    assert result.config is not config
    assert result.config.run_dir == str(tmp_path / "run")
    assert result.config.store_address is not None and config.store_address is None
    assert result.produced == result.applied == 20
    # Every child is gone; the embedded store left cleanly on SIGTERM (exit code 0).
    (run,) = runs
    assert all(proc.exit_code is not None for proc in run.procs.values())
    assert run.procs[run.store_pid].exit_code == 0


def test_backlog_scale_merges_a_large_backlog_as_the_mean_of_the_workers_trajectories():
    assert backlog_scale(3, 2, 4) == 1.0  # a few pending gradients: asynchronous SGD
    # 443 gradients from 3 workers' local trajectories: their mean, not one step of 443.
    assert backlog_scale(443, 3, 6) == pytest.approx(1 / 3)
    assert backlog_scale(40, 1, 4) == 1.0  # one worker's trajectory is kept whole


def test_a_trail_is_summed_as_the_worker_summed_it():
    # Gradients of very different sizes, so that the order of float32 additions shows.
    noise = torch.randn(40, 1000, generator=torch.Generator().manual_seed(0))
    g = [v.numpy() for v in noise * torch.logspace(-3, 3, 40)[:, None]]
    assert torch.equal(gradient_sum_with_trails(g, []), gradient_sum(g))
    # A PS that read gradients 5-29 as one worker's running sum (its trail) and 33-39 as
    # another's adds each sum where the singles would have gone: that is what the audit
    # record's spans make the replay do.
    trail_a, trail_b = gradient_sum(g[5:30]).numpy(), gradient_sum(g[33:]).numpy()
    received = gradient_sum([*g[:5], trail_a, *g[30:33], trail_b])
    assert torch.equal(gradient_sum_with_trails(g, [[33, 40], [5, 30]]), received)
    assert not torch.equal(received, gradient_sum(g))  # so the spans must be recorded
    with pytest.raises(ValueError, match="audit record is corrupt"):
        gradient_sum_with_trails(g, [[5, 30], [20, 35]])


def test_update_rule_and_wire_roundtrip():
    weights = torch.randn(10)
    grads = torch.randn(3, 10)
    blobs = [pack({"k": k}, g) for k, g in enumerate(grads)]
    total = gradient_sum(vector_view(blob) for blob in blobs)
    assert torch.allclose(total, grads.sum(0))
    expected = weights - 0.5 * 0.1 * total
    assert torch.equal(apply_update(weights, total, 0.1, 0.5), expected)
    assert all(torch.equal(total, gradient_sum(vector_view(b) for b in blobs)) for _ in range(3))
    assert torch.equal(grads[0], unpack(blobs[0])[1])  # the sum did not write into the bytes
    assert gradient_sum(iter([])) is None
    header, vector = unpack(pack({"a": [1, 2]}, weights))
    assert header == {"a": [1, 2]} and torch.equal(vector, weights)


class _FlakyStore(KeyValueStore):
    """Fails the first ``failures`` connections, like a store that is restarting."""

    address = "flaky:0"
    attempts = 0

    def __init__(self, failures: int) -> None:
        type(self).attempts += 1
        if type(self).attempts <= failures:
            raise RuntimeError("connection refused")
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data.get(key)

    def get_many(self, keys):
        return [self.data[k] for k in keys]

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, desired):
        if self.data.get(key, b"") == expected:
            self.data[key] = desired
            return True
        return False

    def delete(self, key):
        self.data.pop(key, None)


def test_retrying_store_backs_off_then_recovers(caplog):
    _FlakyStore.attempts = 0
    with caplog.at_level(logging.WARNING, logger="stalwart.ps.store"):
        store = RetryingStore(lambda: _FlakyStore(3), patience=5, first_delay=0.01, name="w0")
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.retries == 3
    err = caplog.text
    assert "retry 1 in 0.01s" in err and "retry 3 in 0.04s" in err  # doubling backoff
    assert "answers again" in err
    assert all(record.levelno == logging.WARNING for record in caplog.records)


def test_retrying_store_gives_up_after_its_patience():
    _FlakyStore.attempts = 0
    with pytest.raises(StoreUnavailableError, match="did not answer for .*retries with backoff"):
        RetryingStore(lambda: _FlakyStore(10**6), patience=0.3, first_delay=0.05)


def test_injector_waits_for_recovery_before_the_next_kill():
    killed, restarted = [], []
    up = {"value": True}
    injector = FailureInjector(
        [KillEvent(10, 0.0), KillEvent(20, 0.0)],
        kill=lambda targets: killed.append(targets) or [1],
        restart=lambda targets: restarted.append(targets),
        server_up=lambda: up["value"],
    )
    injector.poll(5)
    assert not killed
    injector.poll(10)
    assert len(killed) == 1 and injector.pending
    up["value"] = False
    injector.poll(25)  # restart due (downtime 0)
    assert len(restarted) == 1
    injector.poll(25)  # not recovered yet: no second kill on the same outage
    assert len(killed) == 1
    up["value"] = True
    injector.poll(25)
    assert len(killed) == 2 and not injector.unfired() and injector.pending


def test_injector_kills_at_a_time_whatever_the_progress():
    killed = []
    injector = FailureInjector(
        [KillEvent(at_seconds=2.0, downtime=1.0)],
        kill=lambda targets: killed.append(targets) or [1],
        restart=lambda targets: None,
        server_up=lambda: True,
        started=100.0,
    )
    injector.poll(10**6, now=101.9)
    assert not killed
    injector.poll(0, now=102.0)
    assert killed == [("ps",)] and injector.pending
