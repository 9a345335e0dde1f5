"""JPEGs cut from real photographs that installed packages ship, at ImageNet's sizes.

ImageNet's training JPEGs are photos of about 500x375 (short side mostly 333-500,
aspect up to 4:3 either way), 4:2:0, quality ~90. The photos here are the ones
scikit-learn (``load_sample_images``: china.jpg, flower.jpg, 640x427) and matplotlib
(``sample_data/grace_hopper.jpg``, 512x600) install; each file is a random window of
one of them (a random aspect in [3/4, 4/3], half to all of the largest such window,
maybe mirrored or turned to portrait), resized with Lanczos to a short side in
[333, 500] and saved at a quality in [85, 95] (1 in 10 at 4:4:4, the rest 4:2:0). Real
photographs matter for decode cost: their entropy-coded size (~40-90 KB here) is
what the Huffman decoder spends its time on, and synthetic patterns compress far
better than a photo.

    photo_jpegs(n, seed) -> list of bytes          # in memory
    write_photo_folder(root, n, classes, seed)     # an ImageFolder tree
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np

__all__ = ["source_photos", "photo_jpegs", "write_photo_folder"]


def source_photos() -> list[np.ndarray]:
    """The real photographs installed packages ship, as HxWx3 uint8 arrays."""
    from PIL import Image

    paths: list[Path] = []
    try:
        import sklearn.datasets
        images = Path(sklearn.datasets.__file__).parent / "images"
        paths += [images / "china.jpg", images / "flower.jpg"]
    except ImportError:
        pass
    try:
        import matplotlib
        paths.append(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    except ImportError:
        pass
    photos = [np.asarray(Image.open(p).convert("RGB")) for p in paths if p.exists()]
    if not photos:
        raise RuntimeError("no sample photographs found: pip install scikit-learn matplotlib")
    return photos


def _one(photo: np.ndarray, rng: np.random.Generator) -> bytes:
    from PIL import Image

    if rng.random() < 0.5:
        photo = photo[:, ::-1]
    if rng.random() < 0.3:
        photo = photo.transpose(1, 0, 2)  # portrait
    h, w = photo.shape[:2]
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))  # width / height
    # the largest window of that aspect, then half to all of its area
    ww, hh = (w, w / aspect) if w / aspect <= h else (h * aspect, h)
    f = math.sqrt(rng.uniform(0.5, 1.0))
    ww, hh = max(16, int(ww * f)), max(16, int(hh * f))
    x, y = int(rng.integers(0, w - ww + 1)), int(rng.integers(0, h - hh + 1))
    short = int(rng.integers(333, 501))
    scale = short / min(ww, hh)
    size = (max(1, round(ww * scale)), max(1, round(hh * scale)))
    img = Image.fromarray(np.ascontiguousarray(photo[y:y + hh, x:x + ww])).resize(
        size, Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(rng.integers(85, 96)),
             subsampling=0 if rng.random() < 0.1 else 2)
    return buf.getvalue()


def photo_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs cut from the installed photographs (deterministic in ``seed``)."""
    photos = source_photos()
    rng = np.random.default_rng(seed)
    return [_one(photos[i % len(photos)], rng) for i in range(n)]


def write_photo_folder(root: str | os.PathLike[str], n: int, classes: int = 10,
                       seed: int = 0) -> list[bytes]:
    """Write ``n`` photo JPEGs as ``root/c<k>/<i>.jpg`` (an ImageFolder tree); returns them."""
    jpegs = photo_jpegs(n, seed)
    root = Path(root)
    for i, data in enumerate(jpegs):
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:07d}.jpg").write_bytes(data)
    return jpegs
