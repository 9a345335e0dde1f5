"""``rt.data.DecodeCrop``: encoded image -> random-resized crop, decoding only what it needs.

The ImageNet-style augmentation (RandomResizedCrop + horizontal flip) throws most of a
photo away: the box covers 8-100% of it (45% on average). Decoding the whole photo and
then cropping spends the decoder's time on pixels nobody looks at; here:

1. the box is drawn first, from the image's header alone (:mod:`ringtrain.data.cropbox`:
   torchvision's sampling, seeded by the loader);
2. only the box is decoded: libjpeg-turbo 3's region decode (rows below the box are not
   read, columns outside it are not transformed; :mod:`ringtrain.data.turbojpeg`), at a
   DCT scaling of 1/2, 1/4 or 1/8 when the box is at least twice the output on both
   sides at that scale (a cheaper inverse DCT on fewer pixels);
3. the box is resized with an antialiased bilinear filter (torch's uint8
   ``interpolate(..., antialias=True)``, which follows Pillow's filter; Pillow's own
   from the fractional box of a DCT-scaled decode) and flipped.

Measured on real photos at ImageNet sizes, one process (docs/data.md, "DecodeCrop"):
region decode 1.20x faster than whole decode; torch's resize 2.4x faster than Pillow's
from a contiguous crop (4.8x from a numpy view); DCT scaling at 5/8-7/8 (crops 1-2x the
output) saved nothing and moved the result up to 7 levels from the reference, so it is
only used at 2x and more. Without libturbojpeg 3 the whole image is decoded (simplejpeg,
else Pillow) and the rest is the same; that is logged once.

PNGs, progressive, arithmetic-coded, 12-bit and CMYK JPEGs take the whole-image path.
``device="cuda"``: see :mod:`ringtrain.data.gpudecode`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.data import turbojpeg
from ringtrain.data.cropbox import Box, check_range, draw_flip, random_resized_box
from ringtrain.data.decode import JPEG_DECODER, decode_image
from ringtrain.data.jpeginfo import ImageInfo, image_info
from ringtrain.errors import DataError

__all__ = ["DecodeCrop", "resize_crop", "dct_scale", "region_backend"]

log = logging.getLogger("ringtrain.data")

_SAID: list[str] = []  # what has been logged in this process (once each)

# The DCT-scaled path resizes with Pillow (it takes a fractional box); Pillow is optional.
_HAVE_PILLOW = importlib.util.find_spec("PIL") is not None


def region_backend() -> str:
    """What decodes a JPEG crop here: ``"libturbojpeg <path>"`` (region decode) or
    ``"whole image (<decoder>)"``."""
    tj = turbojpeg.load()
    if tj is not None:
        return f"libturbojpeg {tj.path}"
    return f"whole image ({JPEG_DECODER or 'none'})"


def dct_scale(box_w: int, box_h: int, size: int) -> int:
    """The DCT scaling numerator M (of M/8) for a box: the smallest of 1, 2, 4 that keeps
    the scaled box at least twice ``size`` on both sides, else 8 (no scaling).

    Measured (docs/data.md): scaling a box of 1-2x the output to just above it saved
    nothing at ImageNet sizes (the 3/8..7/8 inverse DCTs have no SIMD code) and put the
    result up to 7 levels (mean absolute difference) from the full-resolution resize; at
    2x and more the antialiased resize that follows dominates the result."""
    short = min(box_w, box_h)
    for m in (1, 2, 4):
        if short * m >= 16 * size:  # short * m/8 >= 2 * size
            return m
    return 8


def resize_crop(pixels: np.ndarray, size: int, flip: bool) -> np.ndarray:
    """``H x W x 3`` uint8 (any strides) -> ``3 x size x size`` uint8, antialiased
    bilinear (torch's uint8 kernel; within 0.21 levels of Pillow's BILINEAR, measured),
    mirrored left-right when ``flip``."""
    x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)  # a channels-last view
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                          align_corners=False)
    out = x[0]
    if flip:
        out = out.flip(-1)
    return out.contiguous().numpy()


def _check_size(size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise DataError(f"DecodeCrop size must be a positive int, got {size!r}")
    return size


def _encoded(data: Any) -> bytes:
    """The encoded file as bytes: bytes-like, or a uint8 array or tensor (torchvision's
    ``read_file``); anything else (a path, a decoded image) is a DataError saying what to give."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, (np.ndarray, torch.Tensor)) and data.dtype in (np.uint8, torch.uint8) \
            and data.ndim == 1:
        return (data.numpy(force=True) if isinstance(data, torch.Tensor) else data).tobytes()
    raise DataError(
        f"DecodeCrop takes an encoded image file's bytes, got {type(data).__name__}"
        + (f" {data[:60]!r}" if isinstance(data, str) else "")
        + "; read the file's bytes (rt.data.ImageFolder(root, decode=False, transform=...)), "
        "or use a torchvision transform on decoded images")


