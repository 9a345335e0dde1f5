"""The doctor's advice for an input-bound job that decodes photos: DecodeCrop, then GPU decode."""

from __future__ import annotations

from typing import Any

import pytest
from test_observe_verdict import report

from ringtrain.observe.verdict import diagnose, render


def _images(images: str | None, gpu_busy: float | None = None) -> dict[str, Any]:
    r = report(data=0.5, workers=2, cpus=2)
    r["loader"]["images"] = images
    if gpu_busy is not None:  # an NVML-sampled GPU, as on a GPU host
        r["summary"]["gpu"] = {"util_mean": gpu_busy * 100, "mem_used_max": 1, "mem_total": 8}
        r["summary"]["device_busy"].update(mean=gpu_busy, source="nvml")
    return r


@pytest.mark.parametrize("images,gpu_busy,decodecrop,gpu_decode", [
    ("whole", None, True, False),  # CPU only: decode only the crop
    ("whole", 0.45, True, True),  # and a GPU that idles: decode there
    ("DecodeCrop", 0.45, False, True),
    ("DecodeCrop", None, False, False),
    ("DecodeCrop(cuda)", 0.45, False, False),  # already on the GPU
    (None, 0.45, False, False),  # not known to be images: no image advice
])
def test_input_bound_photo_jobs_are_told_about_decodecrop(
        images: str | None, gpu_busy: float | None, decodecrop: bool, gpu_decode: bool) -> None:
    d = diagnose([_images(images, gpu_busy)])
    assert d.verdict == "input-bound"
    text = render(d)
    assert ("transform=rt.data.DecodeCrop(224)" in text) is decodecrop
    assert ("DecodeCrop(224, device='cuda')" in text) is gpu_decode
