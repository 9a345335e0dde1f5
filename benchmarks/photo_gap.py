"""What separates rt.data.Loader from the DecodeCrop ceiling on the photo workload.

The ceiling (benchmarks/loader_field.py) is as many processes as workers doing nothing
but ``DecodeCrop(224)`` on photos already in memory. The loader does more per sample:
it reads the file, seeds the batch, writes each sample into a shared-memory slot and
hands the slot to the training process. This measures both sides in the same run, with
each loader measurement between two ceiling measurements (C L C L ... C), so a VM whose
speed drifts from minute to minute (here: the same ceiling 1,222 vs 1,615 samples/s a
minute apart) is compared with itself:

- per round: the loader's samples/s over its steady state (after ``--warm`` batches, so
  every slot has been written by every worker once) divided by the mean of the ceilings
  measured just before and just after it; the median of the rounds' ratios;
- per sample, for the loader's workers and the ceiling's processes: user and system CPU
  (us) and minor page faults, from /proc; the training process's CPU per sample;
- in one process, interleaved: CPU per sample of reading the file, of DecodeCrop on
  bytes in memory, of
  ImageFolder's ``__getitem__`` (file read + DecodeCrop), and of a whole batch through the
  worker's own ``load_batch`` (seeding, getitem, the copy into the batch's memory).

    python benchmarks/photo_gap.py [--rounds 5] [--seconds 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loader_field as lf  # noqa: E402

from ringtrain.data import ImageFolder, Loader  # noqa: E402
from ringtrain.data.workers import _seed_batch, load_batch  # noqa: E402

BATCH, WORKERS, PHOTOS = 256, 2, 2000
_TICK = os.sysconf("SC_CLK_TCK")


def _proc(pid: int) -> np.ndarray:
    """[user s, system s, minor faults] of one process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return np.array([int(fields[11]) / _TICK, int(fields[12]) / _TICK, int(fields[7])], float)


def _procs(pids: list[int]) -> np.ndarray:
    return np.sum([_proc(p) for p in pids], axis=0)


def _per_sample(delta: np.ndarray, n: int) -> dict[str, float]:
    return {"user_us": delta[0] / n * 1e6, "sys_us": delta[1] / n * 1e6, "minflt": delta[2] / n}


def _ceiling_proc(raw: lf.Raw, seconds: float, start: Any, out: Any) -> None:
    torch.set_num_threads(1)
    s0 = _proc(os.getpid())
    start.wait()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(32):
            lf._DECODE_CROP(raw.jpegs[n % len(raw.jpegs)])
            n += 1
    out.put((n, time.perf_counter() - t0, _proc(os.getpid()) - s0))


def ceiling(raw: lf.Raw, seconds: float) -> dict[str, float]:
    """WORKERS processes doing only DecodeCrop, all at once: samples/s and per-sample CPU."""
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_proc, args=(raw, seconds, start, out)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join()
    n = sum(g[0] for g in got)
    return {"samples_per_s": sum(g[0] / g[1] for g in got),
            **_per_sample(sum((g[2] for g in got), np.zeros(3)), n)}


def loader(folder: Path, seconds: float, warm: int) -> dict[str, float]:
    """rt.data.Loader over the photo folder at steady state: samples/s and per-sample CPU."""
    ds = ImageFolder(folder, decode=False, transform=lf._DECODE_CROP)
    ld = Loader(ds, batch_size=BATCH, num_workers=WORKERS, device="cpu")

    def batches() -> Any:
        epoch = 0
        while True:
            ld.set_epoch(epoch)
            yield from ld
            epoch += 1

    it = batches()
    for _ in range(warm):
        next(it)
    pids = lf._children()
    w0, m0 = _procs(pids), _proc(os.getpid())
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        n += len(next(it)[1])
    wall = time.perf_counter() - t0
    w1, m1 = _procs(pids), _proc(os.getpid())
    it.close()
    ld.close()
    main = _per_sample(m1 - m0, n)
    return {"samples_per_s": n / wall, **_per_sample(w1 - w0, n),
            "main_cpu_us": main["user_us"] + main["sys_us"]}


