"""``oxygen-bench sim-policy``: a checkpoint drives the simulated arm directly, with no ROS and no
node in between: many episodes quickly, to compare checkpoints (``closed-loop`` measures the
node).

Every ``action_dt`` of sim time the policy sees both cameras (rendered at the sim node's 128 px)
and the joint state, samples a chunk, and the chunk goes to the sim's two controllers the way the
node sends it: point ``i`` due ``(i + 1) * action_dt`` after the observation, the five arm joints
and the gripper on their own trajectories. Inference takes no sim time (the sim waits for it), so
this is the policy at zero delay; its tasks and layouts are ``closed-loop``'s rounds for the same
``--seed``. Touch episodes time out after 8 s of sim time, place after 20 s, two-step (``--tasks
two_step``: a place, then a touch or another place, scored in order) after 30 s (``--timeout-s``):
the scripted expert touches in ~1.6 s, and a policy that wanders into contact is not succeeding.

pi0.5's hierarchy, stage by stage (``--subtask``, `subtask_modes`): ``flat`` (the flat action
prompt), ``oracle`` (every frame's prompt carries the sim's own subtask), ``lying`` (the same with
another side's place words), ``predicted`` (the checkpoint's own subtask, decoded by the node's
engine with ``same_frame`` conditioning; ``--subtask-every N``: from every Nth frame).

Measured (summary keys of ``--json``):

* ``success_rate`` (``successes`` of ``episodes``, Wilson ``ci95``) and ``time_to_success_s``: the
  sim's verdict. A touch succeeds when a finger or the hand is in contact with the named cube,
  and fails (status ``wrong_cube``, counted in ``wrong_cube``) when another cube was touched first;
* touch only, ``touch_contact`` (= ``success_rate``) and ``touch_tip``: the share under the old
  rule (the tip within 3 cm of the cube's centre before the timeout, whatever it touched), for
  tables made before the contact rule. An episode the contact rule ended runs on under the policy
  until the old rule holds or the timeout passes, as it ran then (its oracle words are the ended
  episode's; ``predicted`` tallies only the frames before the end); per episode ``touch_tip`` and
  ``tip_rule_s``;
* ``closest_tip_to_cube_m``: the median over episodes of the closest the tip came to the cube;
* ``heading_correlation``: the arm starts every episode at the same pose, so the first chunk can
  only head for the named cube if the policy found it. The correlation, over episodes, of the
  first executed chunk's last ``shoulder_pan`` with the cube's azimuth from the base (the
  scripted expert's 1 s pan: 0.99; a policy that ignores the scene: about 0);
* ``heading_noise_share``: on the first ``--noise-layouts`` layouts, ``--noise-draws`` first chunks
  at the start pose, each from another noise draw: the within-layout variance of their heading
  over the total variance, both estimated as `heading_noise` says (1: the noise alone picks the
  heading, 0: the scene and the words alone);
* ``lying`` only, ``heading_follows_lie``: the correlation of the first chunk's heading with the
  nominal azimuth of the side its lying words name (`subtask_modes.SIDE_AZIMUTH`: the middle of
  that third of the place sector, +-0.57 rad; the lie is always left or right);
* ``predicted`` only, over every frame a subtask was decoded from: ``subtask_exact``, the share
  whose subtask says the sim's words at that frame, and ``subtask_place_right``, over those where
  the sim's subtask names a place (a reach's cube, a carry's pad), the share whose place words
  are the sim's;
  ``subtask_flips_per_episode`` and ``episodes_with_flips``: how often the decoded subtask changed
  from one decoded frame to the next while the sim's stayed the same (a subtask flipping
  mid-reach, which the expert follows; a change that follows the sim's a frame late counts too);
  ``subtask_wrong_changes_per_episode``: how often it changed to a subtask that is not the sim's
  at that frame (a flicker or a guess ahead, not a lag).

``--noise-offsets K [K ...]`` runs the layouts once per K, every episode's flow noise drawn from
its layout seed + K: the same layouts under other draws of the policy's own noise (the summary
pools them and adds ``successes_by_noise_offset``). Place's success moves by several episodes in
60 between draws (docs/benchmarks/place_stages/README.md), so a setting is ranked over draws.

``--gripper-commit`` keeps each gripper switch a chunk plans ahead to the time it was first
planned for (`engine.switch_commit`, the node's ``gripper_commit``): executing one step of each
chunk, a switch planned a few steps ahead can otherwise recede frame after frame.

Real-time chunking under delay (``--continuity none | guided | trained``, ``--delay-steps D``,
``--execute-steps S``): a chunk reaches the controllers ``D`` frames after its observation (sent
then, stamped with the observation's time, so the controller takes it up at its step ``D``) and
the arm runs on through the chunk it executes meanwhile; a new observation is taken every ``S``
frames (default ``max(1, D)``: as soon as the last chunk arrived, as a node whose inference takes
the whole delay). ``guided`` and ``trained`` continue the executed chunk through the engine's own
`ChunkContinuity`, told the delay (``D`` frozen steps). Measured besides: ``switch_jump_rad``
(p50 and p95 over every chunk switch: the commanded reference's jump, as ``closed-loop``
measures it), ``jerk_rms`` (median over episodes of the executed arm's RMS jerk), ``timeouts``
and, per episode, ``last_second_motion_rad`` (the arm's largest joint travel over the episode's
last second: a stalled arm's is near 0).

Place, stage by stage (`place_stages`; per episode ``stages``, summed in ``place_stages``): the
furthest phase reached, every close of the gripper (the tip's height above the cube's centre,
its distance beside it and its speed at the close; the most fingers on the cube and whether it
was held within a second), whether the held cube was let go over the pad, where each chunk
computed over the pad would take it (``release_aims``), and the stage each episode ended at
(``ended_at``).

``--probe-layouts N`` also asks the checkpoint the grounding questions
(`oxygen_ros.sim.grounding`) about N held-out layouts (seeds from 9,100,000, never trained on nor
read by a training run's gates), each at its start pose and four moments of a view's
episode, and reports the share answered exactly per question kind, also split by pose
(``start/where``, ``along/where``, ...).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from oxygen_ros.engine.subtasks import HeldGate, PhaseOrder
from oxygen_ros.engine.switch_commit import SwitchCommitment
from oxygen_ros.tools.benches import place_stages
from oxygen_ros.tools.benches.closed_loop import round_task
from oxygen_ros.tools.benches.closed_loop_metrics import (
    Plan,
    mean_or_nan,
    rms_jerk,
    switch_jumps,
    wilson_interval,
)
from oxygen_ros.tools.benches.common import print_table, write_json
from oxygen_ros.tools.benches.place_stages import PlaceStages
from oxygen_ros.tools.benches.subtask_modes import (
    CONTINUITY,
    MODES,
    ChunkSource,
    ConditionedChunk,
    Continuity,
    chunk_source,
    named_azimuth,
    place_of,
    same_words,
)

HELP = "a checkpoint drives the sim directly (no ROS): success over many episodes"
CAMERA_PX = 128  # the sim node's default image size
SLOTS = {"scene": "observation.images.scene", "wrist": "observation.images.wrist"}
TIMEOUT_S = {"touch": 8.0, "place": 20.0, "two_step": 30.0}  # sim s per episode, by kind
SIM_GRIPPER_LEVEL = 0.5  # the sim's gripper command between open (0) and closed (1)
SIM_HELD_RANGE = (0.25, 0.8)  # the sim's gripper state holding a cube: ~0.5 (1: closed on nothing)
SAID_KEPT = 5  # distinct decoded subtasks kept per episode record
# the probe's layouts: past the held-out block's first seeds, which training runs' gates read
PROBE_OFFSET = 100_000
LAST_SECOND_S = 1.0  # the window of ``last_second_motion_rad``


@dataclasses.dataclass(frozen=True)
class Timing:
    """When chunks reach the arm: ``delay`` frames after their observation, a new observation
    every ``every`` frames (at least ``delay``: one inference in flight)."""

    delay: int = 0
    every: int = 1

    def __post_init__(self) -> None:
        if self.delay < 0 or self.every < max(1, self.delay):
            raise ValueError(
                f"a chunk every {self.every} frames cannot arrive {self.delay} frames late: "
                "the execute steps must be >= max(1, delay steps)"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint", type=Path, default=Path("models/sim_so101"), help="default models/sim_so101"
    )
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--tasks", default="touch", choices=list(TIMEOUT_S))
    parser.add_argument("--seed", type=int, default=777, help="closed-loop's round seed")
    parser.add_argument(
        "--subtask",
        default="flat",
        choices=MODES,
        help="what conditions the chunks: flat prompt, the sim's subtask (oracle), the sim's with "
        "another side's place words (lying), the checkpoint's own via the engine (predicted)",
    )
    parser.add_argument(
        "--subtask-every",
        type=int,
        default=1,
        help="predicted: decode a subtask from every Nth frame (0: once per episode)",
    )
    parser.add_argument(
        "--subtask-confirmations",
        type=int,
        default=1,
        help="predicted: a changed subtask conditions the chunks once decoded this many times "
        "in a row (the node's subtask_confirmations)",
    )
    parser.add_argument(
        "--subtask-held-pattern",
        default="",
        help="predicted: a changed subtask matching this regular expression (e.g. "
        "'^(carry|release) ') is adopted only while the gripper holds (the node's "
        "subtask_held_pattern; '': no gate)",
    )
    parser.add_argument(
        "--subtask-held-range",
        type=float,
        nargs=2,
        default=SIM_HELD_RANGE,
        metavar=("LOW", "HIGH"),
        help="predicted: the sim's gripper state between which it holds a cube (0 open, ~0.5 on a "
        "cube, 1 closed on nothing)",
    )
    parser.add_argument(
        "--subtask-phase-order",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="predicted: the task's phases in order, each a regular expression (e.g. '^reach ' "
        "'^grasp ' '^carry ' '^release '): a change to a later phase is adopted at once, one back "
        "or within a phase after --subtask-confirmations (the node's subtask_phase_order)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help=f"sim seconds per episode (default: touch {TIMEOUT_S['touch']:g}, "
        f"place {TIMEOUT_S['place']:g}, two_step {TIMEOUT_S['two_step']:g})",
    )
    parser.add_argument(
        "--continuity",
        default="none",
        choices=CONTINUITY,
        help="each chunk continues the executed one: no, guided RTC (identity), the checkpoint's "
        "training-time RTC",
    )
    parser.add_argument(
        "--rtc-guidance-weight",
        type=float,
        default=5.0,
        help="guided: the guidance weight's clip (the node's rtc_max_guidance_weight, beta)",
    )
    parser.add_argument(
        "--rtc-execution-horizon",
        type=int,
        default=0,
        help="guided: at most this many steps of each new chunk are guided (the node's "
        "rtc_execution_horizon; default 0: the whole overlap)",
    )
    parser.add_argument(
        "--delay-steps",
        type=int,
        default=0,
        help="a chunk reaches the arm this many frames after its observation (default 0)",
    )
    parser.add_argument(
        "--execute-steps",
        type=int,
        default=0,
        help="a new observation every this many frames, >= the delay (0: max(1, delay))",
    )
    parser.add_argument("--action-dt", type=float, default=0.1, help="the dataset's 1/fps")
    parser.add_argument(
        "--gripper-commit",
        action="store_true",
        help="keep the gripper switches a chunk plans ahead to their time (the node's "
        "gripper_commit; `engine.switch_commit`)",
    )
    parser.add_argument("--prompt-format", default="openpi_subtask")
    parser.add_argument("--num-steps", type=int, default=10, help="flow-matching steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--noise-layouts",
        type=int,
        default=8,
        help="layouts of the heading-noise measurement (0: none)",
    )
    parser.add_argument(
        "--noise-draws", type=int, default=4, help="first chunks per layout, one noise draw each"
    )
    parser.add_argument(
        "--noise-offsets",
        type=int,
        nargs="+",
        default=[0],
        metavar="K",
        help="run the layouts once per K, each episode's flow noise drawn from its layout seed + "
        "K (default 0: the seed itself): the same layouts under other draws of the policy's noise",
    )
    parser.add_argument(
        "--probe-layouts",
        type=int,
        default=0,
        help="also ask the grounding questions about this many held-out layouts (0: no probe)",
    )
    parser.add_argument("--json", type=Path, help="write every episode and the summary here")


def bench_arguments(**values: Any) -> argparse.Namespace:
    """sim-policy's arguments for a caller outside its command line: every flag's default, with
    ``values`` in their place (a flag added later needs no change there)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **values})


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments no bench can run, naming the flag."""
    problems = [
        f"--{name.replace('_', '-')} must be {rule}"
        for name, rule, ok in (
            ("episodes", "at least 1", args.episodes >= 1),
            ("subtask_every", ">= 0", args.subtask_every >= 0),
            ("subtask_confirmations", ">= 1", args.subtask_confirmations >= 1),
            ("timeout_s", "> 0", args.timeout_s is None or args.timeout_s > 0),
            ("action_dt", "> 0", args.action_dt > 0),
            ("noise_layouts", ">= 0", args.noise_layouts >= 0),
            ("noise_draws", "at least 2", args.noise_layouts == 0 or args.noise_draws >= 2),
            ("delay_steps", ">= 0", args.delay_steps >= 0),
            ("rtc_execution_horizon", ">= 0", args.rtc_execution_horizon >= 0),
            (
                "execute_steps",
                "0 or >= max(1, --delay-steps)",
                args.execute_steps == 0 or args.execute_steps >= max(1, args.delay_steps),
            ),
        )
        if not ok
    ]
    if problems:
        raise SystemExit("oxygen-bench sim-policy: " + "; ".join(problems))


def timing(args: argparse.Namespace) -> Timing:
    """The ``--delay-steps`` / ``--execute-steps`` timing."""
    return Timing(args.delay_steps, args.execute_steps or max(1, args.delay_steps))


def make_source(args: argparse.Namespace) -> ChunkSource:
    """Load the checkpoint as the node does and wrap it in the ``--subtask`` mode's source,
    continuing chunks as ``--continuity`` says and keeping the gripper's planned switches with
    ``--gripper-commit``."""
    from oxygen_ros.engine.runtime import ModelSpec, load_policy
    from oxygen_ros.policy_io.prompts import PromptFormatError, check_conditioning, resolve_format

    prompt_format = resolve_format(args.prompt_format)
    if args.subtask != "flat":
        try:
            check_conditioning(
                prompt_format, "same_frame" if args.subtask == "predicted" else "prompt"
            )
        except PromptFormatError as exc:
            raise SystemExit(f"oxygen-bench sim-policy: --subtask {args.subtask}: {exc}") from None
    try:
        gate = held_gate(args)
    except ValueError as exc:
        raise SystemExit(f"oxygen-bench sim-policy: --subtask-held-pattern: {exc}") from None
    try:
        order = PhaseOrder.of(args.subtask_phase_order)
    except ValueError as exc:
        raise SystemExit(f"oxygen-bench sim-policy: --subtask-phase-order: {exc}") from None
    policy = load_policy(ModelSpec(checkpoint_dir=str(args.checkpoint), torch_threads=args.threads))
    plan = timing(args)
    horizon = policy.config.action_horizon
    if plan.delay + plan.every > horizon:
        raise SystemExit(
            f"oxygen-bench sim-policy: --delay-steps {plan.delay} + execute steps {plan.every} run "
            f"past the checkpoint's {horizon}-step chunk"
        )
    try:
        source = chunk_source(
            args.subtask,
            policy,
            prompt_format,
            args.num_steps,
            args.subtask_every,
            args.action_dt,
            continuity_of(args),
            plan.delay * args.action_dt,
            args.subtask_confirmations,
            gate,
            order,
        )
    except ValueError as exc:
        raise SystemExit(
            f"oxygen-bench sim-policy: --continuity {args.continuity}: {exc}"
        ) from None
    if not args.gripper_commit:
        return source
    from oxygen_ros.sim.scene import ARM_JOINTS  # the sim's gripper: the last action dim

    return CommittedChunks(
        source, SwitchCommitment((len(ARM_JOINTS),), SIM_GRIPPER_LEVEL, args.action_dt)
    )


def continuity_of(args: argparse.Namespace) -> Continuity:
    """``--continuity`` with its guided-RTC knobs (``--rtc-guidance-weight``,
    ``--rtc-execution-horizon``)."""
    return Continuity(args.continuity, args.rtc_guidance_weight, args.rtc_execution_horizon)


def held_gate(args: argparse.Namespace) -> HeldGate | None:
    """``--subtask-held-pattern``'s gate on the sim's gripper state (None without a pattern)."""
    from oxygen_ros.sim.scene import ARM_JOINTS  # the sim's gripper: the state's last dim

    if not args.subtask_held_pattern:
        return None
    return HeldGate(args.subtask_held_pattern, (len(ARM_JOINTS),), *args.subtask_held_range)


class CommittedChunks:
    """``--gripper-commit``: a chunk source whose chunks keep the gripper's planned switches
    (`engine.switch_commit`), forgotten at each episode's start."""

    def __init__(self, source: ChunkSource, commitment: SwitchCommitment) -> None:
        self.source, self.commitment = source, commitment
        self.mode, self.policy = source.mode, source.policy

    def start(self, sim, noise_seed: int) -> None:
        self.source.start(sim, noise_seed)
        self.commitment.reset()

    def chunk(self, sim, observation) -> ConditionedChunk:
        chunk = self.source.chunk(sim, observation)
        actions = self.commitment.apply(chunk.actions, observation.stamp)
        return dataclasses.replace(chunk, actions=actions)

    def published(self) -> None:
        self.source.published()

    def close(self) -> None:
        self.source.close()


