"""Grounding questions: what a scene rendered from the sim shows, asked and answered in words.

pi0.5 co-trains its backbone on vision-language data (captions, VQA, detection) besides robot
demonstrations; a policy trained from scratch here has no such data, and measured without it, it
never binds the task's colour word to the right cube in its images. This module holds the scenes
(:class:`GroundingScenes`, rendered by :mod:`.grounding`) and the questions whose answers their
labels give (:func:`scene_questions`). One of them names every cube's place in one answer ("red far
left, green near centre, blue near right"): it makes the model tell the cubes apart by colour.

Pure Python and numpy (no physics, no ROS): training reads it without the simulator.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from .language import PLACES, SceneFacts, current_phase, every_phase, place_words
from .scene import CUBE_COLORS, PAD_COLORS, PAD_HALF
from .tasks import PLACE, TOUCH, Task, parse_task

NO_CUBE = -1

# question kinds (:func:`scene_questions`)
WHERE = "where"  # where is the <colour> cube? -> its place words
WHERE_PAD = "where_pad"  # where is the <colour> pad? -> its place words
ALL_CUBES = "all_cubes"  # where are the cubes? -> every cube's place, in colour order
WHICH_AT = "which_at"  # which cube is <place>? -> the cube, or none
HELD = "held"  # which cube does the gripper hold? -> the cube, or none
NEAREST = "nearest"  # which cube is nearest the gripper? -> the cube
ON_PAD = "on_pad"  # is the <colour> cube on a pad? -> yes, the <pad> pad / no
TARGET = "target"  # which cube are you going for? -> the task's cube
SUBTASK = "subtask"  # the node's subtask request on the frame -> the sim's subtask there
QUESTION_KINDS = (WHERE, WHERE_PAD, ALL_CUBES, WHICH_AT, HELD, NEAREST, ON_PAD, TARGET, SUBTASK)
TARGET_QUESTION = "which cube are you going for?"  # what the closed-loop bench's Ask asks
# how a question is laid out for the model (`oxygen_ros.training.grounding`): VQA as pi0.5's
# vision-language data (the question in the bidirectional prefix with the images: the image
# tokens can read the colour asked about), ASK as the node's Ask request (after the frame's
# prompt, which the question cannot change: for questions about the task itself), SUBTASK_PROMPT
# as the node asks for its subtask (the frame's action prompt, its subtask generated inside it)
VQA, ASK, SUBTASK_PROMPT = "vqa", "ask", "subtask_prompt"
START = "start"  # the view of a scene at its layout's start pose (`.grounding` names the others)
# how often each kind is asked in training: binding a colour word to its cube (where, all_cubes)
# is what a policy needs and what is slow to learn, so it gets most of the questions; where a pad
# is, the carry's destination, is one colour among two and quicker
KIND_WEIGHTS = {
    WHERE: 0.35,
    WHERE_PAD: 0.05,
    ALL_CUBES: 0.25,
    SUBTASK: 0.15,
    WHICH_AT: 0.06,
    TARGET: 0.04,
    NEAREST: 0.04,
    HELD: 0.03,
    ON_PAD: 0.03,
}


@dataclasses.dataclass
class GroundingScenes:
    """Rendered scenes, one row each (N rows).

    scene, wrist: uint8 [N, px, px, 3]; state: float32 [N, 6] (arm joints, gripper opening);
    cubes: float32 [N, 3, 3] centres in :data:`CUBE_COLORS` order; pads: float32 [N, 2, 2];
    tip: float32 [N, 3]; grasped: int64 [N], the held cube's index or :data:`NO_CUBE`;
    seeds: int64 [N] the layout's seed; tasks: the task whose episode the pose comes from;
    subtasks: the sim's subtask of that task there ("" unknown); views: how the arm got there
    (:data:`START`, or a view of `.grounding`; "" unknown). Files written before the last two
    existed load with them "".
    """

    scene: np.ndarray
    wrist: np.ndarray
    state: np.ndarray
    cubes: np.ndarray
    pads: np.ndarray
    tip: np.ndarray
    grasped: np.ndarray
    seeds: np.ndarray
    tasks: list[str]
    subtasks: list[str]
    views: list[str]

    def __len__(self) -> int:
        return len(self.seeds)

    def starts(self) -> np.ndarray:
        """bool [N]: the rows seen at their layout's start pose."""
        return np.array([v == START for v in self.views], dtype=bool)

    def save(self, path: Path | str) -> None:
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _TEXT_FIELDS:
            arrays[name] = np.array(arrays[name])
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: Path | str) -> GroundingScenes:
        with np.load(path) as data:
            fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data.files}
        for name in _TEXT_FIELDS:
            fields[name] = (
                [str(t) for t in fields[name]] if name in fields else [""] * len(fields["seeds"])
            )
        scenes = cls(**fields)
        scenes.subtasks = [_with_pad_place(scenes, row) for row in range(len(scenes))]
        return scenes

    @classmethod
    def concatenate(cls, parts: list[GroundingScenes]) -> GroundingScenes:
        fields = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(cls)
            if f.name not in _TEXT_FIELDS
        }
        texts = {name: [t for p in parts for t in getattr(p, name)] for name in _TEXT_FIELDS}
        return cls(**fields, **texts)


