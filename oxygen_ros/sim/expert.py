"""The scripted expert: privileged state in, the two controllers' JointTrajectory messages out.

:class:`ScriptedExpert` is a small state machine over the task's steps (approach above the cube,
descend, close, lift, carry above the pad, lower, open, retreat; for touch: approach, descend).
To touch, it lays a finger on the cube's top: the open fingers would straddle a cube they are
centred over and touch nothing, so the tip goes down :data:`TOUCH_ASIDE` from the cube's centre
along the fingers' closing axis, on the side that keeps the other finger farthest from the other
cubes, to where the finger's end rests on the top (:func:`touch_point`).
Every planning tick it moves the tip along a straight line towards the step's target at
:data:`TIP_SPEED`, with the gripper pointing down and aligned with the cube, as a trajectory of a
few points :data:`POINT_DT` apart from "now" (analytic IK per point, velocities by finite
differences, zero at the last point, so a stock controller accepts it), and sends the gripper's
opening as a one-point trajectory. Each step's end is read from the state (the tip reached its
target, the cube is held, the gripper is open); a cube that slips out sends it back to the
approach, a close that grasps nothing is retried. A two-step task is done one step after the
other: once the sim counts the first step (a place) done and the expert has opened and retreated
above the pad, it starts the second step from its approach.

:class:`ExpertNode` runs it as a ROS 2 node beside the sim (in the same process: it reads the
privileged state through a Python callable, never from a topic) and publishes to the same
``arm_controller/joint_trajectory`` and ``gripper_controller/joint_trajectory`` topics a policy
would. Its timer runs on ROS time, so with ``use_sim_time`` it ticks in simulated seconds.

:class:`ArmPerturbation` makes demonstrations that teach recovery (DART, Laskey et al. 2017): the
arm trajectory the controller executes is the expert's plan plus a smooth random joint offset, so
the arm wanders off the expert's path, while the clean plan, published on ``expert/arm_plan``, is
what a dataset takes as the action label. Every plan starts from where the arm really is, so the
labels show the way back from states a perfect expert never visits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.ros.convert import seconds_to_duration, seconds_to_stamp

from .episode import RUNNING, PrivilegedState
from .kinematics import Unreachable, tip_down_ik
from .scene import (
    ARM_JOINTS,
    CUBE_SIZE,
    FINGER_BEYOND_TIP,
    FINGER_OFFSET,
    GRIPPER_JOINT,
    PAD_HALF,
    PAD_THICKNESS,
)
from .tasks import PLACE, Task

TIP_SPEED = 0.12  # m/s along the straight line to the target
POINT_DT = 0.1  # seconds between a trajectory's points
POINTS = 4  # points per arm trajectory
GRIPPER_MOVE_S = 0.25  # the gripper's one point this far ahead
HOVER_Z = 0.09  # tip height when moving above the table
REACHED = 0.008  # a tip this close to its target has reached it
CLOSE_TIMEOUT_S = 1.0  # a close that holds nothing after this is retried
OPENED = 0.15  # a gripper reading below this is open
# A corrective expert (labelling a policy's states) goes straight down to its spot from anywhere in
# a cone above it, and re-centres at the tip's own height when the tip is near across and high
# enough that nothing below it is swept.
NEAR = 0.03
FINGERS_CLEAR = 0.005  # open fingers' ends this far above a cube's top pass over it
CARRY_CLEAR_Z = 0.055  # a held cube's bottom and the fingers clear the cubes on the table
STRADDLE = 0.008  # open fingers this far off the cube's centre along their closing axis pass it
# the tip this far above the grasp point puts the fingers' ends at the cube's top
FINGERS_AT_TOP = CUBE_SIZE / 2 - 0.002 + FINGER_BEYOND_TIP
# A corrective expert lowers a held cube from wherever its centre is within RELEASE_ACROSS of the
# pad's centre along both of the pad's edges, and lets it go there once its bottom is within
# RELEASE_DROP of the pad's top: let go that low it lands on the pad with a centimetre to spare.
RELEASE_ACROSS = PAD_HALF - 0.01
RELEASE_DROP = 0.006
CONE_SLACK = 0.005  # a descent is left only this far outside its cone (no flicker at the edge)
# touch: the tip this far from the cube's centre puts a finger's centre a quarter edge inside the
# cube's top (contact for tip errors from -11 to +27 mm along the closing axis)
TOUCH_ASIDE = FINGER_OFFSET - CUBE_SIZE / 4
TOUCH_PRESS = 0.002  # the touch point's finger end this far below the cube's top
TOUCH_CLEARANCE = 0.05  # the outer finger's centre this far from another cube's centre is clear

APPROACH, DESCEND, CLOSE, LIFT, CARRY, LOWER, OPEN, RETREAT = (
    "approach",
    "descend",
    "close",
    "lift",
    "carry",
    "lower",
    "open",
    "retreat",
)
HOLDING_STEPS = (LIFT, CARRY, LOWER)
GRASPING_STEPS = (APPROACH, DESCEND, CLOSE, RETREAT)  # a cube held here was just grasped


class ArmPerturbation:
    """A joint offset drifting as an Ornstein-Uhlenbeck process: stationary standard deviation
    ``scale_rad`` per joint, correlation time ``correlation_s``; zero when ``scale_rad`` is 0."""

    def __init__(self, scale_rad: float, correlation_s: float = 0.5, seed: int = 0) -> None:
        if not (math.isfinite(scale_rad) and scale_rad >= 0):
            raise ValueError(f"perturbation scale must be >= 0 rad, got {scale_rad}")
        if not (math.isfinite(correlation_s) and correlation_s > 0):
            raise ValueError(f"perturbation correlation time must be > 0 s, got {correlation_s}")
        self.scale_rad = float(scale_rad)
        self.correlation_s = float(correlation_s)
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """A fresh episode: offset zero, draws from ``seed``."""
        self._rng = np.random.default_rng([seed, 11])
        self.offset = np.zeros(len(ARM_JOINTS))

    def advance(self, dt_s: float) -> np.ndarray:
        """The offset ``dt_s`` seconds later (exact OU transition)."""
        if self.scale_rad == 0.0:
            return self.offset
        keep = math.exp(-dt_s / self.correlation_s)
        spread = self.scale_rad * math.sqrt(1.0 - keep * keep)
        self.offset = keep * self.offset + spread * self._rng.standard_normal(self.offset.shape)
        return self.offset

    def apply(self, plan: JointTrajectory) -> JointTrajectory:
        """``plan`` with the current offset added to every point's positions."""
        out = JointTrajectory(header=plan.header, joint_names=list(plan.joint_names))
        for point in plan.points:
            out.points.append(
                JointTrajectoryPoint(
                    positions=(np.asarray(point.positions) + self.offset).tolist(),
                    velocities=list(point.velocities),
                    time_from_start=point.time_from_start,
                )
            )
        return out