class DecodeCrop:
    """Encoded image (bytes) -> ``3 x size x size`` uint8 array: a random-resized crop
    (torchvision's ``RandomResizedCrop(size, scale, ratio)`` sampling) and a horizontal
    flip with probability ``flip``, decoding only the crop's region where it can.

    Use it as an image folder's transform on undecoded files::

        ds = rt.data.ImageFolder(root, decode=False, transform=rt.data.DecodeCrop(224))

    Random numbers come from torch's global generator, which the loader seeds per batch
    from its position: the same seed gives the same crops, also after a resume.

    Args:
        size: output side in pixels.
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's aspect ratio (width / height).
        flip: probability of a left-right mirror.
        device: ``"cpu"`` (decode in the loader's workers) or ``"cuda"`` (workers hand
            over the file and its box; the batch is decoded on the GPU with nvJPEG, see
            :mod:`ringtrain.data.gpudecode` and :meth:`collate`).
    """

    def __init__(self, size: int = 224, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: float = 0.5,
                 device: str | torch.device = "cpu") -> None:
        self.size = _check_size(size)
        self.scale = check_range("scale", scale, zero=True)
        self.ratio = check_range("ratio", ratio)
        if isinstance(flip, bool):
            # flip=True read as "random flips on" but was the probability 1.0: every
            # image mirrored, no flip augmentation at all.
            raise DataError(f"flip is a probability, got {flip!r}; pass 0.5 for a random "
                            "mirror (torchvision's RandomHorizontalFlip), 1.0 for always, 0.0 for never")
        if not isinstance(flip, (int, float)) or not 0.0 <= flip <= 1.0:
            raise DataError(f"flip must be a probability in [0, 1], got {flip!r}")
        self.flip = float(flip)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            self.device = torch.device("meta")  # refused just below
        if self.device.type not in ("cpu", "cuda"):
            raise DataError(f"DecodeCrop device must be 'cpu' or 'cuda', got {device!r}")
        self.backend = region_backend()
        if turbojpeg.load() is None and "whole" not in _SAID and self.device.type == "cpu":
            _SAID.append("whole")
            log.info("DecodeCrop decodes whole JPEGs (%s): no libturbojpeg >= 3.0 found for "
                     "region decoding (~1.2x faster per sample); install libjpeg-turbo 3 or "
                     "set %s=/path/to/libturbojpeg.so.0", JPEG_DECODER or "no decoder",
                     turbojpeg.ENV_VAR)

    def __repr__(self) -> str:
        return (f"DecodeCrop({self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"flip={self.flip}, device={str(self.device)!r})")

    # ---- sampling ----------------------------------------------------------------------
    def sample(self, width: int, height: int) -> tuple[Box, bool]:
        """A box and a flip for a ``width`` x ``height`` image, from torch's generator."""
        box = random_resized_box(width, height, self.scale, self.ratio)
        return box, draw_flip(self.flip)

    def __call__(self, data: bytes | bytearray | memoryview | np.ndarray | torch.Tensor) -> Any:
        data = _encoded(data)
        info = image_info(data)
        box, flip = self.sample(info.width, info.height)
        if self.device.type == "cuda":
            from ringtrain.data.gpudecode import encode_sample
            return encode_sample(self, data, info, box, flip)
        return self._apply(data, info, box, flip)

    # ---- the deterministic form ---------------------------------------------------------
    def apply(self, data: bytes | bytearray | memoryview | np.ndarray | torch.Tensor, box: Box,
              flip: bool = False) -> np.ndarray:
        """The crop ``box`` = ``(left, top, width, height)`` of the encoded image, resized
        to ``3 x size x size`` and mirrored when ``flip`` (no randomness)."""
        data = _encoded(data)
        return self._apply(data, image_info(data), box, flip)

    def _apply(self, data: bytes, info: ImageInfo, box: Box, flip: bool) -> np.ndarray:
        left, top, w, h = (int(v) for v in box)
        if w <= 0 or h <= 0 or left < 0 or top < 0 or left + w > info.width \
                or top + h > info.height:
            raise DataError(f"crop box {tuple(box)} is not inside the {info.width}x{info.height} "
                            "image; give (left, top, width, height) with width, height > 0")
        tj = turbojpeg.load() if info.region else None
        if tj is None:
            img = decode_image(data)
            return resize_crop(img[top:top + h, left:left + w], self.size, flip)
        m = dct_scale(w, h, self.size)
        if m == 8 or not _HAVE_PILLOW:
            # Without Pillow (only in the optional extras) a large box is decoded at full
            # scale: slower, but the same torch resize as every other box.
            return resize_crop(self._region(tj, data, info, (left, top, w, h), 8), self.size, flip)
        return self._scaled(tj, data, info, (left, top, w, h), m, flip)

    def _region(self, tj: turbojpeg.TurboJPEG, data: bytes, info: ImageInfo,
                box: Box, m: int) -> np.ndarray:
        """The pixels of ``box`` (in the image scaled by ``m``/8; whole pixels) through
        region decode. The region's left edge must sit on an iMCU column of the scaled
        image, so the decoded region starts there and the box is cut from it.

        The region reaches at least one column past the box on both sides (where the
        image has one): libjpeg-turbo's fancy chroma upsampling (4:2:0, 4:2:2) treats
        a region's first and last columns as the image's edge, which put the box's edge
        columns up to 21 levels from the whole-image decode (measured on photos); one
        column more each side makes the box's pixels the whole decode's exactly. The pad
        costs an extra iMCU column only where the box's edge sits on an iMCU boundary,
        which is where the neighbour is needed (measured: no difference in decode time
        over 400 photos' boxes). Rows need no pad: libjpeg-turbo decodes the rows above
        and below that the upsampling reads (every top and height checked)."""
        left, top, w, h = box
        width = (info.width * m + 7) // 8
        mcu = max(1, math.ceil(info.mcu[0] * m / 8))
        xa = max(0, left - 1) // mcu * mcu
        right = min(width, left + w + 1)
        if right - xa < 3:
            # One chroma column (a region 1 or 2 pixels wide): libjpeg-turbo upsamples it
            # by plain replication, rows too, not with the fancy filter the whole image
            # gets (a 1-pixel-wide box of a 4:2:0 JPEG came out up to 47 levels off).
            # Three columns keep the filter; a whole row narrower than that is the
            # whole decode's anyway.
            right = min(width, xa + 3)
            xa = min(xa, max(0, right - 3) // mcu * mcu)
        pixels = tj.decode(data, m, (xa, top, right - xa, h))
        return pixels[:, left - xa:left - xa + w]

    def _scaled(self, tj: turbojpeg.TurboJPEG, data: bytes, info: ImageInfo, box: Box,
                m: int, flip: bool) -> np.ndarray:
        """A box at least twice the output, decoded at ``m``/8 and resized from its exact
        (fractional) edges. Rounding them to whole scaled pixels moved the result up to 3
        levels from the reference (a one-pixel shift of a sharp photo, measured), so
        this resize is Pillow's, which takes a fractional box (rare at ImageNet sizes:
        only for boxes of 448+ pixels both ways at 224)."""
        from PIL import Image

        left, top, w, h = box
        f = m / 8
        sw, sh = (info.width * m + 7) // 8, (info.height * m + 7) // 8
        # the box's scaled pixels plus one on each side for the filter's support
        x0, y0 = max(0, math.floor(left * f) - 1), max(0, math.floor(top * f) - 1)
        x1 = min(sw, math.ceil((left + w) * f) + 1)
        y1 = min(sh, math.ceil((top + h) * f) + 1)
        pixels = np.ascontiguousarray(self._region(tj, data, info, (x0, y0, x1 - x0, y1 - y0), m))
        img = Image.fromarray(pixels).resize(
            (self.size, self.size), Image.Resampling.BILINEAR,
            box=(left * f - x0, top * f - y0, (left + w) * f - x0, (top + h) * f - y0))
        out = np.asarray(img).transpose(2, 0, 1)
        return np.ascontiguousarray(out[:, :, ::-1] if flip else out)

    # ---- GPU decode ---------------------------------------------------------------------
    @property
    def collate(self) -> Any:
        """The loader's ``collate_fn`` for ``device="cuda"``: packs a batch's files and
        boxes in the workers; its ``on_device`` stage decodes them on the GPU, on the
        loader's side stream (see :mod:`ringtrain.data.gpudecode`)::

            crop = rt.data.DecodeCrop(224, device="cuda")
            ds = rt.data.ImageFolder(root, decode=False, transform=crop)
            loader = rt.data.Loader(ds, device="cuda", collate_fn=crop.collate)
        """
        from ringtrain.data.gpudecode import GpuDecodeCollate
        return GpuDecodeCollate(self)
