"""Grounding questions (`oxygen_ros.sim.questions`) as text-only training batches, and the probe.

Two layouts (a question's ``layout``):

* ``vqa``, as pi0.5's vision-language data (PaliGemma's prefix-LM): the images, bos and the
  question bidirectional, then the answer and an eos, causal and supervised. The image tokens read
  the question, so they learn to pick out the cube it names;
* ``ask``, as the node lays out an Ask request: the images and the frame's flat action prompt (the
  scene's task, the state's bins), then the ``answer`` kind's cue with the question
  (``"\\nQuestion: ...\\nAnswer: "``), then the answer; the prefix cannot read the question, so
  this is for questions about the task itself ("which cube are you going for?");
* ``subtask_prompt``, as the node asks for its subtask (`.batches.prompt_layout`, the same tokens
  the demonstrations' subtask-conditioned prompts hold): the frame's action prompt with the sim's
  subtask generated inside it, supervised. Asked of every scene, it teaches the subtask on as many
  layouts and poses as the questions, not only the demonstrations'.

No example carries an action loss: these batches train the backbone (and the vision tower) alone,
as pi0.5's vision-language co-training does.

The probe asks held-out scenes' questions teacher-forced and counts a question right when every
answer token (and the eos) is the argmax: exactly what greedy decoding would say; it reports each
kind over all scenes and split by pose: ``start/<kind>`` at the layouts' start pose,
``along/<kind>`` at the moments the arm has moved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.objectives import ObjectiveBatch, backbone_pass
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.policy_io.preprocess_torch import lerobot_resize_with_pad
from oxygen_ros.policy_io.prompts import PromptFormat
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.sim.questions import (
    ASK,
    KIND_WEIGHTS,
    QUESTION_KINDS,
    SUBTASK_PROMPT,
    VQA,
    GroundingScenes,
    Question,
    curriculum_questions,
    draw_question,
    scene_questions,
)

from .batches import BatchError, TextLayout, collate, prompt_layout

if TYPE_CHECKING:
    from oxygen_ros.policy_io.policy import Pi05Policy

ANSWER_KIND = "answer"
VQA_PROMPT = "{question}\n"  # PaliGemma's VQA prefix: the question, then a newline
SCENE_CAMERAS = {"scene": "scene", "wrist": "wrist"}  # dataset camera key suffix -> scene field


class GroundingBatchMaker:
    """Text-only batches of grounding questions for one model and prompt format.

    normalize_state: the prompt's state normalisation (the dataset's, as the policy's).
    cameras: the model's image slots in order, as dataset keys (``observation.images.scene``).

    Raises:
        BatchError: a format without an ``answer`` kind, or a camera the scenes do not render.
    """

    def __init__(
        self,
        scenes: GroundingScenes,
        config: Pi05Config,
        tokenizer: Pi05Tokenizer,
        prompt_format: PromptFormat,
        normalize_state: Callable[[np.ndarray], np.ndarray],
        cameras: Sequence[str],
        border: float = -1.0,
        weights: dict[str, float] = KIND_WEIGHTS,
    ) -> None:
        if ANSWER_KIND not in prompt_format.kinds:
            raise BatchError(f"prompt format {prompt_format.name!r} has no {ANSWER_KIND!r} kind")
        self.fields = []
        for key in cameras:
            name = key.rsplit(".", 1)[-1]
            if name not in SCENE_CAMERAS:
                raise BatchError(
                    f"camera {key!r}: grounding scenes render {sorted(SCENE_CAMERAS)} only"
                )
            self.fields.append(SCENE_CAMERAS[name])
        self.scenes = scenes
        self.config = config
        self.tokenizer = tokenizer
        self.format = prompt_format
        self.weights = weights  # how often each question kind is drawn (`draw_question`)
        self.states = np.stack([normalize_state(s) for s in scenes.state]).astype(np.float32)
        self.border = border
        self._questions = [scene_questions(scenes, row) for row in range(len(scenes))]

    @classmethod
    def for_policy(
        cls, policy: Pi05Policy, scenes: GroundingScenes, prompt_format: PromptFormat
    ) -> GroundingBatchMaker:
        """Questions on ``scenes`` as a loaded checkpoint sees them: its tokenizer, state
        normalisation, camera slots and image border."""
        return cls(
            scenes,
            policy.config,
            policy.tokenizer,
            prompt_format,
            policy.prompt_state,
            policy.image_slots,
            policy.conventions.border,
        )

    def questions(self, row: int) -> list[Question]:
        return self._questions[row]

    def layout(self, row: int, question: Question) -> TextLayout:
        """``question`` about scene ``row`` and its answer (supervised), in the question's
        layout: :data:`VQA`, :data:`ASK` or :data:`SUBTASK_PROMPT`.

        Raises:
            BatchError: an unknown layout.
        """
        if question.layout == VQA:
            return self.vqa_layout(question)
        if question.layout == ASK:
            return self.ask_layout(row, question)
        if question.layout == SUBTASK_PROMPT:
            return self.frame_prompt(row, question.answer)
        raise BatchError(f"question {question.kind!r}: unknown layout {question.layout!r}")

    def frame_prompt(self, row: int, subtask: str | None = None) -> TextLayout:
        """Scene ``row``'s action prompt, conditioned on ``subtask`` (supervised) when given."""
        return prompt_layout(
            self.tokenizer,
            self.format,
            self.scenes.tasks[row],
            self.states[row],
            self.config.max_token_len,
            subtask,
        )

    def vqa_layout(self, question: Question) -> TextLayout:
        """PaliGemma's prefix-LM layout, as pi0.5's vision-language data: bos and the question
        bidirectional with the images, then the answer and an eos, causal and supervised."""
        tok = self.tokenizer
        prefix = [tok.bos_id] + tok.encode_text(VQA_PROMPT.format(question=question.text))
        answer = tok.encode_text(question.answer) + [tok.eos_id]
        return TextLayout(
            ids=prefix + answer,
            causal=[False] * len(prefix) + [True] * len(answer),
            supervised=[False] * len(prefix) + [True] * len(answer),
            action_reads=[True] * len(prefix) + [False] * len(answer),
        )

    def ask_layout(self, row: int, question: Question) -> TextLayout:
        """Scene ``row``'s flat action prompt, then the ``answer`` kind's cue with ``question``,
        then its answer (supervised)."""
        tok = self.tokenizer
        prompt = self.frame_prompt(row)
        cue = self.format.kind_ids(tok, ANSWER_KIND, text=question.text)
        answer = tok.encode_text(question.answer) + [tok.eos_id]
        return TextLayout(
            ids=prompt.ids + cue + answer,
            causal=prompt.causal + [True] * (len(cue) + len(answer)),
            supervised=prompt.supervised + [False] * len(cue) + [True] * len(answer),
            action_reads=prompt.action_reads + [False] * (len(cue) + len(answer)),
        )

    def images(self, rows: np.ndarray) -> torch.Tensor:
        size = self.config.vision.image_size
        per_camera = [
            lerobot_resize_with_pad(
                torch.from_numpy(getattr(self.scenes, field)[rows]), size, size, self.border
            )
            for field in self.fields
        ]
        return torch.stack(per_camera, dim=1)

    def examples(self, rows: Sequence[int], questions: Sequence[Question]) -> ObjectiveBatch:
        """The batch asking scene ``rows[i]`` the question ``questions[i]``."""
        rows = np.asarray(rows, dtype=np.int64)
        layouts = [self.layout(int(r), q) for r, q in zip(rows, questions, strict=True)]
        actions = torch.zeros(len(rows), self.config.action_horizon, self.config.action_dim)
        return collate(layouts, self.images(rows), actions)

    def draw(
        self, size: int, rng: np.random.Generator, one_colour: bool = False
    ) -> tuple[np.ndarray, list[Question]]:
        """``size`` scene rows drawn uniformly and one question about each (`draw_question`:
        kinds by ``weights``; the warm-up's only, with ``one_colour``: `curriculum_questions`)."""
        rows = rng.integers(0, len(self.scenes), size=size)
        chosen = [
            draw_question(
                curriculum_questions(self._questions[int(row)], one_colour), rng, self.weights
            )
            for row in rows
        ]
        return rows, chosen

    def batch(
        self, size: int, rng: np.random.Generator, one_colour: bool = False
    ) -> ObjectiveBatch:
        """A batch of :meth:`draw`'s questions."""
        return self.examples(*self.draw(size, rng, one_colour))


