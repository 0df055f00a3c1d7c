"""An engine `Observation` as the openpi client of its robot family would send it: the inverse of
`observations.ObservationReader.read`, for clients written here (the node's remote mode, the
serve bench).

Images keyed by model slot go back to the robot's camera names (`RobotAdapter.cameras`), under
the layout's flat keys (droid, libero) or in an ``images`` map (aloha, generic, LeRobot); the
state is split into the layout's parts (DROID's 7 joint positions + 1 gripper position).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.types import Observation
from ..policy_io.robots import robot_adapter
from .observations import LAYOUTS, NESTED_LAYOUT

# the widths of a layout's state parts but the last, which takes the rest (openpi's examples)
STATE_PART_WIDTHS = {"observation/joint_position": 7}
# A LeRobot folder is served as robot "lerobot": the generic adapter (no openpi transforms) with
# the folder's widths (`Pi05Policy`), so its clients send what a generic robot's clients send.
LEROBOT_ROBOT = "lerobot"


def client_robot(served: str) -> str:
    """The robot whose openpi client a served robot's clients are (``lerobot``: generic)."""
    return "generic" if served == LEROBOT_ROBOT else served


def client_message(observation: Observation, robot: str) -> dict[str, Any]:
    """``observation`` as robot ``robot``'s openpi client sends it (``prompt`` included; a served
    ``lerobot`` as generic).

    Raises:
        ValueError: an image slot the robot has no camera for, or a state too short for the
            layout's parts.
    """
    robot = client_robot(robot)
    layout = LAYOUTS.get(robot, NESTED_LAYOUT)
    camera_of = {slot: camera for camera, slot in robot_adapter(robot).cameras.items()}
    images = {}
    for slot, image in observation.images.items():
        if camera_of and slot not in camera_of:
            raise ValueError(
                f"image slot {slot!r} has no camera of robot {robot} (its slots: "
                f"{sorted(camera_of)})"
            )
        images[camera_of.get(slot, slot)] = image
    message: dict[str, Any] = {"prompt": observation.prompt}
    if layout.flat_cameras:
        message.update(
            {key: images[camera] for key, camera in layout.flat_cameras.items() if camera in images}
        )
    else:
        message["images"] = images
    state = np.asarray(observation.state, dtype=np.float32)
    start = 0
    for index, key in enumerate(layout.state_parts):
        last = index == len(layout.state_parts) - 1
        end = len(state) if last else start + STATE_PART_WIDTHS[key]
        if end > len(state) or (last and end == start):
            raise ValueError(
                f"a {len(state)}-value state cannot fill robot {robot}'s parts "
                f"{list(layout.state_parts)}"
            )
        message[key] = state[start:end]
        start = end
    return message
