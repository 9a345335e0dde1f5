"""DecodeCrop's cheaper paths keep torchvision's results bit for bit: the box draw (one
tensor refilled in place, the log-ratio bounds made once) leaves the same boxes and the
same generator state as torchvision's per-try draws, in float32 and float64; and the
region decode's pixels are the whole decode's at every left edge (every offset in an
iMCU), every width down to one pixel, for 4:2:0, 4:2:2 and 4:4:4."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.data import turbojpeg
from ringtrain.data.cropbox import random_resized_box
from ringtrain.data.jpeginfo import image_info

Image = pytest.importorskip("PIL.Image")

HAVE_TJ3 = turbojpeg.load() is not None
NO_TJ3 = ("no libturbojpeg >= 3.0 here (the dev extra's turbojpeg wheel bundles one on "
          "Linux x86-64; or set RINGTRAIN_TURBOJPEG)")

RANGES = [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.0, 1.0), (0.1, 10.0)), ((0.5, 1.5), (1.0, 1.0)),
          ((0.9, 3.0), (3 / 4, 4 / 3))]
SIZES = [(500, 375), (375, 500), (6000, 4000), (1, 1), (3, 2), (40, 30), (1000, 100),
         (100, 1000), (4032, 3024), (224, 224), (17, 999), (640, 427)]
HUGE = [(10**6, 10**6), (10**6, 7 * 10**5)]


def _torchvision_box(width: int, height: int, scale: tuple[float, float],
                     ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision 0.28's ``RandomResizedCrop.get_params`` as written there (a fresh
    tensor per draw, ``torch.exp``, ``torch.randint``), as (left, top, width, height)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()  # type: ignore[arg-type]
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return int(j), int(i), w, h
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


@pytest.fixture
def default_dtype() -> Iterator[None]:
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


def test_box_draws_and_the_generator_after_them_are_torchvisions(default_dtype: None) -> None:
    # float64 as the default dtype makes torchvision draw 64-bit uniforms (two words of
    # the generator each): the bounds made once per ratio must follow it. The huge
    # sizes make an ulp of the aspect (a float64 exp, float32 bounds in float64) move
    # a side by a pixel in a few percent of draws.
    for dtype, seeds, huge_seeds in ((torch.float32, 2, 15), (torch.float64, 1, 30),
                                     (torch.float32, 1, 3)):
        torch.set_default_dtype(dtype)
        for scale, ratio in RANGES:
            for (width, height), n in [(size, seeds) for size in SIZES] + [(size, huge_seeds) for size in HUGE]:
                for seed in range(n):
                    torch.manual_seed(seed * 1009 + width)
                    want = _torchvision_box(width, height, scale, ratio)
                    after_want = torch.randint(0, 2**24, (2,)).tolist()
                    torch.manual_seed(seed * 1009 + width)
                    got = random_resized_box(width, height, scale, ratio)
                    after = torch.randint(0, 2**24, (2,)).tolist()
                    where = (dtype, width, height, scale, ratio, seed)
                    assert got == want, where
                    assert after == after_want, where  # the same words drawn, no more


# ---- the region's pixels -----------------------------------------------------------------
def _noise_jpeg(width: int, height: int, subsampling: int) -> bytes:
    """Noise (every neighbour differs, so any edge treatment shows) as a JPEG with
    Pillow's ``subsampling`` (0: 4:4:4, 1: 4:2:2, 2: 4:2:0)."""
    rng = np.random.default_rng(width * 10 + subsampling)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


@pytest.mark.skipif(not HAVE_TJ3, reason=NO_TJ3)
@pytest.mark.parametrize("width", [34, 40])
@pytest.mark.parametrize("subsampling,mcu", [(2, 16), (1, 16), (0, 8)])
def test_region_is_the_whole_decode_at_every_left_and_width(width: int, subsampling: int,
                                                            mcu: int) -> None:
    # Every left offset within an iMCU (and past it), widths down to one pixel and to
    # the image's last column: 34 = 2 x 16 + 2 leaves a 2-pixel iMCU at the right.
    data = _noise_jpeg(width, 24, subsampling)
    info = image_info(data)
    assert info.region and info.mcu[0] == mcu
    tj = turbojpeg.load()
    assert tj is not None
    crop = rt.data.DecodeCrop(8)
    whole = tj.decode(data, 8, (0, 0, width, 24))
    bad = []
    for left in range(width):
        for w in sorted({1, 2, 3, 4, 5, 17, width - left}):
            if left + w > width:
                continue
            for top, h in ((0, 24), (5, 3)):
                got = crop._region(tj, data, info, (left, top, w, h), 8)
                if not np.array_equal(got, whole[top:top + h, left:left + w]):
                    bad.append((left, top, w, h))
    assert not bad, f"{len(bad)} boxes differ from the whole decode, first {bad[:5]}"


@pytest.mark.skipif(not HAVE_TJ3, reason=NO_TJ3)
@pytest.mark.parametrize("box", [(0, 3, 1, 9), (33, 0, 1, 24), (0, 0, 2, 5)])
def test_one_pixel_wide_boxes_of_a_420_jpeg_are_torchvisions(box: tuple[int, int, int, int]) -> None:
    # A region one or two pixels wide holds one chroma column, which libjpeg-turbo
    # upsamples by replication (rows too): 1-pixel boxes at the left edge and at a
    # 2-pixel last iMCU came out up to 47 levels off.
    data = _noise_jpeg(34, 24, 2)
    whole = rt.data.decode_image(data, decoder="pillow")
    left, top, w, h = box
    cut = torch.from_numpy(np.ascontiguousarray(whole[top:top + h, left:left + w]))
    want = F.interpolate(cut.permute(2, 0, 1)[None], size=(8, 8), mode="bilinear",
                         antialias=True)[0]
    np.testing.assert_array_equal(rt.data.DecodeCrop(8).apply(data, box), want.numpy())
