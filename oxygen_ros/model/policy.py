"""pi0.5 policy I/O: robot observation -> model inputs, model actions -> robot actions.

This is openpi's inference transform chain for pi0.5, in order: resize_with_pad to 224 and scale
to [-1, 1]; the robot's state transform (:mod:`.robots`); quantile-normalise the state; tokenize
the prompt in the checkpoint's prompt format (:mod:`.prompts`; openpi's by default, with the state
bins or, for robots trained without the state in the prompt, the task alone); and on the way out
take the robot's action dimensions, quantile-unnormalise them and apply the robot's output
transform (delta -> absolute, flips, gripper encoding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from .config import IMAGE_SLOTS
from .device import resolve_device
from .pi05 import Pi05Model
from .preprocess import NormStats, pad_to_dim, resize_with_pad, to_model_range
from .prompts import FramePrompt, PromptFormat, SubtaskText
from .robots import RobotAdapter, robot_adapter
from .tokenizer import Pi05Tokenizer


@dataclasses.dataclass
class PrefixInputs:
    """Model-ready tensors of one observation (batch of one)."""

    images: Tensor  # [1, slots, 3, 224, 224] in [-1, 1]
    image_masks: Tensor  # [1, slots] bool
    tokens: Tensor  # [1, T] int64
    token_masks: Tensor  # [1, T] bool
    token_causal: Tensor | None = None  # [1, T] bool: causal prompt tokens (None: bidirectional)


class Pi05Policy:
    """A loaded model plus everything needed to feed it robot data.

    ``robot`` is the adapter (or its registered name) whose input and output transforms wrap the
    model; its fixed action width, if any, is the default ``action_dim``.

    Raises:
        ValueError: a tokenizer larger than the model's vocabulary, an unknown robot, or an
            ``action_dim`` the model or the robot cannot serve.
    """

    def __init__(
        self,
        model: Pi05Model,
        tokenizer: Pi05Tokenizer,
        norm_stats: Mapping[str, NormStats],
        action_dim: int | None = None,
        robot: RobotAdapter | str = "generic",
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
        self.robot = robot_adapter(robot) if isinstance(robot, str) else robot
        fixed = self.robot.action_dim
        if action_dim and fixed and action_dim != fixed:
            raise ValueError(
                f"robot {self.robot.name} has {fixed} action dims, asked for {action_dim}"
            )
        self.action_dim = action_dim or fixed or self.action_stats.dim  # the robot's action width
        if self.action_dim > model.config.action_dim:
            raise ValueError(
                f"robot action_dim {self.action_dim} exceeds the model's {model.config.action_dim}"
            )

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @staticmethod
    def present_slots(images: Mapping[str, np.ndarray]) -> tuple[int, ...]:
        """Indices (into IMAGE_SLOTS) of the slots an observation fills; checks the slot names."""
        unknown = set(images) - set(IMAGE_SLOTS)
        if unknown:
            raise ValueError(
                f"unknown image slots {sorted(unknown)}; expected some of {IMAGE_SLOTS}"
            )
        present = tuple(i for i, slot in enumerate(IMAGE_SLOTS) if slot in images)
        if not present:
            raise ValueError("observation has no camera image: at least one image slot is required")
        return present

    def prompt_state(self, state: np.ndarray) -> np.ndarray | None:
        """The state as the prompt carries it: the robot's state transform and quantile
        normalisation; None for robots trained without the state in the prompt
        (``discrete_state_input`` false), whose state is still checked.

        Raises:
            ValueError: a state of the wrong width or with non-finite values.
        """
        pi_state = self.robot.state_to_pi(state)
        if not self.robot.discrete_state_input:
            return None
        return self.state_stats.normalize_quantile(pi_state)

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
    ) -> None:
        """Refuse a task whose prompt would not fit ``max_token_len`` with a ``state_dim``-value
        state (the worst case: `Pi05Tokenizer.check_task`) in ``prompt_format`` (None: openpi's;
        ``conditioned``: its subtask-conditioned prompt), before it is ever used.

        Raises:
            PromptTooLong: naming the prompt's tokens and the model's limit.
        """
        in_prompt = self.prompt_state(np.zeros(state_dim))  # the width the prompt really gets
        width = None if in_prompt is None else len(in_prompt)
        self.tokenizer.check_task(
            task, width, self.config.max_token_len, prompt_format, conditioned
        )

    def encode(
        self,
        images: Mapping[str, np.ndarray],
        state: np.ndarray,
        prompt: str,
        frame_prompt: FramePrompt | None = None,
    ) -> PrefixInputs:
        """Images by slot name (RGB uint8, any size; missing slot = masked), raw state, task
        text; ``frame_prompt``: the prompt ids to use instead of openpi's action prompt."""
        present_idx = self.present_slots(images)
        size = self.config.vision.image_size
        pixels = np.zeros((len(IMAGE_SLOTS), 3, size, size), dtype=np.float32)
        present = np.zeros(len(IMAGE_SLOTS), dtype=bool)
        for i in present_idx:
            pixels[i] = to_model_range(resize_with_pad(images[IMAGE_SLOTS[i]], size, size))
            present[i] = True
        if frame_prompt is None:
            frame_prompt = self.frame_prompt(state, prompt)
        device = self.device
        tokens = torch.tensor(frame_prompt.ids, dtype=torch.int64)[None].to(device)
        causal = None
        if frame_prompt.causal_from is not None:
            causal = torch.from_numpy(frame_prompt.causal_mask())[None].to(device)
        return PrefixInputs(
            images=torch.from_numpy(pixels)[None].to(device),
            image_masks=torch.from_numpy(present)[None].to(device),
            tokens=tokens,
            token_masks=torch.ones_like(tokens, dtype=torch.bool),
            token_causal=causal,
        )

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
        unnormalized = self.action_stats.unnormalize_quantile(chunk[:, : self.action_dim])
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
        normalized = self.action_stats.normalize_quantile(unnormalized)
        return pad_to_dim(normalized, self.config.action_dim).astype(np.float32)


def load_policy(
    checkpoint_dir,
    tokenizer_path=None,
    device: str = "cpu",
    dtype: str = "float32",
    action_dim: int | None = None,
    robot: RobotAdapter | str = "generic",
) -> Pi05Policy:
    """Load an openpi-layout checkpoint and its tokenizer into a ready policy for ``robot``.

    ``tokenizer_path`` defaults to the checkpoint's own ``tokenizer.model`` (tiny/small presets ship
    one); real pi0.5 weights need PaliGemma's sentencepiece model given explicitly. The robot's
    trained horizon decides the model's when no config file does (`checkpoint.resolve_config`).

    Raises:
        DeviceUnavailable (a ValueError): ``device`` is one this torch cannot use (the message
            names torch's version, whether CUDA is available, and the fix).
    """
    from .checkpoint import load_checkpoint  # local import: checkpoint pulls in safetensors

    resolve_device(device)  # a clear error before torch's bare one from deep inside the load
    robot = robot_adapter(robot) if isinstance(robot, str) else robot
    loaded = load_checkpoint(
        checkpoint_dir, device=device, dtype=dtype, robot_horizon=robot.action_horizon
    )
    path = tokenizer_path or loaded.tokenizer_path
    if path is None:
        raise FileNotFoundError(
            f"checkpoint {checkpoint_dir} ships no tokenizer.model: pass the PaliGemma "
            "sentencepiece model path"
        )
    return Pi05Policy(loaded.model, Pi05Tokenizer(path), loaded.norm_stats, action_dim, robot)
