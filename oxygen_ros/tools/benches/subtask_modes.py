"""What conditions each chunk of ``oxygen-bench sim-policy`` (``--subtask``): pi0.5's subtask
hierarchy, one stage at a time.

* ``flat``: the format's plain action prompt, no subtask (the node's ``subtask_conditioning:
  none``);
* ``oracle``: the format's subtask-conditioned action prompt carrying the sim's own subtask of the
  moment (`oxygen_ros.sim.language.current_phase`: "touch the red cube, far left"), its ids encoded
  as training encodes them: can the actions follow the right words?
* ``lying``: the same subtask with the place words of another side (`lying_subtask`): do the
  actions follow the words rather than the images?
* ``predicted``: the checkpoint's own subtask, decoded by the engine the node builds
  (`oxygen_ros.engine.runtime.build_engine` with ``subtask_conditioning: same_frame``): each
  frame's chunk and its subtask request are `OxygenEngine.step`'s, and the subtask decoded from
  one frame conditions the next.

A source of chunks is started on a layout (`start`) and then asked for one chunk per frame
(`chunk`). flat, oracle and lying draw a frame's start noise as the engine does
(`oxygen_ros.engine.frames.frame_noise` of the episode's noise seed and the frame's number), so on
the same layout they start from the same noise and differ only by their prompt.

Each chunk can continue the one the arm executes (``continuity``, `CONTINUITY`): ``guided`` or
``trained`` real-time chunking through the engine's own `ChunkContinuity`, which the source tells
what was sent and after what delay (`published`), as the node tells the engine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from oxygen_ros.engine.continuity import ChunkContinuity, build_continuity
from oxygen_ros.engine.frames import frame_noise
from oxygen_ros.engine.runtime import build_engine
from oxygen_ros.engine.scheduler import OxygenEngine
from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.engine.subtasks import HeldGate, PhaseOrder
from oxygen_ros.engine.types import ActionChunk, Observation
from oxygen_ros.policy_io.policy import Pi05Policy
from oxygen_ros.policy_io.prompts import FramePrompt, PromptFormat, SubtaskText
from oxygen_ros.policy_io.robots import DELTA_POSITION
from oxygen_ros.sim.language import SIDE_ANGLE, without_place
from oxygen_ros.sim.tasks import PLACE_ANGLE

if TYPE_CHECKING:
    from oxygen_ros.sim.episode import Simulation  # MuJoCo: imported where an episode runs

MODES = ("flat", "oracle", "lying", "predicted")
# how a chunk continues the executed one: not at all, guided RTC (identity), training-time RTC
CONTINUITY = ("none", "guided", "trained")
# the side a lying subtask names instead of the true one (the depth is kept)
LIE_SIDE = {"left": "right", "right": "left", "centre": "left"}
# a side's nominal azimuth from the base (rad, +: the robot's left): the middle of its third of
# the place sector (`place_words` splits the sector at +-SIDE_ANGLE)
SIDE_AZIMUTH = {
    "left": (SIDE_ANGLE + PLACE_ANGLE[1]) / 2,
    "centre": 0.0,
    "right": (PLACE_ANGLE[0] - SIDE_ANGLE) / 2,
}


def joint_targets(policy: Pi05Policy, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
    """A robot-unit chunk as the joint positions the node commands: a relative-actions
    checkpoint's ``delta_position`` dims get the observation's state added (`ros.commands`)."""
    if policy.robot.action_space != DELTA_POSITION:
        return actions
    relative = np.ones(actions.shape[1], dtype=bool)
    relative[list(policy.robot.gripper_dims)] = False
    return np.where(relative, actions + state[: actions.shape[1]], actions).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Continuity:
    """How each chunk continues the executed one: a `CONTINUITY` mode and, for guided RTC, the
    guidance weight's clip (the engine's ``rtc_max_guidance_weight``) and how many steps of a new
    chunk it guides at most (``rtc_execution_horizon``; 0: the whole overlap).

    Raises:
        ValueError: an unknown mode, a negative execution horizon.
    """

    mode: str = "none"
    guidance_weight: float = 5.0
    execution_horizon: int = 0

    def __post_init__(self) -> None:
        if self.mode not in CONTINUITY:
            raise ValueError(
                f"continuity must be one of {', '.join(CONTINUITY)}, got {self.mode!r}"
            )
        if self.execution_horizon < 0:
            raise ValueError(
                f"the RTC execution horizon must be >= 0 steps, got {self.execution_horizon}"
            )

    def engine_fields(self) -> dict[str, object]:
        """The `EngineConfig` fields that make the engine continue its chunks this way."""
        if self.mode == "none":
            return {"chunk_continuity": "none"}
        return {
            "chunk_continuity": "rtc",
            "rtc_mode": self.mode,
            "rtc_guidance": "identity",
            "rtc_max_guidance_weight": self.guidance_weight,
            "rtc_execution_horizon": self.execution_horizon,
        }


def check_continuity(policy: Pi05Policy, continuity: str) -> None:
    """Raise ValueError for ``trained`` on a checkpoint that declares no training-time RTC."""
    if continuity == "trained" and not policy.rtc_training_max_delay:
        raise ValueError(
            "continuity trained needs a checkpoint whose config.json declares "
            "rtc_training_max_delay > 0"
        )


def place_of(subtask: str) -> str | None:
    """The place words a subtask ends in ("far left": a reach's cube, a carry's pad), None
    when it has none."""
    stem = without_place(subtask)
    return subtask[len(stem) + 2 :] if stem != subtask else None


def lying_subtask(subtask: str) -> str:
    """``subtask`` with the place words of another side ("touch the red cube, far left" ->
    "..., far right"; centre -> left); a subtask without place words is returned as it is."""
    place = place_of(subtask)
    if place is None:
        return subtask
    depth, side = place.split()
    return f"{without_place(subtask)}, {depth} {LIE_SIDE[side]}"


def named_azimuth(subtask: str) -> float | None:
    """The nominal azimuth of the side ``subtask``'s place words name (None: no place words)."""
    place = place_of(subtask)
    return SIDE_AZIMUTH[place.split()[1]] if place is not None else None


