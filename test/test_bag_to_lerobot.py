"""rosbag2 -> LeRobotDataset v3 on a hand-made bag with known stamps: frame grid, zero-order hold,
trajectory sampling, staleness drops and episode splits, strings, tasks, stats recomputed here,
and the v3 layout LeRobot's reader expects (file names, info keys, column names and types)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from oxygen_ros.data.alignment import TimedStream, align, frame_grid
from oxygen_ros.data.bag_episode import BagError
from oxygen_ros.data.bag_to_lerobot import convert_bag, convert_bags
from oxygen_ros.data.lerobot_dataset import read_dataset
from oxygen_ros.data.mapping import MappingError, load_mapping, parse_mapping
from oxygen_ros.data.message_values import MessageValueError
from oxygen_ros.tools.bag_to_lerobot import main as bag_to_lerobot_main

REPO = Path(__file__).resolve().parents[1]
MAPPING = REPO / "config" / "sim_dataset.yaml"
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]
ARM = JOINTS[:5]
T0_NS = 1_000 * 10**9  # header-stamp (sim clock) origin of the hand-made episode
RECORD_OFFSET_NS = 5 * 10**9 + 10**6  # the recorder's clock: 5 s ahead, plus 1 ms latency
MS = 10**6
SCENE_MS = [0, 100, 200, 300, 400, 700, 800, 900, 1000]  # 500 and 600 missing: a stale frame
WRIST_MS = list(range(50, 1000, 100))
JOINT_MS = list(range(0, 1001, 20))
TASKS = [(120, "touch the red cube"), (700, "put the red cube on the green pad")]
SUBTASKS = [(100, "reach"), (420, "grasp")]
NARRATION = [(100, "reaching for the red cube"), (430, "closing the gripper"), (440, "got it"),
             (640, "lifting")]  # fmt: skip
# (receipt ms, header stamp ms or None for 0, [(time_from_start s, positions)]); the second arm
# trajectory is received at 500 ms but starts at its stamp, 600 ms
ARM_TRAJECTORIES = [
    (0, None, [(0.1, [1, 2, 3, 4, 5]), (0.3, [3, 4, 5, 6, 7])]),
    (500, 600, [(0.2, [10] * 5), (0.4, [20] * 5)]),
]
GRIPPER_TRAJECTORIES = [(10, None, [(0.5, [1.0])]), (800, None, [(0.1, [0.4]), (0.3, [0.0])])]


def _stamp(store, ns: int):
    return store.types["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9)


def _header(store, ns: int):
    return store.types["std_msgs/msg/Header"](stamp=_stamp(store, ns), frame_id="")


def _image(store, stamp_ns: int, pixels: np.ndarray, encoding: str) -> object:
    height, width = pixels.shape[:2]
    return store.types["sensor_msgs/msg/Image"](
        header=_header(store, stamp_ns), height=height, width=width, encoding=encoding,
        is_bigendian=0, step=width * 3, data=pixels.reshape(-1))  # fmt: skip


def _joint_state(store, stamp_ns: int, names: list[str], positions: list[float]) -> object:
    return store.types["sensor_msgs/msg/JointState"](
        header=_header(store, stamp_ns), name=names, position=np.array(positions, float),
        velocity=np.zeros(0), effort=np.zeros(0))  # fmt: skip


def _trajectory(store, stamp_ns: int, names: list[str], points) -> object:
    """A JointTrajectory from ``points``: [(time_from_start s, positions)]."""
    t = store.types
    return t["trajectory_msgs/msg/JointTrajectory"](
        header=_header(store, stamp_ns), joint_names=names, points=[
            t["trajectory_msgs/msg/JointTrajectoryPoint"](
                positions=np.array(p, float), velocities=np.zeros(0),
                accelerations=np.zeros(0), effort=np.zeros(0),
                time_from_start=t["builtin_interfaces/msg/Duration"](
                    sec=int(s), nanosec=round(s % 1 * 1e9)))
            for s, p in points])  # fmt: skip


def _write_bag(path: Path, store, records: list[tuple[int, str, object]], ns: str = "") -> Path:
    """A rosbag2 (mcap) of ``records``: (record time ns, relative topic, message)."""
    with Writer(path, version=Writer.VERSION_LATEST, storage_plugin=StoragePlugin.MCAP) as w:
        connections = {}
        for _, topic, msg in records:
            if topic not in connections:
                connections[topic] = w.add_connection(
                    f"{ns}/{topic}", msg.__msgtype__, typestore=store
                )
        for stamp, topic, msg in sorted(records, key=lambda r: r[0]):
            w.write(connections[topic], stamp, store.serialize_cdr(msg, msg.__msgtype__))
    return path


def write_episode_bag(path: Path, ns: str = "/r1", size: int = 8) -> Path:
    """The hand-made episode: every stream at the times above, record time = header time +
    RECORD_OFFSET_NS (strings and trajectories: their timeline time + RECORD_OFFSET_NS)."""
    store = get_typestore(Stores.ROS2_JAZZY)
    records: list[tuple[int, str, object]] = []

    def add(ms: int, topic: str, msg: object) -> None:
        records.append((T0_NS + ms * MS + RECORD_OFFSET_NS, topic, msg))

    for ms in SCENE_MS:
        pixels = np.zeros((size, size, 3), np.uint8)
        pixels[..., 0], pixels[..., 1], pixels[..., 2] = ms // 10, 200, np.arange(size)[None, :]
        add(ms, "camera/scene/image_raw", _image(store, T0_NS + ms * MS, pixels, "rgb8"))
    for ms in WRIST_MS:
        bgr = np.zeros((size, size, 3), np.uint8)
        bgr[..., 0], bgr[..., 1], bgr[..., 2] = 7, 1, ms // 10  # B, G, R
        add(ms, "camera/wrist/image_raw", _image(store, T0_NS + ms * MS, bgr, "bgr8"))
    for ms in JOINT_MS:
        names = list(reversed(JOINTS))  # message order differs from the mapping's
        positions = [ms / 1000 + JOINTS.index(n) for n in names]
        add(ms, "joint_states", _joint_state(store, T0_NS + ms * MS, names, positions))
    for topic, names, trajectories in (
        ("arm_controller/joint_trajectory", ARM, ARM_TRAJECTORIES),
        ("gripper_controller/joint_trajectory", ["gripper"], GRIPPER_TRAJECTORIES),
    ):
        for ms, stamp_ms, points in trajectories:
            stamp = 0 if stamp_ms is None else T0_NS + stamp_ms * MS
            add(ms, topic, _trajectory(store, stamp, names, points))
    for topic, items in (("sim/task", TASKS), ("sim/subtask", SUBTASKS),
                         ("sim/narration", NARRATION)):  # fmt: skip
        for ms, text in items:
            add(ms, topic, store.types["std_msgs/msg/String"](data=text))
    add(300, "sim/episode", store.types["std_msgs/msg/String"](
        data=json.dumps({"status": "running"})))  # fmt: skip
    return _write_bag(path, store, records, ns)


# Expected frames: t = 50, 150, ..., 950 ms; 650 dropped (scene image 400 ms is 250 ms old).
FRAME_MS = [50, 150, 250, 350, 450, 550, 750, 850, 950]
EPISODES = [FRAME_MS[:6], FRAME_MS[6:]]
SCENE_HELD = [0, 100, 200, 300, 400, 400, 700, 800, 900]
# actions: the trajectory started by the frame, sampled one frame later (t + 100 ms)
ARM_REF = [1.5, 2.5, 3.0, 3.0, 3.0, 3.0, 12.5, 17.5, 20.0]  # first joint; others + j
GRIPPER_REF = [1.0] * 7 + [0.3, 0.1]
SUBTASK = ["", "reach", "reach", "reach", "grasp", "grasp", "grasp", "grasp", "grasp"]
NARRATED = ["", "reaching for the red cube", "", "", "closing the gripper got it", "",
            "lifting", "", ""]  # fmt: skip


@pytest.fixture(scope="module")
def episode_bag(tmp_path_factory) -> Path:
    return write_episode_bag(tmp_path_factory.mktemp("bags") / "episode_000")


@pytest.fixture(scope="module")
def dataset(episode_bag, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "sim"
    report = convert_bags([episode_bag], out, load_mapping(MAPPING))
    return out, report, read_dataset(out)


def test_frame_grid_hold_and_staleness_on_known_stamps(dataset) -> None:
    _, report, ds = dataset
    assert report.grid_frames == 10 and report.frames == 9 and report.episodes == 2
    assert dict(report.drops) == {"stale:observation.images.scene": 1}
    f = ds.frames
    assert f["index"].tolist() == list(range(9))
    assert f["episode_index"].tolist() == [0] * 6 + [1] * 3
    assert f["frame_index"].tolist() == [*range(6), *range(3)]
    assert f["timestamp"].dtype == np.float32
    np.testing.assert_allclose(f["timestamp"], [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0, 0.1, 0.2], atol=1e-7)
    # scene: the latest image at or before the frame (red channel = its stamp / 10 ms)
    assert f["observation.images.scene"].shape == (9, 8, 8, 3)
    assert f["observation.images.scene"][:, 0, 0, 0].tolist() == [ms // 10 for ms in SCENE_HELD]
    assert f["observation.images.scene"][0, 3, :, 2].tolist() == list(range(8))
    # wrist: bgr8 turned into RGB; stamps equal to the frame time are held
    wrist = f["observation.images.wrist"]
    assert wrist[:, 0, 0].tolist() == [[ms // 10, 1, 7] for ms in FRAME_MS]
    # state: joint states every 20 ms, held; mapping order, not the message's
    held = [ms // 20 * 20 / 1000 for ms in FRAME_MS]
    expected_state = np.array([[h + j for j in range(6)] for h in held], np.float32)
    assert f["observation.state"].dtype == np.float32
    np.testing.assert_allclose(f["observation.state"], expected_state, rtol=1e-6)


def test_action_samples_each_controllers_latest_trajectory(dataset) -> None:
    action = dataset[2].frames["action"]
    # the first trajectory (joint j: + j) until the second starts, at 600 ms
    expected = np.array([[a + j for j in range(5)] for a in ARM_REF[:6]] + [
        [a] * 5 for a in ARM_REF[6:]])  # fmt: skip
    np.testing.assert_allclose(action[:, :5], expected, rtol=1e-6)
    np.testing.assert_allclose(action[:, 5], GRIPPER_REF, rtol=1e-6)


# An expert episode as oxygen-collect records it unpaced: the recorder on the sim clock, joint
# states reaching it ever later (a backlog of up to 750 ms), and the expert planning on the camera
# ticks (its plan arrives at the tick or 20 ms after it; the tick at 700 ms missed).
EXPERT_FRAMES_MS = list(range(0, 1501, 100))
EXPERT_PLANS_MS = [ms for ms in range(0, 1201, 100) if ms != 700]
SPEED = 1.0  # rad/s of every arm joint along the expert's plans
GRASP_MS = 500  # the gripper is commanded closed from the plan of this tick on


def write_expert_bag(path: Path) -> Path:
    store = get_typestore(Stores.ROS2_JAZZY)
    string = store.types["std_msgs/msg/String"]
    records: list[tuple[int, str, object]] = []

    def add(ms: int, latency_ms: float, topic: str, msg: object) -> None:
        records.append((T0_NS + round((ms + latency_ms) * MS), topic, msg))

    pixels = np.zeros((4, 4, 3), np.uint8)
    for ms in EXPERT_FRAMES_MS:
        for camera in ("scene", "wrist"):
            add(ms, 5, f"camera/{camera}/image_raw", _image(store, T0_NS + ms * MS, pixels, "rgb8"))
    for ms in range(0, 1501, 20):
        positions = [ms / 1000] * len(JOINTS)
        add(ms, ms / 2, "joint_states", _joint_state(store, T0_NS + ms * MS, JOINTS, positions))
    for n, ms in enumerate(EXPERT_PLANS_MS):
        latency = 20 * (n % 2)
        points = [(k / 10, [j + SPEED * (ms / 1000 + k / 10) for j in range(5)])
                  for k in range(1, 5)]  # fmt: skip
        add(ms, latency, "arm_controller/joint_trajectory",
            _trajectory(store, T0_NS + ms * MS, ARM, points))  # fmt: skip
        closed = [(0.25, [float(ms >= GRASP_MS)])]
        add(ms, latency, "gripper_controller/joint_trajectory",
            _trajectory(store, T0_NS + ms * MS, ["gripper"], closed))  # fmt: skip
    add(0, 0, "sim/task", string(data="touch the red cube"))
    add(0, 0, "sim/subtask", string(data="reach"))
    add(550, 0, "sim/subtask", string(data="grasp"))
    return _write_bag(path, store, records)


def test_action_is_the_command_in_force_one_frame_later(tmp_path) -> None:
    """Each frame's action is the plan started by the frame, sampled at the next frame: no label
    repeats while the arm moves, whether a plan arrives at its tick or after it, or a tick is
    missed; and a recorder's backlog does not move the strings placed by receipt."""
    bag = write_expert_bag(tmp_path / "expert")
    (episode,) = convert_bag(bag, load_mapping(MAPPING)).episodes
    assert ((episode.frame_ns - T0_NS) // MS).tolist() == EXPERT_FRAMES_MS
    action = np.asarray(episode.frames["action"], np.float64)
    ahead = (np.array(EXPERT_FRAMES_MS) + 100) / 1000
    expected_arm = np.array([[j + SPEED * t for j in range(5)] for t in ahead])
    np.testing.assert_allclose(action[:, :5], expected_arm, atol=1e-6)
    closed = (np.array(EXPERT_FRAMES_MS) >= GRASP_MS).astype(float)
    np.testing.assert_allclose(action[:, 5], closed)
    assert not np.any(np.all(action[1:] == action[:-1], axis=1))
    subtasks = episode.frames["subtask"]
    assert subtasks == ["reach"] * 6 + ["grasp"] * 10  # "grasp" said at 550 ms, on the clock


def test_strings_and_tasks(dataset) -> None:
    ds = dataset[2]
    assert ds.frames["subtask"] == SUBTASK
    assert ds.frames["narration"] == NARRATED  # "lifting" moves past the dropped frame
    assert ds.tasks == ["touch the red cube", "put the red cube on the green pad"]
    # the task latched at 120 ms is used before it arrived; the new one from 700 ms on
    assert ds.frames["task_index"].tolist() == [0] * 6 + [1] * 3
    assert [e["tasks"] for e in ds.episodes] == [["touch the red cube"],
                                                 ["put the red cube on the green pad"]]  # fmt: skip


def test_stats_recomputed_independently(dataset) -> None:
    ds = dataset[2]
    quantiles = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
    for key in ("observation.state", "action"):
        values = ds.frames[key].astype(np.float64)
        per_episode = []
        for e, row in enumerate(ds.episodes):
            part = values[ds.episode_slice(e)]
            per_episode.append(part)
            np.testing.assert_allclose(row[f"stats/{key}/min"], part.min(0), rtol=1e-6)
            np.testing.assert_allclose(row[f"stats/{key}/mean"], part.mean(0), rtol=1e-6)
            np.testing.assert_allclose(row[f"stats/{key}/std"], part.std(0), rtol=1e-5, atol=1e-7)
            assert row[f"stats/{key}/count"] == [len(part)]
            for q, p in quantiles.items():
                np.testing.assert_allclose(row[f"stats/{key}/{q}"], np.quantile(part, p, 0),
                                           rtol=1e-6)  # fmt: skip
        stats = ds.stats[key]
        np.testing.assert_allclose(stats["min"], values.min(0), rtol=1e-6)
        np.testing.assert_allclose(stats["max"], values.max(0), rtol=1e-6)
        np.testing.assert_allclose(stats["mean"], values.mean(0), rtol=1e-6)
        np.testing.assert_allclose(stats["std"], values.std(0), rtol=1e-5, atol=1e-7)
        assert stats["count"].tolist() == [9]
        low = np.min([np.quantile(p, 0.01, 0) for p in per_episode], axis=0)
        high = np.max([np.quantile(p, 0.99, 0) for p in per_episode], axis=0)
        np.testing.assert_allclose(stats["q01"], low, rtol=1e-6)
        np.testing.assert_allclose(stats["q99"], high, rtol=1e-6)
    images = ds.frames["observation.images.scene"].astype(np.float64) / 255
    scene = ds.stats["observation.images.scene"]
    assert scene["mean"].shape == (3, 1, 1) and scene["count"].tolist() == [9]
    np.testing.assert_allclose(scene["mean"][:, 0, 0], images.mean((0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(scene["max"][:, 0, 0], images.max((0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(scene["std"][:, 0, 0], images.std((0, 1, 2)), atol=1e-9)
    for e, row in enumerate(ds.episodes):  # per episode: quantiles over every pixel
        pixels = images[ds.episode_slice(e)].reshape(-1, 3)
        for q, p in quantiles.items():
            got = np.asarray(row[f"stats/observation.images.scene/{q}"])
            assert got.shape == (3, 1, 1)
            np.testing.assert_allclose(got[:, 0, 0], np.quantile(pixels, p, 0), rtol=1e-6)
    assert "subtask" not in ds.stats and "narration" not in ds.stats
    np.testing.assert_allclose(ds.stats["timestamp"]["max"], [0.5], rtol=1e-6)
    assert ds.stats["index"]["mean"].tolist() == [4.0]


def test_layout_is_lerobot_v3(dataset) -> None:
    root, report, _ = dataset
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        "data/chunk-000/file-000.parquet",
        "meta/episodes/chunk-000/file-000.parquet",
        "meta/info.json",
        "meta/stats.json",
        "meta/tasks.parquet",
    ]
    info = json.loads((root / "meta/info.json").read_text())
    assert list(info) == [
        "codebase_version", "fps", "features", "total_episodes", "total_frames", "total_tasks",
        "chunks_size", "data_files_size_in_mb", "video_files_size_in_mb", "data_path",
        "video_path", "robot_type", "splits",
    ]  # fmt: skip
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (2, 9, 2)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] is None and info["splits"] == {"train": "0:2"}
    assert info["robot_type"] == "so101_sim"
    features = info["features"]
    assert list(features) == [
        "observation.images.scene", "observation.images.wrist", "observation.state", "action",
        "subtask", "narration", "timestamp", "frame_index", "episode_index", "index", "task_index",
    ]  # fmt: skip
    assert features["observation.images.scene"] == {
        "dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channels"]}  # fmt: skip
    assert features["action"] == {"dtype": "float32", "shape": [6], "names": JOINTS}
    assert features["subtask"] == {"dtype": "string", "shape": [1], "names": None}
    assert features["timestamp"] == {"dtype": "float32", "shape": [1], "names": None}

    schema = pq.read_schema(root / "data/chunk-000/file-000.parquet")
    assert schema.names == list(features)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("observation.images.scene").type == image_type
    assert schema.field("observation.state").type == pa.list_(pa.float32(), 6)
    assert schema.field("subtask").type == pa.string()
    assert schema.field("timestamp").type == pa.float32()
    assert schema.field("index").type == pa.int64()
    hf = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    assert hf["observation.images.scene"] == {"_type": "Image"}
    assert hf["action"] == {"feature": {"dtype": "float32", "_type": "Value"}, "length": 6,
                            "_type": "List"}  # fmt: skip
    data = pq.ParquetFile(root / "data/chunk-000/file-000.parquet")
    assert data.metadata.num_row_groups == 2  # one per episode
    png = data.read_row_group(0).column("observation.images.scene")[0].as_py()["bytes"]
    assert png.startswith(b"\x89PNG")

    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.schema.names == ["task_index", "task"]
    pandas_meta = json.loads(tasks.schema.metadata[b"pandas"])
    assert pandas_meta["index_columns"] == ["task"]
    assert tasks.column("task_index").type == pa.int64()

    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet")
    assert episodes.schema.names[:7] == [
        "episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
        "dataset_from_index", "dataset_to_index",
    ]  # fmt: skip
    assert episodes.schema.names[-2:] == ["meta/episodes/chunk_index", "meta/episodes/file_index"]
    assert episodes.column("dataset_from_index").to_pylist() == [0, 6]
    assert episodes.column("dataset_to_index").to_pylist() == [6, 9]
    assert episodes.column("length").to_pylist() == [6, 3]
    assert episodes.schema.field("tasks").type == pa.list_(pa.string())
    stat_columns = {n for n in episodes.schema.names if n.startswith("stats/")}
    names = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
    numeric = [k for k in features if k not in ("subtask", "narration")]
    expected = {f"stats/{k}/{s}" for k in numeric for s in names}
    assert stat_columns == expected
    stats = json.loads((root / "meta/stats.json").read_text())
    assert set(stats) == {k for k in features if k not in ("subtask", "narration")}
    assert report.dataset_bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_short_runs_are_dropped_and_counted(episode_bag) -> None:
    conversion = convert_bag(episode_bag, load_mapping(MAPPING), min_run_frames=4)
    assert [len(e.tasks) for e in conversion.episodes] == [6]
    assert dict(conversion.drops) == {"stale:observation.images.scene": 1, "short_run": 3}
    assert (conversion.episodes[0].frame_ns - T0_NS).tolist() == [ms * MS for ms in EPISODES[0]]


def test_alignment_rules() -> None:
    def ms(*values: int) -> np.ndarray:
        return np.array(values, np.int64) * MS

    streams = [
        TimedStream("a", ms(0, 100, 200, 330)),
        TimedStream("b", ms(30, 90, 400), max_staleness_s=0.15),
        TimedStream("cmd", ms(10), bounds_end=False),  # one command does not end the grid
        TimedStream("text", ms(500), required=False),
    ]
    assert (frame_grid(streams, 10) // MS).tolist() == [30, 130, 230, 330]
    result = align(streams, 10)
    assert result.held["a"].tolist() == [0, 1, 2, 3]
    assert result.held["text"].tolist() == [-1] * 4
    # b held from 90 ms: 40, 140 (<= 150) and 240 ms old
    assert result.keep.tolist() == [True, True, True, False]
    assert dict(result.drops) == {"stale:b": 1}


def test_errors_name_what_is_wrong(episode_bag, tmp_path) -> None:
    raw = {"fps": 10, "features": {"x": {"kind": "lidar", "topic": "scan"}}}
    with pytest.raises(MappingError, match="unknown feature kind 'lidar'"):
        parse_mapping(raw)
    mapping = load_mapping(MAPPING)
    missing = parse_mapping({"fps": 10, "features": {
        "observation.state": {"kind": "joint_positions", "topic": "joint_states",
                              "names": ["elbow"]},
        "task": {"kind": "task", "topic": "sim/task"}}})  # fmt: skip
    with pytest.raises(MessageValueError, match="JointState has no joint 'elbow'"):
        convert_bag(episode_bag, missing)
    no_topic = parse_mapping({"fps": 10, "features": {
        "observation.state": {"kind": "joint_positions", "topic": "robot/joints", "names": ["a"]},
        "task": {"kind": "task", "topic": "sim/task"}}})  # fmt: skip
    with pytest.raises(BagError, match="no topic 'robot/joints' in the bag"):
        convert_bag(episode_bag, no_topic)
    with pytest.raises(BagError, match="cannot open as a rosbag2"):
        convert_bag(tmp_path, mapping)


def test_cli_converts_and_reports(episode_bag, tmp_path, capsys) -> None:
    out = tmp_path / "cli_ds"
    assert (
        bag_to_lerobot_main([str(episode_bag), "--out", str(out), "--mapping", str(MAPPING)]) == 0
    )
    text = capsys.readouterr().out
    assert "9 frames in 2 episodes" in text
    assert "stale:observation.images.scene: 1" in text
    assert "frames/s" in text and "bytes per episode" in text
    assert read_dataset(out).info["total_frames"] == 9
