"""The workspace build: `colcon build` of a copy of the repository, plain and --symlink-install.

The repository's files are copied into ``ws/src/oxygen_ros`` and built by colcon (from PyPI,
requirements.txt) the way a robot engineer builds it, with this venv activated and its ROS wheels
as the underlay. In each build mode (one build per mode, shared by the module's tests):

* the install space holds the sources, the generated messages and action, and the share/ files;
* every entry point is an executable in ``lib/oxygen_ros`` (where ``ros2 run`` and launch_ros
  look), whose shebang is the activated venv's Python;
* ``oxygen_node``, found the way ``ros2 run oxygen_ros oxygen_node`` finds it, starts with the
  installed params file and model and activates, and exits 0 on SIGINT;
* after ``source install/setup.bash`` the messages, the action and the package's sources import
  from the install space (ahead of the venv's editable install).

Cost: one colcon build per mode (28 s each on an idle 2-core machine, up to 90 s on a loaded one)
plus 10-25 s of checks, mostly the two node starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_messages import CONSOLE_SCRIPTS

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
PACKAGE = "oxygen_ros"
BUILD_MODES = {"plain": [], "symlink-install": ["--symlink-install"]}
ACTIVE_LINE = "active: publishing action chunks"

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Workspace:
    mode: str
    root: Path
    env: dict[str, str]  # this process's environment after `source install/setup.bash`

    @property
    def install(self) -> Path:
        return self.root / "install"

    @property
    def prefix(self) -> Path:
        return self.install / PACKAGE

    @property
    def site_packages(self) -> Path:
        return self.prefix / "lib" / f"python{sysconfig.get_python_version()}" / "site-packages"


def _package_files() -> list[str]:
    """The repository's files as a clone has them (tracked and new, not ignored: no .venv,
    build/ or install/)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def _activated_venv_env() -> dict[str, str]:
    """This process's environment with the venv activated (as `source .venv/bin/activate` does)
    and its ROS wheels as the underlay (what `source /opt/ros/<distro>/setup.bash` gives)."""
    return dict(
        os.environ,
        VIRTUAL_ENV=str(VENV),
        PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        CMAKE_PREFIX_PATH=str(VENV),
        AMENT_PREFIX_PATH=str(VENV),
        PYTHONUNBUFFERED="1",
    )


