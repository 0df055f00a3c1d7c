"""Dataset frames -> model-space training batches (`model.objectives.ObjectiveBatch`).

Each example is one frame, drawn uniformly from the dataset:

* **images**: every camera through the inference path of the checkpoint that training writes
  (LeRobot main's: float bilinear resize with padding, borders -1, scale to [-1, 1];
  `policy_io.preprocess_torch.lerobot_resize_with_pad`), then openpi's augmentation
  (:mod:`.augment`) when on;
* **prompt**: the task and the normalised state's bins in the prompt format. Asked for, the state
  shown is perturbed: Gaussian noise of ``state_noise`` (normalised units), or with probability
  ``state_dropout`` a uniformly random state. A policy that cannot read its next move off the
  state has to find it in the images (a policy trained from scratch otherwise learns to continue
  the motion its state shows and never where the named cube is). In a format with a
  subtask generated inside the prompt (``openpi_subtask``, ``opentau``, ``brunofang``) a frame with
  a subtask gets the subtask-conditioned prompt, its subtask tokens and their eos supervised (the
  text the subtask request generates), except a ``flat_fraction`` of them, which get the plain
  action prompt (what the node feeds with ``subtask_conditioning: none``);
* **narration**: where the format has a narration prompt and the frame a sentence, the kind's cue
  follows the frame's prompt, then the sentence and an eos, supervised and causal; the action
  expert does not read it (a narration request reads the frame, the frame does not read it);
* **actions**: the ``horizon`` commanded actions from the frame on, within its episode (the last
  one repeated past the episode's end, as a robot holds its last command), normalised with the
  dataset's quantiles and zero-padded to the model's action width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from oxygen_ros.checkpoints.conventions import InputConventions
from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.objectives import ObjectiveBatch
from oxygen_ros.policy_io.preprocess_torch import lerobot_resize_with_pad
from oxygen_ros.policy_io.prompts import EOS_PIECE, SUBTASK_IDS_PIECE, PromptFormat, SubtaskText
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer

from .augment import augment_images
from .dataset import TrainingFrames, frame_chunk
from .normalization import DatasetNorms

NARRATION_KIND = "narration"


class BatchError(ValueError):
    """Data, model and prompt format that do not fit together; the message says which field."""


@dataclasses.dataclass(frozen=True)
class TextLayout:
    """One example's token ids and what each is for."""

    ids: list[int]
    causal: list[bool]  # attends causally (openpi's ar=1)
    supervised: list[bool]  # a target of the text loss
    action_reads: list[bool]  # part of the frame's prompt (the action expert reads it)


def subtask_piece_follows_eos(fmt: PromptFormat) -> bool:
    """Whether the format's subtask-conditioned prompt puts an eos right after the subtask ids."""
    template = fmt.subtask_action or ()
    index = template.index(SUBTASK_IDS_PIECE) if SUBTASK_IDS_PIECE in template else -1
    return 0 <= index < len(template) - 1 and template[index + 1] == EOS_PIECE


def check_format(fmt: PromptFormat) -> None:
    """Refuse a format whose subtask training cannot supervise here.

    Raises:
        BatchError: a subtask format whose subtask is not generated inside the action prompt.
    """
    if fmt.has_subtask and not (
        fmt.same_frame_exact and fmt.subtask_action[fmt.causal_from] == SUBTASK_IDS_PIECE
    ):
        raise BatchError(
            f"prompt format {fmt.name!r}: training supervises a subtask generated inside the "
            "action prompt (its causal tail starting with the subtask ids: openpi_subtask, "
            "opentau, brunofang); this format re-prefills the subtask's text"
        )


def collate(
    layouts: Sequence[TextLayout], images: torch.Tensor, actions: torch.Tensor
) -> ObjectiveBatch:
    """One batch of ``layouts`` (right-padded to the longest), with their images [B, slots, 3, S,
    S] and normalised action chunks [B, horizon, action_dim]."""
    b, length = len(layouts), max(len(t.ids) for t in layouts)
    tokens = torch.zeros(b, length, dtype=torch.int64)
    masks = torch.zeros(b, length, dtype=torch.bool)
    causal = torch.zeros(b, length, dtype=torch.bool)
    reads = torch.zeros(b, length, dtype=torch.bool)
    supervised = torch.zeros(b, length, dtype=torch.bool)
    for row, layout in enumerate(layouts):
        n = len(layout.ids)
        tokens[row, :n] = torch.tensor(layout.ids)
        masks[row, :n] = True
        causal[row, :n] = torch.tensor(layout.causal)
        reads[row, :n] = torch.tensor(layout.action_reads)
        supervised[row, :n] = torch.tensor(layout.supervised)
    # position i predicts token i + 1
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    loss_mask = torch.zeros_like(supervised)
    loss_mask[:, :-1] = supervised[:, 1:]
    return ObjectiveBatch(
        images=images,
        image_masks=torch.ones(images.shape[:2], dtype=torch.bool),
        tokens=tokens,
        token_masks=masks,
        token_causal=causal,
        action_reads=reads,
        text_targets=targets,
        text_loss_mask=loss_mask,
        actions=actions,
    )


