"""launch/oxygen.launch.py: always compiled, its params-file choice (robot:=, config_file:=) always
tested; loaded and expanded where launch_ros is installed (it is not available from PyPI, so CI on
the pip wheels checks the plain-Python part only)."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest

LAUNCH_FILE = Path(__file__).resolve().parents[1] / "launch" / "oxygen.launch.py"


def _load_launch_module():
    spec = importlib.util.spec_from_file_location("oxygen_launch", LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launch_file_compiles(tmp_path):
    py_compile.compile(str(LAUNCH_FILE), cfile=str(tmp_path / "oxygen.launch.pyc"), doraise=True)


def test_launch_description_declares_its_arguments():
    if importlib.util.find_spec("launch_ros") is None:
        pytest.skip("launch_ros is not installed (no PyPI package exists); compiled only")
    module = _load_launch_module()
    from launch.actions import DeclareLaunchArgument

    description = module.generate_launch_description()
    declared = {a.name for a in description.entities if isinstance(a, DeclareLaunchArgument)}
    assert declared == {"robot", "config_file", "checkpoint_dir", "namespace"}


# --- which params file: plain Python, no launch imports needed -----------------------------------

ROBOT_FILES = {
    "droid": "pi05_droid.yaml",
    "aloha": "pi05_aloha.yaml",
    "libero": "pi05_libero.yaml",
    "lerobot": "lerobot_pi05.yaml",
}


@pytest.fixture
def config_dir(tmp_path):
    for name in ["oxygen.yaml", *ROBOT_FILES.values()]:
        (tmp_path / name).write_text("/**:\n  ros__parameters: {}\n")
    return tmp_path


def test_the_module_loads_without_launch_installed():
    module = _load_launch_module()
    assert module.ROBOT_CONFIGS == ROBOT_FILES


def test_default_is_the_package_config(config_dir):
    module = _load_launch_module()
    assert module.config_path("", "", str(config_dir)) == str(config_dir / "oxygen.yaml")


@pytest.mark.parametrize("robot", sorted(ROBOT_FILES))
def test_robot_picks_its_params_file(robot, config_dir):
    module = _load_launch_module()
    assert module.config_path("", robot, str(config_dir)) == str(config_dir / ROBOT_FILES[robot])


def test_an_explicit_config_file_wins_over_robot(config_dir):
    module = _load_launch_module()
    assert module.config_path("/my/robot.yaml", "droid", str(config_dir)) == "/my/robot.yaml"


def test_unknown_robot_and_missing_file_are_clear_errors(config_dir):
    module = _load_launch_module()
    with pytest.raises(
        ValueError, match=r"robot:=ur5 is not known; use one of aloha, droid, lerobot, lib"
    ):
        module.config_path("", "ur5", str(config_dir))
    (config_dir / "pi05_aloha.yaml").unlink()
    with pytest.raises(ValueError, match=r"robot:=aloha needs .*pi05_aloha.yaml, which is not in"):
        module.config_path("", "aloha", str(config_dir))
