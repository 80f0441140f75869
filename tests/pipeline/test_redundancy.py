"""EagerFRC: layer-by-layer forward redundancy gives the owner's exact output and gradients."""

from __future__ import annotations

import torch
from torch import nn

from stalwart.pipeline.redundancy import EagerFRC


def stages() -> dict[int, nn.Sequential]:
    torch.manual_seed(0)
    return {
        0: nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
        1: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)),
    }


def test_sliced_frc_equals_the_owner_forward_and_backward_bit_for_bit():
    replica = stages()
    owner = stages()  # same seed: the owner's copy of the same stages
    x = torch.randn(5, 8)
    frc = EagerFRC(replica, load_input=lambda stage, mb: x)
    frc.post(0, 0, None)  # stage 0: the input is loaded (the wrap-around replica)
    frc.post(1, 0, None)  # stage 1: fed by the FRC of stage 0 (queue order)
    steps = 0
    while frc.pending:
        frc.advance()  # one layer at a time, as in a receive wait
        steps += 1
    assert steps == 5  # 2 + 3 layers
    assert frc.completed == frc.posted == 2
    (_, out0), (leaf1, out1) = frc.take(0, 0), frc.take(1, 0)
    want = owner[1](owner[0](x))
    assert torch.equal(out1, want)
    # The saved graph is what a shadow's backward (lazy BRC) runs on: same gradients.
    out1.sum().backward()
    want.sum().backward()
    for a, b in zip(replica[1].parameters(), owner[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert leaf1.grad is not None and out0.grad_fn is not None


def test_post_skips_cached_and_forget_keeps_only_named_stages():
    modules = stages()
    frc = EagerFRC(modules, load_input=lambda stage, mb: torch.randn(2, 8))
    frc.post(0, 0, None)
    frc.finish()
    frc.post(0, 0, None)  # already cached from an interrupted attempt: not redone
    assert not frc.pending and frc.posted == 1
    frc.post(1, 0, torch.randn(2, 16))
    frc.post(0, 1, None)
    frc.forget(keep=[1])
    assert [t.stage for t in frc.queue] == [1] and frc.take(0, 0) is None
    frc.finish(stages=[0])  # only stage 0's queued work would run: stage 1's is dropped
    assert not frc.pending and frc.take(1, 0) is None
