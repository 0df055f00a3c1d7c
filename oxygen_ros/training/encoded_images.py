"""One camera's training frames kept as the dataset stores them (PNG bytes), decoded when drawn.

Decoded, a 128 x 128 camera costs 48 KiB a frame, so 140,000 frames of two cameras fill 13 GiB
before training starts; encoded they take a few KiB each, and a batch decodes only its own frames
(a dozen small PNGs a step, next to a forward and backward pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from oxygen_ros.data.lerobot_dataset import decode_png


class EncodedImages:
    """Frames of one camera as encoded images of one shape; indexing decodes what it selects.

    ``images[i]`` is one (H, W, 3) uint8 frame; ``images[indices]`` (an int array, a list or a
    slice) is (len, H, W, 3) uint8.
    """

    ndim = 4

    def __init__(self, encoded: Sequence[bytes], frame_shape: tuple[int, ...]) -> None:
        self._encoded = list(encoded)
        self._frame_shape = tuple(int(n) for n in frame_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self._encoded), *self._frame_shape)

    def __len__(self) -> int:
        return len(self._encoded)

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            return self._decode(self._encoded[index])
        chosen = self._encoded[index] if isinstance(index, slice) else self._pick(index)
        frames = np.empty((len(chosen), *self._frame_shape), dtype=np.uint8)
        for row, data in enumerate(chosen):
            frames[row] = self._decode(data)
        return frames

    def take(self, indices: Sequence[int] | np.ndarray) -> EncodedImages:
        """The frames at ``indices``, still encoded."""
        return EncodedImages(self._pick(indices), self._frame_shape)

    @staticmethod
    def concatenate(parts: Sequence[EncodedImages]) -> EncodedImages:
        """One camera's frames from several datasets, end to end (one frame shape)."""
        shapes = {part._frame_shape for part in parts}
        if len(shapes) != 1:
            raise ValueError(f"frames of different shapes cannot be joined: {sorted(shapes)}")
        return EncodedImages([data for part in parts for data in part._encoded], shapes.pop())

    def _pick(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        return [self._encoded[int(i)] for i in np.asarray(indices).reshape(-1)]

    def _decode(self, data: bytes) -> np.ndarray:
        frame = decode_png(data)
        if frame.shape != self._frame_shape:
            raise ValueError(
                f"an encoded frame decodes to {frame.shape}, not the dataset's {self._frame_shape}"
            )
        return frame
