"""The two decode paths give the same pixels (pipeline.models.encode).

CPU path: PIL decode + open_clip's eval transform (float32). uint8 path: the same PIL resize and
crop to uint8, normalised later (`pil_pixels` + `normalize_pixels`): bit-identical. Device
path: torchvision's batched JPEG decode + tensor resize (`decode_pixels`, run here on CPU):
within PIXEL_LEVELS uint8 levels of the CPU path at every pixel, PIXEL_MEAN_LEVELS on average.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from pipeline.models import ModelSpec, load_transforms
from pipeline.models.encode import (
    decode_pixels,
    normalize_pixels,
    pil_pixels,
    pixel_spec,
)

# Tolerance of the device path vs PIL, in uint8 levels of the resized image: both decode with
# libjpeg-turbo's IDCT, and the resizes are bicubic with antialiasing in float (torchvision)
# vs fixed point (PIL).
PIXEL_LEVELS = 2.0
PIXEL_MEAN_LEVELS = 0.05

SIZES = [(64, 64), (97, 150), (300, 200), (640, 480), (40, 30)]


def scene_jpeg(size: tuple[int, int], seed: int) -> bytes:
    """A photo-like JPEG: a smooth gradient with a few filled shapes (sharp edges)."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
    image = Image.fromarray(base.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x0, y0, x0 + int(rng.integers(4, w)), y0 + int(rng.integers(4, h))]
        draw.ellipse(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module", params=["ncl-tiny", "ViT-B-32"])
def transform(request):
    preprocess, _ = load_transforms(ModelSpec(request.param, None))
    return preprocess, pixel_spec(preprocess)


@pytest.fixture(scope="module")
def blobs():
    return [scene_jpeg(size, seed) for seed, size in enumerate(SIZES)]


def _cpu_path(blobs, preprocess) -> torch.Tensor:
    return torch.stack([preprocess(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs])


def test_uint8_path_is_the_eval_transform_bit_for_bit(transform, blobs):
    preprocess, spec = transform
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
    uint8 = torch.from_numpy(np.stack([pil_pixels(image, spec) for image in images]))
    assert uint8.dtype == torch.uint8 and uint8.shape == (len(blobs), 3, spec.size, spec.size)
    assert torch.equal(normalize_pixels(uint8, spec), _cpu_path(blobs, preprocess))


def test_device_path_on_cpu_matches_pil_within_tolerance(transform, blobs):
    preprocess, spec = transform
    pixels, errors = decode_pixels(blobs, spec, "cpu")
    assert errors == [None] * len(blobs)
    reference = _cpu_path(blobs, preprocess)
    assert pixels.shape == reference.shape and pixels.dtype == torch.float32
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    levels = (pixels - reference).abs() * std * 255  # back to uint8 levels
    assert levels.max() <= PIXEL_LEVELS + 1e-3, float(levels.max())
    assert levels.mean() <= PIXEL_MEAN_LEVELS, float(levels.mean())


def test_undecodable_blob_is_named_and_the_rest_decode(transform, blobs):
    _, spec = transform
    broken = blobs[2][: len(blobs[2]) // 3] + b"\x00" * 16
    pixels, errors = decode_pixels([blobs[0], b"not a jpeg", blobs[1]], spec, "cpu")
    assert pixels.shape[0] == 2
    assert errors[0] is None and errors[2] is None and errors[1]
    alone, _ = decode_pixels([blobs[0], blobs[1]], spec, "cpu")
    assert torch.equal(pixels, alone)
    # A JPEG cut short is refused, as PIL refuses it (the CPU path's undecodable_image).
    assert decode_pixels([broken], spec, "cpu")[1] == ["Image is incomplete or truncated"]


def test_non_square_transforms_are_refused_with_the_fix():
    from torchvision import transforms as T

    odd = T.Compose([T.Resize((64, 32)), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    with pytest.raises(ValueError, match="embed.decode: cpu"):
        pixel_spec(odd)


def test_a_squash_transform_keeps_its_own_pixels_and_refuses_an_explicit_device_decode():
    """SigLIP's and DFN's tags resize to a square without a crop: `auto` resolved to the device
    decode falls back to the model's transform in the threads; an explicit device decode is
    refused before the run, naming the model."""
    from pipeline.config import JobConfig, JobConfigError
    from pipeline.models import load_clip
    from pipeline.models.loading import load_image_transform
    from pipeline.models.pixels import pixel_plan
    from pipeline.run.specs import check_decode

    squash = load_image_transform(ModelSpec("ViT-B-16-SigLIP", "webli"))
    loaded = load_clip(ModelSpec("ncl-tiny", None, seed=0), "cpu")
    loaded = dataclasses.replace(loaded, preprocess=squash)
    plan = pixel_plan("device", loaded)
    assert (plan.on_device, plan.pixels, plan.preprocess) == (False, None, squash)
    assert pixel_plan("device", load_clip(ModelSpec("ncl-tiny", None), "cpu")).on_device

    def job(decode: str) -> JobConfig:
        model = {"name": "ViT-B-16-SigLIP", "pretrained": "webli"}
        embed = {"decode": decode}
        return JobConfig.model_validate(
            {
                "name": "j",
                "input": {"shards": "/d/0.tar"},
                "output": "/o",
                "model": model,
                "embed": embed,
            }
        )

    check_decode(job("auto"))
    check_decode(job("cpu"))
    with pytest.raises(
        JobConfigError,
        match=r"device is not possible for ViT-B-16-SigLIP: .*"
        r"Resize\(size=\(224, 224\)",
    ):
        check_decode(job("device"))


@pytest.mark.gpu
def test_device_path_on_cuda_matches_the_cpu_decode(transform, blobs):
    preprocess, spec = transform
    pixels, errors = decode_pixels(blobs, spec, "cuda")
    assert errors == [None] * len(blobs) and pixels.device.type == "cuda"
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    levels = (pixels.cpu() - _cpu_path(blobs, preprocess)).abs() * std * 255
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a level or two more.
    assert levels.max() <= PIXEL_LEVELS + 2, float(levels.max())
    assert levels.mean() <= 2 * PIXEL_MEAN_LEVELS, float(levels.mean())


def test_a_chunk_mixes_device_jpegs_and_thread_pixels(transform, blobs):
    """`chunk_pixels`: JPEG bytes left to the device and pixels made in the decode threads
    (a PNG here) become one batch, in order; a JPEG that does not decode is named."""
    from pipeline.io.decode import DecodedSample, sample_pixels
    from pipeline.models.pixels import PixelPlan, chunk_pixels, image_pixels

    preprocess, spec = transform
    plan = PixelPlan(torch.device("cpu"), True, spec, preprocess)
    png = io.BytesIO()
    Image.open(io.BytesIO(blobs[3])).convert("RGB").save(png, format="PNG")

    def sample(data: bytes, fmt: str) -> DecodedSample:
        return DecodedSample("k", "s", None, "c", None, {}, "", data, fmt, "jpg")

    def thread_part(data: bytes, fmt: str):
        return sample_pixels(sample(data, fmt), lambda image: image_pixels(image, plan), True)

    pixels = [thread_part(blobs[0], "JPEG"), thread_part(png.getvalue(), "PNG")]
    pixels += [thread_part(b"\xff\xd8 broken", "JPEG"), thread_part(blobs[2], "JPEG")]
    assert isinstance(pixels[0], bytes) and pixels[1].dtype == np.uint8
    errors, batch = chunk_pixels(pixels, plan)
    assert errors[0] is None and errors[1] is None and errors[3] is None and errors[2]
    reference = _cpu_path([blobs[0], png.getvalue(), blobs[2]], preprocess)
    assert torch.equal(batch[1], reference[1])  # decoded by PIL in the thread: exact
    levels = (batch - reference).abs() * torch.tensor(spec.std).view(1, 3, 1, 1) * 255
    assert levels.max() <= PIXEL_LEVELS + 1e-3
    broken_png = sample_pixels(sample(b"\x89PNG\r\n\x1a\n cut", "PNG"), np.asarray, True)
    assert broken_png.reason == "undecodable_image" and broken_png.member == "k.jpg"