def closing_angle(arm: np.ndarray) -> float:
    """The fingers' closing axis on the table (rad) of a hand pointing down: ``pan + pi/2 -
    roll`` (the axis the IK turns the hand to, see :func:`.kinematics.tip_down_ik`)."""
    return float(arm[0]) + math.pi / 2 - float(arm[4])


def off_faces_rad(arm: np.ndarray, cube_yaw: float) -> float:
    """How far the closing axis is turned from the nearest of a cube's face normals: 0 (the
    fingers meet two opposite faces) to pi/4 (they meet its edges)."""
    turned = (closing_angle(arm) - cube_yaw) % (math.pi / 2)
    return min(turned, math.pi / 2 - turned)


def closing_axis(state: PrivilegedState, cube: str) -> np.ndarray:
    """The fingers' closing axis (a horizontal unit vector), snapped to the nearest of the
    cube's face normals."""
    axis = closing_angle(state.arm)
    yaw = state.cube_yaws[cube]
    axis = yaw + round((axis - yaw) / (math.pi / 2)) * (math.pi / 2)
    return np.array([math.cos(axis), math.sin(axis)])


def touch_point(state: PrivilegedState, cube: str) -> np.ndarray:
    """Where the tip goes to touch ``cube``: :data:`TOUCH_ASIDE` from its centre along the
    closing axis, so the finger on the other side rests on the cube's top (pressing it by
    :data:`TOUCH_PRESS`); the tip on the base's side of the cube unless the outer finger would
    come within :data:`TOUCH_CLEARANCE` of another cube there and less so on the other side."""
    centre = state.cubes[cube]
    axis = closing_axis(state, cube)
    others = [c[:2] for name, c in state.cubes.items() if name != cube]

    def clearance(side: float) -> float:  # the outer finger's distance to the nearest other cube
        outer = centre[:2] - side * (TOUCH_ASIDE + FINGER_OFFSET) * axis
        return min((float(np.linalg.norm(outer - o)) for o in others), default=math.inf)

    near = 1.0 if float(np.dot(axis, centre[:2])) >= 0 else -1.0  # the tip on the base's side
    side = near if clearance(near) >= TOUCH_CLEARANCE else max((near, -near), key=clearance)
    xy = centre[:2] - side * TOUCH_ASIDE * axis
    z = centre[2] + CUBE_SIZE / 2 + FINGER_BEYOND_TIP - TOUCH_PRESS
    return np.array([xy[0], xy[1], z])


