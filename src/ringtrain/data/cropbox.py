"""Where a random-resized crop falls: the box sampling of torchvision's ``RandomResizedCrop``.

The sampling (Szegedy et al. 2015, "Going deeper with convolutions", as torchvision
implements it and documents it): up to ten tries of an area fraction uniform in
``scale`` and an aspect ratio log-uniform in ``ratio``; the first box that fits in the
image is placed uniformly at random; after ten misses, the largest centred box whose
aspect is clamped into ``ratio``. Random numbers come from torch's global CPU generator,
drawn in torchvision's order (area, log-ratio, then top, then left; a flip after it
with one ``torch.rand``) and in its float32 arithmetic, so with the same torch seed the
boxes are torchvision's; the
loader seeds that generator per batch from the batch's position (``seed_workers``), so a
resumed run draws the same boxes.

Pure functions; no image is touched here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ringtrain.errors import DataError

__all__ = ["Box", "random_resized_box", "draw_flip", "check_range"]

#: ``(left, top, width, height)`` in pixels of the source image.
Box = tuple[int, int, int, int]


def check_range(name: str, value: Sequence[float], zero: bool = False) -> tuple[float, float]:
    """``value`` as a ``(low, high)`` pair with ``0 < low <= high`` (``0 <= low`` when
    ``zero``); else a DataError. torchvision takes ``scale=(0.0, 1.0)`` (a zero area is
    one of its misses), not a zero ratio (its log is out of range)."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise DataError(f"{name} must be a (low, high) pair of numbers, got {value!r}") from None
    if not (low <= high and (low > 0 or (zero and low == 0))):
        bound = "0 <=" if zero else "0 <"
        raise DataError(f"{name} must be (low, high) with {bound} low <= high, got {value!r}")
    return low, high


#: torch.log of a ratio pair, per (low, high, default dtype): torchvision's bounds, made
#: once rather than per box (a tensor, a log and two reads were a third of a box's time).
_LOG_RATIO: dict[tuple[float, float, torch.dtype], tuple[float, float]] = {}


def _log_bounds(ratio: tuple[float, float]) -> tuple[float, float]:
    """``torch.log(torch.tensor(ratio))`` as torchvision computes it (in torch's default
    dtype, float32 unless set otherwise), as two floats."""
    key = (ratio[0], ratio[1], torch.get_default_dtype())
    bounds = _LOG_RATIO.get(key)
    if bounds is None:
        low, high = torch.log(torch.tensor(ratio)).tolist()
        if len(_LOG_RATIO) >= 64:  # ratios made per call: keep the table small
            _LOG_RATIO.clear()
        bounds = _LOG_RATIO[key] = (low, high)
    return bounds


def random_resized_box(width: int, height: int, scale: tuple[float, float] = (0.08, 1.0),
                       ratio: tuple[float, float] = (3 / 4, 4 / 3), tries: int = 10) -> Box:
    """A random-resized-crop box of a ``width`` x ``height`` image (see the module
    docstring), drawn from torch's global generator."""
    area = width * height
    # The log-ratio bounds and the exp in torch's default dtype (float32), as
    # torchvision computes them: in float64 the aspect moved by an ulp now and then, and
    # about 1 box in 6,000 of a 6000x4000 photo came out a pixel off (and placed
    # elsewhere, as randint's range changed with it).
    log_lo, log_hi = _log_bounds(ratio)
    # One tensor for the tries' draws and one for the position, refilled in place: the
    # kernels torchvision runs on a fresh tensor per draw (torch.empty(1).uniform_,
    # torch.exp; randint is empty(...).random_(low, high)) on the same generator, so the
    # values and the generator's state after them are torchvision's (checked against
    # torchvision 0.28 on 48,000 seeds, sizes and ranges, float32 and float64), in a
    # third of the time (14 us a box against 40: fewer allocations and argument parses).
    draw = torch.empty(1)
    for _ in range(tries):
        target = area * draw.uniform_(scale[0], scale[1]).item()
        aspect = draw.uniform_(log_lo, log_hi).exp_().item()
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            pick = torch.empty(1, dtype=torch.int64)
            top = int(pick.random_(0, height - h + 1).item())
            left = int(pick.random_(0, width - w + 1).item())
            return left, top, w, h
    # Ten misses (a very long or very tall image, or a scale range above 1): the whole
    # image, cut to the nearest allowed aspect, centred.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def draw_flip(p: float) -> bool:
    """A horizontal flip with probability ``p``: one draw whatever ``p``, as
    RandomHorizontalFlip does, so the generator stays in step with torchvision's."""
    return bool(torch.rand(1).item() < p)
