"""JPEG/PNG decoding with the fastest decoder this machine has.

Measured here (2 cores, ``python benchmarks/loader_field.py --decoders``, numbers in
docs/data.md): ``simplejpeg`` (libjpeg-turbo through a thin Cython binding) decodes
JPEGs 2.9x faster than Pillow at 96x96, 1.6x at 256x256 and 1.4x at 512x512: Pillow
parses the headers in Python and builds an Image object per file, a cost per image.
``torchvision.io.decode_jpeg`` (timed in a separate torch 2.14.1 + torchvision 0.29.1
environment: PyPI's torchvision wheels for torch 2.13 do not load against its CPU build)
sits between them, 1.6x slower than simplejpeg at 96x96 and within 4% at 512x512.
Pillow-SIMD is not on PyPI for this Python. So JPEG goes to simplejpeg when it is
installed (``pip install 'ringtrain[formats]'``), else Pillow; PNG and everything else
to Pillow.
"""

from __future__ import annotations

import importlib.util
import io
from typing import Any

import numpy as np

from ringtrain.errors import DataError

__all__ = ["decode_image", "jpeg_decoders", "JPEG_DECODER", "unreadable"]

_MODES = {"RGB": "RGB", "L": "GRAY"}


def jpeg_decoders() -> list[str]:
    """The JPEG decoders installed here, fastest first (measured, see above); found
    without importing them."""
    return [name for name, module in (("simplejpeg", "simplejpeg"), ("pillow", "PIL"))
            if importlib.util.find_spec(module) is not None]


#: The decoder :func:`decode_image` uses for JPEG by default ("" when none is installed).
JPEG_DECODER = (jpeg_decoders() or [""])[0]


def _pillow(data: Any, mode: str, jpeg: bool) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding images needs Pillow (pip install pillow)") from None
    try:
        img = Image.open(io.BytesIO(data))
        if jpeg:
            img.draft(mode, img.size)  # decode straight into the target colour space
        if img.mode.startswith("I;16"):
            # 16-bit greyscale (PNG, TIFF): Pillow's convert() clips at 255, so a 16-bit
            # image came out almost all white. Keep the high byte, as Pillow does for
            # 16-bit RGB PNGs and libpng's png_set_strip_16 does.
            grey = (np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8)
            return grey if mode == "L" else np.repeat(grey[:, :, None], 3, axis=2)
        return np.array(img.convert(mode))  # writable (np.asarray of an Image is read-only)
    except (OSError, ValueError, SyntaxError) as exc:  # UnidentifiedImageError is an OSError
        raise DataError(unreadable(data, exc)) from None


def unreadable(data: Any, exc: BaseException) -> str:
    """Why encoded bytes are not an image, in words (Pillow's message names a BytesIO)."""
    if len(data) == 0:
        return "the file is empty (0 bytes); copy it again or leave it out of the dataset"
    text = str(exc)
    if "cannot identify image file" in text:
        head = bytes(data[:8])
        return (f"not an image Pillow can read ({len(data)} bytes starting {head!r}); "
                "give JPEG, PNG or another Pillow format, or leave the file out")
    return f"{text}; copy the file again or leave it out of the dataset"


def decode_image(data: bytes | bytearray | memoryview, mode: str = "RGB",
                 decoder: str | None = None) -> np.ndarray:
    """Decode a JPEG or PNG (any format Pillow reads) to an ``HxWxC`` uint8 array.

    Greyscale and CMYK images are converted to ``mode``; 16-bit images keep their high
    byte (Pillow alone clips 16-bit greyscale at 255). EXIF orientation is not applied,
    as neither Pillow's ``Image.open`` nor torchvision's ``ImageFolder`` applies it.

    Args:
        data: the encoded file.
        mode: ``"RGB"`` (``HxWx3``) or ``"L"`` (greyscale, ``HxWx1``).
        decoder: ``"simplejpeg"`` or ``"pillow"`` to force one for JPEG (default: the
            fastest installed, :data:`JPEG_DECODER`).
    """
    if mode not in _MODES:
        raise DataError(f"mode must be 'RGB' or 'L', got {mode!r}")
    jpeg = bytes(data[:2]) == b"\xff\xd8"
    use = decoder or JPEG_DECODER
    if decoder is not None and decoder not in ("simplejpeg", "pillow"):
        raise DataError(f"decoder must be 'simplejpeg' or 'pillow', got {decoder!r}")
    if jpeg and use == "simplejpeg":
        import simplejpeg

        try:
            return simplejpeg.decode_jpeg(data, colorspace=_MODES[mode])  # type: ignore[no-any-return]
        except ValueError:
            if decoder is not None:
                raise
            # JPEGs libjpeg-turbo's fast path refuses (or a corrupt one): Pillow reads them
    out = _pillow(data, mode, jpeg)
    return out if out.ndim == 3 else out[:, :, None]
