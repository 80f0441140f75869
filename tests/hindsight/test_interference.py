"""The interference meter charges background writes with the slowdown they cause."""

from __future__ import annotations

import pytest

from stalwart.hindsight.interference import InterferenceMeter


def test_shadowed_epochs_are_charged_their_excess_over_clean_ones():
    meter = InterferenceMeter()
    for seconds in (1.0, 1.1, 0.9, 1.0):
        meter.observe(seconds, shadowed=False)
    assert meter.baseline == pytest.approx(0.925)  # lower quartile: noise only slows epochs
    meter.observe(1.5, shadowed=True)
    assert meter.take() == pytest.approx(1.5 - 0.925)
    assert meter.take() == 0.0


def test_noise_refunds_but_the_total_never_goes_negative():
    meter = InterferenceMeter()
    meter.observe(1.0, shadowed=False)
    meter.observe(1.3, shadowed=True)
    assert meter.take() == pytest.approx(0.3)
    meter.observe(0.8, shadowed=True)  # a fast shadowed epoch: noise
    assert meter.take() == pytest.approx(-0.2)
    meter.observe(0.5, shadowed=True)
    assert meter.take() == pytest.approx(-0.1)  # only what was charged is refunded


def test_warmup_never_baselines_and_shadowed_epochs_wait_for_a_baseline():
    meter = InterferenceMeter()
    meter.observe(5.0, shadowed=False, warmup=True)
    meter.observe(1.4, shadowed=True)
    assert meter.take() == 0.0
    meter.observe(1.0, shadowed=False)
    assert meter.take() == pytest.approx(0.4)


def test_a_machine_that_slows_down_as_a_whole_is_not_charged_to_checkpoints():
    meter = InterferenceMeter()
    for _ in range(8):
        meter.observe(1.0, shadowed=False)
    meter.observe(1.4, shadowed=False)  # one slow clean epoch among fast ones: noise
    meter.observe(1.0, shadowed=False)
    meter.observe(1.4, shadowed=False)
    assert meter.baseline == pytest.approx(1.0)
    meter.observe(1.4, shadowed=False)
    meter.observe(1.4, shadowed=False)  # three in a row: every epoch is slower now
    assert meter.baseline == pytest.approx(1.4)
    meter.observe(1.5, shadowed=True)
    assert meter.take() == pytest.approx(0.1)  # the write's slowdown, not the machine's


def test_a_machine_that_speeds_up_lowers_the_baseline():
    meter = InterferenceMeter()
    for seconds in [1.4] * 8 + [1.0] * 4:
        meter.observe(seconds, shadowed=False)
    assert meter.baseline == pytest.approx(1.0)
