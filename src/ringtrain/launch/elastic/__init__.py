"""ringrun's side of a resizable job (``--min-np M --max-np N``).

- :mod:`.states`: the job's states and every transition between them (pure);
- :mod:`.driver`: the driver, the state machine that watches the job and decides when
  it re-forms, grows or ends (:func:`~.driver.run_elastic` runs a job);
- :mod:`.workers`: starting a world's workers and telling the others their next world;
- :mod:`.worlds`: who is in the next world, with which rank; the blacklist (pure);
- :mod:`.discovery`: which hosts the job may use now.

The workers' side is :mod:`ringtrain.elastic`; the two talk through the files of
:mod:`ringtrain.assignment`. Nothing is imported here, so :mod:`ringtrain.launch.job`
can use :mod:`.worlds` without starting a circle through the driver.
"""

from __future__ import annotations

__all__: list[str] = []