def _sourced_env(setup_bash: Path, env: dict[str, str]) -> dict[str, str]:
    dump = subprocess.run(
        ["bash", "-c", 'source "$1" && env -0', "bash", str(setup_bash)],
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return dict(item.split("=", 1) for item in dump.split("\0") if "=" in item)


@pytest.fixture(scope="module", params=sorted(BUILD_MODES))
def workspace(request, tmp_path_factory) -> Workspace:
    if shutil.which("cmake") is None or not (VENV / "share" / "ament_cmake").is_dir():
        pytest.skip("needs cmake and the ROS build wheels in this Python's prefix")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the package's files")
    colcon = VENV / "bin" / "colcon"
    assert colcon.is_file(), f"no {colcon}: `make setup` installs colcon (requirements.txt)"
    mode = request.param
    ws = tmp_path_factory.mktemp(f"ws-{mode}")
    src = ws / "src" / PACKAGE
    for name in _package_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    env = _activated_venv_env()
    command = [str(colcon), "build", "--packages-select", PACKAGE, *BUILD_MODES[mode]]
    done = subprocess.run(command, cwd=ws, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        log = ws / "log" / "latest_build" / PACKAGE / "stdout_stderr.log"
        detail = log.read_text(errors="replace")[-4000:] if log.is_file() else done.stderr[-4000:]
        pytest.fail(f"`{' '.join(command[1:])}` failed:\n{done.stdout[-2000:]}\n{detail}")
    return Workspace(mode, ws, _sourced_env(ws / "install" / "setup.bash", env))


def _executables(directory: Path) -> dict[str, Path]:
    """The files ``ros2 run`` can start from ``directory`` (ros2pkg's get_executable_paths: every
    file below it that is executable, links followed), by name."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            if os.access(path, os.X_OK):
                found[filename] = path
    return found


def test_install_holds_sources_generated_interfaces_and_share_files(workspace):
    package = workspace.site_packages / PACKAGE
    for relative in (
        "__init__.py",
        "action/_ask.py",
        "msg/_narration.py",
        "ros/ask_action.py",
        "tools/model_info.py",
        "tools/tiny_tokenizer.py",
        "policy_io/tokenizer.py",
    ):
        assert (package / relative).is_file(), f"{relative} not installed"
    share = workspace.prefix / "share" / PACKAGE
    for relative in (
        "package.xml",
        "action/Ask.action",
        "launch/oxygen.launch.py",
        "config/oxygen.yaml",
        "config/sim_policy.yaml",
        "rviz/oxygen.rviz",
        "models/sim_so101/model.safetensors",
    ):
        assert (share / relative).is_file(), f"share/{PACKAGE}/{relative} not installed"


def test_every_entry_point_is_an_executable_in_lib_with_the_venvs_python(workspace):
    lib = workspace.prefix / "lib" / PACKAGE
    expected = sorted(entry.split("=")[0] for entry in CONSOLE_SCRIPTS)
    assert sorted(_executables(lib)) == expected, sorted(p.name for p in lib.iterdir())
    for name in expected:
        # a symlink install links each one to its wrapper in the build folder
        assert (lib / name).is_symlink() == (workspace.mode == "symlink-install"), name
        shebang = (lib / name).read_text().splitlines()[0]
        assert Path(shebang.removeprefix("#!")).parent == VENV / "bin", shebang


def test_ros2_run_finds_oxygen_node_and_it_activates_with_the_installed_model(
    workspace, tmp_path, monkeypatch
):
    from ament_index_python.packages import get_package_prefix

    # the lookup of `ros2 run oxygen_ros oxygen_node`: the package's prefix in ament's index (the
    # sourced AMENT_PREFIX_PATH), then the executable of that name below its lib/oxygen_ros
    monkeypatch.setenv("AMENT_PREFIX_PATH", workspace.env["AMENT_PREFIX_PATH"])
    prefix = Path(get_package_prefix(PACKAGE))
    assert prefix == workspace.prefix
    node = _executables(prefix / "lib" / PACKAGE)["oxygen_node"]
    share = prefix / "share" / PACKAGE
    log_path = tmp_path / "oxygen_node.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                str(node),
                "--ros-args",
                "--params-file",
                str(share / "config" / "sim_policy.yaml"),
                "-p",
                f"checkpoint_dir:={share / 'models' / 'sim_so101'}",
            ],
            env=workspace.env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while ACTIVE_LINE not in log_path.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, f"not active in 120 s:\n{log_path.read_text()}"
            time.sleep(0.2)
        assert process.poll() is None, f"exited {process.returncode}:\n{log_path.read_text()}"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_messages_action_and_sources_import_from_the_install_space(workspace):
    code = (
        "import oxygen_ros.action._ask as ask, oxygen_ros.msg._action_chunk as chunk\n"
        "import oxygen_ros.msg._narration as narration, oxygen_ros.ros.params as params\n"
        "from oxygen_ros.action import Ask\n"
        "from oxygen_ros.msg import ActionChunk, Narration\n"
        "from rclpy.type_support import check_for_type_support\n"
        "for t in (Ask, ActionChunk, Narration): check_for_type_support(t)\n"
        "for m in (ask, chunk, narration, params): print(m.__file__)\n"
    )
    done = subprocess.run(
        ["python3", "-c", code],  # the activated venv's, first on the sourced PATH
        env=workspace.env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workspace.root,
    )
    assert done.returncode == 0, done.stderr
    package = workspace.site_packages / PACKAGE
    assert [Path(line) for line in done.stdout.split()] == [
        package / "action" / "_ask.py",
        package / "msg" / "_action_chunk.py",
        package / "msg" / "_narration.py",
        package / "ros" / "params.py",
    ]


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