def same_words(a: str, b: str) -> bool:
    """Whether two subtasks say the same words (spacing aside, as the prompt lays them out)."""
    return a.split() == b.split()


@dataclasses.dataclass(frozen=True)
class ConditionedChunk:
    """One frame's chunk and the words around it."""

    actions: np.ndarray  # [horizon, action dims], robot units
    subtask: str  # the subtask the frame's prompt carried ("": none)
    # predicted: the subtask the engine decoded from this frame's observation (None: none was due)
    decoded: str | None = None


class ChunkSource(Protocol):
    """Chunks for one episode's frames, each conditioned as its mode says."""

    mode: str
    policy: Pi05Policy

    def start(self, sim: Simulation, noise_seed: int) -> None:
        """A new episode on ``sim``'s current layout, its noise drawn from ``noise_seed``."""

    def chunk(self, sim: Simulation, observation: Observation) -> ConditionedChunk:
        """The chunk for ``observation`` (the sim's present frame)."""

    def published(self) -> None:
        """The newest chunk reached the controller (after the source's delay)."""

    def close(self) -> None:
        """Let go of what the last episode held."""


class PromptedChunks:
    """flat, oracle and lying: the bench lays out each frame's prompt and samples the chunk."""

    def __init__(
        self,
        policy: Pi05Policy,
        prompt_format: PromptFormat,
        mode: str,
        num_steps: int,
        continuity: Continuity = Continuity(),
        action_dt: float = 0.1,
        delay_s: float = 0.0,
    ) -> None:
        if mode not in ("flat", "oracle", "lying"):
            raise ValueError(f"PromptedChunks serves flat, oracle and lying, not {mode!r}")
        check_continuity(policy, continuity.mode)
        self.policy, self.format, self.mode, self.num_steps = policy, prompt_format, mode, num_steps
        self.config = EngineConfig(
            action_dt=action_dt,
            rtc_training_max_delay=policy.rtc_training_max_delay,
            **continuity.engine_fields(),
        )
        self.delay_s = delay_s
        self.noise_seed, self.frames = 0, 0
        self.continuity: ChunkContinuity | None = None
        self._newest: np.ndarray | None = None  # the newest chunk, robot units

    def start(self, sim: Simulation, noise_seed: int) -> None:
        self.noise_seed, self.frames = noise_seed, 0
        self.continuity = build_continuity(self.policy, self.config)  # an episode starts free
        self._newest = None

    def subtask(self, sim: Simulation) -> str | None:
        """The subtask this mode puts in the present frame's prompt (None: flat)."""
        if self.mode == "flat":
            return None
        truth = sim.phase.subtask
        return truth if self.mode == "oracle" else lying_subtask(truth)

    def frame_prompt(self, observation: Observation, subtask: str | None) -> FramePrompt:
        """The frame's prompt ids: the flat prompt, or the conditioned one carrying ``subtask``."""
        policy = self.policy
        if subtask is None:
            return policy.frame_prompt(observation.state, observation.prompt, self.format)
        text = SubtaskText(tuple(policy.tokenizer.encode_text(subtask)), subtask)
        return policy.frame_prompt(
            observation.state, observation.prompt, self.format, conditioned=True, subtask=text
        )

    def chunk(self, sim: Simulation, observation: Observation) -> ConditionedChunk:
        policy, model = self.policy, self.policy.model
        self.frames += 1
        subtask = self.subtask(sim)
        prompt = self.frame_prompt(observation, subtask)
        inputs = policy.encode(observation.images, observation.state, observation.prompt, prompt)
        noise = frame_noise(policy.config, self.noise_seed, self.frames, policy.device)
        continuity = self.continuity
        guidance = continuity.guidance(observation) if continuity else None
        with torch.inference_mode():
            prefix = model.prefill(
                inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks,
                inputs.token_causal,
            )  # fmt: skip
            actions = model.sample_actions(prefix, noise, self.num_steps, guidance)
        robot = policy.robot_actions(actions[0], observation.state)
        if continuity:
            continuity.record(observation, ActionChunk(self.frames, observation.stamp, robot, 0, 0))
        self._newest = robot
        return ConditionedChunk(joint_targets(policy, robot, observation.state), subtask or "")

    def published(self) -> None:
        if self.continuity and self._newest is not None:
            self.continuity.published(self.frames, self._newest, self.delay_s)

    def close(self) -> None:
        pass