def observe(sim):
    """The sim's present frame as the node sees it: both cameras at 128 px, the joint state."""
    from oxygen_ros.engine.types import Observation

    world = sim.world
    state = np.append(world.arm_positions(), world.gripper_opening()).astype(np.float32)
    images = {slot: world.render(camera, CAMERA_PX, CAMERA_PX) for camera, slot in SLOTS.items()}
    return Observation(images, state, sim.task.text, sim.now_s)


def send(sim, actions: np.ndarray, action_dt: float, stamp_s: float | None = None) -> None:
    """A chunk to the two controllers as the node sends it (arm joints, then the gripper),
    stamped with its observation's time (default: now)."""
    from oxygen_ros.ros.convert import chunk_to_joint_trajectory, seconds_to_stamp
    from oxygen_ros.sim.episode import ARM_CONTROLLER, GRIPPER_CONTROLLER
    from oxygen_ros.sim.scene import ARM_JOINTS, GRIPPER_JOINT

    stamp = seconds_to_stamp(sim.now_s if stamp_s is None else stamp_s)
    arm = len(ARM_JOINTS)
    sim.receive(
        ARM_CONTROLLER, chunk_to_joint_trajectory(actions[:, :arm], ARM_JOINTS, action_dt, stamp)
    )
    sim.receive(
        GRIPPER_CONTROLLER,
        chunk_to_joint_trajectory(actions[:, arm:], [GRIPPER_JOINT], action_dt, stamp),
    )


