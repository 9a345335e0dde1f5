"""Which batch goes to a worker next: the dispatch window over two plans (pure logic).

The training process numbers every task it sends with a *seq*, increasing across
plans, so an answer that arrives late can always be told apart from a current one.
The current plan owns seqs ``[base, base + num_batches)``: batch ``k`` is seq
``base + k``. The likely next epoch's plan, when known, owns the seqs right after it,
and its first batches are sent once every batch of the current plan has gone out::

    seq:   ... stale ... | base ........ current plan ........ | next plan ... |
                          ^ taken        ^ dispatched                ^ next_dispatched

At most ``limit`` batches are out (sent, not yet taken by the loop) at once, counting
both plans. :meth:`DispatchWindow.begin` either *adopts* the next plan (the loop went
on with the epoch that was loaded ahead: its batches already sent are kept) or starts
afresh (everything sent so far becomes stale); plan ids are never reused, so a worker
never confuses a dropped next plan with a new one.

No processes, sockets or clocks here: :class:`ringtrain.data.feed.WorkerFeed` asks
the window what to send and tells it what it sent and what the loop took.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

__all__ = ["DispatchWindow", "NextTask", "Batches"]


class Batches(Protocol):
    """What the window needs from a plan (``EpochPlan``, ``ShardPlan``)."""

    @property
    def num_batches(self) -> int: ...


class NextTask(NamedTuple):
    """A batch to send: batch ``batch`` of ``plan`` (id ``plan_id``) as task ``seq``."""

    plan: Any
    plan_id: int
    batch: int
    seq: int


class DispatchWindow:
    """Seq numbering and the bounded window of batches sent ahead, over two plans."""

    def __init__(self) -> None:
        self.plan: Batches | None = None
        self.next_plan: Batches | None = None
        self.plan_id = 0
        self.base = 0  # seq of the current plan's batch 0; lower seqs are stale
        self.top = 0  # one past the highest seq handed out or reserved
        self.dispatched = 0  # batches of the current plan sent so far
        self.taken = 0  # batches of the current plan the loop has taken
        self.next_dispatched = 0  # batches of the next plan sent so far

    # ---- plans -------------------------------------------------------------------
    def begin(self, plan: Batches, next_plan: Batches | None = None) -> bool:
        """Deliver ``plan`` from now on; ``next_plan`` is the likely one after it.

        Returns True when ``plan`` is the next plan loaded ahead (its batches already
        sent are kept, the rest of the old plan is stale), False when it starts afresh
        (every seq handed out so far is stale).
        """
        adopted = self.plan is not None and self.next_plan is not None and plan == self.next_plan
        if adopted:
            assert self.plan is not None
            self.base += self.plan.num_batches
            self.plan_id += 1
            self.dispatched = self.next_dispatched
        else:
            self.abandon()
            self.plan_id += 2  # skip the id a dropped next plan had
            self.dispatched = 0
        self.plan, self.next_plan = plan, next_plan
        self.next_dispatched = 0
        self.top = max(self.top, self.base + plan.num_batches)
        self.taken = 0
        return adopted

    def abandon(self) -> None:
        """No current plan; everything handed out so far is stale."""
        self.base = self.top
        self.plan = self.next_plan = None
        self.next_dispatched = 0

    # ---- seqs --------------------------------------------------------------------
    def seq(self, k: int) -> int:
        """The seq of the current plan's batch ``k``."""
        return self.base + k

    def batch_of(self, seq: int) -> int:
        """The current plan's batch number of ``seq`` (negative: an older plan's)."""
        return seq - self.base

    def is_stale(self, seq: int) -> bool:
        """True for a seq of a plan that ended or was dropped."""
        return seq < self.base

    # ---- the window --------------------------------------------------------------
    @property
    def out(self) -> int:
        """Batches sent and not yet taken, both plans."""
        return self.dispatched - self.taken + self.next_dispatched

    @property
    def left(self) -> int:
        """Batches of both plans not sent yet."""
        if self.plan is None:
            return 0
        nxt = self.next_plan
        return (self.plan.num_batches - self.dispatched
                + (nxt.num_batches - self.next_dispatched if nxt is not None else 0))

    def next_task(self, limit: int) -> NextTask | None:
        """The next batch to send, unless ``limit`` batches are out or none is left."""
        plan = self.plan
        if plan is None or self.out >= limit:
            return None
        # tuple.__new__: a NamedTuple's own __new__ is Python code, and this runs once
        # per batch in the training process.
        if self.dispatched < plan.num_batches:
            return tuple.__new__(NextTask, (plan, self.plan_id, self.dispatched,
                                            self.base + self.dispatched))
        nxt = self.next_plan
        if nxt is not None and self.next_dispatched < nxt.num_batches:
            return tuple.__new__(NextTask, (nxt, self.plan_id + 1, self.next_dispatched,
                                            self.base + plan.num_batches + self.next_dispatched))
        return None

    def sent(self, task: NextTask) -> None:
        """``task`` (from :meth:`next_task`) went to a worker."""
        if task.plan_id == self.plan_id:
            self.dispatched += 1
        else:
            self.next_dispatched += 1
            self.top = max(self.top, task.seq + 1)

    def taking(self, k: int) -> None:
        """The loop waits for batch ``k``: batches before it no longer count as out."""
        self.taken = max(self.taken, k)

    def took(self, k: int) -> None:
        """Batch ``k`` was taken (by the loop, or wrapped for it by the helper)."""
        self.taken = k + 1
