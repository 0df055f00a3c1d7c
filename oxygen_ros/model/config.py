"""Model configuration: frozen dataclasses plus named presets.

The `pi05` preset reproduces openpi's pi0.5 sizes exactly (PaliGemma 2B backbone, Gemma 300M action
expert, SigLIP So400m/14). `tiny` and `small` keep every structural rule of pi0.5 (3 image slots,
224 px, 256 tokens per image, multi-query attention, shared head width between experts) and only
shrink widths and depths, so the same code path is exercised at every size.
"""

from __future__ import annotations

import dataclasses

IMAGE_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """SigLIP vision tower (ViT with learned position embeddings, pre-LN blocks, post-LN)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    image_size: int = 224
    patch_size: int = 14

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """One Gemma transformer stack (one "expert" of the Mixture-of-Transformers)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class Pi05Config:
    """Everything that fixes tensor shapes of a pi0.5 checkpoint."""

    name: str
    vision: SiglipConfig
    backbone: GemmaConfig  # PaliGemma language model: reads images and prompt, writes the prefix KV
    expert: GemmaConfig  # action expert: reads the prefix KV, denoises actions
    vocab_size: int
    action_dim: int = 32  # model action width; robot actions are zero-padded to it
    action_horizon: int = 50
    max_token_len: int = 200
    num_image_slots: int = len(IMAGE_SLOTS)
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        b, e = self.backbone, self.expert
        # Joint attention concatenates both experts' heads along the sequence: head layout must
        # agree.
        if (b.num_heads, b.num_kv_heads, b.head_dim, b.depth) != (
            e.num_heads,
            e.num_kv_heads,
            e.head_dim,
            e.depth,
        ):
            raise ValueError(
                "backbone and expert must share depth/heads/kv heads/head_dim for joint "
                "attention, got "
                f"{(b.depth, b.num_heads, b.num_kv_heads, b.head_dim)} vs "
                f"{(e.depth, e.num_heads, e.num_kv_heads, e.head_dim)}"
            )
        if b.num_heads % b.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def image_tokens(self) -> int:
        return self.vision.num_patches

    @property
    def num_layers(self) -> int:
        return self.backbone.depth

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of backbone K+V stored per prefix/text token across all layers."""
        b = self.backbone
        return 2 * b.depth * b.num_kv_heads * b.head_dim * element_size


PRESETS: dict[str, Pi05Config] = {
    "tiny": Pi05Config(
        name="tiny",
        # 64 tokens per image
        vision=SiglipConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=28),
        backbone=GemmaConfig(
            width=64, depth=2, mlp_dim=128, num_heads=2, num_kv_heads=1, head_dim=16
        ),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16),
        vocab_size=512,
        action_dim=8,
        action_horizon=10,
        max_token_len=96,
    ),
    "small": Pi05Config(
        name="small",
        vision=SiglipConfig(width=256, depth=4, mlp_dim=1024, num_heads=4),
        backbone=GemmaConfig(
            width=512, depth=6, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=64
        ),
        expert=GemmaConfig(
            width=256, depth=6, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=64
        ),
        vocab_size=512,
        action_dim=32,
        action_horizon=50,
        max_token_len=200,
    ),
    # `sim` exists to train the simulated SO-101 arm's policy (models/sim_so101) from scratch on
    # this 2-core CPU in <= 30 min, where tiny's 224 px input is both slow (the sim's 128 px
    # cameras upsampled, 64 tokens each) and too narrow to find the named cube: the tower takes
    # the 128 px images as they are, in 32 px patches (16 tokens per image, so a training example
    # is ~100 tokens), 4x wider than tiny's, 1.4 M params in all; horizon 10 (1 s at the
    # dataset's 10 fps); 96 prompt tokens hold openpi_subtask's prompt with a 6-value state, the
    # subtask and the narration (72 at most on the sim's texts).
    "sim": Pi05Config(
        name="sim",
        vision=SiglipConfig(
            width=128, depth=2, mlp_dim=256, num_heads=4, image_size=128, patch_size=32
        ),
        backbone=GemmaConfig(
            width=128, depth=3, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32
        ),
        expert=GemmaConfig(
            width=64, depth=3, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=32
        ),
        vocab_size=512,
        action_dim=8,
        action_horizon=10,
        max_token_len=96,
    ),
    "pi05": Pi05Config(
        name="pi05",
        vision=SiglipConfig(width=1152, depth=27, mlp_dim=4304, num_heads=16),  # So400m/14
        backbone=GemmaConfig(
            width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256
        ),
        expert=GemmaConfig(
            width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256
        ),
        vocab_size=257_152,
        action_dim=32,
        action_horizon=50,
        max_token_len=200,
    ),
}


def get_preset(name: str) -> Pi05Config:
    """Return a named preset, or raise a ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None
