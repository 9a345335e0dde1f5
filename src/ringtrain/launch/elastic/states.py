"""The states of a resizable job and every transition between them, in one table (pure).

::

    STARTING ──LAUNCHED──► FORMING ──FORMED──► RUNNING
                            ▲  │  ▲               │
                            └──┘  └─LOST, GROWN,──┘
                        LOST, GROWN   REMOVED
    FORMING, RUNNING ──SHORT──► WAITING ──GROWN──► FORMING
    WAITING ──LOST──► WAITING
    FORMING, RUNNING ──FINISHED──► FINISHING ──FORMED──► FINISHING
    FINISHING ──LOST, ALL_EXITED──► ENDED
    FORMING, RUNNING ──TOO_FEW, LIMIT──► ENDED;  WAITING ──TOO_FEW──► ENDED
    every state but ENDED ──STOPPED──► ENDED
    FORMING, RUNNING, WAITING, FINISHING ──OUTPUT_FAILED──► ENDED

- **STARTING**: the first world is not launched yet (waiting for ``--min-np`` slots).
- **FORMING**: the newest world was announced (its new workers started, the others told
  through their assignment files) and not every one of its workers has joined it yet.
- **RUNNING**: every worker of the newest world joined it; only now may the job grow, or
  shrink because the discovery script no longer lists some of its slots (``REMOVED``).
- **WAITING**: fewer than ``--min-np`` workers are left and ``--elastic-timeout`` has not
  run out: the survivors wait for their next world while the driver waits for hosts.
- **FINISHING**: a worker exited 0, so the job is ending: nothing grows or re-forms any
  more; a worker that fails now fails the job.
- **ENDED**: the job's exit code is decided.

A host lost while a world forms (a resize in progress) is ``FORMING --LOST--> FORMING``:
the new workers of the world that never formed are stopped and the survivors are given
the next world. :data:`TRANSITIONS` is every allowed move; :func:`next_state` refuses the
others, so a driver bug is an error instead of a job in a state nobody planned for.
"""

from __future__ import annotations

import enum

__all__ = ["Event", "IllegalTransition", "JobState", "TRANSITIONS", "next_state"]


class JobState(enum.Enum):
    STARTING = "starting"
    FORMING = "forming"
    RUNNING = "running"
    WAITING = "waiting"
    FINISHING = "finishing"
    ENDED = "ended"


class Event(enum.Enum):
    #: The first world's workers were started.
    LAUNCHED = "launched"
    #: Every worker of the newest world acknowledged it.
    FORMED = "formed"
    #: Workers of the world failed or their host was lost; the survivors were given a
    #: smaller world (or, while ending, the job fails).
    LOST = "lost"
    #: New hosts joined: a larger world was announced.
    GROWN = "grown"
    #: The discovery script stopped listing some of the world's slots: a smaller world
    #: without their workers was announced, taken at the next commit.
    REMOVED = "removed"
    #: Fewer than ``--min-np`` workers are left; the job waits for hosts.
    SHORT = "short"
    #: A worker of the world exited 0.
    FINISHED = "finished"
    #: Every worker of the last formed world has exited.
    ALL_EXITED = "all exited"
    #: Fewer than ``--min-np`` workers are left (and no more waiting), or none at all.
    TOO_FEW = "too few"
    #: The job changed size ``--reset-limit`` times and would have to again.
    LIMIT = "reset limit"
    #: ringrun received a signal.
    STOPPED = "stopped"
    #: The job's output can no longer be written (a closed stdout, a full disk).
    OUTPUT_FAILED = "output failed"


_S, _E = JobState, Event
_LIVE = (_S.STARTING, _S.FORMING, _S.RUNNING, _S.WAITING, _S.FINISHING)

#: (state, event) -> the next state. Anything not listed cannot happen.
TRANSITIONS: dict[tuple[JobState, Event], JobState] = {
    (_S.STARTING, _E.LAUNCHED): _S.FORMING,
    (_S.FORMING, _E.FORMED): _S.RUNNING,
    (_S.FORMING, _E.LOST): _S.FORMING,  # a host lost during a resize: the next world
    (_S.FORMING, _E.GROWN): _S.FORMING,  # a host that was connecting joined meanwhile
    (_S.FORMING, _E.FINISHED): _S.FINISHING,
    (_S.RUNNING, _E.LOST): _S.FORMING,
    (_S.RUNNING, _E.GROWN): _S.FORMING,
    (_S.RUNNING, _E.REMOVED): _S.FORMING,
    (_S.FORMING, _E.SHORT): _S.WAITING,
    (_S.RUNNING, _E.SHORT): _S.WAITING,
    (_S.WAITING, _E.GROWN): _S.FORMING,  # hosts came: the survivors and them
    (_S.WAITING, _E.LOST): _S.WAITING,  # another survivor failed meanwhile
    (_S.RUNNING, _E.FINISHED): _S.FINISHING,
    (_S.FINISHING, _E.FORMED): _S.FINISHING,
    (_S.FINISHING, _E.LOST): _S.ENDED,
    (_S.FINISHING, _E.ALL_EXITED): _S.ENDED,
    **{(state, event): _S.ENDED for state in (_S.FORMING, _S.RUNNING)
       for event in (_E.TOO_FEW, _E.LIMIT)},
    (_S.WAITING, _E.TOO_FEW): _S.ENDED,  # --elastic-timeout ran out
    **{(state, _E.STOPPED): _S.ENDED for state in _LIVE},
    **{(state, _E.OUTPUT_FAILED): _S.ENDED for state in (_S.FORMING, _S.RUNNING, _S.WAITING, _S.FINISHING)},
}


class IllegalTransition(RuntimeError):
    """The driver asked for a move the table does not have (a bug in ringrun)."""


def next_state(state: JobState, event: Event) -> JobState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"a resizable job cannot go from {state.value} on {event.value}") from None
