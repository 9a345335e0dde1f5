"""Training over slow links: exchange every ``sync_every`` steps instead of every step.

::

    opt = rt.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=10)
    opt = rt.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                    torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
                    sync_every=50)

- :mod:`.localsgd`  ``LocalSGD``: local steps, parameters averaged every H steps
- :mod:`.diloco`    ``DiLoCo``: inner steps, an outer optimizer on the averaged change
- :mod:`.periodic`  the engine both share: schedule, fused exchange, state, resizing
- :mod:`.fragments` which parameters form each fragment and when it syncs (pure)
- :mod:`.checks`    argument checks and the first-step agreement of every rank

See docs/lowcomm.md for when each pays and what it costs in convergence.
"""

from __future__ import annotations

from ringtrain.lowcomm.diloco import DiLoCo
from ringtrain.lowcomm.localsgd import LocalSGD
from ringtrain.lowcomm.periodic import PeriodicSync

__all__ = ["DiLoCo", "LocalSGD", "PeriodicSync"]
