"""Shared by the tests that drive ``rt.elastic``'s resize loop without processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ringtrain.elastic import resize

__all__ = ["stop_watcher"]


@pytest.fixture(autouse=True)
def stop_watcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's assignment watcher ends with the test (torn down before monkeypatch
    puts the module's watcher back): a later test's stubs see only its own watcher.
    Autouse in every module that imports it."""
    yield
    if resize._watcher is not None:
        resize._watcher.stop()
