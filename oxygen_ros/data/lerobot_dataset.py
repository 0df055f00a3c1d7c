"""Writing and reading a LeRobotDataset v3 folder (images as ``image`` features, no video).

The layout LeRobot's reader (``lerobot.datasets``, codebase ``v3.0``) expects, written here with
pyarrow only (no ``datasets``/``pandas`` needed):

* ``meta/info.json``: ``codebase_version`` "v3.0", ``fps``, ``features`` (dtype/shape/names per
  key, LeRobot's default columns ``timestamp``, ``frame_index``, ``episode_index``, ``index``,
  ``task_index`` after the mapped ones), ``total_episodes``, ``total_frames``, ``total_tasks``,
  ``chunks_size`` (1000), ``data_files_size_in_mb`` (100), ``video_files_size_in_mb`` (200),
  ``data_path`` template, ``video_path`` null (no video features), ``robot_type``, ``splits``
  ``{"train": "0:N"}``; the key order of LeRobot's ``DatasetInfo``.
* ``meta/stats.json``: per feature (strings excepted) the stats of :mod:`.stats`, as lists.
* ``meta/tasks.parquet``: what ``pandas.DataFrame({"task_index": ...}, index=Index(tasks,
  name="task")).to_parquet()`` writes: columns ``task_index`` (int64) and ``task`` (string), with
  pandas metadata naming ``task`` the index, so ``pd.read_parquet`` gives the task as index.
* ``meta/episodes/chunk-000/file-000.parquet``: one row per episode: ``episode_index``, ``tasks``
  (list of strings), ``length``, ``data/chunk_index``, ``data/file_index``,
  ``dataset_from_index``, ``dataset_to_index``, ``stats/<feature>/<stat>`` (lists),
  ``meta/episodes/chunk_index``, ``meta/episodes/file_index``.
* ``data/chunk-{c:03d}/file-{f:03d}.parquet``: the frames, one row group per episode, a new file
  once one reaches ``data_files_size_in_mb``. Column types are those of the HF ``datasets``
  features LeRobot derives from info.json (``get_hf_features_from_features``): an image is a
  struct ``{bytes: binary (PNG), path: string}`` (HF ``Image()``), a (1,) feature a scalar
  (``Value``), a (D,) feature a fixed-size list (``List(length=D)``), a string feature ``string``.
  The schema carries the ``huggingface`` metadata ``datasets`` writes.

:func:`read_dataset` reads such a folder back into numpy (images decoded).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image as PILImage

from oxygen_ros.data.stats import Stats, aggregate_stats, image_stats, vector_stats

CODEBASE_VERSION = "v3.0"
DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 200
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE_PATTERN + ".parquet"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE_PATTERN + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"

DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
"""LeRobot's columns of every dataset (``lerobot.utils.constants.DEFAULT_FEATURES``)."""


class DatasetFormatError(ValueError):
    """A frame or folder does not fit the dataset's features; the message names the key."""


def image_feature(height: int, width: int) -> dict[str, Any]:
    """info.json entry of an RGB image feature."""
    return {"dtype": "image", "shape": [height, width, 3], "names": ["height", "width", "channels"]}


def vector_feature(names: Sequence[str], dtype: str = "float32") -> dict[str, Any]:
    """info.json entry of a named vector."""
    return {"dtype": dtype, "shape": [len(names)], "names": list(names)}


def string_feature() -> dict[str, Any]:
    """info.json entry of a per-frame string."""
    return {"dtype": "string", "shape": [1], "names": None}


# ----------------------------------------------------------------------------------------------
# Arrow types of LeRobot's HF features
# ----------------------------------------------------------------------------------------------

_IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def arrow_type(feature: Mapping[str, Any]) -> pa.DataType:
    """The arrow type ``datasets`` gives the HF feature LeRobot derives from ``feature``."""
    dtype, shape = feature["dtype"], tuple(feature["shape"])
    if dtype == "image":
        return _IMAGE_TYPE
    value = pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype))
    if shape == (1,):
        return value
    if len(shape) == 1:
        return pa.list_(value, shape[0])
    raise DatasetFormatError(f"feature shape {shape} ({dtype}) is not supported here")


