"""A DDP training script written for torchrun, with no ringtrain in it.

``python ddp_torchrun_style.py MODE OUT``: MODE picks how the script joins the job
(``gloo``: init_process_group("gloo"); ``none``: init_process_group(backend=None);
``env``: init_process_group("gloo", init_method="env://"); ``rt-after``: as ``gloo``, then
rt.init() joins the same group). Rank 0 writes the final weights to OUT.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "none":
        dist.init_process_group()
    elif mode == "env":
        dist.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if mode == "rt-after":
        import ringtrain as rt

        rt.init()
        if (rt.rank(), rt.size()) != (rank, size):
            raise SystemExit(f"rt.init() saw rank {rt.rank()} of {rt.size()}")
        # ringtrain's collectives on the script's own group
        if rt.allreduce(torch.ones(1), op=rt.Sum).item() != size:
            raise SystemExit("rt.allreduce on the joined group is wrong")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8 * size, 6, generator=g), torch.randn(8 * size, 2, generator=g)
        mine = slice(rank * 8, (rank + 1) * 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    print(f"rank {rank} of {size} done", flush=True)
    # No rank leaves before every rank has saved and said so: torch 2.13 now and then
    # aborts a rank at interpreter exit (hosts/harness.py's run_torch_only), and the
    # launcher then stops the others, once cutting rank 0 short of its weights.
    dist.barrier()
    if mode == "rt-after":
        rt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
