"""The dispatch window: seqs, the bound on batches out, the next plan, stale answers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ringtrain.data.window import DispatchWindow, NextTask


@dataclass(frozen=True)
class P:
    """A plan as the window sees it: a number of batches (and an identity)."""

    num_batches: int
    epoch: int = 0


def drain(w: DispatchWindow, limit: int) -> list[NextTask]:
    """Send every task the window allows now."""
    out = []
    while (task := w.next_task(limit)) is not None:
        w.sent(task)
        out.append(task)
    return out


def test_batches_go_out_in_order_up_to_the_limit() -> None:
    w = DispatchWindow()
    w.begin(P(10))
    sent = drain(w, limit=3)
    assert [t.batch for t in sent] == [0, 1, 2] and w.out == 3
    assert [t.seq for t in sent] == [w.seq(0), w.seq(1), w.seq(2)]
    assert w.next_task(3) is None  # full
    w.took(0)  # the loop took batch 0: one more may go
    assert [t.batch for t in drain(w, 3)] == [3]
    w.taking(2)  # waiting for batch 2: batches 0 and 1 no longer count
    assert [t.batch for t in drain(w, 3)] == [4]


def test_the_next_plan_starts_only_after_every_batch_of_this_one() -> None:
    w = DispatchWindow()
    this, nxt = P(3), P(5, epoch=1)
    w.begin(this, nxt)
    first = drain(w, limit=4)
    assert [(t.plan, t.batch) for t in first] == [(this, 0), (this, 1), (this, 2), (nxt, 0)]
    assert first[3].plan_id == first[0].plan_id + 1
    assert first[3].seq == w.seq(3)  # the seqs right after this plan's
    assert w.left == 4


def test_adopting_the_next_plan_keeps_what_it_sent() -> None:
    w = DispatchWindow()
    this, nxt = P(3), P(5, epoch=1)
    w.begin(this, nxt)
    sent = drain(w, limit=5)
    for k in range(3):
        w.took(k)
    sent += drain(w, limit=5)  # nxt batches 0..4 are out now
    ahead = [t for t in sent if t.plan is nxt]
    assert [t.batch for t in ahead] == [0, 1, 2, 3, 4]
    assert w.begin(P(5, epoch=1), P(5, epoch=2)) is True  # equal to the plan loaded ahead
    # its batch k is the seq it was sent under, the old plan's seqs are stale
    assert [w.seq(t.batch) for t in ahead] == [t.seq for t in ahead]
    assert all(w.is_stale(t.seq) for t in sent if t.plan is this)
    assert not any(w.is_stale(t.seq) for t in ahead)
    assert w.out == 5 and w.next_task(5) is None  # nothing sent twice
    w.took(0)
    nxt_task = w.next_task(5)
    assert nxt_task is not None and nxt_task.plan == P(5, epoch=2) and nxt_task.batch == 0


def test_another_plan_makes_everything_sent_stale() -> None:
    w = DispatchWindow()
    w.begin(P(4), P(4, epoch=1))
    sent = drain(w, limit=8)
    assert len(sent) == 8
    assert w.begin(P(6, epoch=7)) is False
    assert all(w.is_stale(t.seq) for t in sent)
    fresh = drain(w, limit=2)
    assert [t.batch for t in fresh] == [0, 1]
    assert min(t.seq for t in fresh) > max(t.seq for t in sent)  # seqs are never reused
    assert w.batch_of(fresh[1].seq) == 1 and w.batch_of(sent[0].seq) < 0


def test_plan_ids_are_never_reused_by_a_dropped_next_plan() -> None:
    # A worker keeps the plans it was sent by id: a new plan must not get the id a
    # dropped next plan had, or its tasks would be indexed with the old order.
    w = DispatchWindow()
    w.begin(P(1), P(2, epoch=1))
    ids = {t.plan_id: t.plan for t in drain(w, limit=3)}
    w.begin(P(2, epoch=9), P(2, epoch=10))
    new = drain(w, limit=4)
    for t in new:
        assert t.plan_id not in ids or ids[t.plan_id] == t.plan


def test_abandon_leaves_nothing_to_send() -> None:
    w = DispatchWindow()
    w.begin(P(5))
    sent = drain(w, limit=2)
    w.abandon()
    assert w.next_task(10) is None and w.left == 0 and w.plan is None
    assert all(w.is_stale(t.seq) for t in sent)
    w.begin(P(5))  # after an abandon, even an equal plan starts afresh
    assert drain(w, limit=1)[0].seq > sent[-1].seq


@pytest.mark.parametrize("limit", [1, 2, 7])
def test_every_batch_of_two_epochs_goes_out_exactly_once(limit: int) -> None:
    w = DispatchWindow()
    plans = [P(5, epoch=e) for e in range(3)]
    w.begin(plans[0], plans[1])
    delivered: list[tuple[int, int]] = []
    seq_plan: dict[int, tuple[int, int]] = {}
    for e in (0, 1):
        if e:
            assert w.begin(plans[1], plans[2])
        for k in range(5):
            for t in drain(w, limit):
                assert t.seq not in seq_plan
                seq_plan[t.seq] = (t.plan.epoch, t.batch)
            w.taking(k)
            delivered.append(seq_plan[w.seq(k)])  # what the loop receives as batch k
            w.took(k)
    assert delivered == [(e, k) for e in (0, 1) for k in range(5)]
