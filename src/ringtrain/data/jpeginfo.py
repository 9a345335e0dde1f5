"""What a crop needs to know about an encoded image before decoding it: its size, and
for a JPEG whether a region of it can be decoded (baseline or extended Huffman, 1 or 3
components) and its iMCU size.

Read from the markers in Python (a few microseconds: the SOF segment sits within the
first kilobytes); other formats through Pillow's lazy ``Image.open`` (header only).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from ringtrain.errors import DataError

__all__ = ["ImageInfo", "image_info"]

# SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE = frozenset((0xC2, 0xC6, 0xCA, 0xCE))
_HUFFMAN_SEQUENTIAL = frozenset((0xC0, 0xC1))  # baseline, extended sequential
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM, RSTn: no length field


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int
    #: A JPEG whose region can be decoded alone (sequential Huffman, 8-bit, grey or
    #: YCbCr/RGB); False for progressive, arithmetic, 12-bit, CMYK and non-JPEG files.
    region: bool = False
    #: iMCU width and height in pixels (8 x the largest sampling factors).
    mcu: tuple[int, int] = (8, 8)
    jpeg: bool = False


def _jpeg(data: bytes) -> ImageInfo:
    n = len(data)
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise DataError(f"corrupt JPEG: no marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if marker in _SOF:
            if i + 10 > n:
                break
            precision = data[i + 4]
            height = (data[i + 5] << 8) | data[i + 6]
            width = (data[i + 7] << 8) | data[i + 8]
            comps = data[i + 9]
            if i + 10 + 3 * comps > n or width == 0 or height == 0:
                break
            hmax = max(data[i + 11 + 3 * c] >> 4 for c in range(comps))
            vmax = max(data[i + 11 + 3 * c] & 15 for c in range(comps))
            region = marker in _HUFFMAN_SEQUENTIAL and precision == 8 and comps in (1, 3)
            return ImageInfo(width, height, region, (8 * hmax, 8 * vmax), True)
        if marker == 0xDA:  # start of scan before any frame header
            break
        i += 2 + length
    raise DataError("corrupt JPEG: no frame header (SOF) found")


def image_info(data: bytes | bytearray | memoryview) -> ImageInfo:
    """Size (and JPEG layout) of an encoded image, without decoding it."""
    head = bytes(data[:2])
    if head == b"\xff\xd8":
        return _jpeg(bytes(data) if not isinstance(data, bytes) else data)
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading non-JPEG images needs Pillow (pip install pillow)") from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Exception as err:
        from ringtrain.data.decode import unreadable

        raise DataError(unreadable(data, err)) from None
    return ImageInfo(width, height)
