"""Load and save pi0.5 checkpoints in openpi's PyTorch layout.

    ckpt_dir/
      model.safetensors                   weights, openpi's state-dict names
      assets/<asset_id>/norm_stats.json   quantile stats of state and actions
      oxygen_config.json                  optional: our Pi05Config (absent in openpi checkpoints)
      config.json                         optional: what openpi's converter writes (its
                                          action_horizon / max_token_len are read)
      tokenizer.model                     optional: sentencepiece model (written for tiny/small)

Weights are read with safetensors only (never pickle), validated against the model before a single
byte is loaded, and streamed tensor by tensor into a model allocated directly at its final dtypes.
The only name difference between the module and the file is isolated in `module_to_file_key` /
`file_to_module_key`.
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
from safetensors.torch import safe_open, save_file
from torch import nn

from .config import PRESETS, GemmaConfig, Pi05Config, SiglipConfig
from .conventions import OPENPI_CONVENTIONS, InputConventions
from .pi05 import Pi05Model
from .preprocess import NormStats, NormStatsError, load_norm_stats, save_norm_stats

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
DTypeLike = torch.dtype | str

MODEL_FILENAME = "model.safetensors"
CONFIG_FILENAME = "oxygen_config.json"
OPENPI_CONFIG_FILENAME = "config.json"  # by openpi's examples/convert_jax_model_to_pytorch.py
OPENPI_CONFIG_FIELDS = ("action_horizon", "max_token_len")  # what tensor shapes do not fix
TOKENIZER_FILENAME = "tokenizer.model"
ASSETS_DIRNAME = "assets"
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


# -- saving ----------------------------------------------------------------------------------------


def save_checkpoint(
    model: nn.Module,
    ckpt_dir: PathLike,
    norm_stats: Mapping[str, NormStats],
    asset_id: str = "robot",
    config: Pi05Config | None = None,
) -> Path:
    """Write ``model`` (and its config and norm stats) in openpi's PyTorch checkpoint layout.

    The config defaults to ``model.config``. Tensors are saved at their current dtypes.
    Returns ``ckpt_dir``.
    """
    ckpt_dir = Path(ckpt_dir)
    _check_asset_id(asset_id)
    config = config if config is not None else getattr(model, "config", None)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        module_to_file_key(k): v.detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
    }
    tmp = ckpt_dir / (MODEL_FILENAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files 0600; a checkpoint is meant to be shared
    os.replace(tmp, ckpt_dir / MODEL_FILENAME)
    if config is not None:
        (ckpt_dir / CONFIG_FILENAME).write_text(
            json.dumps(config_to_dict(config), indent=2) + "\n", encoding="utf-8"
        )
    save_norm_stats(ckpt_dir / ASSETS_DIRNAME / asset_id / "norm_stats.json", norm_stats)
    return ckpt_dir


def _check_asset_id(asset_id: str) -> None:
    """A relative path below ``assets/``: one or more plain names (openpi's LIBERO asset id is
    ``physical-intelligence/libero``)."""
    parts = asset_id.split("/") if asset_id else []
    if (
        not parts
        or "\\" in asset_id
        or asset_id.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(
            f"asset_id must be a relative path of plain directory names (e.g. droid or "
            f"physical-intelligence/libero), got {asset_id!r}"
        )


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
    format: str = "openpi"  # "openpi" | "lerobot" (`lerobot_format.detect_format`)
    format_reason: str = ""  # the files that decided the format
    conventions: InputConventions = OPENPI_CONVENTIONS  # how the framework built model inputs
    lerobot: Any = None  # lerobot_format.LeRobotSpec of a LeRobot folder

    @property
    def tokenizer_path(self) -> Path | None:
        """``ckpt_dir/tokenizer.model`` if the checkpoint ships one (tiny/small do)."""
        path = self.ckpt_dir / TOKENIZER_FILENAME
        return path if path.is_file() else None


def load_checkpoint(
    ckpt_dir: PathLike,
    config: Pi05Config | None = None,
    device: str | torch.device = "cpu",
    dtype: DTypeLike = torch.float32,
    asset_id: str | None = None,
    robot_horizon: int | None = None,
    preferred_asset_id: str | None = None,
    lerobot_version: str = "auto",
) -> LoadedCheckpoint:
    """Load a checkpoint directory: openpi's PyTorch layout, or a LeRobot pi05 folder.

    The format is decided from the files (`lerobot_format.detect_format`); a LeRobot folder is
    loaded by `lerobot_format.load_lerobot_checkpoint` (``lerobot_version``: "auto", "0.4" or
    "main", see `conventions`). What follows describes the openpi layout.

    The config comes from `resolve_config` (``robot_horizon``: the horizon the robot's checkpoints
    were trained with, used when no config file says).

    ``asset_id`` selects ``assets/<asset_id>/norm_stats.json`` (nested ids such as
    ``physical-intelligence/libero`` too); if omitted, the single one present is used, or
    ``preferred_asset_id`` (the robot's openpi asset id) when there are several.

    ``dtype`` follows openpi: bfloat16 keeps the parameters listed in `KEEP_FLOAT32_SELECTORS` and
    the action/time projections in float32.

    Raises:
        CheckpointError: missing/corrupt files, any missing, unexpected, mis-shaped or non-float
            tensor (all listed at once), unusable norm stats or an undeterminable config.
    """
    ckpt_dir = Path(ckpt_dir)
    dtype = as_dtype(dtype)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt_dir}")
    from .lerobot_format import detect_format, load_lerobot_checkpoint  # imports this module

    detected = detect_format(ckpt_dir)
    logger.info("%s: %s", ckpt_dir, detected.reason)
    if detected.name == "lerobot":
        return load_lerobot_checkpoint(
            ckpt_dir, detected.reason, config, device, dtype, lerobot_version
        )
    weights = ckpt_dir / MODEL_FILENAME
    header = read_safetensors_header(weights)
    resolved = resolve_config(ckpt_dir, header, config, robot_horizon)
    config = resolved.config
    asset_id = resolve_asset_id(ckpt_dir, asset_id, preferred_asset_id)
    norm_stats = load_checkpoint_norm_stats(ckpt_dir, asset_id, config)

    with torch.device("meta"):
        probe = Pi05Model(config)
    problems = find_tensor_problems(header, expected_file_tensors(probe))
    if problems:
        raise CheckpointError(
            f"{weights} does not fit the {config.name!r} model:\n" + "\n".join(problems)
        )

    model = build_model(config, device, dtype)
    stream_weights(weights, model)
    model.eval().requires_grad_(False)
    return LoadedCheckpoint(
        model,
        config,
        norm_stats,
        asset_id,
        ckpt_dir,
        resolved.source,
        format_reason=detected.reason,
    )


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


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    config: Pi05Config
    source: str  # what decided it, in words (logged; shown by oxygen-model-info)


def read_openpi_config(ckpt_dir: Path) -> dict[str, int]:
    """``action_horizon`` / ``max_token_len`` from openpi's ``config.json``, those present; {}
    without the file.

    Raises:
        CheckpointError: an unreadable file, not a JSON object, or a value that is not a positive
            integer.
    """
    path = ckpt_dir / OPENPI_CONFIG_FILENAME
    if not path.is_file():
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(written, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(written).__name__}")
    fields = {}
    for name in OPENPI_CONFIG_FIELDS:
        value = written.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{path}: {name} must be a positive integer, got {value!r}")
        fields[name] = value
    return fields


def resolve_config(
    ckpt_dir: Path,
    header: Mapping[str, tuple[str, tuple[int, ...]]],
    config: Pi05Config | None = None,
    robot_horizon: int | None = None,
) -> ResolvedConfig:
    """The config a checkpoint loads with, and what decided it (logged).

    An explicit ``config`` wins (with a warning if oxygen_config.json disagrees); else
    oxygen_config.json; else the preset whose tensor names and shapes match the file exactly (an
    openpi pi0.5 checkpoint resolves to ``pi05``). Shapes fix neither ``action_horizon`` nor
    ``max_token_len`` (a fine-tune is trained with its own: pi05_droid 15, pi05_libero 10), so
    for a preset they come from openpi's config.json when it holds them, the horizon else from
    ``robot_horizon`` (the robot adapter's), else the preset's own.

    Raises:
        CheckpointError: an unreadable config file or no single matching preset.
    """
    config_path = ckpt_dir / CONFIG_FILENAME
    stored = read_config(config_path) if config_path.is_file() else None
    if config is not None:
        if stored is not None and stored != config:
            logger.warning(
                "using the given config %r; %s holds a different one (%r)",
                config.name,
                config_path,
                stored.name,
            )
        resolved = ResolvedConfig(config, "given explicitly")
    elif stored is not None:
        resolved = ResolvedConfig(stored, f"from {CONFIG_FILENAME}")
    else:
        resolved = _preset_with_openpi_fields(ckpt_dir, infer_config(header), robot_horizon)
    logger.info("%s: config %r, %s", ckpt_dir, resolved.config.name, resolved.source)
    horizon = resolved.config.action_horizon
    if robot_horizon is not None and horizon != robot_horizon:
        logger.warning(
            "%s: the model denoises %d action tokens, the robot's checkpoints were trained with %d",
            ckpt_dir,
            horizon,
            robot_horizon,
        )
    return resolved


def _preset_with_openpi_fields(
    ckpt_dir: Path, preset: Pi05Config, robot_horizon: int | None
) -> ResolvedConfig:
    fields = read_openpi_config(ckpt_dir)
    sources = [f"{k} {v} from openpi's {OPENPI_CONFIG_FILENAME}" for k, v in fields.items()]
    if "action_horizon" not in fields:
        if robot_horizon is not None:
            fields["action_horizon"] = robot_horizon
            sources.append(f"action_horizon {robot_horizon} from the robot adapter")
        else:
            sources.append(f"action_horizon {preset.action_horizon} from the preset")
    source = f"no {CONFIG_FILENAME}: the tensor shapes match it; " + ", ".join(sources)
    return ResolvedConfig(dataclasses.replace(preset, **fields), source)


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


def find_asset_ids(ckpt_dir: Path) -> list[str]:
    """Every ``<asset_id>`` with an ``assets/<asset_id>/norm_stats.json``, at any depth (openpi's
    LIBERO id is ``physical-intelligence/libero``), sorted."""
    assets = ckpt_dir / ASSETS_DIRNAME
    if not assets.is_dir():
        return []
    return sorted(
        p.parent.relative_to(assets).as_posix()
        for p in assets.rglob("norm_stats.json")
        if p.parent != assets
    )


def resolve_asset_id(ckpt_dir: Path, asset_id: str | None, preferred: str | None = None) -> str:
    """``asset_id`` checked; else the single asset with norm stats; else, among several,
    ``preferred`` (the robot's openpi asset id, e.g. ``droid``) when it is one of them.

    Raises:
        CheckpointError: no norm stats, or several assets and none chosen.
    """
    assets = ckpt_dir / ASSETS_DIRNAME
    if asset_id is not None:
        _check_asset_id(asset_id)
        return asset_id
    found = find_asset_ids(ckpt_dir)
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(
            f"no norm stats in {assets} (expected {ASSETS_DIRNAME}/<asset_id>/norm_stats.json)"
        )
    if preferred in found:
        logger.info("%s: several assets %s; using the robot's %r", assets, found, preferred)
        return preferred
    raise CheckpointError(f"several assets in {assets}: {found}; pass asset_id=")


def load_checkpoint_norm_stats(
    ckpt_dir: Path, asset_id: str, config: Pi05Config
) -> dict[str, NormStats]:
    """``assets/<asset_id>/norm_stats.json``, checked against the model's ``action_dim``.

    Raises:
        CheckpointError: a missing or unusable file, or stats wider than the model.
    """
    path = ckpt_dir / ASSETS_DIRNAME / asset_id / "norm_stats.json"
    try:
        stats = load_norm_stats(path)
    except (FileNotFoundError, NormStatsError) as exc:
        raise CheckpointError(str(exc)) from exc
    for key in ("state", "actions"):
        if stats[key].dim > config.action_dim:
            raise CheckpointError(
                f"{path}: {key} stats have {stats[key].dim} dims but the model's action_dim is "
                f"{config.action_dim}"
            )
    return stats


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
