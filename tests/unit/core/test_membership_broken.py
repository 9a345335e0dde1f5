"""Which failures mark a process's groups broken (no teardown, exit with status 1)."""

from __future__ import annotations

from types import SimpleNamespace

from ringtrain.runtime.membership import Membership


def _joined() -> Membership:
    m = Membership()
    m.world = SimpleNamespace(owns_group=False)  # type: ignore[assignment] - only its presence matters
    return m


def test_a_failure_inside_a_world_marks_it_broken() -> None:
    m = _joined()
    m.mark_broken("a peer vanished mid-exchange")
    assert m.broken == "a peer vanished mid-exchange"


def test_a_late_failure_of_an_abandoned_world_marks_nothing() -> None:
    """A resizable job left the world (abandon) and has not joined the next: a failure of
    the old world's operations reported now (the Horovod coordinator failing what was
    pending when the lost hosts' connections are closed again) must not make the next
    world end with status 1."""
    m = _joined()
    m.mark_broken("the coordinator stopped: the job changed size")
    m.abandon()
    assert m.broken is None
    m.mark_broken("the coordinator stopped: the job changed size")
    assert m.broken is None
