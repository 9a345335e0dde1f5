"""Shared test set-up: make tests/ importable so spawned workers find helper modules, and
switch on tests/timing.py when tests/times.py runs the suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("RINGTEST_TIMES")
    if out:
        from timing import TimingPlugin

        config.pluginmanager.register(TimingPlugin(out), "ringtest-timing")


@pytest.fixture
def hvd_one_rank() -> Iterator[None]:
    """``ringtrain.horovod`` initialised as a 1-process world for the test, shut down after."""
    import ringtrain.horovod as hvd

    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()