class ScriptedExpert:
    """Plans each tick's trajectories from the privileged state; one episode at a time.

    ``corrective`` makes it label states it did not make (a policy driving, DAgger): near its spot
    and clear of the cubes it re-centres at the tip's height instead of climbing back to
    :data:`HOVER_Z`, counts a held cube lifted once it is clear, and leaves a descent the tip has
    wandered away from. Its own episodes then take shortcuts; the demonstrations keep the default.
    """

    def __init__(self, corrective: bool = False) -> None:
        self.corrective = corrective
        self.episode = -1
        self.step = APPROACH
        self.task_step = 0  # which of the task's steps it carries out (two-step: 0, then 1)
        self._step_since_s = 0.0
        self._tip_offset = np.zeros(3)  # the held cube's centre to the tip

    def plan(self, state: PrivilegedState) -> tuple[JointTrajectory, JointTrajectory] | None:
        """This tick's (arm, gripper) trajectories, or None when no episode runs."""
        if state.task is None or state.status != RUNNING:
            return None
        target, gripper = self.target(state)
        yaw = state.cube_yaws[state.task.steps[self.task_step].cube]
        return self._arm_trajectory(state, target, yaw), self._gripper_trajectory(state, gripper)

    def target(self, state: PrivilegedState) -> tuple[np.ndarray, float]:
        """This tick's step: where the tip heads and the gripper's command (0 open, 1 closed)."""
        if state.episode != self.episode:
            self.episode, self.step, self._step_since_s = state.episode, APPROACH, state.time_s
            self.task_step = 0
        self._next_task_step(state)
        return self._advance(state.task.steps[self.task_step], state)

    def _next_task_step(self, state: PrivilegedState) -> None:
        """Go on to the task's next step once the sim has counted this one done and, after a
        place, the hand is back above the pad (so it does not sweep the placed cube away)."""
        if self.task_step + 1 >= len(state.task.steps) or state.step <= self.task_step:
            return
        task = state.task.steps[self.task_step]
        if task.kind == PLACE:
            pad_x, pad_y = state.pads[task.pad]
            if self.step != RETREAT or not self._reached(state, np.array([pad_x, pad_y, HOVER_Z])):
                return
        self.task_step += 1
        self._tip_offset = np.zeros(3)
        self._go(APPROACH, state)

    # -- the task's steps -------------------------------------------------------------------------
    def _go(self, step: str, state: PrivilegedState) -> None:
        self.step, self._step_since_s = step, state.time_s

    def _advance(self, task: Task, state: PrivilegedState) -> tuple[np.ndarray, float]:
        """Move through the steps the state allows; return the tip's target and the gripper's."""
        cube = state.cubes[task.cube]
        if task.kind != PLACE:
            touch = touch_point(state, task.cube)
            self._leave_if_wandered(state, DESCEND, self._in_descent_cone(state, touch), APPROACH)
            above_touch = self._hover_over(state, touch, self._over_cube_z(cube))
            in_cone = self._in_descent_cone(state, touch, slack=0.0)
            if self.step == APPROACH and self._may_go_down(state, above_touch, in_cone):
                self._go(DESCEND, state)
            return (touch if self.step == DESCEND else above_touch), 0.0

        held = state.grasped == task.cube
        if self.step in HOLDING_STEPS and not held:
            self._go(APPROACH, state)  # the cube slipped out: start over
        if held and self.step in GRASPING_STEPS:  # whoever drove the arm grasped it: lift it
            self._tip_offset = state.tip - cube
            self._go(LIFT, state)
        pad_x, pad_y = state.pads[task.pad]
        grasp = np.array([cube[0], cube[1], cube[2] + 0.002])
        on_pad_z = PAD_THICKNESS + CUBE_SIZE / 2 + self._tip_offset[2] + 0.003
        on_pad = np.array([pad_x, pad_y, on_pad_z])
        self._leave_if_wandered(state, DESCEND, self._in_descent_cone(state, grasp), APPROACH)
        self._leave_if_wandered(state, LOWER, self._over_release_zone(cube, task.pad, state), CARRY)
        above_cube = self._hover_over(state, cube, self._over_cube_z(cube))
        may_grasp = self._may_go_down(
            state, above_cube, self._in_descent_cone(state, grasp, slack=0.0)
        )
        if self.step == APPROACH and may_grasp and state.gripper < OPENED:
            self._go(DESCEND, state)
        if self.step == DESCEND and self._reached(state, grasp):
            self._go(CLOSE, state)
        if self.step == CLOSE and state.time_s - self._step_since_s > CLOSE_TIMEOUT_S:
            self._go(APPROACH, state)
        lift = np.array([state.tip[0], state.tip[1], HOVER_Z])
        above_pad = self._hover_over(state, on_pad, on_pad_z)
        lifted = self._reached(state, lift, vertical_only=True)
        if self.step == LIFT and (lifted or (self.corrective and state.tip[2] >= CARRY_CLEAR_Z)):
            self._go(CARRY, state)
        over_pad = self._over_release_zone(cube, task.pad, state, slack=0.0)
        if self.step == CARRY and self._may_go_down(state, above_pad, over_pad):
            self._go(LOWER, state)
        if self.step == LOWER and (
            self._reached(state, on_pad) or self._may_let_go(cube, over_pad)
        ):
            self._go(OPEN, state)
        if self.step == OPEN and state.gripper < OPENED:
            self._go(RETREAT, state)
        targets = {
            APPROACH: (above_cube, 0.0),
            DESCEND: (grasp, 0.0),
            CLOSE: (grasp, 1.0),
            LIFT: (lift, 1.0),
            CARRY: (above_pad, 1.0),
            LOWER: (on_pad, 1.0),
            OPEN: (state.tip if self.corrective else on_pad, 0.0),  # a corrective one holds still
            RETREAT: (np.array([pad_x, pad_y, HOVER_Z]), 0.0),
        }
        return targets[self.step]

    @staticmethod
    def _over_cube_z(cube: np.ndarray) -> float:
        """The lowest tip height at which open fingers pass over ``cube``."""
        return float(cube[2] + CUBE_SIZE / 2 + FINGER_BEYOND_TIP + FINGERS_CLEAR)

    def _hover_over(self, state: PrivilegedState, spot: np.ndarray, clear_z: float) -> np.ndarray:
        """Where to wait above ``spot`` before going down: :data:`HOVER_Z`, or for a corrective
        expert the tip's own height when the tip is near across and no lower than ``clear_z``."""
        z = HOVER_Z
        across = float(np.linalg.norm(state.tip[:2] - spot[:2]))
        if self.corrective and across <= NEAR and state.tip[2] >= clear_z:
            z = min(float(state.tip[2]), HOVER_Z)
        return np.array([spot[0], spot[1], z])

    def _may_go_down(self, state: PrivilegedState, hover: np.ndarray, in_cone: bool) -> bool:
        """Whether to go down from here: over ``hover``'s spot (the demonstrating expert), or for
        a corrective one, from anywhere below the hover height that ``in_cone`` says is safe."""
        if not self.corrective:
            return self._above(state, hover)
        return state.tip[2] <= HOVER_Z + REACHED and in_cone

    def _may_let_go(self, cube: np.ndarray, over_pad: bool) -> bool:
        """A corrective expert opens wherever a held ``cube`` low over the pad lands on it."""
        low = cube[2] - CUBE_SIZE / 2 - PAD_THICKNESS <= RELEASE_DROP
        return self.corrective and over_pad and low

    def _leave_if_wandered(
        self, state: PrivilegedState, step: str, still_in_cone: bool, back_to: str
    ) -> None:
        """A corrective expert goes ``back_to`` once the tip has left the cone of ``step``'s
        descent (going on down from there would sweep the table or miss the pad)."""
        if self.corrective and self.step == step and not still_in_cone:
            self._go(back_to, state)

    @staticmethod
    def _in_descent_cone(
        state: PrivilegedState, spot: np.ndarray, slack: float = CONE_SLACK
    ) -> bool:
        """A straight line from the tip down to a cube's ``spot`` is safe: the open fingers still
        straddle the cube as their ends pass its top (they close in on the line's end as the tip
        comes down)."""
        across = float(np.linalg.norm(state.tip[:2] - spot[:2]))
        height = float(state.tip[2] - spot[2])
        return across <= max(REACHED, STRADDLE * height / FINGERS_AT_TOP) + slack

    @staticmethod
    def _over_release_zone(
        cube: np.ndarray, pad: str, state: PrivilegedState, slack: float = CONE_SLACK
    ) -> bool:
        """A held ``cube``'s centre within :data:`RELEASE_ACROSS` of ``pad``'s centre along both
        of its edges: lowered straight down from here it lands on the pad."""
        off = np.abs(np.asarray(cube[:2]) - np.asarray(state.pads[pad]))
        return float(np.max(off)) <= RELEASE_ACROSS + slack

    @staticmethod
    def _above(state: PrivilegedState, hover: np.ndarray) -> bool:
        """The tip over ``hover``'s spot (within :data:`REACHED` across) and no higher than it:
        the arm may go down from here, wherever it came from (the expert's own path arrives at
        ``hover`` itself; a policy's may come in lower)."""
        across = float(np.linalg.norm(state.tip[:2] - hover[:2]))
        return across <= REACHED and state.tip[2] <= hover[2] + REACHED

    @staticmethod
    def _reached(state: PrivilegedState, target: np.ndarray, vertical_only: bool = False) -> bool:
        if vertical_only:
            return abs(state.tip[2] - target[2]) <= REACHED
        return float(np.linalg.norm(state.tip - target)) <= REACHED

    # -- messages ---------------------------------------------------------------------------------
    def _arm_trajectory(
        self, state: PrivilegedState, target: np.ndarray, yaw: float
    ) -> JointTrajectory:
        """A straight tip path towards ``target``, POINTS points POINT_DT apart, the fingers
        aligned with ``yaw`` (the step's cube's)."""
        offset = target - state.tip
        distance = float(np.linalg.norm(offset))
        direction = offset / distance if distance > 1e-9 else np.zeros(3)
        roll = float(state.arm[4])
        positions = []
        for k in range(1, POINTS + 1):
            tip = state.tip + direction * min(TIP_SPEED * POINT_DT * k, distance)
            try:
                joints = tip_down_ik(tip, yaw, roll_hint=roll)
            except Unreachable:
                joints = positions[-1] if positions else state.arm
            positions.append(np.asarray(joints, dtype=float))
        path = np.array(positions)
        velocities = np.zeros_like(path)
        velocities[:-1] = np.gradient(path, POINT_DT, axis=0)[:-1]
        msg = JointTrajectory()
        msg.header.stamp = seconds_to_stamp(state.time_s)
        msg.joint_names = list(ARM_JOINTS)
        for k, (q, v) in enumerate(zip(path, velocities, strict=True)):
            msg.points.append(
                JointTrajectoryPoint(
                    positions=q.tolist(),
                    velocities=v.tolist(),
                    time_from_start=seconds_to_duration(POINT_DT * (k + 1)),
                )
            )
        return msg

    @staticmethod
    def _gripper_trajectory(state: PrivilegedState, opening: float) -> JointTrajectory:
        msg = JointTrajectory()
        msg.header.stamp = seconds_to_stamp(state.time_s)
        msg.joint_names = [GRIPPER_JOINT]
        msg.points.append(
            JointTrajectoryPoint(
                positions=[float(opening)],
                velocities=[0.0],
                time_from_start=seconds_to_duration(GRIPPER_MOVE_S),
            )
        )
        return msg


