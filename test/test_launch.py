"""launch/oxygen.launch.py: always compiled; loaded and expanded where launch_ros is installed
(it is not available from PyPI, so CI on the pip wheels only compiles it)."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest

LAUNCH_FILE = Path(__file__).resolve().parents[1] / "launch" / "oxygen.launch.py"


def test_launch_file_compiles(tmp_path):
    py_compile.compile(str(LAUNCH_FILE), cfile=str(tmp_path / "oxygen.launch.pyc"), doraise=True)


def test_launch_description_declares_its_arguments():
    if importlib.util.find_spec("launch_ros") is None:
        pytest.skip("launch_ros is not installed (no PyPI package exists); compiled only")
    spec = importlib.util.spec_from_file_location("oxygen_launch", LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from launch.actions import DeclareLaunchArgument

    description = module.generate_launch_description()
    declared = {a.name for a in description.entities if isinstance(a, DeclareLaunchArgument)}
    assert declared == {"config_file", "checkpoint_dir", "preset", "namespace"}
