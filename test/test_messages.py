"""Custom messages and package metadata.

* oxygen_ros.msg.ActionChunk / Narration have exactly the fields the design asks for and
  round-trip unchanged over real DDS, inside one process and across processes;
* package.xml, setup.py and CMakeLists.txt agree with each other and with the code on disk.
"""

from __future__ import annotations

import array
import ast
import inspect
import json
import re
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ACTION_CHUNK_FIELDS = {
    "header": "std_msgs/Header",
    "frame_id": "uint64",
    "joint_names": "sequence<string>",
    "horizon": "uint32",
    "action_dim": "uint32",
    "dt": "float",
    "actions": "sequence<float>",
    "action_space": "string",
    "observation_age": "float",
    "prefill_ms": "float",
    "action_ms": "float",
    "frame_ms": "float",
    "deadline_met": "boolean",
    "clipped_values": "uint32",
    "subtask_id": "uint32",
    "subtask": "string",
}
NARRATION_FIELDS = {
    "header": "std_msgs/Header",
    "request_id": "uint64",
    "kind": "string",
    "delta": "string",
    "final": "boolean",
    "token_count": "uint32",
    "finish_reason": "string",
}


def to_plain(value):
    """A ROS message as plain JSON-able Python (nested dicts, lists, ints, floats, str)."""
    if hasattr(value, "get_fields_and_field_types"):
        return {name: to_plain(getattr(value, name)) for name in value.get_fields_and_field_types()}
    if isinstance(value, (list, tuple, array.array)):
        return [to_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays / scalars
        return to_plain(value.tolist())
    return value


def _f32(x: float) -> float:
    return float(array.array("f", [x])[0])


def _sample_messages():
    from builtin_interfaces.msg import Time
    from std_msgs.msg import Header

    from oxygen_ros.msg import ActionChunk, Narration

    horizon, action_dim = 50, 32
    chunk = ActionChunk()
    chunk.header = Header(stamp=Time(sec=1_700_000_123, nanosec=456_789_012), frame_id="base_link")
    chunk.frame_id = 2**64 - 1
    chunk.joint_names = [f"joint_{i}" for i in range(7)] + ["gripper"]
    chunk.horizon = horizon
    chunk.action_dim = action_dim
    chunk.dt = 0.02
    chunk.actions = array.array("f", [(-1) ** i * i * 0.001 for i in range(horizon * action_dim)])
    chunk.observation_age = 0.0123
    chunk.prefill_ms = 41.5
    chunk.action_ms = 12.25
    chunk.frame_ms = 57.1
    chunk.deadline_met = True
    chunk.clipped_values = 2**32 - 1
    chunk.action_space = "velocity"

    narration = Narration()
    narration.header = Header(stamp=Time(sec=5, nanosec=999_999_999), frame_id="camera")
    narration.request_id = 123_456_789_012
    narration.kind = "answer"
    narration.delta = "picks up the cup — 杯子 ✓"
    narration.final = True
    narration.token_count = 17
    narration.finish_reason = "eos"
    return chunk, narration


def _expected(msg) -> dict:
    """What a receiver must see: the sent values, float32 fields rounded to float32."""
    plain = to_plain(msg)
    for name, kind in msg.get_fields_and_field_types().items():
        if kind == "float":
            plain[name] = _f32(plain[name])
    return plain


def _qos():
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

    return QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
    )


# --- generated code ---------------------------------------------------------------------------


def test_generated_messages_import_beside_sources():
    import oxygen_ros
    from oxygen_ros.msg import ActionChunk, Narration

    # The source package owns the name; the generated msg/ is reached through its __path__.
    assert Path(oxygen_ros.__path__[0]).resolve() == ROOT / "oxygen_ros"
    assert ActionChunk.get_fields_and_field_types() == ACTION_CHUNK_FIELDS
    assert Narration.get_fields_and_field_types() == NARRATION_FIELDS


