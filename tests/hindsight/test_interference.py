"""The interference meter charges background writes with the slowdown they cause."""

from __future__ import annotations

import pytest

from stalwart.hindsight.interference import FirstWriteMeter, InterferenceMeter


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


def first_epoch(batches: list[tuple[float, bool]], writing_at_start: bool = True):
    """A FirstWriteMeter fed (seconds, write in flight after the batch) for each batch."""
    meter, now = FirstWriteMeter(), 0.0
    meter.start(now, writing_at_start)
    for seconds, writing in batches:
        now += seconds
        meter.batch_ended(now, writing)
    return meter


def test_the_first_write_is_charged_the_excess_of_the_batches_it_overlapped():
    # Batch 0 (allocations) is slow and left out; batches 1-3 start with the write in flight,
    # each 0.02 s over the 0.1 s that the ten batches after it take.
    overlapped = [(0.5, True), (0.12, True), (0.12, True), (0.12, False)]
    meter = first_epoch(overlapped + [(0.1, False)] * 10)
    assert meter.slowdown() == pytest.approx(0.06)
    # A write that ran beside the batches without slowing them costs nothing.
    assert (
        first_epoch([(0.5, True), (0.1, True), (0.1, False)] + [(0.1, False)] * 10).slowdown() == 0
    )


@pytest.mark.parametrize(
    "batches",
    [
        [(0.5, True)] + [(0.1, True)] * 12,  # still in flight at the epoch's end
        [(0.5, True), (0.12, False)] + [(0.1, False)] * 3,  # too few batches after it
        [(0.5, False)] + [(0.1, False)] * 12,  # ended within the first batch
    ],
)
def test_a_first_write_that_cannot_be_measured_in_the_epoch_is_not(batches):
    assert first_epoch(batches).slowdown() is None
