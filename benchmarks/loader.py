"""rt.data.Loader vs torch.utils.data.DataLoader, side by side in one run.

Workloads (batch 256, same dataset object, same worker count for both loaders):

  (a) tiny     200,000 samples of 16 float32 + an int label, one __getitem__ each
  (b) images   20,000 uint8 3x72x72 images: random crop 64, flip, normalise (numpy)
  (c) jpeg     JPEG files made with Pillow, kept in a ringtrain record store, decoded
               with Pillow in __getitem__
  (d) step     (b) behind an emulated training step: sleep a fixed "device time" per
               batch (a GPU step leaves the CPU free) and report the device-busy fraction

Throughput is steady state: one warm-up epoch (workers started, slots sized, pages
faulted in), then the measured epochs. Ratios are taken inside this one run; absolute
numbers drift with whatever else the machine runs.

    python benchmarks/loader.py [--quick] [--workers 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ringtrain.data import Loader, RecordDataset, RecordWriter, cpu_budget  # noqa: E402

BATCH = 256
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1) * 255
INV_STD = 1.0 / (np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1) * 255)


# ---- datasets (module level so every start method can pickle them) -------------------
class TinyDataset:
    """(a): per-sample Python overhead dominates."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 16), dtype=np.float32)
        self.y = rng.integers(0, 10, n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], int(self.y[i])


class ImageDataset:
    """(b): random crop 64 of 72, horizontal flip, per-channel normalisation."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(1)
        self.images = rng.integers(0, 256, (n, 3, 72, 72), dtype=np.uint8)
        self.labels = rng.integers(0, 1000, n)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        top, left = np.random.randint(0, 9, 2)
        img = self.images[i, :, top:top + 64, left:left + 64]
        if np.random.rand() < 0.5:
            img = img[:, :, ::-1]
        out = (img.astype(np.float32) - MEAN) * INV_STD
        return out, int(self.labels[i])


def decode_jpeg(record: bytes) -> tuple[np.ndarray, int]:
    """(c): record = 2-byte label + JPEG bytes -> CHW uint8 image and the label."""
    from PIL import Image

    label = int.from_bytes(record[:2], "little")
    img = Image.open(io.BytesIO(record[2:]))
    img.draft("RGB", img.size)
    arr = np.asarray(img.convert("RGB"))
    return np.ascontiguousarray(arr.transpose(2, 0, 1)), label


def make_jpeg_store(directory: Path, n: int, size: int) -> RecordDataset:
    from PIL import Image

    rng = np.random.default_rng(2)
    yy, xx = np.mgrid[0:size, 0:size]
    with RecordWriter(directory, shard_bytes=64 << 20) as writer:
        for i in range(n):
            # Smooth gradients plus noise: compresses like a photo, not like white noise.
            base = (np.sin(xx / (3 + i % 7)) + np.cos(yy / (4 + i % 5))) * 60 + 128
            img = np.stack([base, base[::-1], base[:, ::-1]], axis=-1)
            img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            writer.write((i % 1000).to_bytes(2, "little") + buf.getvalue())
    return RecordDataset(directory, transform=decode_jpeg)


def record_value(record: bytes) -> np.ndarray:
    """(e): a record -> a fixed-size int64 pair (its length and first byte)."""
    return np.array([len(record), record[0] if record else 0], dtype=np.int64)


class NaiveRecords:
    """(e) baseline: every record a Python bytes object in a list, as many datasets do."""

    def __init__(self, records: list[bytes]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> np.ndarray:
        return record_value(self.records[i])


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _write_store(directory: str, n: int) -> None:
    """Write ``n`` random records of 8..39 bytes (run in a child process, so the
    training process holds none of the writer's temporaries)."""
    rng = np.random.default_rng(3)
    with RecordWriter(directory, shard_records=2_000_000) as writer:
        for first in range(0, n, 1_000_000):
            lengths = rng.integers(8, 40, min(1_000_000, n - first))
            blob = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint8).tobytes()
            ends = np.cumsum(lengths).tolist()
            for a, b in zip([0, *ends[:-1]], ends, strict=False):
                writer.write(blob[a:b])


def _read_all(store: RecordDataset) -> list[bytes]:
    return [store.record(i) for i in range(len(store))]


