"""Image preprocessing on the model's device (the GPU fast path's counterpart of ``preprocess``).

`resize_with_pad_torch` follows openpi's `resize_with_pad` geometry exactly (same ratio, the same
integer new size, the same paste offsets, black bars) and `to_model_range`'s float32 arithmetic, so
an image that is already at the target size gives bit-identical model input.

Resampling is where the two differ: PIL's bilinear filter works in fixed point on uint8 and, when
downsampling, widens its triangle kernel by the scale factor. ``F.interpolate(mode="bilinear",
antialias=True)`` implements the same separable antialiased kernel in floating point, and the result
is rounded back to uint8 levels like PIL's, so the outputs usually agree to within one uint8 level
(2/255 ≈ 0.008 in model range); test/test_static_paths.py reports the measured maximum. Keep the
PIL path (the default) where openpi-exact inputs matter more than host CPU time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def resize_geometry(
    height: int, width: int, target_height: int, target_width: int
) -> tuple[int, int, int, int]:
    """openpi's resize_with_pad arithmetic -> (new_height, new_width, pad_top, pad_left)."""
    ratio = max(width / target_width, height / target_height)
    new_height = max(1, int(height / ratio))
    new_width = max(1, int(width / ratio))
    pad_top = max(0, int((target_height - new_height) / 2))
    pad_left = max(0, int((target_width - new_width) / 2))
    return new_height, new_width, pad_top, pad_left


def _batched_uint8(images: Tensor, caller: str) -> Tensor:
    """uint8 [H, W, 3] or [N, H, W, 3] -> [N, H, W, 3], checked (non-empty, 3 channels)."""
    if images.dtype != torch.uint8:
        raise ValueError(f"{caller} expects uint8 images, got {images.dtype}")
    if images.dim() == 3:
        images = images[None]
    if images.dim() != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected images shaped [N, H, W, 3], got {tuple(images.shape)}")
    if images.shape[1] < 1 or images.shape[2] < 1:
        raise ValueError(f"cannot resize an empty image of shape {tuple(images.shape)}")
    return images


def resize_with_pad_torch(
    images: Tensor, height: int, width: int, out: Tensor | None = None
) -> Tensor:
    """uint8 images [H, W, 3] or [N, H, W, 3] (any device) -> float32 [N, 3, height, width] in
    [-1, 1].

    ``out``: optional preallocated [N, 3, height, width] float32 destination (e.g. a static input
    buffer), written in place and returned.
    """
    images = _batched_uint8(images, "resize_with_pad_torch")
    n, cur_height, cur_width = images.shape[:3]
    pixels = images.permute(0, 3, 1, 2).to(torch.float32)  # [N, 3, H, W], uint8 levels
    if (cur_height, cur_width) != (height, width):
        new_height, new_width, top, left = resize_geometry(cur_height, cur_width, height, width)
        resized = F.interpolate(
            pixels,
            size=(new_height, new_width),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        canvas = torch.zeros(n, 3, height, width, dtype=torch.float32, device=images.device)
        canvas[:, :, top : top + new_height, left : left + new_width] = resized.round_().clamp_(
            0, 255
        )
        pixels = canvas
    # to_model_range's float32 ops in the same order: x / 255 * 2 - 1 (pixels is a fresh float copy)
    result = pixels.div_(255.0).mul_(2.0).sub_(1.0)
    if out is None:
        return result.contiguous()
    return out.copy_(result)


def lerobot_resize_with_pad(
    images: Tensor, height: int, width: int, border: float = -1.0, out: Tensor | None = None
) -> Tensor:
    """LeRobot's image path: uint8 [H, W, 3] or [N, H, W, 3] (any device) -> float32
    [N, 3, height, width] in [-1, 1], borders at ``border``.

    As LeRobot computes it: pixels become float32 ``x / 255``; a frame of another size is resized
    with ``F.interpolate(bilinear, align_corners=False)`` on those floats (no antialiasing: on a
    downscale that is not openpi's filter), clamped, and centred on a canvas of
    ``(border + 1) / 2`` (LeRobot 0.4.4 pads -1 before scaling, so its borders end at -3; main
    pads 0 -> -1); then ``x * 2 - 1``. The geometry is openpi's (`resize_geometry`).
    """
    images = _batched_uint8(images, "lerobot_resize_with_pad")
    n, cur_height, cur_width = images.shape[:3]
    # LeRobot: from_numpy(HWC).float() / 255, then permute(2, 0, 1).contiguous()
    pixels = (images.to(torch.float32) / 255).permute(0, 3, 1, 2).contiguous()
    if (cur_height, cur_width) != (height, width):
        new_height, new_width, top, left = resize_geometry(cur_height, cur_width, height, width)
        resized = F.interpolate(
            pixels, size=(new_height, new_width), mode="bilinear", align_corners=False
        ).clamp(0.0, 1.0)
        canvas = torch.full(
            (n, 3, height, width), (border + 1.0) / 2.0, dtype=torch.float32, device=images.device
        )
        canvas[:, :, top : top + new_height, left : left + new_width] = resized
        pixels = canvas
    result = pixels * 2.0 - 1.0
    if out is None:
        return result
    return out.copy_(result)