class PolicyDriver:
    """A chunk source driving on-policy recording (`oxygen_ros.sim.on_policy`): each frame's
    chunk, from the images the recorder rendered, goes to the controllers at once (zero delay)."""

    def __init__(self, source: ChunkSource, action_dt: float) -> None:
        self.source, self.action_dt = source, action_dt

    def start(self, sim, noise_seed: int) -> None:
        self.source.start(sim, noise_seed)

    def act(self, sim, images: dict[str, np.ndarray], state: np.ndarray) -> None:
        from oxygen_ros.engine.types import Observation

        slots = {SLOTS[camera]: image for camera, image in images.items()}
        chunk = self.source.chunk(sim, Observation(slots, state, sim.task.text, sim.now_s))
        send(sim, chunk.actions, self.action_dt)
        self.source.published()

    def close(self) -> None:
        self.source.close()


def phase_verb(subtask: str) -> str:
    """A subtask's phase, as its first word says it ("carry the red cube ..." -> "carry"; "" for
    no words)."""
    words = subtask.split()
    return words[0] if words else ""


class SubtaskTally:
    """predicted: how the subtasks decoded in one episode compare with the sim's."""

    def __init__(self) -> None:
        self.frames = self.exact = self.placed = self.place_right = self.flips = 0
        self.wrong_changes = 0
        self.phases: collections.Counter[str] = collections.Counter()  # "truth>decoded" verbs
        self.said: list[str] = []
        self._last: tuple[str, str] | None = None

    def add(self, decoded: str, truth: str) -> None:
        words = " ".join(decoded.split())
        changed = self._last is not None and self._last[0] != words
        if changed and self._last[1] == truth:
            self.flips += 1  # the decoded subtask changed while the sim's did not
        if changed and not same_words(decoded, truth):
            self.wrong_changes += 1  # changed to words that are not the sim's
        self._last = (words, truth)
        self.frames += 1
        self.exact += same_words(decoded, truth)
        self.phases[f"{phase_verb(truth)}>{phase_verb(decoded)}"] += 1
        place = place_of(truth)
        if place is not None:
            self.placed += 1
            self.place_right += place_of(" ".join(decoded.split())) == place
        if decoded not in self.said and len(self.said) < SAID_KEPT:
            self.said.append(decoded)

    def record(self) -> dict[str, Any]:
        return {
            "subtask_frames": self.frames,
            "subtask_exact_frames": self.exact,
            "placed_frames": self.placed,
            "place_right_frames": self.place_right,
            "subtask_flips": self.flips,
            "subtask_wrong_changes": self.wrong_changes,
            "phase_frames": dict(sorted(self.phases.items())),
            "said": self.said,
        }


