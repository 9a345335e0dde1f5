"""``RINGTRAIN_ELASTIC_PERSIST_S``, how often rank 0 writes a fixed-size hvd.elastic job's
commit to disk: a value that is not a number of seconds >= 0 is a ConfigError when the
state is built (on every rank), not silently the 1 s default."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.horovod.elastic import ObjectState
from ringtrain.horovod.elastic.state import _persist_interval


@pytest.mark.parametrize(("raw", "seconds"), [("", 1.0), ("0", 0.0), (" 2.5 ", 2.5)])
def test_a_number_of_seconds_is_the_interval(monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float) -> None:
    monkeypatch.setenv("RINGTRAIN_ELASTIC_PERSIST_S", raw)
    assert _persist_interval() == seconds
    assert ObjectState(epoch=0).epoch == 0


@pytest.mark.parametrize("raw", ["abc", "1s", "-1", "nan", "inf"])
def test_anything_else_names_the_variable_when_the_state_is_built(monkeypatch: pytest.MonkeyPatch,
                                                                  raw: str) -> None:
    monkeypatch.setenv("RINGTRAIN_ELASTIC_PERSIST_S", raw)
    with pytest.raises(ConfigError, match=r"RINGTRAIN_ELASTIC_PERSIST_S=.* is not a number of seconds >= 0"):
        ObjectState(epoch=0)