def records_memory(n: int, samples: int, naive: bool) -> dict[str, Any]:
    """(e): per-worker memory while 2 workers read ``samples`` random records of ``n``."""
    import multiprocessing as mp

    out: dict[str, Any] = {"records": n, "samples_read": samples}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "r")
        t0 = time.perf_counter()
        writer = mp.get_context("fork").Process(target=_write_store, args=(path, n))
        writer.start()
        writer.join()
        out["write_s"] = time.perf_counter() - t0
        out["store_bytes"] = sum(p.stat().st_size for p in Path(path).iterdir())
        makers: dict[str, Callable[[], Any]] = {
            "RecordDataset": lambda: RecordDataset(path, transform=record_value)}
        if naive:  # what many datasets do: every record a bytes object in a list
            makers["list of bytes"] = lambda: NaiveRecords(_read_all(RecordDataset(path)))
        for name, make in makers.items():
            ds = make()
            loader = Loader(ds, batch_size=4096, num_workers=2, device="cpu")
            it = iter(loader)
            next(it)
            pids = loader.worker_pids
            before = [_smaps(p) for p in pids]
            t0 = time.perf_counter()
            for k, _ in enumerate(it):
                if (k + 2) * 4096 >= samples:
                    break
            wall = time.perf_counter() - t0
            after = [_smaps(p) for p in pids]
            parent = _smaps(os.getpid())
            loader.close()
            out[name] = {
                "samples_per_s": samples / wall,
                "parent_rss_mib": parent["Rss"] / 2**20,
                "worker_rss_mib": [a["Rss"] / 2**20 for a in after],
                "worker_pss_mib": [a["Pss"] / 2**20 for a in after],
                "worker_uss_mib": [(a["Private_Dirty"] + a.get("Private_Clean", 0)) / 2**20
                                   for a in after],
                "worker_private_growth_mib": [
                    (a["Private_Dirty"] - b["Private_Dirty"]) / 2**20
                    for a, b in zip(after, before, strict=False)],
            }
            print(f"  records  {name:14s} {json.dumps(out[name])}", flush=True)
            del loader, it, ds
    return out


# ---- measurement --------------------------------------------------------------------
def _count(batch: Any) -> int:
    return len(batch[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pids(loader: Any) -> list[int]:
    if isinstance(loader, Loader):
        return loader.worker_pids
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None) or []
    return [w.pid for w in workers]  # torch's private field; fine for a benchmark


def measure(make: Callable[[], Iterable[Any]], epochs: int, step_s: float = 0.0
            ) -> dict[str, float]:
    """Samples/s over ``epochs`` after a warm-up epoch; with ``step_s``, also the
    fraction of wall time the emulated device was busy. CPU seconds per sample of the
    training process and of the workers are recorded too: unlike wall time they hardly
    depend on what else the machine runs."""
    loader = make()
    for _ in loader:  # warm-up: workers, slot sizing, page faults
        pass
    pids = _worker_pids(loader)
    cpu0 = [_cpu_s(p) for p in pids]
    samples, busy = 0, 0.0
    own0 = time.process_time()
    start = time.perf_counter()
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch + 1)
        for batch in loader:
            samples += _count(batch)
            if step_s:
                # The emulated device is busy for as long as the sleep really lasts (a
                # wake-up a little late is the emulation's, not the loader's, time).
                t_step = time.perf_counter()
                time.sleep(step_s)
                busy += time.perf_counter() - t_step
    wall = time.perf_counter() - start
    own = time.process_time() - own0
    workers = sum(_cpu_s(p) - c for p, c in zip(pids, cpu0, strict=False))
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del loader
    return {"samples_per_s": samples / wall, "busy": busy / wall if step_s else float("nan"),
            "main_cpu_us_per_sample": own / samples * 1e6,
            "worker_cpu_us_per_sample": workers / samples * 1e6}


def variants(dataset: Any, workers: int, copy_out: bool = False
             ) -> dict[str, Callable[[], Iterable[Any]]]:
    out: dict[str, Callable[[], Iterable[Any]]] = {
        "torch w=0": lambda: DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0),
        f"torch w={workers}": lambda: DataLoader(
            dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
            persistent_workers=True),
        "ringtrain w=0": lambda: Loader(dataset, batch_size=BATCH, num_workers=0, device="cpu"),
        f"ringtrain w={workers}": lambda: Loader(dataset, batch_size=BATCH, num_workers=workers,
                                                 device="cpu"),
    }
    if copy_out:
        out[f"ringtrain w={workers} copy-out"] = lambda: Loader(
            dataset, batch_size=BATCH, num_workers=workers, device="cpu", zero_copy=False)
    return out


