"""DecodeCrop on the GPU (nvJPEG through torchvision) against DecodeCrop in CPU workers.

On a machine with a GPU (benchmarks/gpu_session.sh runs it):

    python benchmarks/gpu_decode.py [--files 1024] [--batches 20] [--workers 2] [--json F]

1. quality: a batch decoded, cropped and resized on the GPU against ``DecodeCrop.apply``
   on the CPU for the same boxes (mean absolute difference per image, 0-255);
2. GPU time per batch of the device stage alone (CUDA events around
   ``crop.collate.on_device``, median of 10);
3. samples/s of ``rt.data.Loader(device="cuda")`` over the same photo folder, CPU path
   (``DecodeCrop(224)`` in the workers) and GPU path (``DecodeCrop(224, device="cuda")``
   + ``collate_fn=crop.collate``), interleaved rounds, medians.

Without CUDA or a torchvision whose ``decode_jpeg`` loads, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ringtrain as rt  # noqa: E402


def _folder(root: Path, n: int) -> str:
    """Photo JPEGs (benchmarks/photos.py) or, where the packages that ship the photos are
    missing, noise-textured JPEGs of the same sizes."""
    try:
        from photos import write_photo_folder
        write_photo_folder(root, n)
        return "real photos (benchmarks/photos.py)"
    except (ImportError, RuntimeError):
        from PIL import Image
        rng = np.random.default_rng(0)
        for i in range(n):
            h, w = int(rng.integers(333, 501)), int(rng.integers(400, 667))
            base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
            img = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            d = root / f"c{i % 10}"
            d.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            (d / f"{i:06d}.jpg").write_bytes(buf.getvalue())
        return "synthetic JPEGs (scikit-learn/matplotlib photos not installed)"


def _quality(ds_files: list[bytes], device: torch.device) -> dict[str, float]:
    gpu, cpu = rt.data.DecodeCrop(224, device="cuda"), rt.data.DecodeCrop(224)
    torch.manual_seed(0)
    samples = [(gpu(f), 0) for f in ds_files]
    images, _ = gpu.collate.on_device(gpu.collate(samples), device)
    images = images.cpu().numpy()
    mads = [float(np.abs(images[k].astype(int) - cpu.apply(f, s[0].box, s[0].flip)).mean())
            for k, (f, s) in enumerate(zip(ds_files, samples, strict=True))]
    return {"mad_mean": statistics.mean(mads), "mad_max": max(mads), "images": len(mads)}


def _gpu_ms_per_batch(files: list[bytes], device: torch.device, reps: int = 10) -> float:
    crop = rt.data.DecodeCrop(224, device="cuda")
    torch.manual_seed(0)
    host = crop.collate([(crop(f), 0) for f in files])
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        crop.collate.on_device(host, device)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def _loader_rate(root: Path, gpu: bool, workers: int, batches: int) -> float:
    crop = rt.data.DecodeCrop(224, device="cuda" if gpu else "cpu")
    ds = rt.data.ImageFolder(root, decode=False, transform=crop)
    kwargs: dict[str, Any] = {"collate_fn": crop.collate} if gpu else {}
    with rt.data.Loader(ds, batch_size=256, num_workers=workers, device="cuda", **kwargs) as ld:
        if len(ld) == 0:
            raise SystemExit(f"no full batch of 256 in {root}: pass --files 256 or more")
        # Over as many epochs as it takes: --files 1024 makes only 4 batches an epoch,
        # and one pass timed nothing (0 samples/s, then a division by zero).
        n, k, t0 = 0, 0, 0.0
        while k <= 3 + batches:
            for x, _ in ld:
                if k == 3:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                elif k > 3:
                    n += x.shape[0]
                k += 1
                if k > 3 + batches:
                    break
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: skipped, no CUDA device")
        return 0
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as err:  # noqa: BLE001
        print(f"gpu_decode: skipped, torchvision.io.decode_jpeg does not load: {err}")
        return 0
    device = torch.device("cuda", 0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "workers": args.workers, "batch_size": 256}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out["data"] = _folder(root, args.files)
        files = [p.read_bytes() for p in sorted(root.rglob("*.jpg"))]
        out["quality"] = _quality(files[:64], device)
        print(f"quality, GPU vs CPU DecodeCrop: {out['quality']}", flush=True)
        out["gpu_ms_per_batch_256"] = _gpu_ms_per_batch(files[:256], device)
        print(f"device stage, batch of 256: {out['gpu_ms_per_batch_256']:.1f} ms GPU time",
              flush=True)
        rates: dict[str, list[float]] = {"cpu": [], "gpu": []}
        for _ in range(args.rounds):  # interleaved: CPU, GPU, CPU, GPU, ...
            for mode in ("cpu", "gpu"):
                rates[mode].append(_loader_rate(root, mode == "gpu", args.workers, args.batches))
                print(f"  {mode}: {rates[mode][-1]:,.0f} samples/s", flush=True)
        out["samples_per_s"] = {m: statistics.median(v) for m, v in rates.items()}
        out["rounds"] = rates
        print(f"loader samples/s (median of {args.rounds}): CPU workers "
              f"{out['samples_per_s']['cpu']:,.0f}, GPU decode {out['samples_per_s']['gpu']:,.0f} "
              f"({out['samples_per_s']['gpu'] / out['samples_per_s']['cpu']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