def test_message_types_have_typesupport():
    from rclpy.type_support import check_for_type_support

    from oxygen_ros.msg import ActionChunk, Narration

    for msg_type in (ActionChunk, Narration):
        check_for_type_support(msg_type)


def test_serialization_roundtrip():
    from rclpy.serialization import deserialize_message, serialize_message

    from oxygen_ros.msg import ActionChunk, Narration

    chunk, narration = _sample_messages()
    for msg, msg_type in ((chunk, ActionChunk), (narration, Narration)):
        back = deserialize_message(serialize_message(msg), msg_type)
        assert to_plain(back) == _expected(msg)


# --- DDS round trips --------------------------------------------------------------------------


@pytest.mark.ros
def test_dds_roundtrip_same_process():
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from oxygen_ros.msg import ActionChunk, Narration

    chunk, narration = _sample_messages()
    suffix = uuid.uuid4().hex[:8]
    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        pub_node = rclpy.create_node(f"oxygen_test_pub_{suffix}", context=context)
        sub_node = rclpy.create_node(f"oxygen_test_sub_{suffix}", context=context)
        received = {}
        sub_node.create_subscription(
            ActionChunk, f"chunk_{suffix}", lambda m: received.setdefault("chunk", m), _qos()
        )
        sub_node.create_subscription(
            Narration, f"narration_{suffix}", lambda m: received.setdefault("narration", m), _qos()
        )
        chunk_pub = pub_node.create_publisher(ActionChunk, f"chunk_{suffix}", _qos())
        narration_pub = pub_node.create_publisher(Narration, f"narration_{suffix}", _qos())
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(pub_node)
        executor.add_node(sub_node)

        deadline = time.monotonic() + 20.0
        published = False
        while len(received) < 2 and time.monotonic() < deadline:
            if (
                not published
                and chunk_pub.get_subscription_count()
                and narration_pub.get_subscription_count()
            ):
                chunk_pub.publish(chunk)
                narration_pub.publish(narration)
                published = True
            executor.spin_once(timeout_sec=0.05)
        assert published, "publishers never matched their subscriptions"
        assert set(received) == {"chunk", "narration"}, f"received only {sorted(received)}"
        assert to_plain(received["chunk"]) == _expected(chunk)
        assert to_plain(received["narration"]) == _expected(narration)
        executor.shutdown()
        pub_node.destroy_node()
        sub_node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


_CHILD_MAIN = """
import json, sys, time
import rclpy
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from oxygen_ros.msg import ActionChunk, Narration

suffix = sys.argv[1]
qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                 durability=DurabilityPolicy.TRANSIENT_LOCAL)
rclpy.init()
node = rclpy.create_node('oxygen_test_echo_' + suffix)
received = {}
node.create_subscription(ActionChunk, 'chunk_' + suffix,
                         lambda m: received.setdefault('chunk', to_plain(m)), qos)
node.create_subscription(Narration, 'narration_' + suffix,
                         lambda m: received.setdefault('narration', to_plain(m)), qos)
print('READY', flush=True)
deadline = time.monotonic() + 30.0
while len(received) < 2 and time.monotonic() < deadline:
    rclpy.spin_once(node, timeout_sec=0.05)
print('RESULT ' + json.dumps(received), flush=True)
node.destroy_node()
rclpy.shutdown()
"""


