"""A rank that starts processes its launcher must end however it ends (issue #18, item 5).

No torch, so it starts fast. It starts
- a child in its own process group, as a data-loader worker is (no death signal);
- a daemon: fork, ``setsid()``, fork again; it is in no group of the job and its
  parent is gone, so neither a group kill nor PR_SET_PDEATHSIG reaches it;
then prints "ready" and sleeps. Run it under a shell (``bash -c "python spawn_tree.py;
true"``) and the rank itself is a grandchild of the launcher, without a death signal.
"""

import os
import subprocess
import sys
import time

loader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)
print("ready", flush=True)
time.sleep(600)
