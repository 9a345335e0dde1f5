"""Where a training step's time goes: step meter, timeline, progress, GPU sampling, doctor.

Metering is switched on by ``rt.init()`` (setting ``observe``, on by default) and
starts with the first step (see :mod:`ringtrain.observe.session`)::

    import ringtrain as rt
    ...
    rt.observe.summary()   # plain data: step time, shares per phase, device busy, samples/s
    rt.observe.set_total(epochs=90)   # the progress ETA then runs to the end of training

A data source that is not ``rt.data.Loader`` is made visible with
:func:`instrument`; ``ringtrain doctor`` runs a script and gives a verdict
(:mod:`ringtrain.observe.doctor`). docs/observe.md has the details.
"""

from __future__ import annotations

from ringtrain.observe.instrument import Instrumented, instrument, span
from ringtrain.observe.meter import PHASES, Meter, StepRecord
from ringtrain.observe.session import current, flush, set_total, start, stop, summary

__all__ = [
    "summary", "instrument", "Instrumented", "span", "start", "stop", "flush", "current",
    "set_total",
    "Meter", "StepRecord", "PHASES",
]