def hf_feature(feature: Mapping[str, Any]) -> dict[str, Any]:
    """The serialised HF ``datasets`` (4.x) feature of ``feature`` (schema metadata)."""
    dtype, shape = feature["dtype"], tuple(feature["shape"])
    if dtype == "image":
        return {"_type": "Image"}
    value = {"dtype": dtype, "_type": "Value"}
    if shape == (1,):
        return value
    return {"feature": value, "length": shape[0], "_type": "List"}


def data_schema(features: Mapping[str, Mapping[str, Any]]) -> pa.Schema:
    """Schema of the data files, with the ``huggingface`` metadata."""
    fields = [pa.field(key, arrow_type(ft)) for key, ft in features.items()]
    info = {"info": {"features": {key: hf_feature(ft) for key, ft in features.items()}}}
    return pa.schema(fields, metadata={"huggingface": json.dumps(info)})


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image."""
    buffer = io.BytesIO()
    PILImage.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    """(H, W, 3) uint8 of PNG (or any PIL-readable) bytes."""
    return np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


@dataclass
class _EpisodeRecord:
    index: int
    tasks: list[str]
    length: int
    chunk_index: int
    file_index: int
    from_index: int
    stats: dict[str, Stats]


def _json_ready(stats: Mapping[str, Stats]) -> dict[str, dict[str, list]]:
    return {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in stats.items()}


class LeRobotDatasetWriter:
    """Writes episodes into a new LeRobotDataset v3 folder; :meth:`finish` writes the metadata.

    Args:
        root: folder to create (must not exist or be empty).
        fps: frames per second.
        features: the mapped features' info.json entries (dtype/shape/names), in column order;
            LeRobot's default columns are added after them.
        robot_type: written into info.json.
        data_files_size_in_mb: start a new data file once one reaches this size.
    """

    def __init__(
        self,
        root: Path | str,
        fps: int,
        features: Mapping[str, Mapping[str, Any]],
        robot_type: str | None = None,
        data_files_size_in_mb: int = DEFAULT_DATA_FILE_SIZE_IN_MB,
    ) -> None:
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            raise DatasetFormatError(f"{self.root} exists and is not empty")
        clash = set(features) & set(DEFAULT_FEATURES)
        if clash:
            raise DatasetFormatError(f"feature keys {sorted(clash)} are LeRobot's own columns")
        self.fps = int(fps)
        self.robot_type = robot_type
        self.features = {**{k: dict(v) for k, v in features.items()}, **DEFAULT_FEATURES}
        self._schema = data_schema(self.features)
        self._max_bytes = data_files_size_in_mb * 1024 * 1024
        self._data_files_size_in_mb = data_files_size_in_mb
        self._tasks: dict[str, int] = {}
        self._episodes: list[_EpisodeRecord] = []
        self._total_frames = 0
        self._chunk, self._file = 0, 0
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None

    @property
    def total_frames(self) -> int:
        """Frames written so far."""
        return self._total_frames

    def task_index(self, task: str) -> int:
        """The index of ``task``, registering it when new."""
        return self._tasks.setdefault(task, len(self._tasks))

    def add_episode(self, frames: Mapping[str, Any], tasks: Sequence[str]) -> int:
        """Append one episode and return its index.

        ``frames`` holds, per mapped feature, a value per frame: images (N, H, W, 3) uint8 (or a
        list of such arrays), vectors (N, D), strings a list of N str; ``tasks`` the task of
        each frame. timestamp, frame_index, episode_index, index and task_index are made here.
        """
        length = len(tasks)
        if length == 0:
            raise DatasetFormatError("an episode needs at least one frame")
        episode = len(self._episodes)
        columns: dict[str, pa.Array] = {}
        stats: dict[str, Stats] = {}
        for key, ft in self.features.items():
            if key in DEFAULT_FEATURES:
                continue
            if key not in frames:
                raise DatasetFormatError(f"episode {episode}: no values for feature {key!r}")
            values = frames[key]
            if len(values) != length:
                raise DatasetFormatError(
                    f"episode {episode}: feature {key!r} has {len(values)} values for "
                    f"{length} frames"
                )
            columns[key], feature_stats = self._column(key, ft, values, episode)
            if feature_stats is not None:
                stats[key] = feature_stats
        frame_index = np.arange(length, dtype=np.int64)
        index = frame_index + self._total_frames
        task_index = np.array([self.task_index(t) for t in tasks], dtype=np.int64)
        defaults = {
            "timestamp": (frame_index / self.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.full(length, episode, dtype=np.int64),
            "index": index,
            "task_index": task_index,
        }
        for key, values in defaults.items():
            columns[key] = pa.array(values)
            stats[key] = vector_stats(values)
        table = pa.Table.from_arrays([columns[k] for k in self.features], schema=self._schema)
        self._write(table)
        self._episodes.append(
            _EpisodeRecord(
                index=episode,
                tasks=list(dict.fromkeys(tasks)),
                length=length,
                chunk_index=self._chunk,
                file_index=self._file,
                from_index=self._total_frames,
                stats=stats,
            )
        )
        self._total_frames += length
        return episode

    def _column(
        self, key: str, ft: Mapping[str, Any], values: Any, episode: int
    ) -> tuple[pa.Array, Stats | None]:
        dtype, shape = ft["dtype"], tuple(ft["shape"])
        if dtype == "image":
            for i, image in enumerate(values):
                image = np.asarray(image)
                if image.shape != shape or image.dtype != np.uint8:
                    raise DatasetFormatError(
                        f"episode {episode} frame {i}: image {key!r} is {image.shape} "
                        f"{image.dtype}, expected {shape} uint8"
                    )
            structs = [
                {"bytes": encode_png(np.asarray(image)), "path": f"frame-{i:06d}.png"}
                for i, image in enumerate(values)
            ]
            return pa.array(structs, type=_IMAGE_TYPE), image_stats(values)
        if dtype == "string":
            if not all(isinstance(v, str) for v in values):
                raise DatasetFormatError(f"episode {episode}: feature {key!r} needs str values")
            return pa.array(list(values), type=pa.string()), None
        array = np.asarray(values, dtype=np.dtype(dtype))
        expected = (len(values),) if shape == (1,) else (len(values), *shape)
        if array.shape != expected and array.reshape(-1).size == int(np.prod(expected)):
            array = array.reshape(expected)
        if array.shape != expected:
            raise DatasetFormatError(
                f"episode {episode}: feature {key!r} has shape {array.shape}, expected {expected}"
            )
        if shape == (1,):
            return pa.array(array), vector_stats(array)
        flat = pa.array(array.reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, shape[0]), vector_stats(array)

    def _write(self, table: pa.Table) -> None:
        if self._writer is not None and self._path.stat().st_size >= self._max_bytes:
            self._writer.close()
            self._writer = None
            self._file += 1
            if self._file >= DEFAULT_CHUNK_SIZE:
                self._chunk, self._file = self._chunk + 1, 0
        if self._writer is None:
            self._path = self.root / DATA_PATH.format(
                chunk_index=self._chunk, file_index=self._file
            )
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._path, self._schema, compression="snappy")
        self._writer.write_table(table)  # one row group per episode

    def finish(self) -> dict[str, Any]:
        """Close the data file and write info, stats, tasks and episodes; returns info."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._episodes:
            raise DatasetFormatError(f"{self.root}: no episode was added")
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "fps": self.fps,
            "features": self.features,
            "total_episodes": len(self._episodes),
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": DEFAULT_CHUNK_SIZE,
            "data_files_size_in_mb": self._data_files_size_in_mb,
            "video_files_size_in_mb": DEFAULT_VIDEO_FILE_SIZE_IN_MB,
            "data_path": DATA_PATH,
            "video_path": None,
            "robot_type": self.robot_type,
            "splits": {"train": f"0:{len(self._episodes)}"},
        }
        (self.root / INFO_PATH).write_text(json.dumps(info, indent=4, ensure_ascii=False))
        dataset_stats = aggregate_stats([e.stats for e in self._episodes])
        (self.root / STATS_PATH).write_text(
            json.dumps(_json_ready(dataset_stats), indent=4, ensure_ascii=False)
        )
        write_tasks(self.root / TASKS_PATH, list(self._tasks))
        self._write_episodes()
        return info

    def _write_episodes(self) -> None:
        rows: dict[str, list] = {
            "episode_index": [],
            "tasks": [],
            "length": [],
            "data/chunk_index": [],
            "data/file_index": [],
            "dataset_from_index": [],
            "dataset_to_index": [],
        }
        stat_columns: dict[str, list] = {}
        for e in self._episodes:
            rows["episode_index"].append(e.index)
            rows["tasks"].append(e.tasks)
            rows["length"].append(e.length)
            rows["data/chunk_index"].append(e.chunk_index)
            rows["data/file_index"].append(e.file_index)
            rows["dataset_from_index"].append(e.from_index)
            rows["dataset_to_index"].append(e.from_index + e.length)
            for key, stats in e.stats.items():
                for stat, value in stats.items():
                    stat_columns.setdefault(f"stats/{key}/{stat}", []).append(
                        np.asarray(value).tolist()
                    )
        rows.update(stat_columns)
        rows["meta/episodes/chunk_index"] = [0] * len(self._episodes)
        rows["meta/episodes/file_index"] = [0] * len(self._episodes)
        path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pydict(rows), path, compression="snappy")


