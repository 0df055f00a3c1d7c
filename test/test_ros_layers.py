"""The ros layer imports downward only: oxygen_ros/ros/ never imports tools/, and
engine/runtime.py (what builds an engine for the node) imports neither ros/, tools/ nor rclpy."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "oxygen_ros"


def _imports(path: Path, package: str):
    """Absolute names of every module ``path`` imports (relative imports resolved in
    ``package``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            else:
                yield node.module


def test_ros_never_imports_tools():
    offending = sorted(
        f"{path.name}: {name}"
        for path in (ROOT / "ros").glob("*.py")
        for name in _imports(path, "oxygen_ros.ros")
        if name.startswith("oxygen_ros.tools")
    )
    assert not offending, offending


def test_engine_runtime_imports_no_upper_layer():
    names = set(_imports(ROOT / "engine" / "runtime.py", "oxygen_ros.engine"))
    assert "oxygen_ros.model.policy" in names  # the resolution works: it does load policies
    upper = sorted(
        n for n in names if n.startswith(("oxygen_ros.ros", "oxygen_ros.tools", "rclpy"))
    )
    assert not upper, upper


def test_an_empty_checkpoint_dir_says_how_to_make_one():
    import pytest

    from oxygen_ros.engine.runtime import ModelSpec, load_policy

    with pytest.raises(ValueError, match="oxygen-make-checkpoint --preset tiny --out DIR"):
        load_policy(ModelSpec(checkpoint_dir=""))
