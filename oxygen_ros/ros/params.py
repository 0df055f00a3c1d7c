"""The node's parameters: declarations with descriptors, per-value checks and the validated
snapshot.

Every parameter is listed once in :data:`PARAMETERS` with its type, default, description, range and
*when it applies*:

* ``STATIC`` — read once at start-up (declared read-only);
* ``CONFIGURE`` — read by the ``configure`` transition (model, engine, topics); changing one while
  the node is configured is refused with a reason ("clean up first");
* ``RUNTIME`` — applied at once while the node runs (rate, task, limits, dry run, ...).

Checks happen at three levels, each with a message that names the parameter and the fix:

1. rclpy enforces the declared type, range and read-only flag (e.g. ``rate_hz`` outside 1-200);
2. :func:`check_value` checks one value on its own (a dtype name, an image slot, a finite limit);
3. :meth:`NodeSettings.from_values` checks the parameters against each other (array lengths,
   unique slots, lower < upper ...). It runs at ``configure`` and on every change while configured.

This module imports only the ROS message definitions it declares with, so it is cheap to test.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType

from ..engine.subtasks import HeldGate, PhaseOrder
from ..model.config import IMAGE_SLOTS
from ..policy_io.prompts import (
    DEFAULT_FORMAT,
    PromptFormat,
    PromptFormatError,
    check_conditioning,
    resolve_format,
)
from ..policy_io.prompts import PRESETS as PROMPT_PRESETS
from ..policy_io.robots import (
    END_EFFECTOR,
    JOINT_ACTION_SPACES,
    ROBOTS,
    RobotAdapter,
    robot_adapter,
)

STATIC = "static"
CONFIGURE = "configure"
RUNTIME = "runtime"

DTYPES = ("float32", "bfloat16", "float16")
DECODE_MODES = ("deadline", "fixed")
CHUNK_CONTINUITY_MODES = (
    "none",
    "rtc",
)  # as model.rtc.CONTINUITY_MODES (this module stays torch-free)
RTC_SCHEDULES = ("exp", "linear")  # as model.rtc.SCHEDULES
RTC_GUIDANCE = ("identity", "vjp")  # as model.rtc.GUIDANCE
RTC_MODES = ("auto", "trained", "guided")  # as model.rtc.RTC_MODES
OVERRUN_POLICIES = ("adapt", "skip")
ENGINES = ("local", "remote")  # the model in this process | in oxygen-serve (ros/remote_engine.py)
LEROBOT_VERSIONS = ("auto", "0.4", "main")  # as checkpoints.conventions.LEROBOT_VERSIONS
LEROBOT_CAMERA_PREFIX = "observation.images."  # LeRobot's camera feature keys
_INT32_MAX = 2**31 - 1


_ARRAY_TYPES = (
    ParameterType.PARAMETER_STRING_ARRAY,
    ParameterType.PARAMETER_BOOL_ARRAY,
    ParameterType.PARAMETER_DOUBLE_ARRAY,
    ParameterType.PARAMETER_INTEGER_ARRAY,
)


class SettingsError(ValueError):
    """Parameters that cannot work together (or a value that cannot work at all)."""


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One declared parameter."""

    name: str
    type: int  # rcl_interfaces ParameterType.PARAMETER_*
    default: Any
    description: str
    applies: str = RUNTIME
    range: tuple[float, float] | None = None  # inclusive; integer or floating per ``type``

    @property
    def dynamic(self) -> bool:
        """Declared with dynamic typing (see :meth:`descriptor`); :func:`check_value` checks the
        type."""
        return self.type in (
            ParameterType.PARAMETER_DOUBLE,
            ParameterType.PARAMETER_DOUBLE_ARRAY,
        ) or (self.type in _ARRAY_TYPES and not self.default)

    def descriptor(self) -> ParameterDescriptor:
        """The ROS descriptor: description (with when it applies), type, range, read-only."""
        when = {
            STATIC: "read once at start-up",
            CONFIGURE: "applied by the configure transition",
            RUNTIME: "can change while running",
        }[self.applies]
        descriptor = ParameterDescriptor(
            name=self.name,
            type=self.type,
            description=f"{self.description} ({when})",
            read_only=self.applies == STATIC,
        )
        if self.dynamic:
            # rclpy infers a static type from the default: [] would become BYTE_ARRAY (rejecting
            # every
            # real override) and a float would reject `-p rate_hz:=30`. These are dynamically typed;
            # check_value checks their type and range and normalise() makes integers floats.
            descriptor.type = ParameterType.PARAMETER_NOT_SET
            descriptor.dynamic_typing = True
        if self.range is not None and self.type == ParameterType.PARAMETER_INTEGER:
            low, high = int(self.range[0]), int(self.range[1])
            descriptor.integer_range = [IntegerRange(from_value=low, to_value=high, step=1)]
        elif self.range is not None:
            descriptor.floating_point_range = [
                FloatingPointRange(
                    from_value=float(self.range[0]), to_value=float(self.range[1]), step=0.0
                )
            ]
        return descriptor


_T = ParameterType
DEFAULT_JOINTS = [f"joint_{i}" for i in range(1, 8)]

