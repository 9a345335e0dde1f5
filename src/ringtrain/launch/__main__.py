"""``python -m ringtrain.launch ...``: ringrun (as ``python -m torch.distributed.run``
is torchrun)."""

from __future__ import annotations

import sys

from ringtrain.launch.cli import main

__all__: list[str] = []

sys.exit(main())
