"""A ``ctypes`` binding to libturbojpeg 3 for region decoding: only the pixels a crop needs.

libjpeg-turbo 3's TurboJPEG API decodes a cropping region (``tj3SetCroppingRegion``) at
a DCT scaling factor (``tj3SetScalingFactor``, M/8 for M = 1..16): rows below the
region are never read, rows above it are entropy-decoded and skipped
(``jpeg_skip_scanlines``), and the inverse DCT, upsampling and colour conversion run
only for the region's iMCU columns (``jpeg_crop_scanline``). Errors come back as return
codes (the library catches libjpeg's ``longjmp`` itself), which is what makes a
``ctypes`` binding safe: the libjpeg API's error handler must not return, and Python
cannot be that handler.

Where the library comes from (checked 2026-12): Debian 12 and 13 ship libturbojpeg0
2.1.5, whose TurboJPEG 2 API has no cropping region; libjpeg-turbo >= 3.0 is packaged
by conda-forge, Fedora >= 39, Arch, Alpine >= 3.19 and Homebrew. On PyPI, Pillow's
wheels bundle libjpeg-turbo 3.x as the libjpeg API only, and simplejpeg links it
statically; the ``turbojpeg`` 0.0.2 wheel bundles a libturbojpeg 3.0 beta (2.1.92).
:func:`load` looks in ``$RINGTRAIN_TURBOJPEG`` (a path), then the system's library
path, then the library the ``turbojpeg`` wheel bundles (``turbojpeg.libs/``; the
``dev`` and ``bench`` extras install it on Linux x86-64, so the region path is what the
tests and the benchmark exercise), and uses what it finds only if it has the ``tj3``
functions.

One handle per process (made on first use, again after a fork), so loader workers
never share one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringtrain.errors import DataError

__all__ = ["TurboJPEG", "JpegHeader", "load", "ENV_VAR", "MCU_WIDTH", "MCU_HEIGHT"]

#: Environment variable naming a libturbojpeg (>= 3.0) to use.
ENV_VAR = "RINGTRAIN_TURBOJPEG"

# TurboJPEG 3 constants (turbojpeg.h of libjpeg-turbo 3.0).
_INIT_DECOMPRESS = 1
_PARAM_JPEGWIDTH, _PARAM_JPEGHEIGHT, _PARAM_SUBSAMP = 5, 6, 4
_PARAM_COLORSPACE, _PARAM_PROGRESSIVE = 8, 12
_PF_RGB = 0
_ERR_FATAL = 1
#: iMCU size in pixels per chroma subsampling (TJSAMP_444, 422, 420, GRAY, 440, 411, 441).
MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)
MCU_HEIGHT = (8, 8, 16, 8, 16, 8, 32)
_CS_CMYK, _CS_YCCK = 3, 4


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int),
                ("h", ctypes.c_int)]


@dataclass(frozen=True)
class JpegHeader:
    width: int
    height: int
    subsamp: int  #: TJSAMP_* (-1: unusual sampling)
    colorspace: int  #: TJCS_*
    progressive: bool

    @property
    def cmyk(self) -> bool:
        return self.colorspace in (_CS_CMYK, _CS_YCCK)


def _bundled() -> list[str]:
    """The libturbojpeg the ``turbojpeg`` wheel (PyPI, a pybind11 binding) ships beside
    its module, found without importing it."""
    spec = importlib.util.find_spec("turbojpeg")
    if spec is None or not spec.origin:
        return []
    libs = Path(spec.origin).parent / "turbojpeg.libs"
    return sorted(str(p) for p in libs.glob("libturbojpeg*.so*")) if libs.is_dir() else []


def _candidates() -> list[str]:
    env = os.environ.get(ENV_VAR)
    if env:
        return [env]  # an explicit choice: nothing else
    found = ctypes.util.find_library("turbojpeg")
    return [name for name in (found, "libturbojpeg.so.0", "libturbojpeg.dylib") if name] \
        + _bundled()


def _open() -> ctypes.CDLL | None:
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "tj3SetCroppingRegion"):
            return lib
    return None


class TurboJPEG:
    """Region + DCT-scaled decoding through libturbojpeg 3 (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        lib.tj3Init.restype = ctypes.c_void_p
        lib.tj3Init.argtypes = [ctypes.c_int]
        lib.tj3Destroy.argtypes = [ctypes.c_void_p]
        lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, _Scaling]
        lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
        lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.tj3GetErrorStr.restype = ctypes.c_char_p
        lib.tj3GetErrorStr.argtypes = [ctypes.c_void_p]
        lib.tj3GetErrorCode.argtypes = [ctypes.c_void_p]
        self._handle: int | None = None
        self._pid = -1

    def _h(self) -> int:
        if self._pid != os.getpid():  # a forked child: its own handle
            handle = self._lib.tj3Init(_INIT_DECOMPRESS)
            if not handle:
                raise DataError("libturbojpeg could not create a decompressor (tj3Init)")
            self._handle, self._pid = handle, os.getpid()
        return self._handle  # type: ignore[return-value]

    def _check(self, rc: int, what: str) -> None:
        # Warnings about a corrupt but complete stream (extraneous bytes before a marker,
        # common in camera files) leave a usable image, as Pillow and simplejpeg decode
        # them too. A stream that ends early is a warning to libjpeg-turbo as well, but
        # the rows after the end come back flat grey: the other decoders refuse such a
        # file ("image file is truncated"), and so does this one.
        if rc == 0:
            return
        msg = (self._lib.tj3GetErrorStr(self._h()) or b"").decode(errors="replace")
        if self._lib.tj3GetErrorCode(self._h()) == _ERR_FATAL:
            raise DataError(f"libturbojpeg: {what}: {msg}")
        if "premature end" in msg.lower():
            raise DataError(f"libturbojpeg: {what}: {msg}: the file is truncated; copy it again or "
                            "leave it out of the dataset")

    def header(self, data: bytes) -> JpegHeader:
        """Size, chroma subsampling, colour space and progressive flag of a JPEG."""
        h = self._h()
        self._check(self._lib.tj3DecompressHeader(h, bytes(data), len(data)), "reading the header")
        get = self._lib.tj3Get
        return JpegHeader(get(h, _PARAM_JPEGWIDTH), get(h, _PARAM_JPEGHEIGHT),
                          get(h, _PARAM_SUBSAMP), get(h, _PARAM_COLORSPACE),
                          bool(get(h, _PARAM_PROGRESSIVE)))

    def decode(self, data: bytes, scale: int, region: tuple[int, int, int, int]) -> np.ndarray:
        """The RGB pixels of ``region`` = ``(x, y, w, h)`` of the image scaled by
        ``scale``/8, as an ``h x w x 3`` uint8 array. ``x`` must be a multiple of the
        scaled iMCU width (``MCU_WIDTH`` of the subsampling x ``scale``/8); ``scale``
        is one of 1..8 (libjpeg-turbo has SIMD inverse DCTs for 1, 2, 4 and 8)."""
        h = self._h()
        x, y, w, hh = region
        self._check(self._lib.tj3DecompressHeader(h, data, len(data)), "reading the header")
        g = math.gcd(scale, 8)  # the library's table holds reduced fractions (3/4, not 6/8)
        self._check(self._lib.tj3SetScalingFactor(h, _Scaling(scale // g, 8 // g)),
                    f"scaling {scale}/8")
        self._check(self._lib.tj3SetCroppingRegion(h, _Region(x, y, w, hh)),
                    f"cropping region {region}")
        out = np.empty((hh, w, 3), dtype=np.uint8)
        self._check(self._lib.tj3Decompress8(h, data, len(data), out.ctypes.data, w * 3, _PF_RGB),
                    "decompressing")
        return out


_CACHE: list[TurboJPEG | None] = []


def load() -> TurboJPEG | None:
    """The binding to the first libturbojpeg 3 found (see the module docstring), or
    ``None``; looked up once per process."""
    if not _CACHE:
        lib = _open()
        _CACHE.append(TurboJPEG(lib, lib._name) if lib is not None else None)
    return _CACHE[0]
