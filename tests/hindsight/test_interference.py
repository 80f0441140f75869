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


def test_a_write_waits_for_clean_epochs_until_the_baseline_is_settled_but_never_past_two():
    meter = InterferenceMeter()
    assert not meter.lets_write(shadowed=False, epochs_since_write=5)  # no baseline yet
    meter.observe(1.0, shadowed=False)
    assert meter.lets_write(shadowed=False, epochs_since_write=1)
    # Right after a write, an epoch that had one in flight gets no new write: the next is clean.
    assert not meter.lets_write(shadowed=True, epochs_since_write=1)
    # A write that outlasted an epoch does not hold up the next past coverage's shortest period.
    assert meter.lets_write(shadowed=True, epochs_since_write=2)
    for seconds in (1.1, 0.9, 1.0):
        meter.observe(seconds, shadowed=False)
    assert meter.settled and meter.lets_write(shadowed=True, epochs_since_write=1)
