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

#: torchvision's ``IMG_EXTENSIONS``: the same list, so a folder gives the same samples
#: (GIFs are not in it; pass ``extensions=IMAGE_EXTENSIONS + (".gif",)`` to include them).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _list_images(root: bytes, classes: list[bytes], exts: tuple[bytes, ...],
                 is_valid_file: Callable[[str], bool] | None = None
                 ) -> tuple[list[bytes], list[int]]:
    """The image files under each class folder as paths relative to ``root`` (the root
    directory's path, ending in ``/``), and how many each class has, in torchvision's ``make_dataset`` order: folders sorted by
    their whole path (``sorted(os.walk(...))``), each folder's files sorted. That is not
    depth first: ``a-b/`` (``-`` sorts before ``/``) comes before ``a/x/``, and sample
    ``i`` must be the same file as in torchvision's ``ImageFolder`` (a saved split,
    a subset by index).

    Bytes names straight from ``os.scandir``, filtered and sorted a folder at a time: 2.3x
    faster than ``os.walk`` with a ``str`` join and ``fsencode`` per file (30,000 files,
    56 vs 131 ms here, of which 38 ms is the directory reads themselves); an ImageNet-size
    tree lists in about 2.5 s instead of 6.
    """
    names: list[bytes] = []
    counts: list[int] = []
    for cls in classes:
        folders: list[tuple[bytes, list[bytes]]] = []
        pending = [cls + b"/"]
        while pending:
            prefix = pending.pop()
            files: list[bytes] = []
            dirs: list[bytes] = []
            try:
                with os.scandir(root + prefix) as entries:
                    for entry in entries:
                        # is_dir() follows links, as os.walk(followlinks=True) did
                        (dirs if entry.is_dir() else files).append(entry.name)
            except OSError as err:
                raise DataError(f"cannot list {os.fsdecode(root + prefix)}: "
                                f"{err.strerror}; fix its permissions or move it out of "
                                "the image folder") from None
            if is_valid_file is None:
                kept = [prefix + f for f in files if f.lower().endswith(exts)]
            else:  # torchvision hands it the whole path, as a str
                kept = [prefix + f for f in files
                        if is_valid_file(os.fsdecode(root + prefix + f))]
            folders.append((prefix[:-1], sorted(kept)))
            pending += [prefix + d + b"/" for d in dirs]
        # UTF-8 bytes sort as the str paths torchvision sorts (code point order)
        folders.sort(key=lambda folder: folder[0])
        before = len(names)
        for _, found in folders:
            names += found
        counts.append(len(names) - before)
    return names, counts


class ImageFolder:
    """Images under ``root/<class>/`` (any depth below the class folder).

    Args:
        root: the directory whose sub-directories are the classes.
        transform: applied to the decoded image (or to the bytes, ``decode=False``).
        decode: decode with :func:`ringtrain.data.decode.decode_image` (the fastest
            JPEG decoder installed); ``False`` hands out the file's bytes.
        extensions: file name endings that count as images (case-insensitive); one
            ending may be given as a str.
        is_valid_file: ``f(path) -> bool`` picks the files instead of ``extensions``
            (as torchvision's; give one of the two).
        allow_empty: keep class folders with no image (their index stays, with no
            samples), as torchvision's ``allow_empty=True``; refused by default.

    Attributes, as torchvision's: ``classes``, ``class_to_idx``, ``targets`` (one class
    index per sample; also ``labels``, a numpy array), ``samples`` (``(path, index)``
    pairs, built when asked for: the dataset itself keeps no string per file).
    """

    def __init__(self, root: str | os.PathLike[str],
                 transform: Callable[[Any], Any] | None = None, decode: bool = True,
                 extensions: Sequence[str] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False) -> None:
        # As torchvision's: "~" expanded, and the root's spelling kept ("./data/" stays
        # so), so the paths is_valid_file and samples see are the strings torchvision's
        # os.path.join(root, ...) makes.
        given = os.path.expanduser(os.fspath(root))
        self.root = Path(given)
        self._root = os.fsencode(given)
        if not self._root.endswith(b"/"):
            self._root += b"/"
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} is not a directory")
        self.transform = transform
        self.decode = decode
        if extensions is not None and is_valid_file is not None:
            raise DataError("give ImageFolder extensions= or is_valid_file=, not both (as "
                            "torchvision): is_valid_file alone decides which files count")
        if extensions is None:
            extensions = IMAGE_EXTENSIONS
        if isinstance(extensions, str):  # one ending, not its characters (".jpg" matched ".png")
            extensions = (extensions,)
        exts = tuple(e.lower() for e in extensions)
        wanted = "that is_valid_file accepts" if is_valid_file is not None else \
            f"({', '.join(exts)})"
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise DataError(f"{self.root} has no class folders; put images in "
                            f"{self.root}/<class name>/")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        names, counts = _list_images(self._root,
                                     [os.fsencode(c) for c in self.classes],
                                     tuple(os.fsencode(e) for e in exts), is_valid_file)
        if not names:
            raise DataError(f"no image files {wanted} under {self.root}'s class folders")
        # torchvision refuses a class folder with no images too: the class would keep its
        # index but never be seen, which a model sized by len(classes) cannot tell.
        empty = [c for c, n in zip(self.classes, counts, strict=True) if n == 0]
        if empty and not allow_empty:
            listed = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise DataError(f"class folder(s) {listed} under {self.root} hold no image files "
                            f"{wanted}; remove them, pass extensions= that match their "
                            "files, or allow_empty=True to keep their indices")
        self._blob = b"".join(names)  # one object: its pages are shared, never written
        self._ends = np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)))
        self._starts = np.concatenate([[0], self._ends[:-1]])
        self.labels = np.repeat(np.arange(len(self.classes), dtype=np.int32), counts)

    def __len__(self) -> int:
        return len(self._ends)

    @property
    def targets(self) -> list[int]:
        """The class index of every sample, in order (torchvision's ``targets``)."""
        return self.labels.tolist()  # type: ignore[no-any-return]

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, class index)`` of every sample (torchvision's ``samples``/``imgs``);
        built on each access, so a worker that never asks holds no string per file."""
        return [(os.fsdecode(self._raw_path(i)), int(self.labels[i])) for i in range(len(self))]

    imgs = samples

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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise DataError(f"cannot read {os.fsdecode(path)}: {err.strerror} (it was listed when the "
                            "ImageFolder was made; build it again if the folder changed)") from None
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
            try:
                image = self.transform(image)
            except DataError as err:  # ringtrain's own (DecodeCrop on the bytes): name the file
                raise DataError(f"cannot decode {os.fsdecode(path)}: {err}") from err
            except TypeError as err:
                if not self.decode or "ndarray" not in str(err):
                    raise  # the transform's own TypeError keeps its class, as under DataLoader
                # torchvision's transforms refuse a numpy array with a TypeError that
                # names neither the dataset nor the way out ("Unexpected type ndarray").
                raise DataError(
                    f"transform failed on {os.fsdecode(path)}: {type(err).__name__}: {err}; "
                    "rt.data.ImageFolder hands transform= an HxWx3 uint8 numpy array, not "
                    "torchvision's PIL image: start a torchvision pipeline with v2.ToImage() "
                    "(or PIL.Image.fromarray), or crop with decode=False, "
                    "transform=rt.data.DecodeCrop(224)") from err
        return image, int(self.labels[i])