@pytest.mark.ros
def test_dds_roundtrip_across_processes(ros_env):
    import rclpy

    from oxygen_ros.msg import ActionChunk, Narration

    chunk, narration = _sample_messages()
    suffix = uuid.uuid4().hex[:8]
    child_code = "import array\n" + inspect.getsource(to_plain) + _CHILD_MAIN
    child = subprocess.Popen(
        [sys.executable, "-c", child_code, suffix],
        env=ros_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = rclpy.create_node(f"oxygen_test_pub_{suffix}", context=context)
        chunk_pub = node.create_publisher(ActionChunk, f"chunk_{suffix}", _qos())
        narration_pub = node.create_publisher(Narration, f"narration_{suffix}", _qos())
        deadline = time.monotonic() + 30.0
        while not (chunk_pub.get_subscription_count() and narration_pub.get_subscription_count()):
            assert child.poll() is None, f"receiver exited early: {child.communicate()}"
            assert time.monotonic() < deadline, "receiver never matched"
            time.sleep(0.02)
        chunk_pub.publish(chunk)
        narration_pub.publish(narration)
        out, err = child.communicate(timeout=40)
        node.destroy_node()
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        rclpy.shutdown(context=context)

    assert child.returncode == 0, err
    result_lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert result_lines, f"no result from receiver; stdout={out!r} stderr={err!r}"
    received = json.loads(result_lines[-1][len("RESULT ") :])
    assert set(received) == {"chunk", "narration"}, f"received only {sorted(received)}"
    assert received["chunk"] == _expected(chunk)
    assert received["narration"] == _expected(narration)


# --- package metadata -------------------------------------------------------------------------


def test_package_xml_declares_dependencies():
    root = ET.parse(ROOT / "package.xml").getroot()
    assert root.tag == "package" and root.get("format") == "3"
    assert root.findtext("name") == "oxygen_ros"
    assert re.fullmatch(r"\d+\.\d+\.\d+", root.findtext("version"))

    def deps(*tags):
        return {e.text.strip() for tag in tags for e in root.findall(tag)}

    build = deps("depend", "build_depend", "buildtool_depend")
    run = deps("depend", "exec_depend")
    assert {"ament_cmake", "ament_cmake_python", "rosidl_default_generators", "std_msgs"} <= build
    assert {
        "rclpy",
        "sensor_msgs",
        "std_msgs",
        "trajectory_msgs",
        "diagnostic_msgs",
        "builtin_interfaces",
        "lifecycle_msgs",
        "launch_ros",
        "rosidl_default_runtime",
        "python3-numpy",
    } <= run
    assert "python3-pytest" in deps("test_depend")
    assert root.findtext("member_of_group") == "rosidl_interface_packages"
    assert root.find("export").findtext("build_type") == "ament_cmake"


def _setup_py_console_scripts() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CONSOLE_SCRIPTS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no CONSOLE_SCRIPTS list")


CONSOLE_SCRIPTS = _setup_py_console_scripts()


def test_cmake_ros_executables_match_setup_py():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    block = re.search(r"set\(OXYGEN_ROS_ENTRY_POINTS(.*?)\)", cmake, re.S)
    assert block, "OXYGEN_ROS_ENTRY_POINTS not found in CMakeLists.txt"
    assert re.findall(r'"([^"]+)"', block.group(1)) == CONSOLE_SCRIPTS
    assert any(entry.startswith("oxygen_node=") for entry in CONSOLE_SCRIPTS)


@pytest.mark.parametrize("entry", CONSOLE_SCRIPTS, ids=lambda e: e.split("=")[0])
def test_console_script_target_exists(entry):
    name, target = entry.split("=")
    module, function = target.split(":")
    base = ROOT / Path(*module.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    if not source.exists():
        pytest.skip(f"{module} not written yet")
    tree = ast.parse(source.read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    assert function in defined, f"{source.relative_to(ROOT)} defines no {function}()"
    if sys.prefix != sys.base_prefix:  # in a venv set up by scripts/setup_env.sh
        assert (Path(sys.prefix) / "bin" / name).exists(), f"console script {name} not installed"


def test_setup_py_never_requires_torch():
    requires = textwrap.dedent((ROOT / "setup.py").read_text())
    tree = ast.parse(requires)
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            names = [re.split(r"[<>=!~\[ ;]", s)[0].lower() for s in ast.literal_eval(node.value)]
            assert "torch" not in names
            return
    raise AssertionError("setup.py has no install_requires")
