"""The photo pipeline against torchvision: DecodeCrop's boxes are
``RandomResizedCrop.get_params``'s bit for bit (its float32 arithmetic), ``scale`` from 0,
a region decode whose edge columns are the whole decode's, and ImageFolder's root
spelled as torchvision spells it, with a one-line error for a torchvision transform
handed a numpy array."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.data import turbojpeg
from ringtrain.data.cropbox import random_resized_box
from ringtrain.data.jpeginfo import image_info
from ringtrain.errors import DataError

Image = pytest.importorskip("PIL.Image")

HAVE_TJ3 = turbojpeg.load() is not None


#: (left, top, width, height) that torchvision 0.28.0's ``RandomResizedCrop.get_params``
#: returned after ``torch.manual_seed(seed)`` (measured with the real torchvision, which
#: CI cannot install): seeds 0-3 per (width, height, range index into RANGES).
RANGES = [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.0, 1.0), (0.1, 10.0)), ((0.5, 1.5), (1.0, 1.0))]
TORCHVISION_BOXES: dict[tuple[int, int, int], list[tuple[int, int, int, int]]] = {
    (500, 375, 0): [(80, 17, 343, 294), (153, 71, 311, 272), (54, 13, 336, 360), (343, 217, 112, 141)],
    (500, 375, 1): [(393, 13, 55, 301), (1, 79, 472, 160), (154, 8, 326, 367), (207, 37, 11, 70)],
    (500, 375, 2): [(95, 19, 332, 332), (65, 27, 315, 315), (62, 0, 375, 375), (89, 37, 307, 307)],
    (1, 1, 0): [(0, 0, 1, 1)] * 4,
    (1, 1, 1): [(0, 0, 1, 1)] * 4,
    (1, 1, 2): [(0, 0, 1, 1)] * 4,
    (3, 2, 0): [(0, 0, 2, 2), (0, 0, 2, 2), (0, 0, 2, 2), (0, 1, 1, 1)],
    (3, 2, 1): [(0, 1, 3, 1), (0, 1, 3, 1), (1, 0, 2, 2), (0, 1, 3, 1)],
    (3, 2, 2): [(0, 0, 2, 2), (1, 0, 2, 2), (1, 0, 2, 2), (1, 0, 2, 2)],
    (40, 30, 0): [(2, 5, 27, 23), (9, 7, 25, 22), (2, 1, 27, 29), (3, 17, 9, 11)],
    (40, 30, 1): [(27, 1, 4, 24), (1, 7, 38, 13), (9, 0, 26, 29), (27, 12, 1, 6)],
    (40, 30, 2): [(9, 3, 27, 27), (5, 5, 25, 25), (5, 0, 30, 30), (3, 1, 25, 25)],
    (1000, 100, 0): [(433, 0, 133, 100), (149, 5, 113, 95), (433, 0, 133, 100), (433, 0, 133, 100)],
    (1000, 100, 1): [(361, 1, 552, 89), (94, 3, 108, 27), (38, 21, 506, 77), (555, 37, 8, 51)],
    (1000, 100, 2): [(450, 0, 100, 100)] * 4,
    (100, 1000, 0): [(6, 415, 91, 110), (0, 433, 100, 133), (0, 433, 100, 133), (12, 515, 82, 103)],
    (100, 1000, 1): [(29, 427, 40, 219), (0, 0, 100, 1000), (15, 62, 83, 534), (60, 187, 8, 51)],
    (100, 1000, 2): [(0, 450, 100, 100)] * 4,
}
#: The same on a 6000x4000 photo, range 0, for seeds whose float64 aspect (math.log /
#: math.exp) rounded a side the other way: a box a pixel off, placed elsewhere.
TORCHVISION_PHOTO_BOXES = {1063: (1464, 209, 3809, 3469), 8241: (1637, 831, 3251, 2483),
                           9815: (10, 683, 2514, 2840)}


def _box(width: int, height: int, seed: int, scale: tuple[float, float],
         ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    torch.manual_seed(seed)
    return random_resized_box(width, height, scale, ratio)


# ---- the boxes ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", sorted(TORCHVISION_PHOTO_BOXES))
def test_boxes_are_torchvisions_in_its_float32_arithmetic(seed: int) -> None:
    assert _box(6000, 4000, seed, *RANGES[0]) == TORCHVISION_PHOTO_BOXES[seed]


def test_boxes_match_across_sizes_ranges_and_the_fallback() -> None:
    for (width, height, r), boxes in TORCHVISION_BOXES.items():
        got = [_box(width, height, seed, *RANGES[r]) for seed in range(4)]
        assert got == boxes, (width, height, RANGES[r])


def test_scale_from_zero_is_taken_as_torchvision_takes_it() -> None:
    crop = rt.data.DecodeCrop(8, scale=(0.0, 1.0))
    assert crop.scale == (0.0, 1.0)
    with pytest.raises(DataError, match=r"scale must be \(low, high\) with 0 <= low"):
        rt.data.DecodeCrop(8, scale=(-0.1, 1.0))
    with pytest.raises(DataError, match=r"ratio must be \(low, high\) with 0 < low"):
        rt.data.DecodeCrop(8, ratio=(0.0, 1.0))


# ---- the pixels --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def photo_420() -> bytes:
    """A real photo (matplotlib's 512x600 sample; importing it is much cheaper than
    scikit-learn's) as a 4:2:0 JPEG, the layout whose chroma upsampling looks at
    neighbouring columns."""
    matplotlib = pytest.importorskip("matplotlib")  # in the dev extra
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.exists():
        pytest.skip(f"no {path}")
    buf = io.BytesIO()
    Image.open(path).convert("RGB").save(buf, format="JPEG", quality=90, subsampling=2)
    return buf.getvalue()


@pytest.mark.skipif(not HAVE_TJ3, reason="no libturbojpeg >= 3.0 here (the dev extra's "
                    "turbojpeg wheel bundles one on Linux x86-64)")
def test_region_decode_edges_are_the_whole_decodes(photo_420: bytes) -> None:
    # Lefts on an iMCU boundary (16) and rights inside the image: the region's first and
    # last columns were upsampled as the image's edge, up to 21 levels off.
    info = image_info(photo_420)
    assert info.region and info.mcu == (16, 16)
    whole = rt.data.decode_image(photo_420, decoder="pillow")
    crop = rt.data.DecodeCrop(64)
    for box in [(32, 40, 150, 120), (48, 0, 301, 200), (0, 7, 97, 100), (16, 16, 5, 9)]:
        left, top, w, h = box
        cut = whole[top:top + h, left:left + w]
        want = F.interpolate(torch.from_numpy(np.ascontiguousarray(cut)).permute(2, 0, 1)[None],
                             size=(64, 64), mode="bilinear", antialias=True)[0]
        np.testing.assert_array_equal(crop.apply(photo_420, box), want.numpy(), err_msg=str(box))


# ---- ImageFolder -------------------------------------------------------------------------
def _tree(root: Path) -> None:
    for rel in ["b/2.jpg", "a/1.png", "a/sub/3.jpg"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")


def test_root_is_spelled_and_expanded_as_torchvision(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    seen: list[str] = []
    ds = rt.data.ImageFolder("./data/", decode=False,
                             is_valid_file=lambda p: seen.append(p) or True)
    # torchvision: os.path.join(root, class, ...) with root as given
    assert ds.samples == [("./data/a/1.png", 0), ("./data/a/sub/3.jpg", 0),
                          ("./data/b/2.jpg", 1)]
    assert sorted(seen) == [s for s, _ in ds.samples]
    home = rt.data.ImageFolder("~/data", decode=False)  # os.path.expanduser, as there
    assert home.samples[0] == (os.path.join(str(tmp_path), "data", "a", "1.png"), 0)
    assert home[2] == (b"x", 1)


def test_a_transform_that_wants_a_pil_image_says_what_it_got(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((6, 8, 3), np.uint8)).save(root / "a" / "x.png")

    def wants_pil(img: object) -> object:  # torchvision's F.get_dimensions on an array
        raise TypeError(f"Unexpected type {type(img)}")

    with pytest.raises(DataError, match=r"x\.png: TypeError: Unexpected type <class "
                       r"'numpy\.ndarray'>; .* HxWx3 uint8 numpy array, .*v2\.ToImage\(\)"):
        rt.data.ImageFolder(root, transform=wants_pil)[0]
    with pytest.raises(TypeError):  # on the file's bytes it is the transform's own error
        rt.data.ImageFolder(root, decode=False, transform=wants_pil)[0]
