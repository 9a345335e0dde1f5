"""A worker for launcher tests that needs no torch: prints where it runs, then obeys argv.

    probe_worker.py report     print rank, host namespace, env contract, cwd; exit 0
    probe_worker.py sleep      print "ready" and sleep (for signal tests)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _namespace() -> str:
    mine = os.stat("/proc/self/ns/net").st_ino
    for ns in Path("/run/netns").glob("*") if Path("/run/netns").is_dir() else []:
        try:
            if ns.stat().st_ino == mine:
                return ns.name
        except OSError:
            continue
    return "root"


def main() -> None:
    mode = sys.argv[1]
    e = os.environ
    if mode == "report":
        print(f"rank={e['RINGTRAIN_RANK']} ns={_namespace()} local={e['RINGTRAIN_LOCAL_RANK']}/"
              f"{e['RINGTRAIN_LOCAL_SIZE']} cross={e['RINGTRAIN_CROSS_RANK']}/{e['RINGTRAIN_CROSS_SIZE']} "
              f"master={e['MASTER_ADDR']} gloo_if={e.get('GLOO_SOCKET_IFNAME')} "
              f"cwd={os.getcwd()} x={e.get('RT_TEST_X')} hvd={e.get('HOROVOD_RANK')}/"
              f"{e.get('HOROVOD_CROSS_RANK')}/{e.get('HOROVOD_CROSS_SIZE')}@{e.get('HOROVOD_HOSTNAME')}",
              flush=True)
    elif mode == "sleep":
        print("ready", flush=True)
        time.sleep(120)


if __name__ == "__main__":
    main()