def _precise_sleep() -> None:
    """Make (d)'s emulated device time exact: Linux delays a sleeping thread's wake-up
    by its timer slack (50 us by default, ~125 us measured per 10 ms sleep in all),
    an artefact of emulating the device with sleep, charged to every loader alike."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK = 29, 1 ns
    except (OSError, AttributeError):
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    _precise_sleep()
    w = args.workers
    scale = 0.25 if args.quick else 1.0
    epochs = 1 if args.quick else 2
    results: dict[str, Any] = {}

    def bench(name: str, dataset: Any, copy_out: bool = False, step_s: float = 0.0) -> None:
        # Best of `repeat` runs, variants interleaved: other load on the machine only
        # ever slows a run down, so the fastest run is the best estimate for each.
        row: dict[str, dict[str, float]] = {}
        runs = [(label, make) for _ in range(args.repeat)
                for label, make in variants(dataset, w, copy_out).items()]
        for label, make in runs:
            r = measure(make, epochs, step_s)
            if label not in row or r["samples_per_s"] > row[label]["samples_per_s"]:
                row[label] = r
            print(f"  {name:8s} {label:26s} {r['samples_per_s']:>12,.0f} samples/s"
                  f"   cpu/sample: main {r['main_cpu_us_per_sample']:6.2f} us, workers "
                  f"{r['worker_cpu_us_per_sample']:6.2f} us"
                  + (f"  busy {r['busy']:.1%}" if step_s else ""), flush=True)
        results[name] = row

    bench("tiny", TinyDataset(int(200_000 * scale)))
    images = ImageDataset(int(20_000 * scale))
    bench("images", images, copy_out=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = make_jpeg_store(Path(tmp) / "jpeg", int(8_000 * scale), args.jpeg_size)
        bench("jpeg", store)
        store.close()
    # (d): a step the workers can outrun: 1.25x the time our loader needs per batch at
    # full speed in (b), but no shorter than args.step_ms.
    capacity = results["images"][f"ringtrain w={w}"]["samples_per_s"]
    step_s = max(args.step_ms / 1e3, 1.25 * BATCH / capacity)
    bench("step", images, step_s=step_s)
    results["step_setup"] = {"step_ms": step_s * 1e3, "demand_samples_per_s": BATCH / step_s,
                             "worker_capacity_samples_per_s": capacity}
    return results


def summarise(results: dict[str, Any], w: int) -> dict[str, Any]:
    def sps(name: str, label: str) -> float:
        return float(results[name][label]["samples_per_s"])

    ours = f"ringtrain w={w}"
    theirs = f"torch w={w}"
    rows = {
        "a tiny: vs torch (>=3x)": (sps("tiny", ours) / sps("tiny", theirs), 3.0),
        "b images: vs torch (>=2x)": (sps("images", ours) / sps("images", theirs), 2.0),
        "b images: vs torch w=0 (>=1.6x)": (sps("images", ours) / sps("images", "torch w=0"), 1.6),
        "c jpeg: vs torch w=0 (>=1.7x)": (sps("jpeg", ours) / sps("jpeg", "torch w=0"), 1.7),
        "d step: device busy (>=97%)": (float(results["step"][ours]["busy"]), 0.97),
    }
    return {k: {"value": v, "target": t, "met": v >= t} for k, (v, t) in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the data, 1 epoch")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs per loader and workload, best kept (default 2, quick 1)")
    parser.add_argument("--jpeg-size", type=int, default=96, help="JPEG side in pixels")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="shortest emulated device step per batch for (d)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("loader.json"))
    parser.add_argument("--records", type=int, default=0, metavar="N",
                        help="only measure per-worker memory reading a store of N records (e)")
    parser.add_argument("--records-read", type=int, default=2_000_000,
                        help="random records the workers read in (e)")
    parser.add_argument("--naive", action="store_true",
                        help="(e) also measures a Python list of bytes (copy-on-write growth)")
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    if args.records:
        mem = records_memory(args.records, args.records_read, args.naive)
        args.out.write_text(json.dumps({"records_memory": mem}, indent=1))
        print(f"wrote {args.out}")
        return 0
    budget = cpu_budget()
    print(f"{budget.describe()}; torch {torch.__version__}; batch {BATCH}; "
          f"{args.workers} workers; best of {args.repeat}{' (quick)' if args.quick else ''}; "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    results = run(args)
    summary = summarise(results, args.workers)
    print("\nworkload  " + "".join(f"{k:>24s}" for k in results["tiny"]))
    for name in ("tiny", "images", "jpeg", "step"):
        cells = []
        for label in results["tiny"]:
            r = results[name].get(label)
            cells.append(f"{r['samples_per_s']:>16,.0f}/s" + (f" {r['busy']:>5.1%}" if name == "step"
                                                            else "      ") if r else " " * 24)
        print(f"{name:9s} " + "".join(f"{c:>24s}" for c in cells))
    setup = results["step_setup"]
    print(f"\n(d) step {setup['step_ms']:.1f} ms/batch = {setup['demand_samples_per_s']:,.0f} "
          f"samples/s demanded; ringtrain workers' capacity "
          f"{setup['worker_capacity_samples_per_s']:,.0f}/s (from (b))")
    print("\ntarget                                   value   target  met")
    for k, v in summary.items():
        fmt = "{:.1%}" if "busy" in k else "{:.2f}x"
        print(f"{k:36s} {fmt.format(v['value']):>9s} {fmt.format(v['target']):>8s}  "
              f"{'yes' if v['met'] else 'NO'}")
    doc = {"machine": {"loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
                       "cpu_budget": budget.cpus, "affinity": budget.affinity,
                       "quota": budget.quota, "python": platform.python_version(),
                       "torch": torch.__version__, "numpy": np.__version__,
                       "os_cpu_count": os.cpu_count()},
           "batch_size": BATCH, "workers": args.workers, "quick": args.quick,
           "repeat": args.repeat,
           "results": results, "targets": summary}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