def in_process(raw: lf.Raw, folder: Path, rounds: int) -> dict[str, float]:
    """CPU us per sample, one process: DecodeCrop on bytes, getitem, a batch through load_batch."""
    torch.set_num_threads(1)
    ds = ImageFolder(folder, decode=False, transform=lf._DECODE_CROP)
    memory = np.zeros(BATCH * 3 * 224 * 224 + 4096, np.uint8)
    rng = np.random.default_rng(0)

    def read(idx: np.ndarray) -> None:
        for i in idx:  # as ImageFolder reads a file
            fd = os.open(ds.path(int(i)), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)

    def decodecrop(idx: np.ndarray) -> None:
        for i in idx:
            lf._DECODE_CROP(raw.jpegs[i % len(raw.jpegs)])

    def getitem(idx: np.ndarray) -> None:
        for i in idx:
            ds[int(i)]

    def batch(idx: np.ndarray) -> None:
        _seed_batch(int(idx[0]))
        load_batch(ds, idx, None, lambda nbytes: memory[:nbytes])

    ways = {"read_us": read, "decodecrop_us": decodecrop, "getitem_us": getitem, "load_batch_us": batch}
    got: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for key, fn in ways.items():
            idx = rng.permutation(len(ds))[:BATCH]
            c0 = time.process_time()
            fn(idx)
            got[key].append((time.process_time() - c0) / BATCH * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="loader measurements (>= 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="timing per measurement")
    parser.add_argument("--warm", type=int, default=24,
                        help="batches before timing (every slot written by every worker)")
    parser.add_argument("--json", help="write the rounds and medians here")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the medians need them")
    with tempfile.TemporaryDirectory(prefix="photo-gap-") as tmp:
        root = Path(tmp)
        raw = lf.Raw("photo", PHOTOS, pool_file=root / "pool.pkl")
        lf.write_folder(raw, root / "folder")
        rows: list[dict[str, Any]] = []
        before = ceiling(raw, args.seconds)
        for r in range(args.rounds):
            ours = loader(root / "folder", args.seconds, args.warm)
            after = ceiling(raw, args.seconds)
            ratio = ours["samples_per_s"] / ((before["samples_per_s"] + after["samples_per_s"]) / 2)
            rows.append({"round": r, "loader": ours, "ceiling_before": before, "ceiling_after": after,
                         "share_of_ceiling": ratio})
            print(f"round {r}: ceiling {before['samples_per_s']:,.0f} | loader "
                  f"{ours['samples_per_s']:,.0f} | ceiling {after['samples_per_s']:,.0f}/s  "
                  f"-> {ratio:.2f} of the ceiling", flush=True)
            before = after
        inproc = in_process(raw, root / "folder", 4 * args.rounds)

    def med(side: str, key: str) -> float:
        vals = [row[side][key] for row in rows]
        if side == "ceiling_after":
            vals += [rows[0]["ceiling_before"][key]]
        return statistics.median(vals)

    summary = {
        "share_of_ceiling_median": statistics.median(r["share_of_ceiling"] for r in rows),
        "share_of_ceiling_rounds": [r["share_of_ceiling"] for r in rows],
        "loader_samples_per_s": med("loader", "samples_per_s"),
        "ceiling_samples_per_s": med("ceiling_after", "samples_per_s"),
        "per_sample": {side: {k: med(key, k) for k in ("user_us", "sys_us", "minflt")}
                       for side, key in (("loader_workers", "loader"), ("ceiling", "ceiling_after"))},
        "loader_main_cpu_us": med("loader", "main_cpu_us"),
        "in_process_us": inproc,
        "settings": f"{WORKERS} workers, batch {BATCH}, {PHOTOS} photos, {args.seconds:g} s per "
                    f"measurement, {args.warm} warm-up batches, {args.rounds} rounds",
        "version": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    print(f"\nshare of the ceiling: median {summary['share_of_ceiling_median']:.2f} "
          f"(rounds {', '.join(f'{x:.2f}' for x in summary['share_of_ceiling_rounds'])}); "
          f"medians {summary['loader_samples_per_s']:,.0f} vs {summary['ceiling_samples_per_s']:,.0f}/s")
    print("per sample (medians)        user us   sys us   minor faults")
    for side, v in summary["per_sample"].items():
        print(f"  {side:24s} {v['user_us']:8.0f} {v['sys_us']:8.1f} {v['minflt']:10.1f}")
    print(f"  training process        {summary['loader_main_cpu_us']:8.1f} us CPU")
    ip = summary["in_process_us"]
    print(f"one process, CPU us/sample: file read {ip['read_us']:.0f}, DecodeCrop on bytes "
          f"{ip['decodecrop_us']:.0f}, getitem "
          f"(read + DecodeCrop) {ip['getitem_us']:.0f}, load_batch (seed, getitem, copy) "
          f"{ip['load_batch_us']:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
