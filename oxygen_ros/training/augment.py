"""openpi's training-time image augmentation, in torch, seeded.

openpi's ``preprocess_observation(train=True)`` (``src/openpi/models/model.py``, commit 15a9616)
runs on images already resized to the model's resolution, in [0, 1]:

* cameras whose name does not contain ``wrist``: a random crop to 95% of each side, resized back,
  then a rotation by an angle uniform in [-5, 5] degrees (augmax ``RandomCrop``, ``Resize``,
  ``Rotate``; pixels rotated in from outside are black);
* every camera: colour jitter with brightness 0.3, contrast 0.4, saturation 0.5 (augmax
  ``ColorJitter``): each factor uniform in [1 - x, 1 + x], applied in that order, clipped to
  [0, 1].

Here crop, resize and rotation are one affine warp (a single bilinear resampling where openpi
resamples twice). Draws come from the ``torch.Generator`` given, so a seed fixes every pixel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CROP_FRACTION = 0.95
MAX_ROTATION_DEG = 5.0
BRIGHTNESS, CONTRAST, SATURATION = 0.3, 0.4, 0.5
# ITU-R 601 luma, as colour jitter's grayscale
LUMA = (0.299, 0.587, 0.114)


def is_wrist_camera(name: str) -> bool:
    """openpi's rule: a camera whose key contains ``wrist`` is not cropped or rotated."""
    return "wrist" in name


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float32)


def crop_rotate(images: Tensor, generator: torch.Generator) -> Tensor:
    """A random 95% crop, resized back, rotated by up to ±5°: [N, 3, H, W] in [0, 1] -> same."""
    n = images.shape[0]
    # the crop's centre offset in normalised coordinates ([-1, 1] spans the image)
    slack = 1.0 - CROP_FRACTION
    offset_x = _uniform(n, -slack, slack, generator)
    offset_y = _uniform(n, -slack, slack, generator)
    angle = torch.deg2rad(_uniform(n, -MAX_ROTATION_DEG, MAX_ROTATION_DEG, generator))
    cos, sin = angle.cos() * CROP_FRACTION, angle.sin() * CROP_FRACTION
    # output pixel -> input pixel: rotate, scale into the crop, move to the crop's centre
    theta = torch.stack(
        [torch.stack([cos, -sin, offset_x], 1), torch.stack([sin, cos, offset_y], 1)], 1
    ).to(images.device)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _grayscale(images: Tensor) -> Tensor:
    weights = torch.tensor(LUMA, dtype=images.dtype, device=images.device)
    return (images * weights[None, :, None, None]).sum(dim=1, keepdim=True)


def color_jitter(images: Tensor, generator: torch.Generator) -> Tensor:
    """Brightness, contrast and saturation factors uniform in [1 - x, 1 + x]: [N, 3, H, W] in
    [0, 1] -> same, clipped."""
    n = images.shape[0]
    shape = (n, 1, 1, 1)
    brightness = _uniform(n, 1 - BRIGHTNESS, 1 + BRIGHTNESS, generator).view(shape)
    contrast = _uniform(n, 1 - CONTRAST, 1 + CONTRAST, generator).view(shape)
    saturation = _uniform(n, 1 - SATURATION, 1 + SATURATION, generator).view(shape)
    brightness, contrast, saturation = (
        f.to(images.device) for f in (brightness, contrast, saturation)
    )
    out = (images * brightness).clamp(0, 1)
    mean = _grayscale(out).mean(dim=(2, 3), keepdim=True)
    out = (mean + (out - mean) * contrast).clamp(0, 1)
    gray = _grayscale(out)
    return (gray + (out - gray) * saturation).clamp(0, 1)


def augment_camera(images: Tensor, camera: str, generator: torch.Generator) -> Tensor:
    """openpi's training augmentation of one camera's batch: float [N, 3, H, W] in [-1, 1] (the
    model's range) -> same shape and dtype; wrist cameras get colour jitter only."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"camera {camera!r}: expected images [N, 3, H, W], got {images.shape}")
    unit = images / 2.0 + 0.5
    if not is_wrist_camera(camera):
        unit = crop_rotate(unit, generator)
    unit = color_jitter(unit, generator)
    return (unit * 2.0 - 1.0).to(images.dtype)


def augment_images(images: Tensor, cameras: tuple[str, ...], generator: torch.Generator) -> Tensor:
    """`augment_camera` per slot of a batch [B, slots, 3, H, W] whose slots are ``cameras``."""
    if images.shape[1] != len(cameras):
        raise ValueError(f"{images.shape[1]} image slots but {len(cameras)} camera names")
    return torch.stack(
        [augment_camera(images[:, i], name, generator) for i, name in enumerate(cameras)], dim=1
    )