_TEXT_FIELDS = ("tasks", "subtasks", "views")  # one string per row


def _with_pad_place(scenes: GroundingScenes, row: int) -> str:
    """Row ``row``'s subtask as the sim says it now: a carry rendered before the carry named
    where its pad is (the sim's carry wording without ``pad_place``) gets the pad's place."""
    subtask = scenes.subtasks[row]
    if not subtask or not scenes.tasks[row]:
        return subtask
    for step in parse_task(scenes.tasks[row]).steps:
        if step.kind != PLACE:
            continue
        unplaced = SceneFacts(False, step.cube, 0.0, math.inf, False)
        if subtask == current_phase(step, unplaced).subtask:
            place = pad_place(scenes, row, PAD_COLORS.index(step.pad))
            return current_phase(step, dataclasses.replace(unplaced, pad_place=place)).subtask
    return subtask


# ----------------------------------------------------------------------------------------------
# Questions and answers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    subject: str = ""  # the colour or place asked about
    layout: str = "vqa"  # VQA: the question with the images; ASK: after the frame, as Ask is


def cube_place(scenes: GroundingScenes, row: int, cube: int) -> str:
    x, y = scenes.cubes[row, cube, :2]
    return place_words(float(x), float(y))


def pad_place(scenes: GroundingScenes, row: int, pad: int) -> str:
    x, y = scenes.pads[row, pad]
    return place_words(float(x), float(y))


def _on_pad(scenes: GroundingScenes, row: int, cube: int) -> str:
    """The pad a cube lies on (centre within its edges, low on the table), else ""."""
    x, y, z = scenes.cubes[row, cube]
    if scenes.grasped[row] == cube or z > 0.04:
        return ""
    for p, pad in enumerate(PAD_COLORS):
        if (
            abs(x - scenes.pads[row, p, 0]) <= PAD_HALF
            and abs(y - scenes.pads[row, p, 1]) <= PAD_HALF
        ):
            return pad
    return ""