PARAMETERS: tuple[ParamSpec, ...] = (
    # -- model and engine (configure) -------------------------------------------------------------
    ParamSpec(
        "checkpoint_dir",
        _T.PARAMETER_STRING,
        "",
        "checkpoint directory: openpi's layout (model.safetensors + assets/*/norm_stats.json) or a "
        "LeRobot pi05 pretrained_model/ folder (config.json type pi05), told apart by its files; "
        "required: `oxygen-make-checkpoint --preset tiny --out DIR` makes a random-weight one",
        CONFIGURE,
    ),
    ParamSpec(
        "tokenizer_path",
        _T.PARAMETER_STRING,
        "",
        "sentencepiece tokenizer, or a Hugging Face tokenizer folder holding tokenizer.model "
        "(google/paligemma-3b-pt-224's, as LeRobot uses); empty: the checkpoint's own "
        "tokenizer.model",
        CONFIGURE,
    ),
    ParamSpec(
        "lerobot_version",
        _T.PARAMETER_STRING,
        "auto",
        f"LeRobot checkpoints: whose input conventions to use, {' | '.join(LEROBOT_VERSIONS)} "
        "(0.4: state padded to max_state_dim in the prompt, image borders -3; main: neither); "
        "auto: main when config.json has use_relative_actions or the preprocessor a "
        "relative-actions step, else 0.4",
        CONFIGURE,
    ),
    ParamSpec("device", _T.PARAMETER_STRING, "cpu", "torch device: cpu, cuda, cuda:N", CONFIGURE),
    ParamSpec(
        "dtype",
        _T.PARAMETER_STRING,
        "float32",
        "model dtype: float32 | bfloat16 | float16",
        CONFIGURE,
    ),
    ParamSpec(
        "seed",
        _T.PARAMETER_INTEGER,
        0,
        "seed of the flow-matching noise and of sampled text",
        CONFIGURE,
        (0, _INT32_MAX),
    ),
    ParamSpec(
        "decode_mode",
        _T.PARAMETER_STRING,
        "deadline",
        "language decoding budget: deadline (as many batched steps as fit before the next tick) "
        "| fixed (decode_steps_per_frame steps per tick, ended early at the next tick's deadline)",
        CONFIGURE,
    ),
    ParamSpec(
        "decode_steps_per_frame",
        _T.PARAMETER_INTEGER,
        5,
        "batched decode steps per tick in fixed mode",
        CONFIGURE,
        (0, 10_000),
    ),
    ParamSpec(
        "decode_margin_ms",
        _T.PARAMETER_DOUBLE,
        3.0,
        "time kept free before the next tick (for taking the inputs that arrived meanwhile) when "
        "deciding whether one more decode step fits",
        CONFIGURE,
        (0.0, 1000.0),
    ),
    ParamSpec(
        "static_shapes",
        _T.PARAMETER_BOOL,
        False,
        "fixed-shape prefill / action / text steps (the GPU fast path; eager on CPU)",
        CONFIGURE,
    ),
    ParamSpec(
        "cuda_graphs",
        _T.PARAMETER_BOOL,
        False,
        "capture the action path and batched decode steps in CUDA graphs (implies static_shapes; "
        "needs device cuda)",
        CONFIGURE,
    ),
    ParamSpec(
        "gpu_preprocess",
        _T.PARAMETER_BOOL,
        False,
        "resize_with_pad and scaling on the model device with pinned, non-blocking uploads (needs "
        "static_shapes or cuda_graphs; openpi's or a LeRobot checkpoint's resize); exact for "
        "224x224 images, within one uint8 level otherwise",
        CONFIGURE,
    ),
    ParamSpec(
        "max_active_requests",
        _T.PARAMETER_INTEGER,
        16,
        "language requests decoded together; more wait in the queue",
        CONFIGURE,
        (1, 4096),
    ),
    ParamSpec(
        "kv_capacity_tokens",
        _T.PARAMETER_INTEGER,
        0,
        "KV memory budget in tokens; 0: room for max_active_requests frames plus their text",
        CONFIGURE,
        (0, 100_000_000),
    ),
    # -- inputs (configure) -----------------------------------------------------------------------
    ParamSpec(
        "camera_topics",
        _T.PARAMETER_STRING_ARRAY,
        ["camera/base/image_raw", "camera/wrist/image_raw"],
        "camera topics, one per image slot; relative names (no leading /) follow the node's "
        "namespace, as joint_states does",
        CONFIGURE,
    ),
    ParamSpec(
        "camera_slots",
        _T.PARAMETER_STRING_ARRAY,
        ["base_0_rgb", "left_wrist_0_rgb"],
        f"model image slot of each camera topic (same length, unique): {', '.join(IMAGE_SLOTS)}; "
        f"for a LeRobot checkpoint its camera keys ({LEROBOT_CAMERA_PREFIX}<name>, from its "
        "config.json input_features)",
        CONFIGURE,
    ),
    ParamSpec(
        "camera_compressed",
        _T.PARAMETER_BOOL_ARRAY,
        [],
        "per camera topic: true = sensor_msgs/CompressedImage (jpeg/png), false = "
        "sensor_msgs/Image; empty: compressed when the topic ends in /compressed",
        CONFIGURE,
    ),
    ParamSpec(
        "joint_names",
        _T.PARAMETER_STRING_ARRAY,
        DEFAULT_JOINTS,
        "joints read from joint_states, in the model's state order",
        CONFIGURE,
    ),
    ParamSpec(
        "action_joint_names",
        _T.PARAMETER_STRING_ARRAY,
        [],
        "joints driven by the first N action dimensions (a subset of joint_names); empty: "
        "joint_names",
        CONFIGURE,
    ),
    # -- loop and outputs (runtime) ---------------------------------------------------------------
    ParamSpec(
        "rate_hz",
        _T.PARAMETER_DOUBLE,
        60.0,
        "action loop rate (one shared prefill + chunk per tick); "
        "overrun_policy adapt runs slower while ticks cannot hold it",
        RUNTIME,
        (1.0, 200.0),
    ),
    ParamSpec(
        "torch_threads",
        _T.PARAMETER_INTEGER,
        1,
        "torch intra-op threads of the thread running the model",
        RUNTIME,
        (1, 256),
    ),
    ParamSpec(
        "action_dt",
        _T.PARAMETER_DOUBLE,
        0.02,
        "seconds between consecutive actions of a chunk",
        RUNTIME,
        (0.001, 10.0),
    ),
    ParamSpec(
        "action_horizon",
        _T.PARAMETER_INTEGER,
        0,
        "actions published per chunk (the first N); 0: the model's whole horizon",
        RUNTIME,
        (0, 10_000),
    ),
    ParamSpec(
        "task",
        _T.PARAMETER_STRING,
        "pick up the red block",
        "task text given to the model (also set by ~/instruction)",
        RUNTIME,
    ),
    ParamSpec(
        "max_observation_age_s",
        _T.PARAMETER_DOUBLE,
        0.5,
        "inputs older than this (receive time or header stamp) are not used; no action without "
        "fresh joint states and at least one fresh camera",
        RUNTIME,
        (0.001, 3600.0),
    ),
    ParamSpec(
        "joint_lower_limits",
        _T.PARAMETER_DOUBLE_ARRAY,
        [],
        "per action joint lower position limit; empty: unlimited",
        RUNTIME,
    ),
    ParamSpec(
        "joint_upper_limits",
        _T.PARAMETER_DOUBLE_ARRAY,
        [],
        "per action joint upper position limit; empty: unlimited",
        RUNTIME,
    ),
    ParamSpec(
        "max_joint_velocity",
        _T.PARAMETER_DOUBLE_ARRAY,
        [],
        "per action joint speed limit (units/s) between consecutive actions and from the current "
        "state to the first; empty: unlimited",
        RUNTIME,
    ),
    ParamSpec(
        "dry_run",
        _T.PARAMETER_BOOL,
        False,
        "publish only ~/action_chunk, never ~/joint_trajectory",
        RUNTIME,
    ),
    ParamSpec(
        "narration_period_s",
        _T.PARAMETER_DOUBLE,
        2.0,
        "seconds between narration requests; 0 disables narration",
        RUNTIME,
        (0.0, 86_400.0),
    ),
    ParamSpec(
        "narration_max_tokens",
        _T.PARAMETER_INTEGER,
        30,
        "token limit of a narration",
        RUNTIME,
        (1, 4096),
    ),
    ParamSpec(
        "answer_max_tokens",
        _T.PARAMETER_INTEGER,
        40,
        "token limit of an answer to ~/ask",
        RUNTIME,
        (1, 4096),
    ),
    ParamSpec(
        "temperature",
        _T.PARAMETER_DOUBLE,
        0.0,
        "text sampling temperature; 0 is greedy",
        RUNTIME,
        (0.0, 10.0),
    ),
    # -- continuous chunks: real-time chunking (configure) -----------------------------------------
    ParamSpec(
        "chunk_continuity",
        _T.PARAMETER_STRING,
        "none",
        "none: every chunk is denoised from fresh noise | rtc: real-time chunking, each chunk "
        "continues the previous chunk as published (after the safety limits) over the steps the "
        "robot executes before it arrives (the delay from the observation's stamp to the "
        "publication, in action_dt steps): a checkpoint that declares rtc_training_max_delay runs "
        "training-time RTC (that prefix frozen, no guidance; a longer delay falls back to guided "
        "RTC), any other guided RTC (the frozen prefix set to the published chunk, a soft decay "
        "over the rest of the overlap, see rtc_guidance); the shipped configs run rtc, guided",
        CONFIGURE,
    ),
    ParamSpec(
        "rtc_mode",
        _T.PARAMETER_STRING,
        "auto",
        "chunk_continuity rtc: auto: training-time RTC when the checkpoint declares "
        "rtc_training_max_delay, else guided | trained: always training-time RTC (refused for a "
        "checkpoint that declares none) | guided: guided RTC on any checkpoint (rtc_guidance; "
        "what the shipped configs use: docs/rtc.md)",
        CONFIGURE,
    ),
    ParamSpec(
        "rtc_guidance",
        _T.PARAMETER_STRING,
        "identity",
        "chunk_continuity rtc, guided: identity: the correction is the weighted error itself "
        "(LeRobot's guided RTC as its code runs; about the cost of a plain chunk, runs on the "
        "static path / CUDA graphs) | vjp: the paper's pseudoinverse guidance, one "
        "vector-Jacobian product of the action expert per denoising step (2.5-4x the plain "
        "chunk, always the eager sampler)",
        CONFIGURE,
    ),
    ParamSpec(
        "rtc_execution_horizon",
        _T.PARAMETER_INTEGER,
        0,
        "chunk_continuity rtc: guide at most this many steps of a new chunk; 0: the whole overlap "
        "with the previous chunk",
        CONFIGURE,
        (0, 10_000),
    ),
    ParamSpec(
        "rtc_max_guidance_weight",
        _T.PARAMETER_DOUBLE,
        5.0,
        "chunk_continuity rtc: beta, the clip of the guidance weight (0 disables guidance; above "
        "2 x the 10 denoising steps it overshoots)",
        CONFIGURE,
        (0.0, 100.0),
    ),
    ParamSpec(
        "rtc_schedule",
        _T.PARAMETER_STRING,
        "exp",
        "chunk_continuity rtc: decay of the guidance over the overlap after the frozen steps: "
        "exp | linear",
        CONFIGURE,
    ),
    # -- start-up (static) ------------------------------------------------------------------------
    ParamSpec(
        "autostart", _T.PARAMETER_BOOL, True, "configure and activate on start (plain runs)", STATIC
    ),
    # -- robot adapter and action space (configure) -----------------------------------------------
    ParamSpec(
        "robot",
        _T.PARAMETER_STRING,
        "generic",
        f"openpi robot transforms around the checkpoint: {' | '.join(ROBOTS)} (state layout, delta "
        "-> absolute, ALOHA flips and grippers, state in the prompt or not; generic: none)",
        CONFIGURE,
    ),
    ParamSpec(
        "action_space",
        _T.PARAMETER_STRING,
        "",
        f"what the robot-unit actions command: {' | '.join(JOINT_ACTION_SPACES)} (delta_position: "
        "relative "
        "to the joint state at the observation; velocity: JointTrajectory points carry velocities "
        "and "
        "positions integrated from that state); empty: the robot's own (generic/aloha position, "
        "droid velocity, libero end-effector actions on ~/action_chunk only)",
        CONFIGURE,
    ),
    ParamSpec(
        "gripper_joint_names",
        _T.PARAMETER_STRING_ARRAY,
        [],
        "action joints that are absolute positions in every action space (a subset of "
        "action_joint_names); empty: the robot's own (droid: its 8th dim, aloha: both grippers)",
        CONFIGURE,
    ),
    ParamSpec(
        "gripper_trajectory",
        _T.PARAMETER_BOOL,
        True,
        "publish the gripper dims (gripper_joint_names, else the robot's) as their own "
        "JointTrajectory on ~/gripper_trajectory, for the gripper's own controller, and the other "
        "action joints on ~/joint_trajectory (a stock arm joint_trajectory_controller rejects a "
        "joint it does not have); false: every action joint on ~/joint_trajectory, for one "
        "controller that owns them all",
        CONFIGURE,
    ),
    ParamSpec(
        "gripper_commit",
        _T.PARAMETER_BOOL,
        False,
        "keep the gripper switches a chunk plans ahead to their time: once a chunk plans a gripper "
        "dim to cross gripper_switch_level k steps ahead, it switches then, even while later "
        "chunks plan it later (they may bring it sooner; two chunks in a row without it drop it; "
        "a switch made holds 0.5 s). Re-planning every tick otherwise lets a planned switch "
        "recede tick after tick (docs/ros_interfaces.md, Gripper switches)",
        RUNTIME,
    ),
    ParamSpec(
        "gripper_switch_level",
        _T.PARAMETER_DOUBLE,
        0.5,
        "gripper_commit: the gripper value (published units) between open and closed",
        RUNTIME,
        (-1e6, 1e6),
    ),
    # -- fault tolerance and graceful degradation of the loop (runtime) ---------------------------
    ParamSpec(
        "max_consecutive_failures",
        _T.PARAMETER_INTEGER,
        30,
        "ticks in a row in which an engine call fails (an observation the model rejects does not "
        "count) before the node reports ERROR and takes the lifecycle error transition: it "
        "releases the engine and ends unconfigured",
        RUNTIME,
        (1, 1_000_000),
    ),
    ParamSpec(
        "max_text_chars",
        _T.PARAMETER_INTEGER,
        500,
        "longest text accepted on ~/ask and ~/instruction (characters); longer ones are refused "
        "and counted",
        RUNTIME,
        (1, 1_000_000),
    ),
    ParamSpec(
        "overrun_policy",
        _T.PARAMETER_STRING,
        "adapt",
        "when ticks cannot be held at rate_hz with room for language: adapt (replan at the rate "
        "the "
        "measured tick cost allows, back up to rate_hz when it falls) | skip (keep rate_hz; the "
        "timer skips the periods a long tick overran)",
        RUNTIME,
    ),
    ParamSpec(
        "inject_inference_delay_ms",
        _T.PARAMETER_DOUBLE,
        0.0,
        "a test and bench knob, 0 in use: sleep this long after each chunk is computed and before "
        "it is published, as a slower model would (the chunk's delay, what RTC sees, grows by "
        "it; oxygen-bench closed-loop sweeps it)",
        RUNTIME,
        (0.0, 10_000.0),
    ),
    # -- prompt format and the subtask loop (configure) -------------------------------------------
    ParamSpec(
        "prompt_format",
        _T.PARAMETER_STRING,
        DEFAULT_FORMAT,
        f"the text format the checkpoint was trained with: {' | '.join(PROMPT_PRESETS)} (see "
        "docs/prompt_formats.md: which preset fits which checkpoint family), or the name of "
        "prompt_format_custom",
        CONFIGURE,
    ),
    ParamSpec(
        "prompt_format_custom",
        _T.PARAMETER_STRING,
        "",
        "a custom prompt format as JSON or YAML text (name, base preset, templates, kinds; see "
        "oxygen_ros/policy_io/prompts.py custom_format); empty: none",
        CONFIGURE,
    ),
    ParamSpec(
        "subtask_conditioning",
        _T.PARAMETER_STRING,
        "none",
        "pi0.5's hierarchy: none (no subtask) | prompt (every frame after a subtask finished is "
        "prefilled with the format's subtask-conditioned action prompt) | same_frame (the newest "
        "subtask's tokens are appended causally on the frame's shared prefix, in the same "
        "prefill; only where that is exact: openpi_subtask, opentau, brunofang)",
        CONFIGURE,
    ),
    ParamSpec(
        "subtask_period_s",
        _T.PARAMETER_DOUBLE,
        1.0,
        "seconds between subtask refreshes (decoded in the slack; also at once when the task "
        "changes); 0: one subtask per task",
        CONFIGURE,
        (0.0, 86_400.0),
    ),
    ParamSpec(
        "subtask_confirmations",
        _T.PARAMETER_INTEGER,
        1,
        "a decoded subtask that differs from the current one conditions the chunks only once "
        "this many refreshes in a row decoded it (1: at once; the task's first at once): a "
        "subtask that flickers for one refresh never reaches the actions",
        CONFIGURE,
        (1, 100),
    ),
    ParamSpec(
        "subtask_held_pattern",
        _T.PARAMETER_STRING,
        "",
        "a regular expression for the subtasks that presuppose a held object (e.g. "
        "'^(carry|release) '): a change to one conditions the chunks only while every gripper "
        "joint (gripper_joint_names, else the robot's) lies within subtask_held_range, so a "
        "decoder guessing ahead of the scene cannot send an empty hand to the goal; '': no gate",
        CONFIGURE,
    ),
    ParamSpec(
        "subtask_held_range",
        _T.PARAMETER_DOUBLE_ARRAY,
        [],
        "low, high: the gripper joint's state (joint_states units) between which it holds an "
        "object (past open, short of closed on nothing); needed by subtask_held_pattern",
        CONFIGURE,
    ),
    ParamSpec(
        "subtask_phase_order",
        _T.PARAMETER_STRING_ARRAY,
        [],
        "the task's phases in the order they are carried out, each a regular expression (e.g. "
        "['^reach ', '^grasp ', '^carry ', '^release ']): a change to a later phase conditions "
        "the chunks at once, a change back or within a phase after subtask_confirmations; []: "
        "every change waits for subtask_confirmations",
        CONFIGURE,
    ),
    ParamSpec(
        "subtask_max_tokens",
        _T.PARAMETER_INTEGER,
        0,
        "token limit of a subtask; 0: the format's (64 for #942, 128 for PI052)",
        CONFIGURE,
        (0, 4096),
    ),
    # -- text in rviz ------------------------------------------------------------------------------
    ParamSpec(
        "narration_marker",
        _T.PARAMETER_BOOL,
        False,
        "also publish each finished text as a visualization_msgs/Marker (TEXT_VIEW_FACING) on "
        "~/narration_marker, for rviz (rviz/oxygen.rviz shows it)",
        CONFIGURE,
    ),
    ParamSpec(
        "narration_marker_frame",
        _T.PARAMETER_STRING,
        "base_link",
        "frame_id of the narration marker (rviz's Fixed Frame or one TF connects to it)",
        RUNTIME,
    ),
    ParamSpec(
        "narration_marker_position",
        _T.PARAMETER_DOUBLE_ARRAY,
        [0.0, 0.0, 1.0],
        "x, y, z of the narration marker in narration_marker_frame (metres)",
        RUNTIME,
    ),
    # -- the model in oxygen-serve (engine: remote) ----------------------------------------------
    ParamSpec(
        "engine",
        _T.PARAMETER_STRING,
        "local",
        "where the model runs: local (this node loads checkpoint_dir) | remote (oxygen-serve at "
        "server_uri or server_uris; topics, limits, trajectories, diagnostics and Ask stay in the "
        "node)",
        CONFIGURE,
    ),
    ParamSpec(
        "server_uri",
        _T.PARAMETER_STRING,
        "",
        "engine remote: oxygen-serve's address, ws://HOST:PORT (HOST:PORT also works); for "
        "several servers use server_uris instead",
        CONFIGURE,
    ),
    ParamSpec(
        "server_uris",
        _T.PARAMETER_STRING_ARRAY,
        [],
        "engine remote: several oxygen-serve addresses serving the same model, used one at a "
        "time in this order; the node moves on to the next (cycling) when its server cannot be "
        "reached, drops the connection or misses server_switch_after_misses replies in a row, "
        "and back to the first once it is ready (server_failback_probe_s) "
        '(instead of server_uri; quote each address in YAML: ["ws://a:8000", "ws://b:8000"])',
        CONFIGURE,
    ),
    ParamSpec(
        "server_switch_after_misses",
        _T.PARAMETER_INTEGER,
        3,
        "engine remote with several servers: ticks in a row without a usable reply in time "
        "(late past server_timeout_ms, or the server's error) after which the node moves on to "
        "the next server",
        CONFIGURE,
        (1, 1000),
    ),
    ParamSpec(
        "server_failback_probe_s",
        _T.PARAMETER_DOUBLE,
        1.0,
        "engine remote with several servers: while on another server, how often the first "
        "one's /healthz is asked; once it is ready the node goes back to it between two ticks "
        "(a new session); 0: stay on the other server",
        CONFIGURE,
        (0.0, 3600.0),
    ),
    ParamSpec(
        "server_api_key_file",
        _T.PARAMETER_STRING,
        "",
        "engine remote: a file holding the server's API key (sent as Authorization: Api-Key "
        "<key>); empty: no key",
        CONFIGURE,
    ),
    ParamSpec(
        "server_connect_timeout_s",
        _T.PARAMETER_DOUBLE,
        10.0,
        "engine remote: how long configure waits for the first connection (afterwards the node "
        "reconnects by itself)",
        CONFIGURE,
        (0.1, 3600.0),
    ),
    ParamSpec(
        "server_timeout_ms",
        _T.PARAMETER_DOUBLE,
        0.0,
        "engine remote: the longest a tick waits for the server's reply; a later reply is dropped "
        "and counted (no_action_server_late); 0: one tick period",
        RUNTIME,
        (0.0, 60_000.0),
    ),
)

