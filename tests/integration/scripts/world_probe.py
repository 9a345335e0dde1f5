"""A tiny ringtrain script used by launcher tests.

Modes (argv[1]): ok (allreduce and print), fail-rank-N (rank N exits 3 after the
others block in a collective), sleep (every rank starts a child and sleeps; no torch,
so it is ready at once: what the signal tests check is the launcher's, and a Python
worker ends on SIGTERM or SIGINT at once with or without torch loaded).
"""

import subprocess
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "sleep":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("ready", flush=True)
    time.sleep(600)

import torch  # noqa: E402

import ringtrain as rt  # noqa: E402
import ringtrain.runtime  # noqa: E402

rt.init()
total = rt.allreduce(torch.tensor([float(rt.rank() + 1)]), op=rt.Sum).item()
print(f"rank={rt.rank()} size={rt.size()} local={rt.local_rank()}/{rt.local_size()} "
      f"launcher={ringtrain.runtime.world().env.launcher} sum={total:g}", flush=True)
if mode.startswith("fail-rank-"):
    if rt.rank() == int(mode.rsplit("-", 1)[1]):
        time.sleep(0.5)
        sys.exit(3)
    rt.barrier()  # blocks until the launcher stops us
rt.shutdown()
