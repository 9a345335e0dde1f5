"""The worker protocol: distinct message types, a compact wire form that round-trips."""

from __future__ import annotations

import pickle

import pytest

from ringtrain.data import protocol as p
from ringtrain.data.order import EpochPlan

MESSAGES = [
    p.Task(seq=7, plan_id=2, batch=3, slot_id=-1),
    p.Plan(plan_id=2, plan=EpochPlan(100, 8, epoch=4)),
    p.MapSlot(slot_id=1, size=4096),
    p.UnmapSlot(slot_id=1),
    p.Stop(),
    p.Done(seq=7, slot_id=1, spec=("a", 0, 32, "<f4", (8,), False)),
    p.Oversize(seq=8, slot_id=-1, spec=("o", None), nbytes=128),
    p.Failed(seq=9, slot_id=2, message="loader worker 0 raised ValueError ..."),
    p.InitFailed(message="worker_init_fn raised"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_pickle_as_their_own_type(msg: tuple) -> None:
    wire = p.encode(msg)
    assert type(wire) is tuple  # a plain tuple on the wire
    got = p.decode(pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)))
    assert type(got) is type(msg) and got == msg
    assert got._asdict() == msg._asdict()  # fields by name


def test_kinds_are_distinct() -> None:
    tags = {p.encode(m)[0] for m in MESSAGES}
    assert len(tags) == len(MESSAGES)  # unlike the old (OK == TASK == 0) codes


def test_oversize_payload_is_filled_by_the_receiver_and_never_sent() -> None:
    msg = p.Oversize(seq=1, slot_id=0, spec=("o", 1), nbytes=3, payload=bytearray(b"abc"))
    wire = p.encode(msg)
    assert b"abc" not in pickle.dumps(wire)
    got = p.decode(wire)
    assert isinstance(got, p.Oversize) and got.payload is None and got.nbytes == 3
    assert got._replace(payload=bytearray(b"abc")).payload == b"abc"
