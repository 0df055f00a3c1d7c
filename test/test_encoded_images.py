"""Training frames kept encoded: indexing decodes exactly the frames a batch selects."""

import io

import numpy as np
import pytest
from PIL import Image

from oxygen_ros.training.encoded_images import EncodedImages


def png(frame: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def frames() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (5, 4, 6, 3), dtype=np.uint8)


def test_indexing_decodes_the_selected_frames(frames):
    images = EncodedImages([png(f) for f in frames], (4, 6, 3))
    assert images.shape == (5, 4, 6, 3) and len(images) == 5 and images.ndim == 4
    np.testing.assert_array_equal(images[3], frames[3])
    np.testing.assert_array_equal(images[np.array([4, 0, 4])], frames[[4, 0, 4]])
    np.testing.assert_array_equal(images[[1, 2]], frames[[1, 2]])
    np.testing.assert_array_equal(images[1:4], frames[1:4])
    assert images[np.array([], dtype=np.int64)].shape == (0, 4, 6, 3)


def test_take_and_concatenate_keep_the_frames_encoded_and_in_order(frames):
    images = EncodedImages([png(f) for f in frames], (4, 6, 3))
    picked = images.take([3, 1])
    assert isinstance(picked, EncodedImages) and picked.shape == (2, 4, 6, 3)
    np.testing.assert_array_equal(picked[:], frames[[3, 1]])
    joined = EncodedImages.concatenate([picked, images])
    np.testing.assert_array_equal(joined[:], np.concatenate([frames[[3, 1]], frames]))
    other = EncodedImages([png(frames[0][:2])], (2, 6, 3))
    with pytest.raises(ValueError, match="different shapes"):
        EncodedImages.concatenate([images, other])


def test_a_frame_of_another_shape_is_named(frames):
    images = EncodedImages([png(frames[0])], (8, 8, 3))
    with pytest.raises(ValueError, match=r"decodes to \(4, 6, 3\), not the dataset's \(8, 8, 3\)"):
        images[0]
