"""What every checkpoint format shares: names, precision, the model's config, tensors.

Weights are read with safetensors only (never pickle), validated against the model before a single
byte is loaded (`read_safetensors_header`, `find_tensor_problems`), and streamed tensor by tensor
(`stream_weights`) into a model allocated directly at openpi's per-parameter dtypes
(`build_model`). The only name difference between the module and openpi's file is isolated in
`module_to_file_key` / `file_to_module_key`; a format with other names (LeRobot) maps its own onto
openpi's. A model without a checkpoint gets deterministic random weights (`init_random_weights`):
they fill a model built here, in openpi's names, and are what the random checkpoints are written
from. Every format's loader returns a `LoadedCheckpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open
from torch import nn

from ..model.config import PRESETS, GemmaConfig, Pi05Config, SiglipConfig
from ..model.pi05 import Pi05Model
from .conventions import OPENPI_CONVENTIONS, InputConventions
from .norm_stats import NormStats

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
DTypeLike = torch.dtype | str

MODEL_FILENAME = "model.safetensors"
CONFIG_FILENAME = "oxygen_config.json"
TOKENIZER_FILENAME = "tokenizer.model"
CONFIG_FORMAT_VERSION = 1

# -- the one name difference between our module and openpi's file ----------------------------------
# openpi saves with safetensors, which keeps only one name of the tied embedding / LM head pair:
# the LM head's.
TIED_EMBEDDING_MODULE_KEY = (
    "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
)
TIED_EMBEDDING_FILE_KEY = "paligemma_with_expert.paligemma.lm_head.weight"
# In openpi files but never used by pi0.5 (the action expert has no LM head): dropped knowingly.
IGNORED_FILE_KEYS = frozenset({"paligemma_with_expert.gemma_expert.lm_head.weight"})

# openpi's `to_bfloat16_for_selected_params` keeps parameters whose name contains one of these in
# float32. openpi applies it to `paligemma_with_expert` only: the action/time projections stay
# float32 too.
KEEP_FLOAT32_SELECTORS = (
    "vision_tower.vision_model.embeddings.patch_embedding.weight",
    "vision_tower.vision_model.embeddings.patch_embedding.bias",
    "vision_tower.vision_model.embeddings.position_embedding.weight",
    "input_layernorm",
    "post_attention_layernorm",
    "model.norm",
)
REDUCED_PRECISION_PREFIX = "paligemma_with_expert."

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_MAX_LISTED = 20  # per problem category in a CheckpointError


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message lists every problem found."""


def module_to_file_key(key: str) -> str:
    """Module state-dict name -> name in openpi's model.safetensors."""
    return TIED_EMBEDDING_FILE_KEY if key == TIED_EMBEDDING_MODULE_KEY else key


def file_to_module_key(key: str | None) -> str | None:
    """Name in model.safetensors -> module state-dict name; None for a knowingly ignored tensor."""
    if key is None or key in IGNORED_FILE_KEYS:
        return None
    return TIED_EMBEDDING_MODULE_KEY if key == TIED_EMBEDDING_FILE_KEY else key


# -- precision ------------------------------------------------------------------------------------


