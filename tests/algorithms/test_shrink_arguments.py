"""Composer's ``Shrink`` refuses the chain writer's bad arguments when it is made, as
``ShrinkCheckpoint`` and ``ShrinkCheckpointIO`` do, with the same message: a typo in ``coder``
was accepted and failed only at the first save, after an epoch of training."""

from __future__ import annotations

import pytest

from stalwart import ConfigurationError, ShrinkCheckpoint
from stalwart.algorithms import Shrink
from stalwart.plugins import ShrinkCheckpointIO

BAD = [
    {"coder": "bogus"},
    {"coder": "ANS"},
    {"keyframe_every": 1.5},
    {"keyframe_every": True},
    {"keyframe_every": 0},
    {"tau": float("nan")},
]


def _refusal(adapter, kwargs, folder) -> str:
    if adapter is ShrinkCheckpoint:
        kwargs = {"dirpath": folder, **kwargs}
    with pytest.raises(ConfigurationError) as refused:
        adapter(**kwargs)
    return str(refused.value)


@pytest.mark.parametrize("kwargs", BAD, ids=lambda kwargs: f"{kwargs}")
def test_bad_writer_arguments_are_refused_by_every_adapter_alike(tmp_path, kwargs):
    said = {
        adapter.__name__: _refusal(adapter, kwargs, tmp_path)
        for adapter in (Shrink, ShrinkCheckpoint, ShrinkCheckpointIO)
    }
    assert len(set(said.values())) == 1, said
    assert not list(tmp_path.iterdir())


def test_good_writer_arguments_are_kept(tmp_path):
    shrink = Shrink(coder="ans", keyframe_every=3)
    assert (shrink.writer.coder, shrink.writer.keyframe_every) == ("ans", 3)
