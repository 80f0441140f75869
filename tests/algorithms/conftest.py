"""Composer is an optional dependency: skip these tests where it is not installed."""

import pytest

pytest.importorskip("composer")
