"""Observation preprocessing and action postprocessing exactly as openpi does it for pi0.5 (host).

* images: `resize_with_pad` (openpi_client's PIL version: keep aspect, bilinear, black bars) then
  `to_model_range` (uint8 -> float32 in [-1, 1], channels first);
* state and actions: `pad_to_dim` to the model width (their quantile normalisation with the
  checkpoint's `norm_stats.json` is `checkpoints.norm_stats.NormStats`).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# -- images ---------------------------------------------------------------------------------------


def resize_with_pad(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 images [..., H, W, 3] to [..., height, width, 3] keeping aspect, padding black.

    Reproduces openpi_client's `image_tools.resize_with_pad` (what openpi's `ResizeImages` uses
    on numpy inputs): scale ``ratio = max(W / width, H / height)``, new size ``int(H / ratio)`` x
    ``int(W / ratio)``, PIL bilinear resampling, the resized image pasted at
    ``(int((width - new_w) / 2), int((height - new_h) / 2))`` on black (the odd pixel goes to the
    bottom/right). Images already at the target size are returned unchanged (the same array).

    One deliberate difference: a side that would round to 0 pixels (e.g. a 1x1000 strip) is kept at
    1 pixel, where openpi would raise inside PIL.

    Raises:
        ValueError: for a non-uint8 array, a shape that is not [..., H, W, 3], or a bad target size.
    """
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"resize_with_pad expects uint8 images, got {images.dtype}")
    if images.ndim < 3 or images.shape[-1] != 3:
        raise ValueError(
            f"resize_with_pad expects images shaped [..., H, W, 3], got {images.shape}"
        )
    if height < 1 or width < 1:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    cur_height, cur_width = images.shape[-3:-1]
    if cur_height < 1 or cur_width < 1:
        raise ValueError(f"cannot resize an empty image of shape {images.shape}")
    if (cur_height, cur_width) == (height, width):
        return images
    flat = images.reshape(-1, cur_height, cur_width, 3)
    out = np.stack([_resize_with_pad_one(im, height, width) for im in flat])
    return out.reshape(*images.shape[:-3], height, width, 3)


def _resize_with_pad_one(image: np.ndarray, height: int, width: int) -> np.ndarray:
    cur_height, cur_width = image.shape[:2]
    ratio = max(cur_width / width, cur_height / height)
    resized_height = max(1, int(cur_height / ratio))
    resized_width = max(1, int(cur_width / ratio))
    resized = Image.fromarray(image).resize(
        (resized_width, resized_height), resample=Image.BILINEAR
    )
    canvas = Image.new(resized.mode, (width, height), 0)
    pad_height = max(0, int((height - resized_height) / 2))
    pad_width = max(0, int((width - resized_width) / 2))
    canvas.paste(resized, (pad_width, pad_height))
    return np.asarray(canvas)


def to_model_range(images: np.ndarray) -> np.ndarray:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W] in [-1, 1], computed as openpi does
    (``x.astype(float32) / 255.0 * 2.0 - 1.0``, in float32)."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"to_model_range expects uint8 images, got {images.dtype}")
    if images.ndim < 3 or images.shape[-1] != 3:
        raise ValueError(f"to_model_range expects images shaped [..., H, W, 3], got {images.shape}")
    scaled = images.astype(np.float32) / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)
    return np.ascontiguousarray(np.moveaxis(scaled, -1, -3))


# -- state and actions ----------------------------------------------------------------------------


def pad_to_dim(x: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad the last axis of ``x`` to ``dim`` (openpi's `PadStatesAndActions`).

    Raises:
        ValueError: if ``x`` is already wider than ``dim`` (openpi would pass it through and the
            model would fail later with a shape error).
    """
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError("pad_to_dim needs at least one axis")
    current = x.shape[-1]
    if current > dim:
        raise ValueError(f"cannot pad a vector of width {current} down to {dim}")
    if current == dim:
        return x
    out = np.zeros((*x.shape[:-1], dim), dtype=x.dtype)  # as np.pad, a fraction of its cost
    out[..., :current] = x
    return out