class Delivery:
    """Chunks in flight to the controllers, and what each switch did to the arm's reference."""

    def __init__(self, action_dt: float) -> None:
        from oxygen_ros.sim.scene import ARM_JOINTS

        self.action_dt, self.arm = action_dt, len(ARM_JOINTS)
        self.in_flight: tuple[int, float, np.ndarray] | None = None  # due frame, stamp, actions
        self.plans: list[Plan] = []
        self.arrivals: list[float] = []

    def start(self, frame: int, delay: int, stamp_s: float, actions: np.ndarray) -> None:
        self.in_flight = (frame + delay, stamp_s, actions)

    def arrive(self, sim, source: ChunkSource, frame: int) -> None:
        """Send the chunk in flight when it is due at ``frame``, and tell the source."""
        if self.in_flight is None or self.in_flight[0] != frame:
            return
        _, stamp_s, actions = self.in_flight
        self.in_flight = None
        send(sim, actions, self.action_dt, stamp_s)
        source.published()
        times = stamp_s + self.action_dt * np.arange(1, len(actions) + 1)
        self.plans.append(Plan(times, actions[:, : self.arm].astype(np.float64)))
        self.arrivals.append(sim.now_s)

    def jumps(self) -> list[float]:
        return switch_jumps(self.plans, self.arrivals)