class EngineChunks:
    """predicted: the node's engine (``same_frame``) makes every chunk and decodes the subtasks.

    The engine's clock is the sim's, so a subtask is due every ``subtask_every`` frames of sim time
    (0: once per episode); each is decoded to its end before the sim moves on (inference takes no
    sim time here). The sim waits for the first subtask as it waits for every chunk: the engine's
    first frame of an episode, at the start pose, decodes it, and that frame's own chunk (carrying
    no subtask yet) is not sent, so every chunk the arm executes is conditioned.
    """

    mode = "predicted"
    MAX_DECODE_CALLS = 1000  # a subtask ends at its token limit long before this

    def __init__(
        self,
        policy: Pi05Policy,
        prompt_format: PromptFormat,
        num_steps: int,
        subtask_every: int,
        action_dt: float,
        continuity: Continuity = Continuity(),
        delay_s: float = 0.0,
        confirmations: int = 1,
        held_gate: HeldGate | None = None,
        phase_order: PhaseOrder | None = None,
    ) -> None:
        if subtask_every < 0:
            raise ValueError(f"subtask_every must be >= 0 frames, got {subtask_every}")
        check_continuity(policy, continuity.mode)
        self.policy, self.format, self.num_steps = policy, prompt_format, num_steps
        self.subtask_every, self.action_dt = subtask_every, action_dt
        self.continuity, self.delay_s = continuity, delay_s
        self.confirmations = confirmations
        self.held_gate, self.phase_order = held_gate, phase_order
        self.engine: OxygenEngine | None = None
        self._primed = False
        self._newest: tuple[int, np.ndarray] | None = None  # frame id, robot units

    def start(self, sim: Simulation, noise_seed: int) -> None:
        self.close()
        # half a frame short of the period: the sim clock's float steps never skip a due frame
        period_s = (self.subtask_every - 0.5) * self.action_dt if self.subtask_every else 0.0
        config = EngineConfig(
            num_steps=self.num_steps,
            seed=noise_seed,
            prompt_format=self.format,
            subtask_conditioning="same_frame",
            subtask_period_s=period_s,
            subtask_confirmations=self.confirmations,
            subtask_held_gate=self.held_gate,
            subtask_phase_order=self.phase_order,
            action_dt=self.action_dt,
            **self.continuity.engine_fields(),
        )
        self.engine = build_engine(self.policy, config, clock=lambda: sim.now_s)
        self._primed = False
        self._newest = None

    def chunk(self, sim: Simulation, observation: Observation) -> ConditionedChunk:
        if self.engine is None:
            raise RuntimeError("EngineChunks.chunk before start")
        if self._primed:
            return self._frame(observation)
        # the start pose's subtask: decoded from a first frame whose unconditioned chunk is dropped
        start = self._frame(observation)
        self.engine.chunk_published(self._newest[0], None, self.delay_s)  # it never ran
        self._primed = True
        return dataclasses.replace(self._frame(observation), decoded=start.decoded)

    def _frame(self, observation: Observation) -> ConditionedChunk:
        """One engine frame, and the subtask request it started decoded to its end."""
        engine = self.engine
        chunk = engine.step(observation).action
        loop = engine.subtasks
        for _ in range(self.MAX_DECODE_CALLS):
            if loop.in_flight is None:
                break
            engine.decode()
        else:
            raise RuntimeError(f"a subtask was still decoding after {self.MAX_DECODE_CALLS} calls")
        latest = loop.latest
        decoded = latest.text.text if latest and latest.frame_id == chunk.frame_id else None
        targets = joint_targets(self.policy, chunk.actions, observation.state)
        self._newest = (chunk.frame_id, chunk.actions)
        return ConditionedChunk(targets, chunk.subtask, decoded)

    def published(self) -> None:
        if self.engine is not None and self._newest is not None:
            self.engine.chunk_published(*self._newest, self.delay_s)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def chunk_source(
    mode: str,
    policy: Pi05Policy,
    prompt_format: PromptFormat,
    num_steps: int,
    subtask_every: int,
    action_dt: float,
    continuity: Continuity = Continuity(),
    delay_s: float = 0.0,
    confirmations: int = 1,
    held_gate: HeldGate | None = None,
    phase_order: PhaseOrder | None = None,
) -> PromptedChunks | EngineChunks:
    """The chunk source of ``--subtask`` ``mode``, each chunk continuing the executed one as
    ``continuity`` says, the chunks reaching
    the arm ``delay_s`` after their observation; predicted: a changed subtask adopted after
    ``confirmations`` decodes in a row (and, with ``held_gate``, a held object's subtask only
    while the gripper holds; with ``phase_order``, a later phase at once)."""
    if mode == "predicted":
        return EngineChunks(
            policy, prompt_format, num_steps, subtask_every, action_dt, continuity, delay_s,
            confirmations, held_gate, phase_order,
        )  # fmt: skip
    if mode not in MODES:
        raise ValueError(f"unknown subtask mode {mode!r}; choose from {', '.join(MODES)}")
    return PromptedChunks(policy, prompt_format, mode, num_steps, continuity, action_dt, delay_s)
