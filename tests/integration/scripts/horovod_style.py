"""A script written the way Horovod scripts and Horovod's test harnesses are: it learns
its place from HOROVOD_* (as horovod/common/util reads them) and checks that ringtrain's
world agrees, then sums the ranks once.

    horovodrun -np 2 python horovod_style.py
"""

import os

import torch

import ringtrain as rt

env = {k: os.environ[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                  "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                                  "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")}
rt.init()
mine = (rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.cross_rank(), rt.cross_size())
theirs = tuple(int(env[k]) for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                    "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"))
if mine != theirs:
    raise SystemExit(f"HOROVOD_* say {theirs}, ringtrain says {mine}")
total = int(rt.allreduce(torch.tensor([float(rt.rank())]), op=rt.Sum).item())
print(f"hvd rank={env['HOROVOD_RANK']}/{env['HOROVOD_SIZE']} local={env['HOROVOD_LOCAL_RANK']}/"
      f"{env['HOROVOD_LOCAL_SIZE']} cross={env['HOROVOD_CROSS_RANK']}/{env['HOROVOD_CROSS_SIZE']} "
      f"host={env['HOROVOD_HOSTNAME']} fusion={os.environ.get('RINGTRAIN_FUSION_MB')}/"
      f"{os.environ.get('HOROVOD_FUSION_THRESHOLD')} timeline={os.environ.get('RINGTRAIN_TIMELINE')}/"
      f"{os.environ.get('HOROVOD_TIMELINE')} sum={total}", flush=True)
rt.shutdown()
