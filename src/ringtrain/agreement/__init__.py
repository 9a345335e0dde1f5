"""Do the ranks agree? Every check that makes all ranks raise the same error, or none.

- :mod:`.ranks`: the one helper they share, :func:`group_ranks` (which ranks hold each
  distinct value) and :func:`settle` (which ranks found a problem);
- :mod:`.headers`: before a collective runs, its ranks compare what they submit
  (``rt.allreduce`` and the others raise a MismatchError on every rank);
- :mod:`.signature`: at the first step of a fused exchange, ranks compare what they will
  exchange, through the job's store.

The same helper decides Horovod's named requests (``horovod/_coordinator/requests.py``),
whether a checkpoint loads (``checkpoint.py``) and whether a layout fits
(``parallel/engine.py``).
"""

from __future__ import annotations

from ringtrain.agreement.headers import (
    KINDS,
    MAX_DIMS,
    OPS,
    Header,
    agree,
    decode,
    describe,
    encode,
    op_code,
    variant_code,
)
from ringtrain.agreement.ranks import group_ranks, settle

__all__ = ["Header", "KINDS", "MAX_DIMS", "OPS", "agree", "decode", "describe", "encode", "group_ranks",
           "op_code", "settle", "variant_code"]