def prompt_layout(
    tokenizer: Pi05Tokenizer,
    fmt: PromptFormat,
    task: str,
    state: np.ndarray,
    max_len: int,
    subtask: str | None = None,
) -> TextLayout:
    """A frame's action prompt (``state`` normalised), conditioned on ``subtask`` when given: its
    ids and the eos after them supervised, as the node's subtask request generates them.

    Raises:
        BatchError: a format whose subtask ids are not where its causal tail starts.
    """
    conditioned = subtask is not None
    text = None
    if conditioned:
        words = " ".join(subtask.split())
        text = SubtaskText(tuple(tokenizer.encode_text(words)), words)
    prompt = tokenizer.frame_prompt(task, state, max_len, fmt, conditioned, text)
    ids = list(prompt.ids)
    supervised = [False] * len(ids)
    if text is not None:
        start, stop = prompt.shared, prompt.shared + len(text.ids)
        if tuple(ids[start:stop]) != text.ids:
            raise BatchError(
                f"prompt format {fmt.name!r}: the subtask ids are not where its causal tail starts"
            )
        stop += int(subtask_piece_follows_eos(fmt))
        supervised[start:stop] = [True] * (stop - start)
    return TextLayout(ids, prompt.causal_mask().tolist(), supervised, [True] * len(ids))


