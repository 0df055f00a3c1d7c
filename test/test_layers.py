"""The model layer stands alone: oxygen_ros/model/ imports nothing from the engine, ROS or tools
layers and no rclpy, and carries no tooling (the tiny tokenizer's trainer lives in tools/)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "oxygen_ros" / "model"
UPPER_LAYERS = ("oxygen_ros.engine", "oxygen_ros.ros", "oxygen_ros.tools", "rclpy")


def _imported_modules(path: Path):
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = "oxygen_ros.model"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            else:
                yield node.module


def test_model_imports_no_upper_layer():
    offending = {
        f"{path.name}: {name}"
        for path in sorted(MODEL.glob("*.py"))
        for name in _imported_modules(path)
        if name == "rclpy" or name.startswith(UPPER_LAYERS)
    }
    assert not offending, f"model/ must not import upper layers: {sorted(offending)}"


def test_relative_imports_resolve_like_python(tmp_path):
    # Guards the test above: inside model/, `..engine` is oxygen_ros.engine, `.config` is ours.
    source = tmp_path / "sample.py"
    source.write_text(
        "from ..engine import x\nfrom .config import y\nfrom . import z\nimport rclpy\n"
    )
    assert list(_imported_modules(source)) == [
        "oxygen_ros.engine",
        "oxygen_ros.model.config",
        "oxygen_ros.model",
        "rclpy",
    ]


def test_tiny_tokenizer_training_is_tooling():
    import oxygen_ros.model.tokenizer as model_tokenizer
    import oxygen_ros.tools.tiny_tokenizer as tooling

    assert not hasattr(model_tokenizer, "train_tiny_tokenizer")
    assert not hasattr(model_tokenizer, "tiny_tokenizer_corpus")
    assert callable(tooling.train_tiny_tokenizer)