SPECS: dict[str, ParamSpec] = {spec.name: spec for spec in PARAMETERS}


def normalise(name: str, value: Any) -> Any:
    """A parameter value as plain Python: arrays become lists of their element type.

    An empty YAML list arrives as None (NOT_SET); integer arrays given for float arrays are
    converted.

    Raises:
        SettingsError: an array parameter given something that is not a list of its element type.
    """
    spec = SPECS[name]
    if spec.type == ParameterType.PARAMETER_DOUBLE:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{name} must be a number, got {value!r}")
        return float(value)
    if spec.type not in _ARRAY_TYPES:
        return value
    if value is None:
        return []
    element, kind = _ELEMENTS[spec.type]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise SettingsError(f"{name} must be a list of {kind}, got {value!r}")
    items = list(value)
    if element is float:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            raise SettingsError(f"{name} must be a list of {kind}, got {items!r}")
        return [float(x) for x in items]
    if not all(isinstance(x, element) for x in items):
        raise SettingsError(f"{name} must be a list of {kind}, got {items!r}")
    return items


_ELEMENTS = {
    ParameterType.PARAMETER_STRING_ARRAY: (str, "strings"),
    ParameterType.PARAMETER_BOOL_ARRAY: (bool, "booleans"),
    ParameterType.PARAMETER_DOUBLE_ARRAY: (float, "numbers"),
    ParameterType.PARAMETER_INTEGER_ARRAY: (int, "integers"),
}


