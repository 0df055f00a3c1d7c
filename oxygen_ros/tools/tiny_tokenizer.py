"""A tiny PaliGemma-like sentencepiece tokenizer for the ``tiny``/``small`` presets.

Random-weight checkpoints, the demo and the tests need a real sentencepiece model of the preset's
vocabulary size; PaliGemma's own (257,152 pieces) is far too large for them. `train_tiny_tokenizer`
trains one on a fixed synthetic corpus (robot narration, questions and answers, memory notes,
pi0.5 prompts), byte-identical on every run. The model itself only needs
`oxygen_ros.policy_io.tokenizer.Pi05Tokenizer`, which reads either file.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Union

import sentencepiece

PathLike = Union[str, "os.PathLike[str]"]

_VERBS = [
    "pick up",
    "place",
    "open",
    "close",
    "push",
    "pull",
    "grasp",
    "move",
    "rotate",
    "lift",
    "put",
    "wipe",
    "fold",
    "stack",
    "pour",
    "slide",
    "turn",
    "hand over",
    "drop",
    "reach for",
]
_OBJECTS = [
    "red cup",
    "blue block",
    "green bowl",
    "yellow sponge",
    "drawer",
    "towel",
    "bottle",
    "plate",
    "apple",
    "banana",
    "box",
    "lid",
    "marker",
    "spoon",
    "mug",
    "cloth",
    "door",
    "bag",
    "tray",
    "can",
]
_PLACES = [
    "on the table",
    "into the drawer",
    "in the bowl",
    "left of the plate",
    "right of the box",
    "on the shelf",
    "next to the mug",
    "in the sink",
    "on the tray",
    "behind the bottle",
]
_NARRATION = [
    "I am moving the arm toward the {o}.",
    "The gripper is closing around the {o}.",
    "Now I {v} the {o} {p}.",
    "The {o} is {p}, so I will {v} it next.",
    "I see a {o} {p}.",
    "Done: the {o} is {p}.",
    "Narration: lifting the {o} slowly.",
    "Question: where is the {o}? Answer: it is {p}.",
    "Question: what should I do next? Answer: {v} the {o}.",
    "Memory: I already put the {o} {p}.",
    "Memory: step {n} finished, the {o} was moved.",
    "The answer is {n}.",
]


# how often each extra sentence (`train_tiny_tokenizer`'s ``extra_sentences``) enters the corpus:
# enough for its words to become pieces of their own
EXTRA_SENTENCE_REPEATS = 40


def tiny_tokenizer_corpus(
    num_sentences: int = 4000, seed: int = 0, extra_sentences: Sequence[str] = ()
) -> Iterator[str]:
    """Deterministic synthetic training text: robot narration, Q&A, memory notes, pi0.5 prompts,
    then each of ``extra_sentences`` (e.g. a dataset's tasks, subtasks and narrations)
    `EXTRA_SENTENCE_REPEATS` times."""
    yield from _builtin_corpus(num_sentences, seed)
    for _ in range(EXTRA_SENTENCE_REPEATS):
        yield from extra_sentences


def _builtin_corpus(num_sentences: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for n in range(256):  # every state bin as a word
        yield f"State: {n} {255 - n} {n // 2};"
    for i in range(num_sentences):
        o, v, p = rng.choice(_OBJECTS), rng.choice(_VERBS), rng.choice(_PLACES)
        if i % 3 == 0:
            state = " ".join(str(rng.randrange(256)) for _ in range(rng.randrange(6, 15)))
            yield f"Task: {v} the {o} {p}, State: {state};\nAction: "
        else:
            yield rng.choice(_NARRATION).format(o=o, v=v, p=p, n=rng.randrange(256)).capitalize()


def train_tiny_tokenizer(
    out_path: PathLike, vocab_size: int = 512, extra_sentences: Sequence[str] = ()
) -> Path:
    """Train a small PaliGemma-like sentencepiece BPE model and write it to ``out_path``.

    Settings mirror Gemma's tokenizer where they matter for behaviour: identity normalisation, no
    dummy prefix, whitespace kept, digits split, byte fallback (any text encodes and round trips),
    and PaliGemma's special ids pad=0, eos=1, bos=2, unk=3. Training is single-threaded on a fixed
    corpus with a fixed seed, so the file is byte-identical across runs.

    The built-in corpus supports vocab sizes from about 310 to 820 (the presets use 512).
    ``extra_sentences`` join the corpus (`tiny_tokenizer_corpus`) so that their words tokenize
    as words (a dataset's texts, for a checkpoint trained on it); none: the built-in tokenizer,
    byte for byte.

    Raises:
        ValueError: if ``vocab_size`` cannot be reached with the built-in corpus.
    """
    out_path = Path(out_path)
    extra_sentences = tuple(extra_sentences)
    corpus = list(tiny_tokenizer_corpus(extra_sentences=extra_sentences))
    min_size = 4 + 256 + len({c for s in corpus for c in s})
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: byte fallback and the corpus characters "
            f"need >= {min_size}"
        )
    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(1234)
    try:
        sentencepiece.SentencePieceTrainer.Train(
            sentence_iterator=iter(corpus),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=True,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise ValueError(
            f"cannot train a tokenizer with vocab_size={vocab_size} on the built-in corpus: {exc}"
        ) from exc
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(model.getvalue())
    return out_path
