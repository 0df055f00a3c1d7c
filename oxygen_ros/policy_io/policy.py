"""pi0.5 policy I/O: robot observation -> model inputs, model actions -> robot actions.

This is openpi's inference transform chain for pi0.5, in order: resize_with_pad to 224 and scale
to [-1, 1]; the robot's state transform (:mod:`.robots`); quantile-normalise the state; tokenize
the prompt in the checkpoint's prompt format (:mod:`.prompts`; openpi's by default, with the state
bins or, for robots trained without the state in the prompt, the task alone); and on the way out
take the robot's action dimensions, quantile-unnormalise them and apply the robot's output
transform (delta -> absolute, flips, gripper encoding).

A LeRobot checkpoint (`checkpoints.lerobot`) runs LeRobot's chain instead, chosen by one value,
`conventions.InputConventions`: its camera keys as image slots, its normaliser (float32, its own
epsilons), its prompt state (padded or not), its image resampling and borders and its flow times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ..checkpoints.conventions import OPENPI_CONVENTIONS, RESAMPLE_PIL, InputConventions
from ..checkpoints.loader import load_checkpoint
from ..checkpoints.norm_stats import NormStats
from ..checkpoints.rtc_metadata import declared_rtc_training_max_delay
from ..model.config import IMAGE_SLOTS
from ..model.device import resolve_device
from ..model.pi05 import Pi05Model
from .preprocess import pad_to_dim, resize_with_pad, to_model_range
from .preprocess_torch import lerobot_resize_with_pad, resize_with_pad_torch
from .prompts import FramePrompt, PromptFormat, SubtaskText
from .robots import DELTA_POSITION, RobotAdapter, robot_adapter
from .tokenizer import Pi05Tokenizer

# a LeRobot camera key ("observation.images.<name>") is also accepted by its <name>
LEROBOT_IMAGE_PREFIX = "observation.images."


@dataclasses.dataclass
class PrefixInputs:
    """Model-ready tensors of B observations (`Pi05Policy.encode_batch`); prompts right-padded."""

    images: Tensor  # [B, slots, 3, 224, 224] in [-1, 1]
    image_masks: Tensor  # [B, slots] bool
    tokens: Tensor  # [B, T] int64
    token_masks: Tensor  # [B, T] bool
    token_causal: Tensor | None = None  # [B, T] bool: causal prompt tokens (None: bidirectional)
    image_columns: tuple[int, ...] = ()  # per row: valid image tokens (present slots' tokens)


class Pi05Policy:
    """A loaded model plus everything needed to feed it robot data.

    ``robot`` is the adapter (or its registered name) whose input and output transforms wrap the
    model; its fixed action width, if any, is the default ``action_dim``.

    ``norm_stats`` maps "state" and "actions" to normalisers (openpi's `NormStats`, or LeRobot's
    `checkpoints.lerobot.FeatureNorm`). ``lerobot`` is the `LeRobotSpec` of a LeRobot
    folder: its cameras become the image slots, its ``n_action_steps`` / ``num_inference_steps``
    are reported, and relative actions make the robot adapter's space ``delta_position`` (the
    dims LeRobot keeps absolute are its gripper dims). ``conventions`` defaults to the folder's
    (openpi's without one).

    Raises:
        ValueError: a tokenizer larger than the model's vocabulary, an unknown robot, an openpi
            robot transform around a LeRobot checkpoint, or an ``action_dim`` the model or the
            robot cannot serve.
    """

    # the checkpoint's training-time RTC maximum delay (`load_policy` reads it; 0: none)
    rtc_training_max_delay: int = 0

    def __init__(
        self,
        model: Pi05Model,
        tokenizer: Pi05Tokenizer,
        norm_stats: Mapping[str, NormStats],
        action_dim: int | None = None,
        robot: RobotAdapter | str = "generic",
        conventions: InputConventions | None = None,
        lerobot=None,
    ) -> None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                f"{model.config.vocab_size}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.state_stats = norm_stats["state"]
        self.action_stats = norm_stats["actions"]
        self.lerobot = lerobot
        self.format_reason = ""  # which checkpoint format, and the files that said so
        self.conventions = conventions or (
            lerobot.conventions if lerobot is not None else OPENPI_CONVENTIONS
        )
        self.model.flow_times = self.conventions.flow_times
        self.robot = robot_adapter(robot) if isinstance(robot, str) else robot
        if lerobot is not None:
            self.robot = self._lerobot_adapter(self.robot, lerobot)
        self.image_slots: tuple[str, ...] = tuple(lerobot.cameras) if lerobot else IMAGE_SLOTS
        self._slot_names = {name: i for i, name in enumerate(self.image_slots)}
        self._slot_names.update(
            {
                name[len(LEROBOT_IMAGE_PREFIX) :]: i
                for i, name in enumerate(self.image_slots)
                if name.startswith(LEROBOT_IMAGE_PREFIX)
            }
        )
        if len(self.image_slots) != model.config.num_image_slots:
            raise ValueError(
                f"{len(self.image_slots)} image slots {list(self.image_slots)} but the model has "
                f"{model.config.num_image_slots}"
            )
        fixed = self.robot.action_dim
        # a LeRobot folder's width is what it has: a robot may use its first dims only
        if action_dim and fixed and (action_dim > fixed if lerobot else action_dim != fixed):
            raise ValueError(
                f"robot {self.robot.name} has {fixed} action dims, asked for {action_dim}"
            )
        self.action_dim = action_dim or fixed or self.action_stats.dim  # the robot's action width
        if self.action_dim > model.config.action_dim:
            raise ValueError(
                f"robot action_dim {self.action_dim} exceeds the model's {model.config.action_dim}"
            )

    @staticmethod
    def _lerobot_adapter(robot: RobotAdapter, lerobot) -> RobotAdapter:
        """LeRobot wraps the model in no robot transform: the generic adapter, with the folder's
        action width and, for relative actions, the node's ``delta_position`` space."""
        if robot.name != "generic":
            raise ValueError(
                f"robot {robot.name!r} applies openpi's {robot.name} transforms, which a LeRobot "
                "checkpoint was not trained with; use robot generic"
            )
        adapter = dataclasses.replace(robot, name="lerobot", action_dim=lerobot.action_dim)
        if lerobot.uses_relative_actions:
            absolute = tuple(i for i, rel in enumerate(lerobot.relative_actions) if not rel)
            adapter = dataclasses.replace(
                adapter, action_space=DELTA_POSITION, gripper_dims=absolute
            )
        return adapter

    @property
    def state_dim(self) -> int | None:
        """The state width the checkpoint's statistics (or LeRobot's features) fix; None: any."""
        if self.lerobot is not None and self.lerobot.state_dim is not None:
            return self.lerobot.state_dim
        return getattr(self.state_stats, "dim", None)

    @property
    def num_steps(self) -> int | None:
        """The checkpoint's own number of denoising steps (LeRobot's num_inference_steps)."""
        return self.lerobot.num_inference_steps if self.lerobot is not None else None

    @property
    def published_horizon(self) -> int:
        """Actions of a chunk meant for execution: LeRobot's n_action_steps, else the horizon."""
        if self.lerobot is not None:
            return min(self.lerobot.n_action_steps, self.config.action_horizon)
        return self.config.action_horizon

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def present_slots(self, images: Mapping[str, np.ndarray]) -> tuple[int, ...]:
        """Indices (into `image_slots`) of the slots an observation fills; checks the names (a
        LeRobot camera key may be given without its ``observation.images.`` prefix)."""
        unknown = set(images) - set(self._slot_names)
        if unknown:
            raise ValueError(
                f"unknown image slots {sorted(unknown)}; expected some of {list(self.image_slots)}"
            )
        present = tuple(sorted({self._slot_names[name] for name in images}))
        if len(present) != len(images):
            raise ValueError(f"two names for one image slot in {sorted(images)}")
        if not present:
            raise ValueError("observation has no camera image: at least one image slot is required")
        return present

    def slot_images(self, images: Mapping[str, np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """An observation's images as (slot index, image), in slot order; checks the names as
        `present_slots` does."""
        present = self.present_slots(images)
        by_slot = {self._slot_names[name]: image for name, image in images.items()}
        return [(slot, by_slot[slot]) for slot in present]

    def model_image(self, image: np.ndarray) -> np.ndarray:
        """One RGB uint8 [H, W, 3] frame -> float32 [3, size, size] model input, prepared the way
        the checkpoint's framework prepared its training images (`InputConventions`)."""
        size = self.config.vision.image_size
        if self.conventions.resample == RESAMPLE_PIL:
            return to_model_range(resize_with_pad(image, size, size))
        frame = torch.from_numpy(np.ascontiguousarray(image))
        return lerobot_resize_with_pad(frame, size, size, self.conventions.border)[0].numpy()

    def model_image_torch(self, images: Tensor, out: Tensor | None = None) -> Tensor:
        """`model_image` on the model's device: uint8 [N, H, W, 3] -> float32 [N, 3, size, size]
        (within one uint8 level of the host path where resampling is involved)."""
        size = self.config.vision.image_size
        if self.conventions.resample == RESAMPLE_PIL:
            return resize_with_pad_torch(images, size, size, out=out)
        return lerobot_resize_with_pad(images, size, size, self.conventions.border, out=out)

    def prompt_state(self, state: np.ndarray) -> np.ndarray | None:
        """The state vector the prompt's bins are made of: the robot's state transform, then the
        checkpoint's normalisation (openpi's quantiles, or LeRobot's normaliser in float32), then,
        for LeRobot 0.4.x, zero-padding to max_state_dim (``conventions.prompt_state_dim``); None
        for robots trained without the state in the prompt (the state is still checked).

        Raises:
            ValueError: a state of the wrong width or with non-finite values.
        """
        pi_state = self.robot.state_to_pi(state)
        expected = self.state_dim if self.lerobot is not None else None
        if expected is not None and pi_state.shape[0] != expected:
            raise ValueError(f"the checkpoint's state has {expected} dims, got {pi_state.shape[0]}")
        if not self.robot.discrete_state_input:
            return None
        normalized = self.state_stats.normalize(pi_state)
        if self.conventions.prompt_state_dim:
            normalized = pad_to_dim(normalized, self.conventions.prompt_state_dim)
        return normalized

    def frame_prompt(
        self,
        state: np.ndarray,
        prompt: str,
        prompt_format: PromptFormat | None = None,
        conditioned: bool = False,
        subtask: SubtaskText | None = None,
    ) -> FramePrompt:
        """A frame's prompt ids for a raw robot state and task text in ``prompt_format`` (None:
        openpi's), conditioned on ``subtask`` when ``conditioned`` (`Pi05Tokenizer.frame_prompt`).

        Raises:
            ValueError: a bad state, or a format that needs state bins this robot does not have.
        """
        return self.tokenizer.frame_prompt(
            prompt,
            self.prompt_state(state),
            self.config.max_token_len,
            prompt_format,
            conditioned,
            subtask,
        )

    def prompt_tokens(
        self, state: np.ndarray, prompt: str, prompt_format: PromptFormat | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The robot's state transform, quantile normalisation and the action prompt: int64 tokens
        and bool mask, both [max_token_len], right-padded. Robots trained without the state in the
        prompt (``discrete_state_input`` false) get the format's state-free prompt (openpi's: the
        task text alone); the state is still checked.

        A prompt over ``max_token_len`` has its task shortened, never its state
        (`Pi05Tokenizer.frame_prompt`).

        Raises:
            ValueError: a state of the wrong width or with non-finite values; PromptTooLong (a
                ValueError): a state that alone does not fit ``max_token_len``.
        """
        return self.tokenizer.encode_prompt(
            prompt, self.prompt_state(state), self.config.max_token_len, prompt_format
        )

    def check_task(
        self,
        task: str,
        state_dim: int,
        prompt_format: PromptFormat | None = None,
        conditioned: bool = False,
        subtask_tokens: int = 0,
    ) -> None:
        """Refuse a task whose prompt would not fit ``max_token_len`` with a ``state_dim``-value
        state (the worst case: `Pi05Tokenizer.check_task`) in ``prompt_format`` (None: openpi's;
        ``conditioned``: its subtask-conditioned prompt, which must leave a subtask
        ``subtask_tokens``), before it is ever used.

        Raises:
            PromptTooLong: naming the prompt's tokens and the model's limit.
        """
        self.tokenizer.check_task(
            task,
            self._prompt_state_width(state_dim),
            self.config.max_token_len,
            prompt_format,
            conditioned,
            subtask_tokens,
        )

    def longest_prompt(
        self,
        task: str,
        state_dim: int,
        prompt_format: PromptFormat | None = None,
        conditioned: bool = False,
    ) -> int:
        """Tokens of ``task``'s prompt with the longest state text a ``state_dim``-value robot
        state can make (`Pi05Tokenizer.longest_prompt`): what any frame's prompt can take."""
        return self.tokenizer.longest_prompt(
            task, self._prompt_state_width(state_dim), prompt_format, conditioned
        )

    def _prompt_state_width(self, state_dim: int) -> int | None:
        """How many values a ``state_dim``-value robot state puts in the prompt (None: none)."""
        in_prompt = self.prompt_state(np.zeros(state_dim))
        return None if in_prompt is None else len(in_prompt)

    def encode(
        self,
        images: Mapping[str, np.ndarray],
        state: np.ndarray,
        prompt: str,
        frame_prompt: FramePrompt | None = None,
    ) -> PrefixInputs:
        """One observation as a batch of one (`encode_batch`): images by slot name, raw state,
        task text; ``frame_prompt``: the prompt ids to use instead of openpi's action prompt."""
        self.present_slots(images)  # the images are checked before the state
        if frame_prompt is None:
            frame_prompt = self.frame_prompt(state, prompt)
        return self.encode_batch([(images, frame_prompt)])

    def encode_batch(
        self, frames: Sequence[tuple[Mapping[str, np.ndarray], FramePrompt]]
    ) -> PrefixInputs:
        """Observations -> one batch of model inputs: per frame its images by slot name (RGB
        uint8, any size; a missing slot is masked) and its prompt ids (`frame_prompt`), prompts
        right-padded to the longest (padding masked, so each row's prefix is its own).

        Raises:
            ValueError: no frame, or a frame's image names (see `present_slots`).
        """
        if not frames:
            raise ValueError("encode_batch needs at least one frame")
        size = self.config.vision.image_size
        batch, slots = len(frames), len(self.image_slots)
        pixels = np.zeros((batch, slots, 3, size, size), dtype=np.float32)
        present = np.zeros((batch, slots), dtype=bool)
        longest = max(len(prompt.ids) for _, prompt in frames)
        tokens = np.zeros((batch, longest), dtype=np.int64)
        token_masks = np.zeros((batch, longest), dtype=bool)
        causal = np.zeros((batch, longest), dtype=bool)
        columns = []
        for row, (images, prompt) in enumerate(frames):
            filled = self.slot_images(images)
            for slot, image in filled:
                pixels[row, slot] = self.model_image(image)
                present[row, slot] = True
            columns.append(len(filled) * self.config.image_tokens)
            tokens[row, : len(prompt.ids)] = prompt.ids
            token_masks[row, : len(prompt.ids)] = True
            causal[row, : len(prompt.ids)] = prompt.causal_mask()
        device = self.device
        any_causal = any(prompt.causal_from is not None for _, prompt in frames)
        return PrefixInputs(
            images=torch.from_numpy(pixels).to(device),
            image_masks=torch.from_numpy(present).to(device),
            tokens=torch.from_numpy(tokens).to(device),
            token_masks=torch.from_numpy(token_masks).to(device),
            token_causal=torch.from_numpy(causal).to(device) if any_causal else None,
            image_columns=tuple(columns),
        )

    def decode_batch(
        self, model_actions: Tensor | np.ndarray, states: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """Model-space chunks [B, horizon, model action_dim] -> each robot's actions in robot
        units (`robot_actions` of row i against ``states[i]``), one copy off the device.

        Raises:
            ValueError: a batch whose size is not ``len(states)``, or a row `robot_actions`
                refuses.
        """
        if isinstance(model_actions, Tensor):
            model_actions = model_actions.detach().float().cpu().numpy()
        if len(model_actions) != len(states):
            raise ValueError(f"{len(model_actions)} action chunks for {len(states)} states")
        rows = zip(model_actions, states, strict=True)
        return [self.robot_actions(chunk, state) for chunk, state in rows]

    def robot_actions(self, model_actions: Tensor | np.ndarray, state: np.ndarray) -> np.ndarray:
        """Model-space chunk [horizon, model action_dim] -> robot units float32
        [horizon, action_dim].

        ``state`` is the raw robot state of the observation the chunk was computed from (the
        robot's delta dims are made absolute against it, as openpi's AbsoluteActions does).

        Raises:
            ValueError: a chunk of the wrong shape, or a state the robot cannot use.
        """
        if isinstance(model_actions, Tensor):
            model_actions = model_actions.detach().float().cpu().numpy()
        chunk = np.asarray(model_actions, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[1] != self.config.action_dim:
            raise ValueError(
                f"model actions must be [horizon, {self.config.action_dim}], got {chunk.shape}"
            )
        unnormalized = self.action_stats.unnormalize(chunk[:, : self.action_dim])
        # openpi adds Unnormalize(Normalize(input-transformed state)): that is the transformed state
        # itself.
        return self.robot.actions_from_pi(unnormalized, self.robot.state_to_pi(state)).astype(
            np.float32
        )

    def model_actions(self, robot_actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Exact inverse of :meth:`robot_actions` on the robot dims: robot units
        [horizon, action_dim] -> float32 [horizon, model action_dim], zero beyond the robot dims.

        Raises:
            ValueError: a chunk of the wrong shape, or a state the robot cannot use.
        """
        chunk = np.asarray(robot_actions, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[1] != self.action_dim:
            raise ValueError(
                f"robot actions must be [horizon, {self.action_dim}], got {chunk.shape}"
            )
        unnormalized = self.robot.actions_to_pi(chunk, self.robot.state_to_pi(state))
        normalized = self.action_stats.normalize(unnormalized)
        return pad_to_dim(normalized, self.config.action_dim).astype(np.float32)


def load_policy(
    checkpoint_dir,
    tokenizer_path=None,
    device: str = "cpu",
    dtype: str = "float32",
    action_dim: int | None = None,
    robot: RobotAdapter | str = "generic",
    lerobot_version: str = "auto",
) -> Pi05Policy:
    """Load a checkpoint (openpi layout or a LeRobot pi05 folder) and its tokenizer into a ready
    policy for ``robot``.

    ``tokenizer_path`` (a sentencepiece ``.model`` file, or a Hugging Face tokenizer folder holding
    ``tokenizer.model``, such as ``google/paligemma-3b-pt-224``) defaults to the checkpoint's own
    ``tokenizer.model`` (tiny/small presets ship one); real pi0.5 weights need PaliGemma's given
    explicitly. The robot's trained horizon decides the model's when no config file does
    (`checkpoints.openpi.resolve_config`); its openpi asset id picks the norm stats among several.

    Raises:
        DeviceUnavailable (a ValueError): ``device`` is one this torch cannot use (the message
            names torch's version, whether CUDA is available, and the fix).
    """
    resolve_device(device)  # a clear error before torch's bare one from deep inside the load
    robot = robot_adapter(robot) if isinstance(robot, str) else robot
    loaded = load_checkpoint(
        checkpoint_dir,
        device=device,
        dtype=dtype,
        robot_horizon=robot.action_horizon,
        preferred_asset_id=robot.asset_id,
        lerobot_version=lerobot_version,
    )
    path = tokenizer_path or loaded.tokenizer_path
    if path is None:
        raise FileNotFoundError(
            f"checkpoint {checkpoint_dir} ships no tokenizer.model: pass the PaliGemma "
            "sentencepiece model (or the Hugging Face paligemma tokenizer folder holding it)"
        )
    policy = Pi05Policy(
        loaded.model,
        Pi05Tokenizer(path),
        loaded.norm_stats,
        action_dim,
        robot,
        loaded.conventions,
        loaded.lerobot,
    )
    policy.format_reason = loaded.format_reason
    policy.rtc_training_max_delay = declared_rtc_training_max_delay(
        checkpoint_dir, loaded.config.action_horizon
    )
    return policy
