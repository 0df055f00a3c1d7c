"""rviz/oxygen.rviz: an rviz2 config showing the narration Marker (and where /diagnostics is seen),
installed to share/oxygen_ros/rviz by both build paths."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RVIZ = ROOT / "rviz" / "oxygen.rviz"


def _config():
    return yaml.safe_load(RVIZ.read_text(encoding="utf-8"))


def _displays():
    return {d["Name"]: d for d in _config()["Visualization Manager"]["Displays"]}


def test_narration_marker_display_listens_to_the_node_topic():
    marker = _displays()["Narration"]
    assert marker["Class"] == "rviz_default_plugins/Marker"
    assert marker["Enabled"] is True
    assert marker["Topic"]["Value"] == "/oxygen_node/narration_marker"


def test_camera_display_shows_the_default_base_camera():
    params = yaml.safe_load((ROOT / "config" / "oxygen.yaml").read_text())["/**"]["ros__parameters"]
    camera = _displays()["Base camera"]
    assert camera["Class"] == "rviz_default_plugins/Image"
    # the config's input topics are relative (they follow the node's namespace); rviz2 is not in
    # one, so its display names the topic of a node in the root namespace
    assert not params["camera_topics"][0].startswith("/")
    assert camera["Topic"]["Value"] == "/" + params["camera_topics"][0]
    # Cameras publish with sensor-data QoS (best effort): a reliable subscription would never match.
    assert camera["Topic"]["Reliability Policy"] == "Best Effort"


def test_every_display_class_is_an_rviz2_plugin_and_diagnostics_points_elsewhere():
    classes = {d["Class"] for d in _displays().values()}
    assert all(c.startswith("rviz_default_plugins/") for c in classes)
    header = RVIZ.read_text(encoding="utf-8").split("Panels:", 1)[0]
    assert "rviz2 has no display for diagnostic_msgs/DiagnosticArray" in header
    assert "rqt_runtime_monitor" in header


def test_both_build_paths_install_the_rviz_folder():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    dirs = re.search(r"foreach\(_dir ([^)]*)\)", cmake).group(1).split()
    assert "rviz" in dirs
    setup = ast.parse((ROOT / "setup.py").read_text())
    strings = {
        n.value for n in ast.walk(setup) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert "rviz/*.rviz" in strings and "/rviz" in strings
