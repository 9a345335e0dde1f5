"""Join the job and report this rank's place in it as ringtrain sees it, with the node it
runs on (SLURMD_NODENAME under Slurm) and a sum over all ranks, for the Slurm tests."""

import os

import torch

import ringtrain as rt
import ringtrain.runtime

rt.init()
total = int(rt.allreduce(torch.tensor([float(rt.rank() + 1)]), op=rt.Sum).item())
print(f"rank={rt.rank()}/{rt.size()} local={rt.local_rank()}/{rt.local_size()} "
      f"cross={rt.cross_rank()}/{rt.cross_size()} node={os.environ.get('SLURMD_NODENAME')} "
      f"launcher={ringtrain.runtime.world().env.launcher} sum={total}", flush=True)
rt.shutdown()
