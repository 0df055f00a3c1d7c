"""Robot adapters: what a pi0.5 checkpoint's state and action numbers mean for one robot family.

openpi wraps every checkpoint in a robot-specific transform pair (``policies/<robot>_policy.py``).
Around the model the chain is, for pi0.5::

    in:   raw robot state -> robot inputs (this module) -> quantile Normalize -> prompt
    out:  model actions -> quantile Unnormalize -> AbsoluteActions -> robot outputs (this module)

An adapter implements the two robot-specific ends exactly as openpi does, in numpy and float64:

* :meth:`RobotAdapter.state_to_pi` — the robot inputs' state transform (e.g. ALOHA's joint flips
  and gripper conversion); its result is what gets normalised and put in the prompt;
* :meth:`RobotAdapter.actions_from_pi` — AbsoluteActions (the state from ``state_to_pi`` added on
  the delta dims) followed by the robot outputs (first N dims, flips, gripper encoding);
* :meth:`RobotAdapter.actions_to_pi` — the exact inverse of ``actions_from_pi`` on the robot dims
  (what openpi's training-side ``DeltaActions`` + ``_encode_actions_inv`` compute), used to turn an
  executed robot chunk back into the model's space.

It also says what the actions mean for the command (``action_space``), whether the state enters the
prompt (``discrete_state_input``), the camera -> image-slot mapping and the checkpoint's horizon.

Adapters: ``generic`` (no transform: state and actions pass through, actions are joint
positions), ``droid`` (7 joint velocities + gripper position), ``aloha`` (bimanual, arm deltas,
flips, grippers), ``libero`` (end-effector actions, no state in the prompt). Get one with
:func:`robot_adapter`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

# What the robot-unit action numbers mean, i.e. how they are commanded.
POSITION = "position"  # absolute joint positions
DELTA_POSITION = "delta_position"  # joint positions relative to the state at the observation
VELOCITY = "velocity"  # joint velocities (units/s)
# not joints (e.g. LIBERO's delta pose + gripper): never a JointTrajectory
END_EFFECTOR = "end_effector"
JOINT_ACTION_SPACES = (POSITION, DELTA_POSITION, VELOCITY)
ACTION_SPACES = JOINT_ACTION_SPACES + (END_EFFECTOR,)


@dataclasses.dataclass(frozen=True)
class RobotAdapter:
    """The generic adapter (openpi with no robot transform) and the base of the others.

    Attributes:
        name: the ``robot`` parameter value.
        state_dim: robot state width the transforms need; None: any.
        action_dim: robot action width (openpi's output slice); None: the caller's choice.
        action_space: the natural meaning of the robot-unit actions (one of ``ACTION_SPACES``).
        discrete_state_input: the state is tokenized into the prompt (pi0.5's default).
        cameras: openpi camera name -> model image slot (the slots this checkpoint was trained
            with).
        action_horizon: the checkpoint's horizon; None: any.
        gripper_dims: indices of the gripper dims (published as positions in every action space).
        asset_id: openpi's asset id of the robot's checkpoints (``assets/<asset_id>/``), which
            picks the norm stats when a checkpoint holds several.
    """

    name: str = "generic"
    state_dim: int | None = None
    action_dim: int | None = None
    action_space: str = POSITION
    discrete_state_input: bool = True
    cameras: Mapping[str, str] = dataclasses.field(default_factory=dict)
    action_horizon: int | None = None
    gripper_dims: tuple[int, ...] = ()
    asset_id: str | None = None

    @property
    def controls_joints(self) -> bool:
        """Whether the actions are joint commands (a JointTrajectory can carry them)."""
        return self.action_space != END_EFFECTOR

    @property
    def slots(self) -> tuple[str, ...]:
        """The image slots this robot fills (empty: any)."""
        return tuple(self.cameras.values())

    # -- checks ---------------------------------------------------------------------------------
    def check_state(self, state: np.ndarray) -> np.ndarray:
        """The state as a finite float64 vector of this robot's width.

        Raises:
            ValueError: wrong shape or width, or a non-finite value (naming the indices).
        """
        state = np.asarray(state, dtype=np.float64)
        if state.ndim != 1:
            raise ValueError(
                f"robot {self.name}: state must be a 1-D vector, got shape {state.shape}"
            )
        if self.state_dim is not None and state.shape[0] != self.state_dim:
            raise ValueError(
                f"robot {self.name} needs a {self.state_dim}-dim state, got {state.shape[0]}"
            )
        bad = np.flatnonzero(~np.isfinite(state))
        if bad.size:
            raise ValueError(f"state has non-finite values at indices {bad.tolist()}")
        return state

    def check_actions(self, actions: np.ndarray, width: int) -> np.ndarray:
        """A [horizon, width] float64 copy of ``actions``.

        Raises:
            ValueError: a shape other than [horizon, width].
        """
        chunk = np.array(actions, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[1] != width:
            raise ValueError(
                f"robot {self.name}: actions must be [horizon, {width}], got {chunk.shape}"
            )
        return chunk

    # -- transforms (identity here; robots override) --------------------------------------------
    def state_to_pi(self, state: np.ndarray) -> np.ndarray:
        """Robot inputs' state transform: raw robot state -> the state openpi normalises
        (float64)."""
        return self.check_state(state)

    def actions_from_pi(self, actions: np.ndarray, pi_state: np.ndarray) -> np.ndarray:
        """Unnormalised model actions [horizon, action_dim] -> robot units (AbsoluteActions, then
        the robot outputs). ``pi_state`` is :meth:`state_to_pi` of the observation's state."""
        return np.array(actions, dtype=np.float64)

    def actions_to_pi(self, actions: np.ndarray, pi_state: np.ndarray) -> np.ndarray:
        """Exact inverse of :meth:`actions_from_pi`: robot units -> unnormalised model actions."""
        return np.array(actions, dtype=np.float64)


# -- DROID -----------------------------------------------------------------------------------------

DROID = RobotAdapter(
    name="droid",
    state_dim=8,  # 7 joint positions + gripper position
    action_dim=8,  # 7 joint velocities (rad/s) + gripper position (absolute, 0..1)
    action_space=VELOCITY,
    cameras={"exterior_image_1_left": "base_0_rgb", "wrist_image_left": "left_wrist_0_rgb"},
    action_horizon=15,
    gripper_dims=(7,),
    asset_id="droid",
)


# -- ALOHA -----------------------------------------------------------------------------------------

# Joint sign flips between ALOHA and pi's internal runtime; also the layout of the 14 dims:
# [left arm 6 joints, left gripper, right arm 6 joints, right gripper].
ALOHA_JOINT_FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
ALOHA_GRIPPERS = (6, 13)
# make_bool_mask(6, -1, 6, -1): the 12 arm joints are predicted as deltas, the grippers absolute.
ALOHA_DELTA_MASK = np.array([True] * 6 + [False] + [True] * 6 + [False])
# Gripper constants (ALOHA / Interbotix code, as used by openpi).
ALOHA_GRIPPER_POSITION = (0.01844, 0.05800)  # linear gripper position: open, closed (m)
ALOHA_GRIPPER_ARM_LENGTH = 0.036
ALOHA_GRIPPER_HORN_RADIUS = 0.022
PI_GRIPPER_ANGLE = (0.5476, 1.6296)  # pi's angular gripper range (rad)
ALOHA_GRIPPER_JOINT = (-0.6213, 1.4910)  # PUPPET_GRIPPER_JOINT_OPEN, _CLOSE (rad)


def _normalize(x: np.ndarray, low: float, high: float) -> np.ndarray:
    return (x - low) / (high - low)


def _unnormalize(x: np.ndarray, low: float, high: float) -> np.ndarray:
    return x * (high - low) + low


def aloha_gripper_state_to_pi(value: np.ndarray) -> np.ndarray:
    """ALOHA's normalised linear gripper position -> pi's normalised angular one (state input)."""
    linear = _unnormalize(np.asarray(value, dtype=np.float64), *ALOHA_GRIPPER_POSITION)
    r, arm = ALOHA_GRIPPER_HORN_RADIUS, ALOHA_GRIPPER_ARM_LENGTH
    angle = np.arcsin(np.clip((r**2 + linear**2 - arm**2) / (2 * r * linear), -1.0, 1.0))
    return _normalize(angle, *PI_GRIPPER_ANGLE)


def aloha_gripper_action_from_pi(value: np.ndarray) -> np.ndarray:
    """pi's gripper action -> ALOHA's normalised gripper joint command (action output)."""
    return _normalize(
        np.asarray(value, dtype=np.float64) + PI_GRIPPER_ANGLE[0], *ALOHA_GRIPPER_JOINT
    )


def aloha_gripper_action_to_pi(value: np.ndarray) -> np.ndarray:
    """Exact inverse of :func:`aloha_gripper_action_from_pi`."""
    return (
        _unnormalize(np.asarray(value, dtype=np.float64), *ALOHA_GRIPPER_JOINT)
        - PI_GRIPPER_ANGLE[0]
    )


@dataclasses.dataclass(frozen=True)
class AlohaAdapter(RobotAdapter):
    """openpi's ``AlohaInputs/AlohaOutputs`` with ``adapt_to_pi=True`` and delta arm actions."""

    name: str = "aloha"
    state_dim: int | None = 14
    action_dim: int | None = 14
    action_space: str = POSITION  # the arm deltas are made absolute here, so commands are positions
    cameras: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {
            "cam_high": "base_0_rgb",
            "cam_left_wrist": "left_wrist_0_rgb",
            "cam_right_wrist": "right_wrist_0_rgb",
        }
    )
    action_horizon: int | None = 50
    gripper_dims: tuple[int, ...] = ALOHA_GRIPPERS
    reset_pose: tuple[float, ...] = (0.0, -1.5, 1.5, 0.0, 0.0, 0.0)  # policy_metadata, per arm
    asset_id: str | None = "trossen"

    def state_to_pi(self, state: np.ndarray) -> np.ndarray:
        pi_state = ALOHA_JOINT_FLIP * self.check_state(state)
        pi_state[list(ALOHA_GRIPPERS)] = aloha_gripper_state_to_pi(pi_state[list(ALOHA_GRIPPERS)])
        return pi_state

    def actions_from_pi(self, actions: np.ndarray, pi_state: np.ndarray) -> np.ndarray:
        chunk = self.check_actions(actions, 14)
        chunk[:, ALOHA_DELTA_MASK] += np.asarray(pi_state, dtype=np.float64)[
            ALOHA_DELTA_MASK
        ]  # AbsoluteActions
        chunk = ALOHA_JOINT_FLIP * chunk
        chunk[:, list(ALOHA_GRIPPERS)] = aloha_gripper_action_from_pi(
            chunk[:, list(ALOHA_GRIPPERS)]
        )
        return chunk

    def actions_to_pi(self, actions: np.ndarray, pi_state: np.ndarray) -> np.ndarray:
        chunk = self.check_actions(actions, 14)
        chunk[:, list(ALOHA_GRIPPERS)] = aloha_gripper_action_to_pi(chunk[:, list(ALOHA_GRIPPERS)])
        chunk = ALOHA_JOINT_FLIP * chunk  # the flips are their own inverse
        chunk[:, ALOHA_DELTA_MASK] -= np.asarray(pi_state, dtype=np.float64)[ALOHA_DELTA_MASK]
        return chunk


# -- LIBERO ----------------------------------------------------------------------------------------

LIBERO = RobotAdapter(
    name="libero",
    state_dim=8,  # observation/state
    action_dim=7,  # 6 delta end-effector pose + gripper: not joints
    action_space=END_EFFECTOR,
    discrete_state_input=False,  # the prompt is the task text alone
    cameras={"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"},
    action_horizon=10,
    asset_id="physical-intelligence/libero",
)


ROBOTS: dict[str, RobotAdapter] = {
    "generic": RobotAdapter(),
    "droid": DROID,
    "aloha": AlohaAdapter(),
    "libero": LIBERO,
}


def robot_adapter(name: str) -> RobotAdapter:
    """The adapter registered as ``name``.

    Raises:
        ValueError: an unknown name (listing the known ones).
    """
    try:
        return ROBOTS[name]
    except KeyError:
        raise ValueError(f"unknown robot {name!r}; known robots: {', '.join(ROBOTS)}") from None
