"""Input conventions: how a checkpoint's framework turned robot data into model inputs.

The same pi0.5 weights see slightly different inputs depending on the framework that trained them,
and the actions move with it (random weights, two 240x320 / 300x200 cameras: up to 0.32 on the
`small` preset, 0.47 in the issue's measurement). One frozen value,
`InputConventions`, carries every such choice; the policy and the preprocessing read it, nothing
else decides:

====================  ==================================  =====================================
choice                openpi (and this package's own)     LeRobot
====================  ==================================  =====================================
state in the prompt   the real dims                       0.4.x: zero-padded to max_state_dim;
                                                          main (0.5+): the real dims
image resampling      uint8, PIL bilinear, antialiased    float32 in [0, 1], bilinear without
                                                          antialiasing (``F.interpolate``)
image borders         black (-1 in model range)           0.4.x: -1 before scaling -> -3;
                                                          main: 0 before scaling -> -1
flow-matching times   ``t += dt`` accumulated (float32)   ``1 + step * dt`` per step
bfloat16 weights      SigLIP embeddings and norms fp32    0.4.x: as openpi; main: the whole
                                                          vision tower and projector fp32
====================  ==================================  =====================================

LeRobot's version is read from the folder: main writes ``use_relative_actions`` into config.json
and a relative-actions step into policy_preprocessor.json; 0.4.x writes neither. A folder that
does not say (e.g. a hand-made config.json) is taken as 0.4.x; the ``lerobot_version`` parameter
overrides the guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

OPENPI, LEROBOT = "openpi", "lerobot"
RESAMPLE_PIL = "pil_antialias"  # openpi_client's resize_with_pad
RESAMPLE_FLOAT = "float_bilinear"  # LeRobot's resize_with_pad_torch on float pixels
LEROBOT_VERSIONS = ("auto", "0.4", "main")
MAIN_KEEP_FLOAT32 = ("vision_tower", "multi_modal_projector")


@dataclasses.dataclass(frozen=True)
class InputConventions:
    """Every framework-dependent choice between robot data and model inputs (see the module)."""

    framework: str = OPENPI
    prompt_state_dim: int = 0  # > 0: the normalised state is zero-padded to it in the prompt
    resample: str = RESAMPLE_PIL
    border: float = -1.0  # model-range value of the letterbox bars
    flow_times: str = OPENPI  # a key of `pi05.FLOW_SCHEDULES`
    reason: str = "openpi conventions"
    # parameter name parts kept in float32 beyond openpi's when the model runs in bfloat16
    keep_float32: tuple[str, ...] = ()

    @property
    def border_before_scaling(self) -> float:
        """The pad value in LeRobot's [0, 1] pixel range that ends at ``border`` after x*2-1."""
        return (self.border + 1.0) / 2.0


OPENPI_CONVENTIONS = InputConventions()


def lerobot_conventions(
    version: str, told_main: Sequence[str], max_state_dim: int
) -> InputConventions:
    """LeRobot's conventions for ``version`` ("auto": main when ``told_main`` lists evidence).

    Raises:
        ValueError: an unknown version.
    """
    if version not in LEROBOT_VERSIONS:
        raise ValueError(f"lerobot_version must be one of {', '.join(LEROBOT_VERSIONS)}")
    if version == "auto":
        version = "main" if told_main else "0.4"
        why = (
            "; ".join(told_main)
            if told_main
            else "config.json has no use_relative_actions and no relative-actions step"
        )
        why = f"LeRobot {version} conventions ({why})"
    else:
        why = f"LeRobot {version} conventions (lerobot_version parameter)"
    if version == "main":
        # main keeps the whole vision path (SigLIP and the projector) in float32 under bfloat16
        return InputConventions(LEROBOT, 0, RESAMPLE_FLOAT, -1.0, LEROBOT, why, MAIN_KEEP_FLOAT32)
    return InputConventions(
        LEROBOT,
        max_state_dim,
        RESAMPLE_FLOAT,
        -3.0,
        LEROBOT,
        why + f": state padded to {max_state_dim} in the prompt, image borders -3",
    )
