"""rt.data.DecodeCrop: torchvision's crop sampling, region decode against a whole-image
reference on real photos, the fallbacks, and the crops a seeded loader draws."""

from __future__ import annotations

import io
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ringtrain as rt
from ringtrain.data import decodecrop, turbojpeg
from ringtrain.data.cropbox import random_resized_box
from ringtrain.data.jpeginfo import image_info
from ringtrain.errors import DataError

Image = pytest.importorskip("PIL.Image")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from photos import photo_jpegs  # noqa: E402

HAVE_TJ3 = turbojpeg.load() is not None
NO_TJ3 = ("no libturbojpeg >= 3.0 here (the dev extra's turbojpeg wheel bundles one on "
          "Linux x86-64; or set RINGTRAIN_TURBOJPEG)")


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    try:
        return photo_jpegs(24, seed=7)
    except RuntimeError as err:  # neither scikit-learn nor matplotlib (both in the dev extra)
        pytest.skip(str(err))


def _reference(data: bytes, box: tuple[int, int, int, int], size: int, flip: bool) -> np.ndarray:
    """The issue's reference: whole-image decode, crop, Pillow's bilinear (antialiased)
    resize."""
    img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    left, top, w, h = box
    crop = Image.fromarray(np.ascontiguousarray(img[top:top + h, left:left + w]))
    out = np.asarray(crop.resize((size, size), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
    return out[:, :, ::-1] if flip else out


def _mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# ---- box sampling -----------------------------------------------------------------------
def test_boxes_follow_torchvisions_draws_in_its_order() -> None:
    # RandomResizedCrop.get_params, as documented: area fraction, then log-ratio (both
    # uniform), w/h rounded, then top, then left with randint; the first box that fits.
    torch.manual_seed(3)
    got = random_resized_box(500, 375)
    torch.manual_seed(3)
    log_ratio = torch.log(torch.tensor((3 / 4, 4 / 3)))  # in float32, as torchvision
    while True:
        area = 500 * 375 * torch.empty(1).uniform_(0.08, 1.0).item()
        aspect = torch.exp(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]))).item()
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= 500 and 0 < h <= 375:
            top = int(torch.randint(0, 375 - h + 1, size=(1,)).item())
            left = int(torch.randint(0, 500 - w + 1, size=(1,)).item())
            break
    assert got == (left, top, w, h)


