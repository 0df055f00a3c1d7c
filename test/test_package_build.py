"""The workspace build: CMakeLists.txt configured the way colcon does (sources installed too).

The repository is copied into ``ws/src/oxygen_ros`` and built with cmake into ``ws/install``
against the ROS wheels of this venv, like ``colcon build`` in a ROS workspace. The installed
package must hold the sources, the generated messages and action, the ROS executables and the
share/ files (launch, config, rviz), and import from there alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)

pytestmark = pytest.mark.slow


def _tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def workspace_install(tmp_path_factory):
    if shutil.which("cmake") is None or not (VENV / "share" / "ament_cmake").is_dir():
        pytest.skip("needs cmake and the ROS build wheels in this Python's prefix")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the package's files")
    ws = tmp_path_factory.mktemp("ws")
    src = ws / "src" / "oxygen_ros"
    for name in _tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    env = dict(os.environ, CMAKE_PREFIX_PATH=str(VENV), AMENT_PREFIX_PATH=str(VENV))
    steps = [
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(ws / "build"),
            f"-DCMAKE_INSTALL_PREFIX={ws / 'install'}",
            f"-DPython3_EXECUTABLE={VENV / 'bin' / 'python3'}",
            "-DBUILD_TESTING=OFF",
        ],
        ["cmake", "--build", str(ws / "build"), "-j", "2"],
        ["cmake", "--install", str(ws / "build")],
    ]
    for step in steps:
        done = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (
            f"{' '.join(step[:2])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return ws / "install"


def _site_packages(install: Path) -> Path:
    version = sysconfig.get_python_version()
    return install / "lib" / f"python{version}" / "site-packages"


def test_install_holds_sources_generated_interfaces_executables_and_share_files(workspace_install):
    package = _site_packages(workspace_install) / "oxygen_ros"
    for relative in (
        "action/_ask.py",
        "msg/_narration.py",
        "ros/ask_action.py",
        "tools/model_info.py",
        "tools/tiny_tokenizer.py",
        "policy_io/tokenizer.py",
    ):
        assert (package / relative).is_file(), f"{relative} not installed"
    share = workspace_install / "share" / "oxygen_ros"
    for relative in (
        "package.xml",
        "action/Ask.action",
        "launch/oxygen.launch.py",
        "config/oxygen.yaml",
        "rviz/oxygen.rviz",
    ):
        assert (share / relative).is_file(), f"share/oxygen_ros/{relative} not installed"
    node = workspace_install / "lib" / "oxygen_ros" / "oxygen_node"
    assert node.is_file() and os.access(node, os.X_OK)


def test_installed_package_imports_from_the_install_alone(workspace_install, ros_env):
    site = _site_packages(workspace_install)
    env = dict(
        ros_env,
        PYTHONPATH=str(site),
        LD_LIBRARY_PATH=f"{workspace_install / 'lib'}:{ros_env.get('LD_LIBRARY_PATH', '')}",
    )
    code = (
        "import oxygen_ros, oxygen_ros.action._ask as generated\n"
        "from oxygen_ros.action import Ask\nfrom oxygen_ros.msg import ActionChunk\n"
        "from oxygen_ros.ros.ask_action import AnswerStream\n"
        "from rclpy.type_support import check_for_type_support\n"
        "check_for_type_support(Ask); check_for_type_support(ActionChunk)\n"
        "print(oxygen_ros.__path__[0]); print(generated.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workspace_install,
    )
    assert done.returncode == 0, done.stderr
    package_dir, generated = done.stdout.split()
    assert Path(package_dir) == site / "oxygen_ros"
    assert Path(generated) == site / "oxygen_ros" / "action" / "_ask.py"


def test_action_build_inputs_are_declared():
    import re
    import xml.etree.ElementTree as ET

    root = ET.parse(ROOT / "package.xml").getroot()
    depends = {e.text.strip() for e in root.findall("depend")}
    assert "action_msgs" in depends  # rosidl refuses an .action without it
    cmake = (ROOT / "CMakeLists.txt").read_text()
    block = re.search(r"rosidl_generate_interfaces\((.*?)\)", cmake, re.S).group(1)
    assert '"action/Ask.action"' in block and "action_msgs" in block
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert "action/*.action" in setup_env  # a changed action rebuilds the venv's interfaces