def run_episode(
    sim,
    source: ChunkSource,
    task,
    seed: int,
    action_dt: float,
    plan: Timing = Timing(),
    noise_seed: int | None = None,
) -> dict[str, Any]:
    """One episode: its status, the tip's start / closest / final distance to the task's cube,
    the first chunk's heading and the words that conditioned it, the trajectories the controllers
    refused (per controller/reason), the chunk switches' jumps and the arm's jerk, and for
    ``predicted`` how its subtasks compare. Chunks reach the arm as ``plan`` says; the policy's
    noise is drawn from ``noise_seed`` (default: the layout's ``seed``). Touch: also
    the old tip rule's verdict; the policy drives on past the episode's end until it is decided
    (the closest and final distances are over that whole run)."""
    from oxygen_ros.sim.episode import RUNNING

    sim.reset(task, seed)
    source.start(sim, seed if noise_seed is None else noise_seed)
    start = sim.facts().tip_to_cube
    steps_per_frame = max(1, round(action_dt / sim.control_dt))
    closest, step, started = np.inf, 0, time.perf_counter()
    cube = sim.world.cube_position(task.cube)
    first = None
    tally, conditioning = SubtaskTally(), SubtaskTally()
    delivery = Delivery(action_dt)
    stages = PlaceStages(task) if task.kind == "place" else None
    times, arm = [], []
    try:
        while sim.status == RUNNING or sim.tip_rule_pending():
            if step % steps_per_frame == 0:
                frame = step // steps_per_frame
                delivery.arrive(sim, source, frame)
                if frame % plan.every == 0:
                    truth = sim.phase.subtask
                    chunk = source.chunk(sim, observe(sim))
                    if stages is not None:
                        stages.plan(sim, chunk.actions)
                    if chunk.decoded is not None and sim.status == RUNNING:
                        tally.add(chunk.decoded, truth)
                        conditioning.add(chunk.subtask, truth)
                    if first is None:
                        first = chunk
                    delivery.start(frame, plan.delay, sim.now_s, chunk.actions)
                    delivery.arrive(sim, source, frame)  # no delay: sent at once
            sim.control_step()
            step += 1
            if stages is not None:
                stages.observe(sim)
            closest = min(closest, sim.facts().tip_to_cube)
            times.append(sim.now_s)
            arm.append(sim.world.arm_positions())
    finally:
        source.close()
    words_azimuth = named_azimuth(first.subtask)
    jumps = delivery.jumps()
    arm_path = np.asarray(arm)
    recent = arm_path[np.asarray(times) >= times[-1] - LAST_SECOND_S]
    record = {
        "task": task.text,
        "seed": seed,
        "status": sim.status,
        "sim_s": round(sim.elapsed_s, 3),
        "start_tip_to_cube_m": round(float(start), 4),
        "closest_tip_to_cube_m": round(float(closest), 4),
        "final_tip_to_cube_m": round(float(sim.facts().tip_to_cube), 4),
        "rejected": sim.episode_report()["rejected"],
        "first_chunk_pan_rad": round(float(first.actions[-1, 0]), 4),
        "cube_azimuth_rad": round(float(np.arctan2(cube[1], cube[0])), 4),
        "first_subtask": first.subtask,
        "words_azimuth_rad": None if words_azimuth is None else round(words_azimuth, 4),
        "switch_jumps_rad": [round(j, 4) for j in jumps],
        "jerk_rms": round(rms_jerk(times, arm_path), 1),
        "last_second_motion_rad": round(float(np.ptp(recent, axis=0).max()), 4),
        "wall_s": round(time.perf_counter() - started, 3),
    }
    if task.kind == "touch":
        report = sim.episode_report()
        record.update(
            touch_contact=sim.status == "success",
            touch_tip=report["tip_rule_s"] is not None,
            tip_rule_s=report["tip_rule_s"],
            touched_first=report["touched_first"],
            reason=report["reason"],
        )
    if task.kind == "two_step":
        report = sim.episode_report()
        record.update(
            step=report["step"], steps_done_s=report["steps_done_s"], reason=report["reason"]
        )
    if stages is not None:
        record["stages"] = stages.record()
    if source.mode == "predicted":
        record.update(tally.record())
        record.update({f"conditioning_{k}": v for k, v in conditioning.record().items()})
    return record