@pytest.mark.parametrize("width,height,expected", [
    (1000, 10, (495, 0, 10 * 4 / 3, 10)),  # too wide: aspect clamped to 4/3, centred
    (10, 1000, (0, 493, 10, 10 / 0.75)),  # too tall
])
def test_ten_misses_fall_back_to_the_centred_clamped_box(width: int, height: int,
                                                         expected: tuple[float, ...]) -> None:
    torch.manual_seed(0)
    left, top, w, h = random_resized_box(width, height, scale=(0.9, 1.0))
    assert (w, h) == (round(expected[2]), round(expected[3]))
    assert (left, top) == ((width - w) // 2, (height - h) // 2)


def test_boxes_stay_inside_and_within_the_ranges() -> None:
    torch.manual_seed(1)
    for _ in range(300):
        left, top, w, h = random_resized_box(500, 375)
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
        assert 0.08 * 0.95 <= w * h / (500 * 375) <= 1.0
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_dct_scale_only_from_twice_the_output() -> None:
    # the scaled box must stay >= 2 x 224 on both sides
    assert decodecrop.dct_scale(895, 2000, 224) == 8
    assert decodecrop.dct_scale(896, 900, 224) == 4
    assert decodecrop.dct_scale(1792, 1800, 224) == 2
    assert decodecrop.dct_scale(3584, 4000, 224) == 1


# ---- quality ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["region", "whole"])
def test_apply_matches_whole_decode_crop_and_pillow_resize(
        photos: list[bytes], backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "region" and not HAVE_TJ3:
        pytest.skip(NO_TJ3)
    if backend == "whole":
        monkeypatch.setattr(turbojpeg, "_CACHE", [None])
    crop = rt.data.DecodeCrop(224)
    torch.manual_seed(0)
    worst = 0.0
    for data in photos:
        info = image_info(data)
        for _ in range(3):
            box, flip = crop.sample(info.width, info.height)
            out = crop.apply(data, box, flip)
            assert out.shape == (3, 224, 224) and out.dtype == np.uint8
            worst = max(worst, _mad(out, _reference(data, box, 224, flip)))
    assert worst <= 2.0  # the bar; measured 0.21 on this corpus


@pytest.mark.skipif(not HAVE_TJ3, reason=NO_TJ3)
def test_dct_scaled_region_of_a_large_photo_stays_close(photos: list[bytes]) -> None:
    big = Image.open(io.BytesIO(photos[0])).convert("RGB").resize((1600, 1200))
    buf = io.BytesIO()
    big.save(buf, format="JPEG", quality=90)
    crop = rt.data.DecodeCrop(112)
    for box in [(0, 0, 1600, 1200), (333, 101, 900, 700), (16, 8, 460, 470), (701, 299, 899, 899)]:
        assert decodecrop.dct_scale(box[2], box[3], 112) < 8
        assert _mad(crop.apply(buf.getvalue(), box), _reference(buf.getvalue(), box, 112, False)) <= 1.0


@pytest.mark.skipif(not HAVE_TJ3, reason=NO_TJ3)
def test_without_pillow_a_large_box_is_decoded_at_full_scale(
        photos: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    big = Image.open(io.BytesIO(photos[0])).convert("RGB").resize((1600, 1200))
    buf = io.BytesIO()
    big.save(buf, format="JPEG", quality=90)
    box = (333, 101, 900, 700)
    assert decodecrop.dct_scale(box[2], box[3], 112) < 8
    monkeypatch.setattr(decodecrop, "_HAVE_PILLOW", False)
    out = rt.data.DecodeCrop(112).apply(buf.getvalue(), box)
    assert _mad(out, _reference(buf.getvalue(), box, 112, False)) <= 1.0


@pytest.mark.skipif(not HAVE_TJ3, reason=NO_TJ3)
@pytest.mark.parametrize("box", [(0, 0, 37, 41), (17, 3, 100, 61), (63, 80, 1, 1)])
def test_region_at_full_scale_equals_the_whole_decode(photos: list[bytes],
                                                      box: tuple[int, int, int, int]) -> None:
    # Unaligned lefts and tiny boxes: the region is cut from the MCU-aligned decode.
    data = photos[1]
    tj = turbojpeg.load()
    assert tj is not None
    whole = rt.data.decode_image(data, decoder="simplejpeg")
    info = image_info(data)
    region = decodecrop.DecodeCrop(8)._region(tj, data, info, box, 8)
    left, top, w, h = box
    assert region.shape[:2] == (h, w)
    # equal but at the region's edges, where fancy chroma upsampling sees other neighbours
    diff = np.abs(region.astype(int) - whole[top:top + h, left:left + w])
    assert diff.max() <= 2 and (diff.size < 300 or diff.mean() <= 0.1)


def test_png_and_greyscale_and_cmyk_take_the_whole_image_path() -> None:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (90, 120, 3), dtype=np.uint8))
    crop = rt.data.DecodeCrop(32, flip=0.0)
    box = (10, 5, 60, 70)
    for fmt, img in [("PNG", rgb), ("JPEG", rgb.convert("L")), ("JPEG", rgb.convert("CMYK"))]:
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        data = buf.getvalue()
        assert image_info(data).region is (fmt == "JPEG" and img.mode == "L")
        out = crop.apply(data, box)
        assert out.shape == (3, 32, 32)
        assert _mad(out, _reference(data, box, 32, False)) <= 2.0


def test_progressive_jpeg_is_not_region_decoded(photos: list[bytes]) -> None:
    buf = io.BytesIO()
    Image.open(io.BytesIO(photos[2])).save(buf, format="JPEG", progressive=True, quality=90)
    info = image_info(buf.getvalue())
    assert info.jpeg and not info.region
    out = rt.data.DecodeCrop(64).apply(buf.getvalue(), (5, 5, 200, 150))
    assert _mad(out, _reference(buf.getvalue(), (5, 5, 200, 150), 64, False)) <= 2.0


# ---- API and errors -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"size": 0}, "size must be a positive int"),
    ({"scale": (0.5, 0.1)}, "scale must be (low, high)"),
    ({"ratio": "wide"}, "ratio must be a (low, high) pair"),
    ({"flip": 2}, "flip must be a probability"),
    # Before: flip=True was taken as the probability 1.0 (every image mirrored).
    ({"flip": True}, "flip is a probability, got True; pass 0.5 for a random mirror"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
])
def test_bad_arguments_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rt.data.DecodeCrop(**kwargs)