def check_value(name: str, value: Any) -> None:
    """Checks one value on its own (rclpy has already checked its type and range).

    Raises:
        SettingsError: naming the parameter, the value and what is allowed.
    """
    value = normalise(name, value)
    spec = SPECS[name]
    if spec.range is not None and not (spec.range[0] <= value <= spec.range[1]):  # NaN fails too
        raise SettingsError(
            f"{name} must be within [{spec.range[0]:g}, {spec.range[1]:g}], got {value!r}"
        )
    if name == "dtype" and value not in DTYPES:
        raise SettingsError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    if name == "decode_mode" and value not in DECODE_MODES:
        raise SettingsError(f"decode_mode must be one of {', '.join(DECODE_MODES)}, got {value!r}")
    if name == "chunk_continuity" and value not in CHUNK_CONTINUITY_MODES:
        raise SettingsError(
            f"chunk_continuity must be one of {', '.join(CHUNK_CONTINUITY_MODES)}, got {value!r}"
        )
    if name == "rtc_mode" and value not in RTC_MODES:
        raise SettingsError(f"rtc_mode must be one of {', '.join(RTC_MODES)}, got {value!r}")
    if name == "rtc_guidance" and value not in RTC_GUIDANCE:
        raise SettingsError(f"rtc_guidance must be one of {', '.join(RTC_GUIDANCE)}, got {value!r}")
    if name == "rtc_schedule" and value not in RTC_SCHEDULES:
        raise SettingsError(
            f"rtc_schedule must be one of {', '.join(RTC_SCHEDULES)}, got {value!r}"
        )
    if name == "prompt_format" and not value.strip():
        raise SettingsError(f"prompt_format must name a preset ({', '.join(PROMPT_PRESETS)})")
    if name == "lerobot_version" and value not in LEROBOT_VERSIONS:
        raise SettingsError(
            f"lerobot_version must be one of {', '.join(LEROBOT_VERSIONS)}, got {value!r}"
        )
    if name == "overrun_policy" and value not in OVERRUN_POLICIES:
        raise SettingsError(
            f"overrun_policy must be one of {', '.join(OVERRUN_POLICIES)}, got {value!r}"
        )
    if name == "engine" and value not in ENGINES:
        raise SettingsError(f"engine must be one of {', '.join(ENGINES)}, got {value!r}")
    if name == "device" and not value.strip():
        raise SettingsError("device must not be empty (cpu, cuda, cuda:N)")
    if name == "task" and not value.strip():
        raise SettingsError("task must not be empty")
    if name == "camera_slots":
        unknown = [
            slot
            for slot in value
            if slot not in IMAGE_SLOTS
            and not (
                slot.startswith(LEROBOT_CAMERA_PREFIX) and len(slot) > len(LEROBOT_CAMERA_PREFIX)
            )
        ]
        if unknown:
            raise SettingsError(
                f"camera_slots {unknown} are not image slots; use {', '.join(IMAGE_SLOTS)} (or a "
                f"LeRobot checkpoint's camera keys, {LEROBOT_CAMERA_PREFIX}<name>)"
            )
        if len(set(value)) != len(value):
            raise SettingsError(f"camera_slots must be unique, got {value}")
    if name == "robot" and value not in ROBOTS:
        raise SettingsError(f"robot must be one of {', '.join(ROBOTS)}, got {value!r}")
    if name == "action_space" and value and value not in JOINT_ACTION_SPACES:
        raise SettingsError(
            f"action_space must be one of {', '.join(JOINT_ACTION_SPACES)} (or empty: the robot's "
            f"own), got {value!r}"
        )
    if name in ("camera_topics", "joint_names", "action_joint_names", "gripper_joint_names"):
        if any(not item.strip() for item in value):
            raise SettingsError(f"{name} must not contain empty names, got {value}")
        if len(set(value)) != len(value):
            raise SettingsError(f"{name} must be unique, got {value}")
    if name in ("joint_lower_limits", "joint_upper_limits", "max_joint_velocity"):
        if not all(math.isfinite(v) for v in value):
            raise SettingsError(f"{name} must be finite numbers, got {value}")
    if name == "narration_marker_frame" and not value.strip():
        raise SettingsError("narration_marker_frame must not be empty (e.g. base_link)")
    if name == "narration_marker_position" and (
        len(value) != 3 or not all(math.isfinite(v) for v in value)
    ):
        raise SettingsError(
            f"narration_marker_position must be 3 finite numbers (x, y, z), got {value}"
        )
    if name == "max_joint_velocity" and any(v <= 0 for v in value):
        raise SettingsError(f"max_joint_velocity must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class CameraInput:
    """One camera subscription."""

    topic: str
    slot: str
    compressed: bool


@dataclasses.dataclass(frozen=True)
class NodeSettings:
    """A consistent snapshot of every parameter (build it with :meth:`from_values`)."""

    checkpoint_dir: str
    tokenizer_path: str
    lerobot_version: str
    device: str
    dtype: str
    seed: int
    decode_mode: str
    decode_steps_per_frame: int
    decode_margin_ms: float
    static_shapes: bool
    cuda_graphs: bool
    gpu_preprocess: bool
    max_active_requests: int
    kv_capacity_tokens: int
    cameras: tuple[CameraInput, ...]
    joint_names: tuple[str, ...]
    action_joint_names: tuple[str, ...]
    rate_hz: float
    torch_threads: int
    action_dt: float
    action_horizon: int
    task: str
    max_observation_age_s: float
    joint_lower_limits: tuple[float, ...]
    joint_upper_limits: tuple[float, ...]
    max_joint_velocity: tuple[float, ...]
    dry_run: bool
    narration_period_s: float
    narration_max_tokens: int
    answer_max_tokens: int
    temperature: float
    # continuous chunks (real-time chunking)
    chunk_continuity: str
    rtc_execution_horizon: int
    rtc_max_guidance_weight: float
    rtc_schedule: str
    rtc_mode: str
    rtc_guidance: str
    autostart: bool
    # -- robot adapter and action space ----------------------------------------------------------
    robot: str
    action_space: str  # as given; see command_space
    gripper_joint_names: tuple[str, ...]
    gripper_trajectory: bool
    gripper_commit: bool
    gripper_switch_level: float
    # fault tolerance and graceful degradation
    max_consecutive_failures: int
    max_text_chars: int
    overrun_policy: str
    inject_inference_delay_ms: float  # a test and bench knob
    # prompt format and the subtask loop
    prompt_format: str
    prompt_format_custom: str
    subtask_conditioning: str
    subtask_period_s: float
    subtask_max_tokens: int
    subtask_confirmations: int
    subtask_held_pattern: str
    subtask_held_range: tuple[float, ...]
    subtask_phase_order: tuple[str, ...]
    # text in rviz
    narration_marker: bool
    narration_marker_frame: str
    narration_marker_position: tuple[float, float, float]
    # the model in oxygen-serve
    engine: str
    server_uri: str
    server_uris: tuple[str, ...]
    server_switch_after_misses: int
    server_failback_probe_s: float
    server_api_key_file: str
    server_connect_timeout_s: float
    server_timeout_ms: float

    @property
    def period_s(self) -> float:
        return 1.0 / self.rate_hz

    @property
    def servers(self) -> tuple[str, ...]:
        """engine remote: the servers in the order they are used (``server_uris``, else
        ``server_uri``)."""
        return self.server_uris or (self.server_uri.strip(),)

    @property
    def format(self) -> PromptFormat:
        """The prompt format (checked by `from_values`)."""
        return resolve_format(self.prompt_format, self.prompt_format_custom or None)

    @property
    def action_joint_indices(self) -> tuple[int, ...]:
        """Index of each action joint in the state vector (joint_names order)."""
        return tuple(self.joint_names.index(name) for name in self.action_joint_names)

    @property
    def command_space(self) -> str:
        """What the published actions mean: ``action_space``, else the robot's own space."""
        return self.action_space or robot_adapter(self.robot).action_space

    @property
    def gripper_dims(self) -> tuple[int, ...]:
        """Action dims published as absolute positions: ``gripper_joint_names``, else the
        robot's."""
        if self.gripper_joint_names:
            return tuple(self.action_joint_names.index(name) for name in self.gripper_joint_names)
        return robot_adapter(self.robot).gripper_dims

    @property
    def held_gate(self) -> HeldGate | None:
        """The subtask loop's held-object gate (``subtask_held_pattern``; None: no gate), on the
        gripper joints' indices in the state."""
        if not self.subtask_held_pattern:
            return None
        state_dims = tuple(self.action_joint_indices[d] for d in self.gripper_dims)
        return HeldGate(self.subtask_held_pattern, state_dims, *self.subtask_held_range)

    @property
    def phase_order(self) -> PhaseOrder | None:
        """The subtask loop's phase order (``subtask_phase_order``; None: none given)."""
        return PhaseOrder.of(self.subtask_phase_order)

    @property
    def arm_joint_dims(self) -> tuple[int, ...]:
        """Action dims published on ~/joint_trajectory: all of them, or all but the gripper dims
        when ``gripper_trajectory`` publishes those on their own."""
        grippers = set(self.gripper_dims) if self.gripper_trajectory else set()
        return tuple(i for i in range(len(self.action_joint_names)) if i not in grippers)

    @property
    def gripper_trajectory_dims(self) -> tuple[int, ...]:
        """Action dims published on ~/gripper_trajectory (none unless ``gripper_trajectory``)."""
        return tuple(self.gripper_dims) if self.gripper_trajectory else ()

    @property
    def publishes_trajectory(self) -> bool:
        """Whether ~/joint_trajectory is published (never in dry_run or for end-effector
        actions)."""
        return not self.dry_run and self.command_space != END_EFFECTOR

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> NodeSettings:
        """Validate every value and their consistency.

        Raises:
            SettingsError: the first problem found, naming the parameters involved.
        """
        missing = sorted(set(SPECS) - set(values))
        if missing:
            raise SettingsError(f"parameters missing: {missing}")
        v = {name: normalise(name, values[name]) for name in SPECS}
        for name in SPECS:
            check_value(name, v[name])
        cameras = _cameras(v["camera_topics"], v["camera_slots"], v["camera_compressed"])
        joints = tuple(v["joint_names"])
        if not joints:
            raise SettingsError("joint_names must name at least one joint (the model's state)")
        action_joints = tuple(v["action_joint_names"]) or joints
        robot = robot_adapter(v["robot"])
        strangers = [name for name in action_joints if name not in joints]
        if strangers and robot.controls_joints:
            raise SettingsError(
                f"action_joint_names {strangers} are not in joint_names {list(joints)}: every "
                "driven joint's current position must be read from joint_states"
            )
        limits = {
            name: tuple(float(x) for x in v[name])
            for name in ("joint_lower_limits", "joint_upper_limits", "max_joint_velocity")
        }
        for name, array in limits.items():
            if array and len(array) != len(action_joints):
                raise SettingsError(
                    f"{name} has {len(array)} values but there are {len(action_joints)} action "
                    f"joints {list(action_joints)}; give one per action joint or none"
                )
        lower, upper = limits["joint_lower_limits"], limits["joint_upper_limits"]
        if lower and upper:
            crossed = [
                name for name, lo, hi in zip(action_joints, lower, upper, strict=True) if lo > hi
            ]
            if crossed:
                raise SettingsError(
                    f"joint_lower_limits exceed joint_upper_limits for joints {crossed}"
                )
        _check_robot(robot, v, cameras, joints, action_joints, limits)
        _check_servers(v)
        _check_prompt_format(robot, v)
        # Every field named like a parameter takes its validated value; the rest are derived above.
        direct = {field.name: v[field.name] for field in dataclasses.fields(cls) if field.name in v}
        settings = cls(
            **{
                **direct,
                "cameras": cameras,
                "joint_names": joints,
                "action_joint_names": action_joints,
                **limits,
                "gripper_joint_names": tuple(v["gripper_joint_names"]),
                "server_uris": tuple(uri.strip() for uri in v["server_uris"]),
                "narration_marker_position": tuple(v["narration_marker_position"]),
                "subtask_held_range": tuple(v["subtask_held_range"]),
                "subtask_phase_order": tuple(v["subtask_phase_order"]),
            }
        )
        if settings.gripper_commit:
            _check_gripper_dims(settings, robot.name, "gripper_commit")
        _check_held_gate(settings, robot.name)
        _check_phase_order(settings)
        return settings


def _check_gripper_dims(settings: NodeSettings, robot: str, parameter: str) -> None:
    """``parameter`` reads the gripper: the robot or gripper_joint_names must name its dims."""
    if not settings.gripper_dims:
        raise SettingsError(
            f"{parameter} needs gripper dims: robot {robot} has none, so name them in "
            "gripper_joint_names"
        )


def _check_held_gate(settings: NodeSettings, robot: str) -> None:
    """subtask_held_pattern: a valid regular expression, two numbers in subtask_held_range and
    gripper joints to read."""
    if not settings.subtask_held_pattern:
        return
    if len(settings.subtask_held_range) != 2:
        raise SettingsError(
            "subtask_held_pattern needs subtask_held_range: [low, high], the gripper state "
            f"between which it holds an object, got {list(settings.subtask_held_range)}"
        )
    _check_gripper_dims(settings, robot, "subtask_held_pattern")
    try:
        settings.held_gate  # noqa: B018 (building the gate runs its checks)
    except ValueError as exc:
        raise SettingsError(f"subtask_held_pattern / subtask_held_range: {exc}") from None


def _check_phase_order(settings: NodeSettings) -> None:
    """subtask_phase_order: two valid regular expressions or more (or none)."""
    try:
        settings.phase_order  # noqa: B018 (building the order runs its checks)
    except ValueError as exc:
        raise SettingsError(f"subtask_phase_order: {exc}") from None


def _check_servers(v: Mapping[str, Any]) -> None:
    """engine remote: one server in server_uri or several in server_uris, not both."""
    one, several = v["server_uri"].strip(), [uri.strip() for uri in v["server_uris"]]
    if one and several:
        raise SettingsError(
            "set server_uri (one server) or server_uris (several, in the order they are used), "
            f"not both: server_uri is {one!r}, server_uris {several}"
        )
    if any(not uri for uri in several):
        raise SettingsError(f"server_uris must not contain empty addresses, got {several}")
    if len(set(several)) != len(several):
        raise SettingsError(f"server_uris must be unique, got {several}")
    if v["engine"] == "remote" and not (one or several):
        raise SettingsError(
            "engine remote needs server_uri (oxygen-serve's address, e.g. ws://gpu-box:8000) "
            "or server_uris (several)"
        )


def _check_robot(
    robot: RobotAdapter,
    v: Mapping[str, Any],
    cameras: Sequence[CameraInput],
    joints: Sequence[str],
    action_joints: Sequence[str],
    limits: Mapping[str, Sequence[float]],
) -> None:
    """The robot adapter's needs against the other parameters (widths, slots, action space)."""
    name = robot.name
    if robot.state_dim is not None and len(joints) != robot.state_dim:
        raise SettingsError(
            f"robot {name} reads a {robot.state_dim}-dim state but joint_names has {len(joints)} "
            f"names; list the {robot.state_dim} state values in the robot's order"
        )
    if robot.action_dim is not None and len(action_joints) != robot.action_dim:
        raise SettingsError(
            f"robot {name} returns {robot.action_dim} action dims but there are "
            f"{len(action_joints)} "
            f"action joints {list(action_joints)}; set action_joint_names to {robot.action_dim} "
            "names"
        )
    unused = [cam.slot for cam in cameras if robot.slots and cam.slot not in robot.slots]
    if unused:
        raise SettingsError(
            f"robot {name} was trained with image slots {list(robot.slots)} only, not {unused}"
        )
    grippers = list(v["gripper_joint_names"])
    strangers = [g for g in grippers if g not in action_joints]
    if strangers:
        raise SettingsError(
            f"gripper_joint_names {strangers} are not action joints {list(action_joints)}"
        )
    if not robot.controls_joints:
        given = [key for key, values in limits.items() if values] + (
            ["gripper_joint_names"] if grippers else []
        )
        if v["action_space"]:
            given.insert(0, "action_space")
        if given:
            raise SettingsError(
                f"robot {name} returns end-effector actions, not joints: it publishes "
                "~/action_chunk "
                f"only (never ~/joint_trajectory), so {', '.join(given)} cannot apply; leave them "
                "empty"
            )


def _check_prompt_format(robot: RobotAdapter, v: Mapping[str, Any]) -> None:
    """The prompt format resolves (a custom one is valid), serves subtask_conditioning, and has a
    prompt for this robot's state (bins or none)."""
    try:
        fmt = resolve_format(v["prompt_format"], v["prompt_format_custom"] or None)
        check_conditioning(fmt, v["subtask_conditioning"])
        if not robot.discrete_state_input:
            fmt.template(v["subtask_conditioning"] != "none", has_state=False)
    except PromptFormatError as exc:
        raise SettingsError(f"prompt_format: {exc}") from None


def _cameras(
    topics: Sequence[str], slots: Sequence[str], compressed: Sequence[bool]
) -> tuple[CameraInput, ...]:
    if not topics:
        raise SettingsError("camera_topics must name at least one camera")
    if len(slots) != len(topics):
        raise SettingsError(
            f"camera_slots has {len(slots)} entries for {len(topics)} camera_topics; give one slot "
            "per topic"
        )
    if compressed and len(compressed) != len(topics):
        raise SettingsError(
            f"camera_compressed has {len(compressed)} entries for {len(topics)} camera_topics; "
            "give one per topic or none"
        )
    flags: list[bool] = list(compressed) or [
        topic.rstrip("/").endswith("/compressed") for topic in topics
    ]
    return tuple(CameraInput(t, s, bool(c)) for t, s, c in zip(topics, slots, flags, strict=True))


def check_chunk_fits(
    settings: NodeSettings, horizon: int, action_dim: int, model: str = "the model"
) -> None:
    """Raise `SettingsError` when ``action_horizon`` or the action joints ask for more than
    ``model`` (a checkpoint here, or the one a server serves) has."""
    if settings.action_horizon > horizon:
        raise SettingsError(
            f"action_horizon {settings.action_horizon} exceeds {model}'s horizon {horizon}"
        )
    if len(settings.action_joint_names) > action_dim:
        raise SettingsError(
            f"{len(settings.action_joint_names)} action joints but {model} has {action_dim} "
            "action dims"
        )


def changed_configure_parameters(names: Sequence[str]) -> list[str]:
    """The names among ``names`` that only the configure transition applies."""
    return [name for name in names if SPECS[name].applies == CONFIGURE]


def declare_parameters(node: Any) -> dict[str, Any]:
    """Declare every parameter on ``node`` (an rclpy Node) and return the values it starts with.

    Values are checked by :meth:`NodeSettings.from_values` when the node configures, so a bad value
    in a params file leaves the node up and unconfigured, saying why.

    Raises:
        SettingsError: an override that rclpy refuses outright (a string for an integer, ...).
    """
    from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException

    values: dict[str, Any] = {}
    for spec in PARAMETERS:
        try:
            parameter = node.declare_parameter(spec.name, spec.default, spec.descriptor())
        except (InvalidParameterTypeException, InvalidParameterValueException) as exc:
            raise SettingsError(
                f"parameter {spec.name}: {exc}; expected: {spec.description}"
            ) from exc
        values[spec.name] = parameter.value  # checked by NodeSettings.from_values at configure
    return values