def start_pose_headings(sim, source: ChunkSource, task, seed: int, draws: int) -> list[float]:
    """``draws`` first chunks' headings (last ``shoulder_pan``) at the start pose of ``task``'s
    layout ``seed``, each from the next frame's noise (the first is the episode's own first)."""
    sim.reset(task, seed)
    source.start(sim, seed)
    observation = observe(sim)
    try:
        return [float(source.chunk(sim, observation).actions[-1, 0]) for _ in range(draws)]
    finally:
        source.close()


def heading_noise(headings: list[list[float]]) -> dict[str, Any]:
    """How much of the first chunk's heading variance the noise explains, from layouts x draws.

    The heading's variance splits into the noise's (within a layout) and the scene's (between the
    layouts' true means), each estimated without the bias of a few draws (one-way random effects):
    the noise's is the mean within-layout variance, the scene's the variance of the layout means
    less the noise's share of it (noise / draws), at least 0. ``share`` is the noise's over their
    sum (about 1 for a policy whose noise alone picks the heading, whatever the draws; nan under 2
    layouts or 2 draws, or without spread); the two spreads are given as standard deviations."""
    pans = np.asarray(headings, dtype=np.float64)
    if pans.ndim != 2 or pans.shape[0] < 2 or pans.shape[1] < 2:
        nan = float("nan")
        return {"share": nan, "within_layout_sd_rad": nan, "layout_sd_rad": nan,
                "headings_rad": headings}  # fmt: skip
    noise = float(pans.var(axis=1, ddof=1).mean())
    scene = max(0.0, float(pans.mean(axis=1).var(ddof=1)) - noise / pans.shape[1])
    total = noise + scene
    return {
        "share": noise / total if total > 0 else float("nan"),
        "within_layout_sd_rad": noise**0.5,
        "layout_sd_rad": scene**0.5,
        "headings_rad": [[round(p, 4) for p in row] for row in headings],
    }


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation (nan under 3 pairs or without spread on either side)."""
    if len(xs) < 3 or np.std(xs) == 0 or np.std(ys) == 0:
        return float("nan")
    return float(np.corrcoef(xs, ys)[0, 1])


def heading_correlation(episodes: list[dict[str, Any]]) -> float:
    """Correlation of the first chunks' final pan with the cubes' azimuths (nan under 3)."""
    return correlation(
        [e["first_chunk_pan_rad"] for e in episodes], [e["cube_azimuth_rad"] for e in episodes]
    )


def heading_follows_words(episodes: list[dict[str, Any]]) -> float:
    """Correlation of the first chunks' final pan with the azimuth their words name (episodes
    whose first subtask names no place left out)."""
    named = [e for e in episodes if e["words_azimuth_rad"] is not None]
    return correlation(
        [e["first_chunk_pan_rad"] for e in named], [e["words_azimuth_rad"] for e in named]
    )


def subtask_shares(episodes: list[dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """predicted: ``subtask_exact`` and ``subtask_place_right`` over all episodes' frames, the
    flips per episode and the phase confusion (`phase_confusion`); of the decoded subtasks, or
    with ``prefix`` "conditioning_" of those that conditioned the chunks (after the holding
    rule)."""

    def total(key: str) -> int:
        return sum(e[prefix + key] for e in episodes)

    frames, placed = total("subtask_frames"), total("placed_frames")
    return {
        prefix + "subtask_frames": frames,
        prefix + "subtask_exact": total("subtask_exact_frames") / frames if frames else math.nan,
        prefix + "subtask_place_right": total("place_right_frames") / placed
        if placed
        else math.nan,
        prefix + "subtask_flips_per_episode": mean_or_nan(
            [e[prefix + "subtask_flips"] for e in episodes]
        ),
        prefix + "episodes_with_flips": sum(e[prefix + "subtask_flips"] > 0 for e in episodes),
        prefix + "subtask_wrong_changes_per_episode": mean_or_nan(
            [e[prefix + "subtask_wrong_changes"] for e in episodes]
        ),
        prefix + "phase_frames": phase_confusion(e[prefix + "phase_frames"] for e in episodes),
    }


def phase_confusion(per_episode: Iterable[dict[str, int]]) -> dict[str, dict[str, float]]:
    """Per phase the sim was in, the share of frames each decoded phase took ("carry" ->
    {"carry": 0.7, "grasp": 0.3}) and its frame count under "frames": where the subtask errs."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for episode in per_episode:
        for pair, n in episode.items():
            truth, decoded = pair.split(">")
            counts[truth][decoded] += n
    table = {}
    for truth, decoded in sorted(counts.items()):
        total = sum(decoded.values())
        row = {verb: round(n / total, 3) for verb, n in decoded.most_common()}
        table[truth] = {"frames": total, **row}
    return table


