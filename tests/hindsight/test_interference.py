"""The interference meter charges background writes with the slowdown they cause."""

from __future__ import annotations

import pytest

from stalwart.hindsight.interference import InterferenceMeter


def test_excess_over_clean_median_is_charged_once():
    meter = InterferenceMeter()
    for duration in (0.010, 0.011, 0.009, 0.010):
        meter.observe(duration, first=False, shadowed=False)
    meter.observe(0.050, first=False, shadowed=True)  # a copy-on-write storm
    meter.observe(0.012, first=False, shadowed=True)
    assert meter.take() == pytest.approx(0.040 + 0.002)
    assert meter.take() == 0.0


def test_first_batches_have_their_own_baseline_once_seen():
    meter = InterferenceMeter()
    meter.observe(0.010, first=False, shadowed=False)
    meter.observe(0.030, first=True, shadowed=True)
    assert meter.take() == pytest.approx(0.020)  # no clean first batch yet: conservative
    meter.observe(0.025, first=True, shadowed=False)
    meter.observe(0.030, first=True, shadowed=True)
    assert meter.take() == pytest.approx(0.005)


def test_warmup_batches_never_form_the_baseline_and_faster_batches_never_refund():
    meter = InterferenceMeter()
    meter.observe(5.0, first=True, shadowed=False, warmup=True)
    meter.observe(9.0, first=True, shadowed=True, warmup=True)
    meter.observe(0.030, first=False, shadowed=True)
    assert meter.take() == 0.0  # nothing to compare with yet; kept for later
    meter.observe(0.010, first=False, shadowed=False)
    assert meter.take() == pytest.approx(0.020)
    meter.observe(0.001, first=False, shadowed=True)
    assert meter.take() == 0.0