@torch.no_grad()
def answers_right(model: Pi05Model, batch: ObjectiveBatch) -> np.ndarray:
    """bool [B]: every supervised token of each example is the model's argmax."""
    out, _ = backbone_pass(model, batch)
    hidden = out.hidden[0][:, -batch.tokens.shape[1] :]
    predicted = model.logits(hidden).argmax(-1)
    right = (predicted == batch.text_targets) | ~batch.text_loss_mask
    return right.all(dim=1).cpu().numpy()


def probe(
    model: Pi05Model, maker: GroundingBatchMaker, max_scenes: int | None = None, chunk: int = 64
) -> dict[str, float]:
    """Held-out accuracy per question kind (and ``all``) over the first ``max_scenes`` scenes of
    ``maker``, every question of each scene asked; with scenes of both pose groups, also per
    kind within each (``start/where``, ``along/where``, ...)."""
    was_training = model.training
    model.eval()
    rows, questions = [], []
    for row in range(min(len(maker.scenes), max_scenes or len(maker.scenes))):
        for question in maker.questions(row):
            rows.append(row)
            questions.append(question)
    right = np.concatenate(
        [
            answers_right(model, maker.examples(rows[i : i + chunk], questions[i : i + chunk]))
            for i in range(0, len(rows), chunk)
        ]
    )
    model.train(was_training)
    kinds = np.array([q.kind for q in questions])
    result = _accuracy_by_kind(right, kinds, "")
    result["all"] = float(right.mean())
    views = maker.scenes.views
    if all(views):  # scenes that say how the arm got there
        at_start = maker.scenes.starts()[np.asarray(rows)]
        if at_start.any() and not at_start.all():
            result.update(_accuracy_by_kind(right[at_start], kinds[at_start], "start/"))
            result.update(_accuracy_by_kind(right[~at_start], kinds[~at_start], "along/"))
    return result


def _accuracy_by_kind(right: np.ndarray, kinds: np.ndarray, prefix: str) -> dict[str, float]:
    return {
        prefix + kind: float(right[kinds == kind].mean())
        for kind in QUESTION_KINDS
        if (kinds == kind).any()
    }