def scene_questions(scenes: GroundingScenes, row: int) -> list[Question]:
    """Every question of scene ``row`` with its answer (ambiguous ones left out)."""
    places = [cube_place(scenes, row, k) for k in range(len(CUBE_COLORS))]
    scene_task = parse_task(scenes.tasks[row]) if scenes.tasks[row] else None
    questions = [
        Question(WHERE, f"where is the {c} cube?", places[k], c) for k, c in enumerate(CUBE_COLORS)
    ]
    questions += [
        Question(WHERE_PAD, f"where is the {p} pad?", pad_place(scenes, row, k), p)
        for k, p in enumerate(PAD_COLORS)
    ]
    listing = ", ".join(f"{c} {places[k]}" for k, c in enumerate(CUBE_COLORS))
    questions.append(Question(ALL_CUBES, "where are the cubes?", listing))
    for place in PLACES:
        there = [c for k, c in enumerate(CUBE_COLORS) if places[k] == place]
        if len(there) <= 1:
            answer = f"the {there[0]} cube" if there else "none"
            questions.append(Question(WHICH_AT, f"which cube is {place}?", answer, place))
    held = int(scenes.grasped[row])
    answer = "none" if held == NO_CUBE else f"the {CUBE_COLORS[held]} cube"
    questions.append(Question(HELD, "which cube does the gripper hold?", answer))
    distances = np.linalg.norm(scenes.cubes[row] - scenes.tip[row], axis=1)
    nearest = np.sort(distances)
    if nearest[1] - nearest[0] > 0.02:  # a clear nearest cube only
        answer = f"the {CUBE_COLORS[int(np.argmin(distances))]} cube"
        questions.append(Question(NEAREST, "which cube is nearest the gripper?", answer))
    for k, c in enumerate(CUBE_COLORS):
        pad = _on_pad(scenes, row, k)
        answer = f"yes, the {pad} pad" if pad else "no"
        questions.append(Question(ON_PAD, f"is the {c} cube on a pad?", answer, c))
    if scene_task is not None:
        cube = scene_task.cube
        questions.append(Question(TARGET, TARGET_QUESTION, f"the {cube} cube", cube, layout=ASK))
    if scene_task is not None and scenes.subtasks[row]:
        subtask = scenes.subtasks[row]
        questions.append(Question(SUBTASK, "", subtask, scene_task.cube, layout=SUBTASK_PROMPT))
    return questions


def curriculum_questions(questions: list[Question], one_colour: bool) -> list[Question]:
    """The questions of the symmetry-breaking warm-up: with ``one_colour``, where the first
    colour's cube is, only (one cube to find, no colour to bind yet); else all of them."""
    if not one_colour:
        return questions
    return [q for q in questions if q.kind == WHERE and q.subject == CUBE_COLORS[0]]


def draw_question(
    questions: list[Question], rng: np.random.Generator, weights: dict[str, float] = KIND_WEIGHTS
) -> Question:
    """A kind drawn by ``weights`` among the kinds ``questions`` holds, then one of its
    questions uniformly."""
    kinds = sorted({q.kind for q in questions})
    p = np.array([weights.get(k, 0.0) for k in kinds])
    if p.sum() <= 0:
        p = np.ones(len(kinds))
    kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
    pool = [q for q in questions if q.kind == kind]
    return pool[int(rng.integers(len(pool)))]


def question_sentences() -> list[str]:
    """Every question and answer wording (for a tokenizer's corpus)."""
    sentences = [f"where is the {c} cube?" for c in CUBE_COLORS]
    sentences += [f"where is the {p} pad?" for p in PAD_COLORS]
    sentences += ["where are the cubes?", "which cube does the gripper hold?", "none", "no"]
    sentences += ["which cube is nearest the gripper?", TARGET_QUESTION]
    sentences += [f"which cube is {p}?" for p in PLACES] + list(PLACES)
    sentences += [f"is the {c} cube on a pad?" for c in CUBE_COLORS]
    sentences += [f"yes, the {p} pad" for p in PAD_COLORS]
    sentences += [", ".join(f"{c} {p}" for c in CUBE_COLORS) for p in PLACES]
    return sentences + task_sentences()


def task_sentences() -> list[str]:
    """Every task and every subtask the sim says for it, so that the subtask question's answers
    tokenise whatever the demonstrations hold."""
    tasks = [Task(TOUCH, c) for c in CUBE_COLORS]
    tasks += [Task(PLACE, c, p) for c in CUBE_COLORS for p in PAD_COLORS]
    subtasks = {phase.subtask for task in tasks for phase in every_phase(task)}
    return sorted(subtasks | {task.text for task in tasks})