class BatchMaker:
    """Makes seeded training batches from a dataset for one model and prompt format.

    Raises:
        BatchError: a dataset wider than the model (action), a camera count other than the
            model's image slots, or a format `check_format` refuses.
    """

    def __init__(
        self,
        frames: TrainingFrames,
        norms: DatasetNorms,
        config: Pi05Config,
        tokenizer: Pi05Tokenizer,
        prompt_format: PromptFormat,
        conventions: InputConventions,
        augment: bool = True,
        flat_fraction: float = 0.25,
        narration: bool = True,
        state_noise: float = 0.0,
        state_dropout: float = 0.0,
        start_share: float = 0.0,
        start_frames: int = 5,
    ) -> None:
        check_format(prompt_format)
        if frames.actions.shape[1] > config.action_dim:
            raise BatchError(
                f"{frames.root}: 'action' has {frames.actions.shape[1]} dims, more than the "
                f"model's action_dim {config.action_dim} (preset {config.name!r})"
            )
        if len(frames.cameras) != config.num_image_slots:
            raise BatchError(
                f"{frames.root}: {len(frames.cameras)} cameras {list(frames.cameras)} but the "
                f"model has {config.num_image_slots} image slots"
            )
        if not 0.0 <= flat_fraction <= 1.0:
            raise BatchError(f"flat_fraction must be in [0, 1], got {flat_fraction}")
        if not (np.isfinite(state_noise) and state_noise >= 0.0):
            raise BatchError(f"state_noise must be >= 0, got {state_noise}")
        if not 0.0 <= state_dropout <= 1.0:
            raise BatchError(f"state_dropout must be in [0, 1], got {state_dropout}")
        if not 0.0 <= start_share <= 1.0 or start_frames < 1:
            raise BatchError(
                f"start_share must be in [0, 1] and start_frames >= 1, got {start_share}, "
                f"{start_frames}"
            )
        if tokenizer.vocab_size > config.vocab_size:
            raise BatchError(
                f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids, more than the "
                f"model's vocabulary {config.vocab_size}"
            )
        self.frames = frames
        self.norms = norms
        self.config = config
        self.tokenizer = tokenizer
        self.format = prompt_format
        self.conventions = conventions
        self.augment = augment
        self.flat_fraction = flat_fraction
        self.state_noise = float(state_noise)
        self.state_dropout = float(state_dropout)
        self.start_share = float(start_share)
        ends = np.unique(frames.episode_end)  # episodes are contiguous, in order
        episode_start = np.r_[0, ends][np.searchsorted(ends, frames.episode_end)]
        self.start_indices = np.flatnonzero(np.arange(len(frames)) - episode_start < start_frames)
        self.narration = narration and NARRATION_KIND in prompt_format.kinds
        self.normalized_states = norms.state.normalize(frames.states)

    # -- text ----------------------------------------------------------------------------------
    def text_layout(
        self, index: int, conditioned: bool, state: np.ndarray | None = None
    ) -> TextLayout:
        """The prompt (conditioned on the frame's subtask when ``conditioned``) and the narration
        of frame ``index``; ``state``: the normalised state to write in the prompt instead of the
        frame's."""
        frames, tok = self.frames, self.tokenizer
        layout = prompt_layout(
            tok,
            self.format,
            frames.tasks[index],
            self.normalized_states[index] if state is None else state,
            self.config.max_token_len,
            frames.subtasks[index] if conditioned else None,
        )
        ids, causal = list(layout.ids), list(layout.causal)
        supervised, action_reads = list(layout.supervised), list(layout.action_reads)
        sentence = frames.narrations[index]
        if self.narration and sentence:
            cue = self.format.kind_ids(tok, NARRATION_KIND)
            said = tok.encode_text(" ".join(sentence.split())) + [tok.eos_id]
            ids += cue + said
            causal += [True] * (len(cue) + len(said))
            supervised += [False] * len(cue) + [True] * len(said)
            action_reads += [False] * (len(cue) + len(said))
        return TextLayout(ids, causal, supervised, action_reads)

    def _conditioned(self, index: int, rng: np.random.Generator) -> bool:
        if not self.format.has_subtask or not self.frames.subtasks[index]:
            return False
        return bool(rng.random() >= self.flat_fraction)

    def _state(self, index: int, rng: np.random.Generator) -> np.ndarray | None:
        """The state the prompt shows (None: the frame's own): with probability ``state_dropout``
        one drawn uniformly over the normalised range, else the frame's with ``state_noise``."""
        if self.state_noise == 0.0 and self.state_dropout == 0.0:
            return None
        state = self.normalized_states[index]
        if self.state_dropout and rng.random() < self.state_dropout:
            return rng.uniform(-1.0, 1.0, state.shape).astype(state.dtype)
        return state + self.state_noise * rng.standard_normal(state.shape).astype(state.dtype)

    # -- images --------------------------------------------------------------------------------
    def model_images(
        self, indices: Sequence[int], generator: torch.Generator | None
    ) -> torch.Tensor:
        """Float32 [B, slots, 3, size, size] in [-1, 1]: resized as inference resizes, augmented
        from ``generator`` when augmentation is on."""
        size = self.config.vision.image_size
        border = self.conventions.border
        per_camera = [
            lerobot_resize_with_pad(
                torch.from_numpy(self.frames.images[key][indices]), size, size, border
            )
            for key in self.frames.cameras
        ]
        images = torch.stack(per_camera, dim=1)
        if self.augment and generator is not None:
            images = augment_images(images, self.frames.cameras, generator)
        return images

    # -- batches -------------------------------------------------------------------------------
    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """Frames drawn uniformly (with replacement), a ``start_share`` of them from the first
        ``start_frames`` of their episodes: where the arm has not moved yet, the images and the
        task alone say where to go."""
        uniform = rng.integers(0, len(self.frames), size=batch_size)
        if self.start_share == 0.0:
            return uniform
        from_start = self.start_indices[rng.integers(0, len(self.start_indices), size=batch_size)]
        return np.where(rng.random(batch_size) < self.start_share, from_start, uniform)

    def batch(
        self,
        indices: Sequence[int],
        rng: np.random.Generator,
        generator: torch.Generator | None = None,
    ) -> ObjectiveBatch:
        """The training batch of frames ``indices``: ``rng`` decides which prompts are
        conditioned, ``generator`` draws the augmentation (None: no augmentation)."""
        indices = np.asarray(indices, dtype=np.int64)
        layouts = [
            self.text_layout(int(i), self._conditioned(int(i), rng), self._state(int(i), rng))
            for i in indices
        ]
        actions = np.stack([self.action_chunk(int(i)) for i in indices])
        images = self.model_images(indices, generator)
        return collate(layouts, images, torch.from_numpy(actions))

    def action_chunk(self, index: int) -> np.ndarray:
        """Frame ``index``'s chunk as the model learns it: normalised, zero-padded to the
        model's action width [horizon, action_dim] float32."""
        raw = frame_chunk(self.frames, index, self.config.action_horizon, self.norms.relative_mask)
        padded = np.zeros((len(raw), self.config.action_dim), dtype=np.float32)
        padded[:, : raw.shape[1]] = self.norms.action.normalize(raw)
        return padded

    def prompt_lengths(self) -> tuple[int, int]:
        """The longest action prompt and the longest full example (prompt + narration), in
        tokens, over the first frame of every distinct (task, subtask, narration) of the dataset
        (with that frame's state)."""
        seen, longest_prompt, longest = set(), 0, 0
        for i in range(len(self.frames)):
            key = (self.frames.tasks[i], self.frames.subtasks[i], self.frames.narrations[i])
            if key in seen:
                continue
            seen.add(key)
            layout = self.text_layout(i, bool(self.format.has_subtask and key[1]))
            longest_prompt = max(longest_prompt, sum(layout.action_reads))
            longest = max(longest, len(layout.ids))
        return longest_prompt, longest