def test_box_outside_the_image_is_named(photos: list[bytes]) -> None:
    info = image_info(photos[0])
    with pytest.raises(DataError, match=f"not inside the {info.width}x{info.height} image"):
        rt.data.DecodeCrop(8).apply(photos[0], (info.width - 5, 0, 10, 10))


@pytest.mark.parametrize("given", ["photo.jpg", None, np.zeros((4, 4), np.uint8)])
def test_what_is_not_a_files_bytes_is_named(given: object) -> None:
    # A path string was bytes()'s "string argument without an encoding" TypeError.
    with pytest.raises(DataError, match=f"takes an encoded image file's bytes, got {type(given).__name__}"):
        rt.data.DecodeCrop(8)(given)


def test_a_uint8_tensor_of_the_file_is_taken_as_its_bytes(photos: list[bytes]) -> None:
    box = (0, 0, 40, 30)
    as_tensor = torch.frombuffer(bytearray(photos[0]), dtype=torch.uint8)
    want = rt.data.DecodeCrop(8).apply(photos[0], box)
    np.testing.assert_array_equal(rt.data.DecodeCrop(8).apply(as_tensor, box), want)
    np.testing.assert_array_equal(rt.data.DecodeCrop(8).apply(memoryview(photos[0]), box), want)


def test_corrupt_file_is_a_data_error() -> None:
    with pytest.raises(DataError):
        rt.data.DecodeCrop(8)(b"\xff\xd8\xff\xe0garbage")


def test_without_libturbojpeg_it_decodes_whole_images_and_says_so_once(
        photos: list[bytes], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(turbojpeg, "_CACHE", [None])
    monkeypatch.setattr(decodecrop, "_SAID", [])
    with caplog.at_level(logging.INFO, logger="ringtrain.data"):
        first, second = rt.data.DecodeCrop(64), rt.data.DecodeCrop(32)
    assert first.backend.startswith("whole image")
    said = [r.getMessage() for r in caplog.records if "DecodeCrop decodes whole" in r.getMessage()]
    assert len(said) == 1 and "RINGTRAIN_TURBOJPEG" in said[0]
    assert second(photos[0]).shape == (3, 32, 32)


def test_a_library_without_tj3_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian 12's libturbojpeg0 (2.1.5) has no cropping region: not a region decoder.
    monkeypatch.setattr(turbojpeg, "_CACHE", [])
    monkeypatch.setenv(turbojpeg.ENV_VAR, "libc.so.6")
    assert turbojpeg.load() is None


# ---- in the loader -------------------------------------------------------------------------
def _folder(tmp_path: Path, jpegs: list[bytes]) -> Path:
    for i, data in enumerate(jpegs):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(data)
    return tmp_path


@pytest.mark.timeout(60)
def test_loader_crops_are_seeded_and_resume_draws_the_same(tmp_path: Path,
                                                           photos: list[bytes]) -> None:
    ds = rt.data.ImageFolder(_folder(tmp_path, photos[:12]), decode=False,
                             transform=rt.data.DecodeCrop(48))
    def run(start_state: dict | None = None, batches: int = 3) -> list[torch.Tensor]:
        loader = rt.data.Loader(ds, batch_size=4, num_workers=1, device="cpu", seed=5)
        if start_state is not None:
            loader.load_state_dict(start_state)
        out = []
        for x, _ in loader:
            out.append(x.clone())
            if len(out) == batches:
                break
        return out
    full = run()
    assert full[0].shape == (4, 3, 48, 48) and full[0].dtype == torch.uint8
    assert torch.equal(full[0], run()[0])  # same seed, same crops
    loader = rt.data.Loader(ds, batch_size=4, num_workers=1, device="cpu", seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = run(state, batches=2)
    assert torch.equal(resumed[0], full[1]) and torch.equal(resumed[1], full[2])
