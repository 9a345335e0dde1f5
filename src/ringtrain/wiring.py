"""The composition root: ``rt.init()`` joins the job, then connects the layers.

Importing a ringtrain module registers nothing and starts nothing. A layer that needs
something from a layer below it (the order of docs/architecture.md) gets it here,
through an explicit hook, once the world exists:

- the collectives resolve ``algorithm=`` names through the strategy table of
  :mod:`ringtrain.sync` (``rt.allreduce(t, algorithm="ring")``);
- the runtime's shutdown releases the exchange channel and stall reporting of
  :mod:`ringtrain.sync` before the process group goes;
- the step meter (:mod:`ringtrain.observe`) listens to the event bus when the
  ``observe`` setting is on (the default) or ``ringtrain doctor`` asks for it; with
  ``RINGTRAIN_OBSERVE=0`` the bus has no listener at all.
"""

from __future__ import annotations

from ringtrain import collectives, runtime, sync
from ringtrain.observe import session

__all__ = ["init", "shutdown"]


def init(backend: str | None = None, timeout: float | None = None) -> runtime.World:
    """Join the job described by the environment (a no-launcher run is a 1-process
    world) and set up what the settings ask for. Calling it again returns the world."""
    world = runtime.init(backend=backend, timeout=timeout)
    collectives.set_algorithm_resolver(sync.resolve)
    runtime.add_shutdown_hook(sync.close)
    if world.settings.observe or session.doctor_request() is not None:
        session.arm()
    else:
        session.disarm()
    return world


def shutdown() -> None:
    """Leave the job; safe to call twice or without :func:`init`."""
    runtime.shutdown()