def as_dtype(dtype: DTypeLike) -> torch.dtype:
    """float32 / bfloat16 / float16, given as a torch dtype or its name."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported model dtype {dtype!r}; use float32, bfloat16 or float16")
    return dtype


def openpi_param_dtype(
    name: str, dtype: DTypeLike, keep_float32: tuple[str, ...] = ()
) -> torch.dtype:
    """The dtype openpi gives parameter ``name`` when the model runs in ``dtype``;
    ``keep_float32``: more name parts kept in float32 (LeRobot main keeps the vision path)."""
    dtype = as_dtype(dtype)
    if dtype == torch.float32 or not name.startswith(REDUCED_PRECISION_PREFIX):
        return torch.float32
    if any(selector in name for selector in KEEP_FLOAT32_SELECTORS + keep_float32):
        return torch.float32
    return dtype


def apply_openpi_precision(
    model: nn.Module, dtype: DTypeLike, keep_float32: tuple[str, ...] = ()
) -> nn.Module:
    """Cast parameters in place the way openpi does for ``dtype`` (see `openpi_param_dtype`).

    In bfloat16: SigLIP patch/position embeddings, every Gemma RMSNorm/adaRMS norm and the
    action/time projections stay float32; everything else becomes bfloat16. Works on meta tensors.
    """
    for name, param in model.named_parameters():
        target = openpi_param_dtype(name, dtype, keep_float32)
        if param.dtype != target:
            param.data = param.data.to(target)
    return model


# -- random weights -------------------------------------------------------------------------------

INIT_STD = 0.02
_GEMMA_RMSNORM = re.compile(
    r"(input_layernorm|post_attention_layernorm|language_model\.norm)\.weight$"
)
_LAYERNORM = re.compile(r"(layer_norm\d|post_layernorm)\.(weight|bias)$")


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, on_device: bool = False) -> nn.Module:
    """Fill every parameter with deterministic random values so that every path matters.

    * linear/conv/embedding weights and all biases: N(0, 0.02) (non-zero biases, so a mis-mapped
      bias changes the output);
    * Gemma RMSNorm weights (applied as ``1 + w``): N(0, 0.02), i.e. scale ~= 1;
    * SigLIP LayerNorms: weight 1 + N(0, 0.02), bias N(0, 0.02);
    * adaRMS ``dense`` (scale, shift, gate chunks): weight N(0, 0.02); bias N(0, 0.02) for scale and
      shift and 1 + N(0, 0.02) for the gate. A zero gate (openpi's training init) would switch off
      every expert residual branch and make the expert ignore the prefix; gate ~= 1 keeps each
      branch on while the time condition still modulates scale, shift and gate.

    Values are drawn on the CPU from one generator in parameter order, so the result is identical
    for a given seed on any device and dtype. ``on_device=True`` draws them on each parameter's own
    device instead (seconds instead of minutes for the 3.3B ``pi05`` preset on a GPU; the values
    then depend on the device's random number generator and differ from the CPU draws).
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"cannot initialise meta parameter {name}; materialise the model first (to_empty)"
            )
        device = param.device if on_device else torch.device("cpu")
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        values = torch.empty(param.shape, dtype=torch.float32, device=device).normal_(
            0.0, INIT_STD, generator=generators[device]
        )
        if name.endswith(".dense.bias"):
            values[2 * param.shape[0] // 3 :] += 1.0  # the gate chunk
        elif _LAYERNORM.search(name) and name.endswith(".weight"):
            values += 1.0
        param.copy_(values)
    return model


# -- config serialisation --------------------------------------------------------------------------


def config_to_dict(config: Pi05Config) -> dict[str, Any]:
    """JSON-ready dict of a config (written as oxygen_config.json)."""
    return {"format_version": CONFIG_FORMAT_VERSION, **dataclasses.asdict(config)}


def config_from_dict(data: Mapping[str, Any]) -> Pi05Config:
    """Inverse of `config_to_dict`.

    Raises:
        ValueError: on an unknown format version, unknown or missing fields.
    """
    data = dict(data)
    version = data.pop("format_version", None)
    if version != CONFIG_FORMAT_VERSION:
        raise ValueError(
            f"unsupported config format_version {version!r} (expected {CONFIG_FORMAT_VERSION})"
        )
    try:
        vision = SiglipConfig(**data.pop("vision"))
        backbone = GemmaConfig(**data.pop("backbone"))
        expert = GemmaConfig(**data.pop("expert"))
        return Pi05Config(vision=vision, backbone=backbone, expert=expert, **data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"config fields do not match Pi05Config: {exc}") from exc


def read_config(path: PathLike) -> Pi05Config:
    """Read an oxygen_config.json file."""
    path = Path(path)
    try:
        return config_from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


# -- building models -------------------------------------------------------------------------------


def build_model(
    config: Pi05Config,
    device: str | torch.device = "cpu",
    dtype: DTypeLike = torch.float32,
    keep_float32: tuple[str, ...] = (),
) -> Pi05Model:
    """An uninitialised model allocated directly at openpi's per-parameter dtypes on ``device``
    (``keep_float32``: see `openpi_param_dtype`).

    Parameters hold arbitrary memory: fill them with `init_random_weights` or a checkpoint.
    """
    with torch.device("meta"):
        model = Pi05Model(config)
    apply_openpi_precision(model, dtype, keep_float32)
    if any(True for _ in model.buffers()):
        # to_empty would leave buffers uninitialised; build for real (slower) and cast instead.
        with torch.device(device):
            model = Pi05Model(config)
        return apply_openpi_precision(model, dtype, keep_float32)
    return model.to_empty(device=device)


def expected_file_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """File key -> shape of every tensor a checkpoint for ``model`` must hold."""
    return {module_to_file_key(k): tuple(v.shape) for k, v in model.state_dict().items()}


# -- loading ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadedCheckpoint:
    """A ready-to-run model (eval mode, no gradients) with what it needs around it."""

    model: Pi05Model
    config: Pi05Config
    norm_stats: dict[str, NormStats]
    asset_id: str
    ckpt_dir: Path
    config_source: str = ""  # what decided the config (see `resolve_config`)
    format: str = "openpi"  # "openpi" | "lerobot" (`loader.detect_format`)
    format_reason: str = ""  # the files that decided the format
    conventions: InputConventions = OPENPI_CONVENTIONS  # how the framework built model inputs
    lerobot: Any = None  # lerobot.LeRobotSpec of a LeRobot folder

    @property
    def tokenizer_path(self) -> Path | None:
        """``ckpt_dir/tokenizer.model`` if the checkpoint ships one (tiny/small do)."""
        path = self.ckpt_dir / TOKENIZER_FILENAME
        return path if path.is_file() else None


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """File key -> (safetensors dtype name, shape), without reading tensor data.

    Raises:
        CheckpointError: if the file is missing, truncated or not a safetensors file.
    """
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {}
            for key in f.keys():
                tensor_slice = f.get_slice(key)
                header[key] = (tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
            return header
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}"
        ) from exc


def find_tensor_problems(
    header: Mapping[str, tuple[str, tuple[int, ...]]], expected: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """Every mismatch between a file header and the expected file tensors, as readable lines."""
    missing = sorted(k for k in expected if k not in header)
    unexpected = sorted(k for k in header if k not in expected and k not in IGNORED_FILE_KEYS)
    for key in sorted(IGNORED_FILE_KEYS & header.keys()):
        logger.debug("ignoring %s %s: unused by pi0.5", key, header[key][1])
    shaped = sorted(
        f"{k}: file {list(header[k][1])}, model {list(expected[k])}"
        for k in expected
        if k in header and tuple(header[k][1]) != tuple(expected[k])
    )
    non_float = sorted(
        f"{k}: {header[k][0]}"
        for k in expected
        if k in header and header[k][0] not in _FLOAT_DTYPES
    )
    problems: list[str] = []
    for title, items in (
        ("missing tensors", missing),
        ("unexpected tensors", unexpected),
        ("wrong shapes", shaped),
        ("non-float dtypes", non_float),
    ):
        if items:
            problems.append(f"{len(items)} {title}:")
            problems.extend(f"  {item}" for item in items[:_MAX_LISTED])
            if len(items) > _MAX_LISTED:
                problems.append(f"  ... and {len(items) - _MAX_LISTED} more")
    return problems


def infer_config(
    header: Mapping[str, tuple[str, tuple[int, ...]]],
    presets: Sequence[Pi05Config] | None = None,
) -> Pi05Config:
    """The preset whose tensors match ``header`` exactly (names and shapes).

    Raises:
        CheckpointError: if no preset (or more than one) matches; names the closest one's problems.
    """
    presets = list(PRESETS.values()) if presets is None else list(presets)
    scored = []
    for candidate in presets:
        with torch.device("meta"):
            probe = Pi05Model(candidate)
        scored.append((find_tensor_problems(header, expected_file_tensors(probe)), candidate))
    matches = [c for problems, c in scored if not problems]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CheckpointError(
            f"tensor shapes match several presets {[c.name for c in matches]}; pass config="
        )
    problems, closest = min(scored, key=lambda item: len(item[0]))
    raise CheckpointError(
        f"no {CONFIG_FILENAME} and the tensors match no preset; pass config=. "
        f"Closest preset {closest.name!r}:\n" + "\n".join(problems)
    )


@torch.no_grad()
def stream_weights(
    path: Path, model: nn.Module, plan: Mapping[str, str | None] | None = None
) -> None:
    """Copy every tensor of ``path`` into ``model``, one at a time, cast to the parameter dtype.

    ``plan``: file key -> openpi file key (None: skip), for files in another naming (LeRobot).
    """
    targets = model.state_dict()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for file_key in f.keys():
                module_key = file_to_module_key(plan[file_key] if plan is not None else file_key)
                if module_key is None:
                    continue
                target = targets[module_key]
                target.copy_(f.get_tensor(file_key).to(target.dtype))
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: failed while reading tensor data: {exc}") from exc
