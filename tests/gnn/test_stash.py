"""Must-show 4: each interval's backward uses exactly the weight version its forward used."""

from __future__ import annotations

import pytest
import torch

from stalwart.gnn import StaleGatherEngine, WeightStash
from tests.gnn.graphs import adam_update, gcn, interval_graph, sbm


def test_stash_reference_counts_and_frees():
    stash = WeightStash({"w": torch.zeros(3)})
    v0, params0 = stash.acquire()
    v0b, _ = stash.acquire()
    assert v0 == v0b == 0
    assert stash.publish({"w": torch.ones(3)}) == 1
    assert stash.live() == {0: 2, 1: 0}
    stash.release(v0)
    assert torch.equal(stash.get(0)["w"], torch.zeros(3))  # still held once
    stash.release(v0b)
    assert stash.live() == {1: 0}  # freed once unused and no longer latest
    with pytest.raises(RuntimeError, match="not held"):
        stash.get(0)
    assert stash.publish({"w": torch.full((3,), 2.0)}) == 2
    assert stash.live() == {2: 0}  # an unheld latest is replaced, not kept
    assert torch.equal(params0["w"], torch.zeros(3))  # a version is a copy, never mutated


def run(staleness, weight_stashing: bool = True):
    graph = interval_graph(sbm(), num_intervals=6)
    model = gcn(graph, dropout=0.5)
    engine = StaleGatherEngine(
        graph, model, staleness, adam_update(model), workers=0, seed=1,
        weight_stashing=weight_stashing,
    )  # fmt: skip
    live = []
    for epoch in range(10):
        engine.run_epoch(epoch, 9)
        live.append(len(engine.stash.live()))
    engine.close()
    return engine, live


def uses(engine: StaleGatherEngine) -> tuple[dict, dict]:
    forward, backward = {}, {}
    for interval, epoch, layer, phase, version, latest, checksum in engine.record.weights:
        key = (interval, epoch, layer)
        (forward if phase == "forward" else backward)[key] = (version, latest, checksum)
    return forward, backward


@pytest.mark.parametrize("staleness", [1, 2])
def test_backward_uses_the_forward_weight_version(staleness):
    engine, live = run(staleness)
    forward, backward = uses(engine)
    assert forward.keys() == backward.keys() and len(forward) == 10 * 6 * 2
    for key, (version, _, checksum) in forward.items():
        b_version, _, b_checksum = backward[key]
        assert b_version == version and b_checksum == checksum, key
    # Newer weights were published between some forward and its backward, so using the
    # latest there would have been wrong: the check above was not vacuous.
    moved = [k for k, (v, latest, _) in backward.items() if latest != v]
    assert moved
    # Reference counting keeps at most S + 2 versions alive (S in flight, latest, one ahead).
    assert max(live) <= staleness + 2


def test_without_stashing_backward_would_use_other_weights():
    engine, _ = run(1, weight_stashing=False)
    forward, backward = uses(engine)
    differ = [k for k in forward if forward[k][2] != backward[k][2]]
    assert differ  # the negative control: the record does catch a version mismatch


def test_sync_and_s0_never_see_a_new_version_mid_epoch():
    for staleness in ("sync", 0):
        engine, live = run(staleness)
        _, backward = uses(engine)
        assert all(latest == version for version, latest, _ in backward.values())
        assert max(live) <= 2
