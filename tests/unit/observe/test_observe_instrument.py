"""instrument() and span(): user code publishes data waits and phases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ringtrain import events
from ringtrain.observe import instrument, span
from ringtrain.observe.instrument import batch_size_of


@pytest.fixture()
def seen() -> Iterator[list[tuple[str, float, float, dict[str, Any]]]]:
    got: list[tuple[str, float, float, dict[str, Any]]] = []

    def listen(kind: str, a: float, b: float, info: dict[str, Any]) -> None:
        got.append((kind, a, b, info))

    events.subscribe(listen)
    yield got
    events.unsubscribe(listen)


def test_each_item_reports_its_wait_and_position(seen: list) -> None:
    def slow() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(3):
            time.sleep(0.01)
            yield torch.zeros(5, 2), torch.zeros(5)

    got = list(instrument(slow()))
    assert len(got) == 3
    waits = [e for e in seen if e[0] == "data_wait"]
    assert [e[3]["batch"] for e in waits] == [0, 1, 2]
    assert all(e[3]["samples"] == 5 and e[3]["workers"] == 0 and e[3]["source"] == "iterable"
               for e in waits)
    assert all(e[2] - e[1] >= 0.009 for e in waits)


def test_length_and_epochs_follow_the_source(seen: list) -> None:
    data = [torch.zeros(2, 1)] * 4
    wrapped = instrument(data)
    assert len(wrapped) == 4  # type: ignore[arg-type]
    list(wrapped), list(wrapped)
    epochs = [e[3]["epoch"] for e in seen]
    assert epochs == [0] * 4 + [1] * 4 and seen[0][3]["batches"] == 4


def test_loader_objects_report_their_workers(seen: list) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(6, 3)),
                                         batch_size=3, num_workers=0)
    list(instrument(loader))
    assert [(e[3]["workers"], e[3]["source"], e[3]["samples"]) for e in seen] == [(0, "DataLoader", 3)] * 2


def test_sources_that_publish_their_own_waits_are_not_wrapped() -> None:
    class SelfReporting(list):
        publishes_data_wait = True

    src = SelfReporting([1, 2])
    assert instrument(src) is src


def test_span_times_a_block(seen: list) -> None:
    with span("h2d_copy", bytes=10):
        time.sleep(0.005)
    (kind, a, b, info), = seen
    assert kind == "h2d_copy" and b - a >= 0.004 and info == {"bytes": 10}


@pytest.mark.parametrize("batch,rows", [
    (torch.zeros(7, 3), 7), ((torch.zeros(4), torch.zeros(4)), 4), ({"x": torch.zeros(2, 2)}, 2),
    ([1, 2, 3], 3), (42, None), (torch.tensor(1.0), None),
])
def test_batch_size_of(batch: Any, rows: int | None) -> None:
    assert batch_size_of(batch) == rows