def switch_summary(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """The chunk-switch jumps (the mean over episodes of each one's mean, as ``closed-loop``
    reports it, and p50 / p95 over every switch) and the median episode's jerk."""
    jumps = [j for e in episodes for j in e.get("switch_jumps_rad", [])]
    jerks = [e["jerk_rms"] for e in episodes if np.isfinite(e.get("jerk_rms", np.nan))]
    nan = float("nan")
    means = [np.mean(e["switch_jumps_rad"]) for e in episodes if e.get("switch_jumps_rad")]
    return {
        "switch_jump_rad": float(np.mean(means)) if means else nan,  # closed-loop's figure
        "switch_jump_rad_p50": float(np.percentile(jumps, 50)) if jumps else nan,
        "switch_jump_rad_p95": float(np.percentile(jumps, 95)) if jumps else nan,
        "jerk_rms": float(np.median(jerks)) if jerks else nan,
    }


def summarise(
    episodes: list[dict[str, Any]], mode: str = "flat", noise: dict[str, Any] | None = None
) -> dict[str, Any]:
    wins = [e for e in episodes if e["status"] == "success"]
    low, high = wilson_interval(len(wins), len(episodes))
    summary = {
        "subtask": mode,
        "episodes": len(episodes),
        "successes": len(wins),
        "success_rate": len(wins) / len(episodes) if episodes else float("nan"),
        "ci95": [low, high],
        "time_to_success_s": mean_or_nan([e["sim_s"] for e in wins]),
        "closest_tip_to_cube_m": float(np.median([e["closest_tip_to_cube_m"] for e in episodes])),
        "heading_correlation": heading_correlation(episodes),
        "heading_noise_share": noise["share"] if noise else float("nan"),
    }
    offsets = list(dict.fromkeys(e.get("noise_offset", 0) for e in episodes))
    if len(offsets) > 1:  # the spread between draws of the same layouts
        summary["successes_by_noise_offset"] = {
            str(k): sum(e["status"] == "success" for e in episodes if e.get("noise_offset", 0) == k)
            for k in offsets
        }
    summary["wrong_cube"] = sum(e["status"] == "wrong_cube" for e in episodes)
    summary["timeouts"] = sum(e["status"] == "timeout" for e in episodes)
    two_steps = [e for e in episodes if "steps_done_s" in e]
    if two_steps:  # how far they got: a first step undone, the second step reached
        summary["undone"] = sum(e["status"] == "undone" for e in two_steps)
        summary["second_step_reached"] = sum(e["step"] == 2 for e in two_steps)
    summary.update(switch_summary(episodes))
    touches = [e for e in episodes if "touch_tip" in e]
    if touches:  # both touch rules side by side
        tip = sum(e["touch_tip"] for e in touches)
        summary.update(
            touch_contact=sum(e["touch_contact"] for e in touches) / len(touches),
            touch_tip=tip / len(touches),
            touch_tip_successes=tip,
        )
    places = [e["stages"] for e in episodes if "stages" in e]
    if places:
        summary["place_stages"] = place_stages.summarise(places)
    if noise:
        summary["heading_noise"] = noise
    if mode == "lying":
        summary["heading_follows_lie"] = heading_follows_words(episodes)
    if mode == "predicted":
        summary.update(subtask_shares(episodes))
        summary.update(subtask_shares(episodes, "conditioning_"))
    return summary


def grounding_probe(policy, prompt_format: str, layouts: int) -> dict[str, float]:
    """The checkpoint's exact-answer share per question kind on ``layouts`` held-out layouts."""
    from oxygen_ros.policy_io.prompts import resolve_format
    from oxygen_ros.sim.grounding import HELDOUT_SEED0, VIEWS, render_scenes
    from oxygen_ros.training.grounding import GroundingBatchMaker, probe

    scenes = render_scenes(HELDOUT_SEED0 + PROBE_OFFSET, layouts, 5, views=VIEWS)
    maker = GroundingBatchMaker.for_policy(policy, scenes, resolve_format(prompt_format))
    return probe(policy.model, maker)


def run_rounds(
    sim, source: ChunkSource, args: argparse.Namespace, plan: Timing
) -> list[dict[str, Any]]:
    """``--episodes`` episodes on closed-loop's rounds of ``--seed`` (the same layouts and noise
    for every source), once per ``--noise-offsets`` draw."""
    episodes = []
    for offset in args.noise_offsets:
        for index in range(args.episodes):
            task, seed = round_task(index, args.seed, args.tasks)
            record = run_episode(sim, source, task, seed, args.action_dt, plan, seed + offset)
            episodes.append({**record, "noise_offset": offset})
    return episodes


def episode_timeout_s(args: argparse.Namespace) -> float:
    return args.timeout_s if args.timeout_s is not None else TIMEOUT_S[args.tasks]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from oxygen_ros.sim.episode import Simulation

    check_arguments(args)
    source = make_source(args)
    plan = timing(args)
    timeout_s = episode_timeout_s(args)
    sim = Simulation(episode_timeout_s=timeout_s)
    headings = []
    try:
        episodes = run_rounds(sim, source, args, plan)
        for index in range(args.noise_layouts):
            task, seed = round_task(index, args.seed, args.tasks)
            headings.append(start_pose_headings(sim, source, task, seed, args.noise_draws))
    finally:
        sim.world.close()
    summary = summarise(episodes, args.subtask, heading_noise(headings) if headings else None)
    summary.update(
        timeout_s=timeout_s,
        continuity=args.continuity,
        delay_steps=plan.delay,
        execute_steps=plan.every,
    )
    if args.probe_layouts > 0:
        summary["probe"] = grounding_probe(source.policy, args.prompt_format, args.probe_layouts)
    print_summary(args, summary)
    result = {"bench": "sim-policy", "args": vars(args), **summary, "runs": episodes}
    write_json(args.json, result)
    return result


def print_place_stages(stages: dict[str, Any]) -> None:
    reached = ", ".join(f"{phase} {n}" for phase, n in stages["reached_phase"].items())
    print(
        f"place stages: reached {reached} (of {stages['episodes']}); held in "
        f"{stages['held_episodes']}, over the pad for 1 s in "
        f"{stages['held_over_pad_1s_episodes']} (lowest there "
        f"{stages['lowest_over_pad_m_p50']:.3f} m above it), let go over the pad in "
        f"{stages['released_over_pad_episodes']}; "
        f"{stages['releases']} releases {stages['release_from_pad_centre_m_p50']:.3f} m from its "
        f"centre, {stages['release_above_pad_m_p50']:.3f} m above it; "
        f"{stages['closes']} closes: both fingers {stages['closes_both_fingers']}, held "
        f"{stages['closes_held']}, tip at the close {stages['close_tip_above_cube_m_p50']:.3f} m "
        f"above the cube's centre, {stages['close_tip_beside_cube_m_p50']:.3f} m beside it, "
        f"{stages['close_tip_speed_m_s_p50']:.3f} m/s, fingers "
        f"{stages['close_off_faces_rad_p50']:.2f} rad off the cube's faces (medians)"
    )
    ended = ", ".join(f"{ending} {n}" for ending, n in stages["ended_at"].items())
    print(f"place episodes ended: {ended}")
    if stages["release_plans"]:
        print(
            f"chunks over the pad: {stages['release_plans']}, taking the cube "
            f"{stages['release_plan_outward_m_p50']:+.3f} m farther from its centre (median), "
            f"{stages['release_plans_off_pad']} off the pad"
        )


def print_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    low, high = summary["ci95"]
    row = {
        "checkpoint": str(args.checkpoint),
        "tasks": args.tasks,
        "subtask": args.subtask,
        "continuity": f"{args.continuity} d{summary['delay_steps']} s{summary['execute_steps']}",
        "success": f"{summary['successes']}/{summary['episodes']} ({low:.2f}-{high:.2f})",
        "wrong cube": str(summary["wrong_cube"]),
        "timeouts": str(summary["timeouts"]),
        "switch jump p50": f"{summary['switch_jump_rad_p50']:.3f}",
        "time to success s": f"{summary['time_to_success_s']:.2f}",
        **(
            {"tip rule": f"{summary['touch_tip_successes']}/{summary['episodes']}"}
            if "touch_tip" in summary
            else {}
        ),
        "median closest m": f"{summary['closest_tip_to_cube_m']:.3f}",
        "heading corr": f"{summary['heading_correlation']:.2f}",
        "noise share": f"{summary['heading_noise_share']:.2f}",
    }
    if "heading_follows_lie" in summary:
        row["follows lie"] = f"{summary['heading_follows_lie']:.2f}"
    if "subtask_exact" in summary:
        row["subtask exact"] = f"{summary['subtask_exact']:.2f}"
        row["place right"] = f"{summary['subtask_place_right']:.2f}"
        row["flipped episodes"] = str(summary["episodes_with_flips"])
        row["conditioning flips/ep"] = f"{summary['conditioning_subtask_flips_per_episode']:.2f}"
        wrong = summary["conditioning_subtask_wrong_changes_per_episode"]
        row["conditioning wrong changes/ep"] = f"{wrong:.2f}"
        row["conditioning exact"] = f"{summary['conditioning_subtask_exact']:.2f}"
    if "probe" in summary:
        row["probe"] = f"{summary['probe']['all']:.3f}"
    print_table([row], list(row))
    if "place_stages" in summary:
        print_place_stages(summary["place_stages"])
    if "probe" in summary:
        print("probe per question kind: " + json.dumps(summary["probe"]))