def write_tasks(path: Path, tasks: Sequence[str]) -> None:
    """``meta/tasks.parquet`` as pandas writes a DataFrame of ``task_index`` indexed by task."""
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": "task",
                "field_name": "task",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    schema = pa.schema(
        [("task_index", pa.int64()), ("task", pa.string())],
        metadata={"pandas": json.dumps(pandas_meta)},
    )
    table = pa.Table.from_arrays(
        [pa.array(range(len(tasks)), pa.int64()), pa.array(list(tasks), pa.string())],
        schema=schema,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


# ----------------------------------------------------------------------------------------------
# Reader
# ----------------------------------------------------------------------------------------------


@dataclass
class LeRobotDatasetContent:
    """A LeRobotDataset v3 folder read into memory."""

    root: Path
    info: dict[str, Any]
    tasks: list[str]
    """Task strings by task_index."""
    episodes: list[dict[str, Any]]
    """The rows of meta/episodes (stats columns included)."""
    stats: dict[str, dict[str, np.ndarray]]
    frames: dict[str, Any] = field(default_factory=dict)
    """Per column: numpy arrays ((N,) scalars, (N, D) vectors, (N, H, W, 3) uint8 images) and
    lists of str for string features."""

    @property
    def fps(self) -> int:
        """Frames per second."""
        return int(self.info["fps"])

    def episode_slice(self, episode_index: int) -> slice:
        """Rows of ``frames`` that belong to ``episode_index``."""
        row = self.episodes[episode_index]
        return slice(row["dataset_from_index"], row["dataset_to_index"])


def read_dataset(root: Path | str, decode_images: bool = True) -> LeRobotDatasetContent:
    """Read a LeRobotDataset v3 folder (this module's image-feature layout) into numpy."""
    root = Path(root)
    info_path = root / INFO_PATH
    if not info_path.is_file():
        raise DatasetFormatError(f"{root}: no {INFO_PATH}")
    info = json.loads(info_path.read_text())
    if info.get("codebase_version") != CODEBASE_VERSION:
        raise DatasetFormatError(
            f"{info_path}: codebase_version {info.get('codebase_version')!r}, expected "
            f"{CODEBASE_VERSION!r}"
        )
    tasks_table = pq.read_table(root / TASKS_PATH)
    indices = tasks_table.column("task_index").to_pylist()
    by_index = dict(zip(indices, tasks_table.column("task").to_pylist(), strict=True))
    tasks = [by_index[i] for i in range(len(by_index))]
    episode_files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    episodes = pa.concat_tables([pq.read_table(p) for p in episode_files]).to_pylist()
    stats_raw = json.loads((root / STATS_PATH).read_text())
    stats = {k: {s: np.asarray(v) for s, v in st.items()} for k, st in stats_raw.items()}
    data_files = sorted((root / "data").glob("*/*.parquet"))
    if not data_files:
        raise DatasetFormatError(f"{root}: no data/*/*.parquet file")
    table = pa.concat_tables([pq.read_table(p) for p in data_files])
    frames: dict[str, Any] = {}
    for key, ft in info["features"].items():
        if key not in table.column_names:
            raise DatasetFormatError(f"{root}: feature {key!r} is not a column of the data files")
        column = table.column(key)
        if ft["dtype"] == "image":
            images = column.to_pylist()
            frames[key] = (
                np.stack([decode_png(i["bytes"]) for i in images]) if decode_images else images
            )
        elif ft["dtype"] == "string":
            frames[key] = column.to_pylist()
        elif tuple(ft["shape"]) == (1,):
            frames[key] = column.to_numpy()
        else:
            flat = column.combine_chunks().flatten().to_numpy()
            frames[key] = flat.reshape(len(column), *ft["shape"])
    return LeRobotDatasetContent(root, info, tasks, episodes, stats, frames)