def trajectory_qos() -> QoSProfile:
    """The controllers' command QoS: reliable, volatile, depth 1 (a JTC's system default is
    reliable/volatile, so this matches it both ways)."""
    return QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE
    )


class ExpertNode(Node):
    """The expert as a ROS 2 node publishing both controllers' trajectories at ``rate_hz``.

    ``state`` returns the sim's privileged state (a copy, taken under the sim's lock).
    ``perturbation_rad`` > 0 adds an :class:`ArmPerturbation` to the arm trajectory the controller
    gets; the clean plan goes out on ``expert/arm_plan`` either way. ``timer=False``: no timer,
    the owner calls :meth:`tick` at each planning instant.
    """

    def __init__(
        self,
        state: Callable[[], PrivilegedState],
        rate_hz: float = 10.0,
        namespace: str = "",
        use_sim_time: bool = True,
        perturbation_rad: float = 0.0,
        timer: bool = True,
        **node_kwargs,
    ) -> None:
        from rclpy.parameter import Parameter

        super().__init__(
            "sim_expert",
            namespace=namespace,
            parameter_overrides=[Parameter("use_sim_time", value=use_sim_time)],
            **node_kwargs,
        )
        if not math.isfinite(rate_hz) or rate_hz <= 0:
            raise ValueError(f"rate_hz must be positive, got {rate_hz}")
        self._state = state
        self.expert = ScriptedExpert()
        self.perturbation = ArmPerturbation(perturbation_rad)
        self._period_s = 1.0 / rate_hz
        qos = trajectory_qos()
        self._plan = self.create_publisher(JointTrajectory, "expert/arm_plan", qos)
        self._arm = self.create_publisher(JointTrajectory, "arm_controller/joint_trajectory", qos)
        self._gripper = self.create_publisher(
            JointTrajectory, "gripper_controller/joint_trajectory", qos
        )
        self.published = 0
        if timer:
            self.create_timer(self._period_s, self.tick)

    def tick(self) -> None:
        """Plan from the present state and publish (the timer's callback; with ``timer=False``
        the owner calls it every ``1 / rate_hz`` of sim time)."""
        state = self._state()
        new_episode = state.episode != self.expert.episode  # the expert's, before it plans
        planned = self.expert.plan(state)
        if planned is None:
            return
        arm, gripper = planned
        if new_episode:
            self.perturbation.reset(state.episode)
        self.perturbation.advance(self._period_s)
        self._plan.publish(arm)
        self._arm.publish(self.perturbation.apply(arm))
        self._gripper.publish(gripper)
        self.published += 1
