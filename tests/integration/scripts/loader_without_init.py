"""A torchrun-style script that starts the process group itself and uses ringtrain's
loader and learning-rate rule without rt.init(): they must see the 2-rank job."""

import torch.distributed as dist

import ringtrain as rt

dist.init_process_group("gloo")
loader = rt.data.Loader(list(range(20)), batch_size=2, shuffle=True, seed=3, num_workers=0,
                        device="cpu")
seen = [int(i) for batch in loader for i in batch]
print(f"rank {dist.get_rank()} samples {sorted(seen)} lr {rt.scale_lr(0.1)}", flush=True)
dist.destroy_process_group()
