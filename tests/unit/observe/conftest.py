"""Each observe test starts with no metering session and leaves none behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ringtrain import events
from ringtrain.observe import session


@pytest.fixture(autouse=True)
def _no_session() -> Iterator[None]:
    session.stop()
    yield
    session.stop()
    events._stop_requested = False  # a doctor test's request must not end the next test
