"""One simulated robot running episodes, without ROS: world + two controllers + task + status.

:class:`Simulation` owns the simulation clock (seconds since ``epoch_s``, advanced one control
step at a time, never reset between episodes), executes the two controllers' trajectories
(``arm_controller`` for the five arm joints, ``gripper_controller`` for ``gripper``), checks
success every control step and ends an episode with ``success``, ``timeout`` or, for a touch
task whose gripper touched another cube first, ``wrong_cube``. The ROS node (:mod:`.node`) and
the headless loop (:mod:`.headless`) both drive it; neither adds behaviour.

Touch is judged by contact (:func:`.tasks.touch_verdict`): the episode's first contact between
the gripper (a finger or the hand) and any cube decides it. The old rule (the tip within
:data:`.tasks.TOUCH_DISTANCE` of the cube's centre) is still tracked, past the episode's end
while the sim is stepped and the timeout has not passed, so benches can report it beside the
contact rule (:meth:`Simulation.tip_rule_pending`).

A two-step task is worked on one step at a time (:attr:`Simulation.step`): the current step is
judged by its own rule, on what happens while it is the current step (a touch step by the first
contact it makes, contacts already there when it began not counting until they end; a place
step by a result that was missing at some moment since it began, so a second place done before
the first counts only once redone), and once done the next step begins. The episode succeeds
when the last step succeeds while the first step's cube still rests on its pad; that cube
leaving its pad after it was placed ends the episode at once with ``undone``. :meth:`facts` and
:attr:`phase` describe the current step, so the subtask and narration follow it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .controller import TrajectoryController
from .language import Phase, SceneFacts, current_phase, place_words
from .scene import ARM_JOINTS, CUBE_COLORS, GRIPPER_JOINT, HOME, PAD_COLORS, PAD_HALF
from .tasks import (
    PLACE,
    TOUCH,
    TWO_STEP,
    Task,
    cube_left_pad,
    cube_on_pad,
    random_layout,
    random_task,
    tip_touches,
    touch_verdict,
)
from .world import World

RUNNING, SUCCESS, TIMEOUT = "running", "success", "timeout"
WRONG_CUBE = "wrong_cube"  # a touch task's gripper touched another cube first
UNDONE = "undone"  # a two-step task's first cube left its pad after it was placed
ARM_CONTROLLER, GRIPPER_CONTROLLER = "arm_controller", "gripper_controller"
RELEASED_GRIPPER = 0.45  # a gripper opened past this has let go of a cube (~0.5 holding one)


@dataclass(frozen=True)
class PrivilegedState:
    """A copy of what only scoring and the expert may know, taken between control steps."""

    time_s: float  # simulation clock
    episode: int
    task: Task | None
    status: str
    arm: np.ndarray  # joint positions
    gripper: float  # 0 open .. 1 closed
    tip: np.ndarray
    cubes: dict[str, np.ndarray]  # colour -> centre (x, y, z)
    cube_yaws: dict[str, float]
    pads: dict[str, tuple[float, float]]
    grasped: str | None
    step: int = 0  # the current step of a two-step task (0-based)


class Simulation:
    """The robot, its controllers and the current episode."""

    def __init__(
        self,
        physics_rate_hz: float = 500.0,
        control_rate_hz: float = 100.0,
        episode_timeout_s: float = 20.0,
        epoch_s: float = 0.0,
    ) -> None:
        if control_rate_hz <= 0 or physics_rate_hz < control_rate_hz:
            raise ValueError(
                f"need 0 < control_rate_hz ({control_rate_hz}) <= physics_rate_hz "
                f"({physics_rate_hz})"
            )
        if episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be positive, got {episode_timeout_s}")
        self.world = World(physics_rate_hz)
        self.substeps = max(1, round(physics_rate_hz / control_rate_hz))
        self.control_dt = self.substeps * self.world.dt
        self.episode_timeout_s = float(episode_timeout_s)
        self.now_s = float(epoch_s)
        self.controllers = {
            ARM_CONTROLLER: TrajectoryController(ARM_CONTROLLER, ARM_JOINTS, HOME),
            GRIPPER_CONTROLLER: TrajectoryController(GRIPPER_CONTROLLER, (GRIPPER_JOINT,), (0.0,)),
        }
        self.episode = -1
        self.task: Task | None = None
        self.seed: int | None = None
        self.status = TIMEOUT  # no episode yet: nothing runs until the first reset
        self.episode_start_s = self.now_s
        self.episode_end_s: float | None = None
        self.phase: Phase | None = None
        self.touched_first: frozenset[str] = frozenset()  # touch: the cubes of the first contact
        self.tip_touch_s: float | None = None  # touch: when the old tip rule first held
        self.step = 0  # the current step of the task's steps (two-step: 0, then 1)
        self.steps_done_s: list[float] = []  # when each finished step was done, episode seconds
        self.episode_limit_s = self.episode_timeout_s  # this episode's timeout
        self._contacts_before_step: frozenset[str] = frozenset()  # touch step: not its contacts
        self._step_result_absent = True  # place step: its result was missing since it began
        self._rejected_at_start = self._rejected_totals()

    # -- episodes ---------------------------------------------------------------------------------
    def reset(
        self, task: Task | None = None, seed: int | None = None, timeout_s: float | None = None
    ) -> Task:
        """Start the next episode: ``task`` (random from the seed when None) on a layout drawn
        from ``seed`` (the episode's index when None), timing out after ``timeout_s`` sim
        seconds (None: ``episode_timeout_s``). Returns the episode's task."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.episode += 1
        self.seed = self.episode if seed is None else int(seed)
        rng = np.random.default_rng(self.seed)
        self.task = task if task is not None else random_task(rng)
        self.world.reset(random_layout(rng))
        self.controllers[ARM_CONTROLLER].reset(self.world.arm_positions())
        self.controllers[GRIPPER_CONTROLLER].reset([self.world.gripper_opening()])
        self.status = RUNNING
        self.episode_start_s = self.now_s
        self.episode_end_s = None
        self.touched_first, self.tip_touch_s = frozenset(), None
        self.step, self.steps_done_s = 0, []
        self.episode_limit_s = self.episode_timeout_s if timeout_s is None else float(timeout_s)
        self._contacts_before_step = frozenset()
        self._step_result_absent = True
        self._rejected_at_start = self._rejected_totals()
        self.phase = current_phase(self.task, self.facts())
        return self.task

    @property
    def elapsed_s(self) -> float:
        """Simulated seconds the episode has run (until it ended, once it has)."""
        end = self.now_s if self.episode_end_s is None else self.episode_end_s
        return end - self.episode_start_s

    # -- the controllers' inputs ------------------------------------------------------------------
    def receive(self, controller: str, msg) -> None:
        """Hand a JointTrajectory to ``controller`` at the present sim time.

        Raises:
            KeyError: no such controller.
            TrajectoryRejected: the controller refuses it (and counts it).
        """
        if controller == ARM_CONTROLLER:
            positions, velocities = self.world.arm_positions(), self.world.arm_velocities()
        elif controller == GRIPPER_CONTROLLER:
            positions = np.array([self.world.gripper_opening()])
            velocities = np.array([self.world.gripper_velocity()])
        else:
            raise KeyError(f"no controller {controller!r} (have {', '.join(self.controllers)})")
        self.controllers[controller].receive(msg, self.now_s, positions, velocities)

    # -- stepping ---------------------------------------------------------------------------------
    def control_step(self) -> None:
        """One control step: sample both controllers, run physics, then score the episode."""
        judge_tip = self.tip_rule_pending()  # the old rule judged this step, as it used to be
        arm_q, arm_v = self.controllers[ARM_CONTROLLER].sample(self.now_s)
        grip_q, grip_v = self.controllers[GRIPPER_CONTROLLER].sample(self.now_s)
        self.world.set_reference(arm_q, arm_v, float(grip_q[0]), float(grip_v[0]))
        self.world.step(self.substeps)
        self.now_s += self.control_dt
        if self.task is None:
            return
        if judge_tip:
            tip, cube = self.world.tip_position(), self.world.cube_position(self.task.cube)
            if tip_touches(tip, cube):
                self.tip_touch_s = self.now_s - self.episode_start_s
        if self.status != RUNNING:
            return
        facts, index = self.facts(), self.step
        step = self.step_task
        if self._first_step_undone():
            self.status = UNDONE
        elif step.kind == TOUCH:  # the step's first contact with any cube decides
            self.touched_first = self.touched_first or self._step_contacts()
            verdict = touch_verdict(step.cube, self.touched_first)
            if verdict is not None:
                self.status = self._step_succeeded() if verdict else WRONG_CUBE
        elif facts.success and self._step_result_absent:
            self.status = self._step_succeeded()
        else:
            self._step_result_absent = self._step_result_absent or not facts.success
        if self.status == RUNNING and self.elapsed_s >= self.episode_limit_s:
            self.status = TIMEOUT
        if self.status != RUNNING:
            self.episode_end_s = self.now_s
        previous = self.phase.key
        if self.step != index:  # a new step began: its facts, not the last one's
            facts, previous = self.facts(), None
        self.phase = current_phase(self.task, facts, previous)

    # -- steps ------------------------------------------------------------------------------------
    @property
    def step_task(self) -> Task:
        """The task of the current step (the episode's task unless it is two-step)."""
        if self.task is None:
            raise RuntimeError("no episode has started (call reset first)")
        return self.task.steps[self.step]

    def _step_succeeded(self) -> str:
        """The current step is done: the episode's status after it (the next step begins, or
        the last step succeeds once the earlier steps' results still hold)."""
        if self.step + 1 < len(self.task.steps):
            self.steps_done_s.append(self.now_s - self.episode_start_s)
            self.step += 1
            self.touched_first = frozenset()
            self._contacts_before_step = self.world.cubes_touched()
            self._step_result_absent = False  # a result already there is not this step's doing
            return RUNNING
        if not self._first_step_holds():
            return RUNNING  # the first cube is still settling on its pad: judged again next step
        self.steps_done_s.append(self.now_s - self.episode_start_s)
        return SUCCESS

    def _step_contacts(self) -> frozenset[str]:
        """The cubes the gripper touches now, less those it has touched without a break since
        the current step began (a touch step after a place starts by the cube just let go)."""
        touched = self.world.cubes_touched()
        self._contacts_before_step &= touched
        return touched - self._contacts_before_step

    def _first_step_undone(self) -> bool:
        """A two-step task past its first step whose placed cube has left its pad."""
        if self.task is None or self.task.kind != TWO_STEP or self.step == 0:
            return False
        first = self.task.steps[0]
        return cube_left_pad(self.world.cube_position(first.cube), self.world.pad_center(first.pad))

    def _first_step_holds(self) -> bool:
        """The first step's cube still rests on its pad (true unless two-step)."""
        if self.task is None or self.task.kind != TWO_STEP:
            return True
        first, world = self.task.steps[0], self.world
        cube, pad = world.cube_position(first.cube), world.pad_center(first.pad)
        return cube_on_pad(cube, world.cube_speed(first.cube), pad)

    # -- scoring ----------------------------------------------------------------------------------
    def tip_rule_pending(self) -> bool:
        """Touch: the old tip rule has neither held nor timed out yet, so the next control step
        still judges it (the old rule's episode ran on while under its timeout)."""
        if self.task is None or self.task.kind != TOUCH or self.tip_touch_s is not None:
            return False
        return self.now_s - self.episode_start_s < self.episode_limit_s

    def facts(self) -> SceneFacts:
        """The scene as the current step's success and language labels see it."""
        task, world = self.step_task, self.world
        cube = world.cube_position(task.cube)
        tip = world.tip_position()
        on_pad = False
        outside_pad, pad_place = math.inf, ""
        if task.kind == PLACE:
            pad = world.pad_center(task.pad)
            pad_place = place_words(float(pad[0]), float(pad[1]))
            outside_pad = float(np.max(np.abs(cube[:2] - pad))) - PAD_HALF
            on_pad = cube_on_pad(cube, world.cube_speed(task.cube), pad)
            released = world.grasped is None and world.gripper_opening() < RELEASED_GRIPPER
            success = on_pad and released
        else:  # touching the named cube now; which cube came first is the episode's to judge
            success = task.cube in world.cubes_touched()
        return SceneFacts(
            success=success,
            grasped=world.grasped,
            tip_to_cube=float(np.linalg.norm(tip - cube)),
            cube_outside_pad=outside_pad,
            cube_on_pad=on_pad,
            cube_place=place_words(float(cube[0]), float(cube[1])),
            step=self.step,
            pad_place=pad_place,
        )

    def privileged_state(self) -> PrivilegedState:
        world = self.world
        return PrivilegedState(
            time_s=self.now_s,
            episode=self.episode,
            task=self.task,
            status=self.status,
            arm=world.arm_positions(),
            gripper=world.gripper_opening(),
            tip=world.tip_position(),
            cubes={c: world.cube_position(c) for c in CUBE_COLORS},
            cube_yaws={c: world.cube_yaw(c) for c in CUBE_COLORS},
            pads={c: world.pad_center(c) for c in PAD_COLORS},
            grasped=world.grasped,
            step=self.step,
        )

    def episode_report(self) -> dict:
        """The episode's public record (published on ``sim/episode``)."""
        totals = self._rejected_totals()
        return {
            "episode": self.episode,
            "task": self.task.text if self.task else "",
            "seed": self.seed,
            "status": self.status,
            "elapsed_s": round(self.elapsed_s, 4),
            **(self._touch_report() if self.task and self.task.kind == TOUCH else {}),
            **(self._two_step_report() if self.task and self.task.kind == TWO_STEP else {}),
            "rejected": {
                key: totals[key] - self._rejected_at_start.get(key, 0)
                for key in totals
                if totals[key] - self._rejected_at_start.get(key, 0)
            },
            "rejected_total": {key: n for key, n in totals.items() if n},
        }

    def _touch_report(self) -> dict:
        """Touch: the cubes the gripper touched first, why the episode failed (if it did), and
        the old tip rule's verdict so far (sim seconds to the tip within reach, or None)."""
        first = sorted(self.touched_first)
        reason = ""
        if self.status == WRONG_CUBE:
            reason = f"touched the {' and '.join(first)} cube before the {self.task.cube} cube"
        tip_s = None if self.tip_touch_s is None else round(self.tip_touch_s, 4)
        return {"touched_first": first, "reason": reason, "tip_rule_s": tip_s}

    def _two_step_report(self) -> dict:
        """Two-step: the step reached (1-based), when each finished step was done (episode
        seconds), why the episode failed (if it did) and, in a touch step, its first contact."""
        step, first = self.step_task, self.task.steps[0]
        reason = ""
        if self.status == UNDONE:
            reason = f"the {first.cube} cube left the {first.pad} pad after it was placed"
        elif self.status == WRONG_CUBE:
            touched = " and ".join(sorted(self.touched_first))
            reason = f"touched the {touched} cube before the {step.cube} cube"
        report = {
            "step": self.step + 1,
            "steps": len(self.task.steps),
            "step_task": step.text,
            "steps_done_s": [round(t, 4) for t in self.steps_done_s],
            "reason": reason,
        }
        if step.kind == TOUCH:
            report["touched_first"] = sorted(self.touched_first)
        return report

    def _rejected_totals(self) -> dict[str, int]:
        return {
            f"{name}/{reason}": count
            for name, controller in self.controllers.items()
            for reason, count in controller.rejected.items()
        }
