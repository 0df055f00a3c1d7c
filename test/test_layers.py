"""The layers import downward only: model <- engine <- ros <- tools.

model/ imports no other layer of the package and no rclpy, engine/ imports model/ only (no rclpy),
ros/ never imports tools/. Tooling (the tiny tokenizer's trainer, random checkpoints) lives in
tools/, and building an engine from plain arguments (engine/runtime.py) needs no ROS.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "oxygen_ros"

# layer -> the modules it must not import
FORBIDDEN = {
    "model": ("oxygen_ros.engine", "oxygen_ros.ros", "oxygen_ros.tools", "rclpy"),
    "engine": ("oxygen_ros.ros", "oxygen_ros.tools", "rclpy"),
    "ros": ("oxygen_ros.tools",),
}


def imported_modules(path: Path, package: str) -> Iterator[str]:
    """Absolute names of the modules ``path`` imports (relative ones resolved in ``package``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            else:
                yield node.module


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downward(layer):
    offending = sorted(
        f"{path.name}: {name}"
        for path in (PACKAGE / layer).glob("*.py")
        for name in imported_modules(path, f"oxygen_ros.{layer}")
        if name.startswith(FORBIDDEN[layer])
    )
    assert not offending, f"{layer}/ must not import {FORBIDDEN[layer]}: {offending}"


def test_relative_imports_resolve_like_python(tmp_path):
    # Guards the test above: inside model/, `..engine` is oxygen_ros.engine, `.config` is ours.
    source = tmp_path / "sample.py"
    source.write_text(
        "from ..engine import x\nfrom .config import y\nfrom . import z\nimport rclpy\n"
    )
    assert list(imported_modules(source, "oxygen_ros.model")) == [
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


def test_an_empty_checkpoint_dir_says_how_to_make_one():
    from oxygen_ros.engine.runtime import ModelSpec, load_policy

    with pytest.raises(ValueError, match="oxygen-make-checkpoint --preset tiny --out DIR"):
        load_policy(ModelSpec(checkpoint_dir=""))
