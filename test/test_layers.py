"""The layers import downward only, and no module imports itself in a circle.

    model < checkpoints < policy_io < engine < serving < ros < tools

model/ is the network alone (plain PyTorch), checkpoints/ its file formats, policy_io/ what a
checkpoint's framework does around the network; engine/ is the OxyGen core (no rclpy), serving/
the engine behind openpi's policy-server protocol and its client (no rclpy), ros/ the node,
tools/ the command-line entry points (they may import anything). Beside them: sim/ (the
simulated robot) imports ros/ and data/ (it writes its demonstrations as a dataset), data/ (the
dataset converter) nothing of the package, and training/ imports model/, checkpoints/,
policy_io/, data/ and the sim's pure task vocabulary (:data:`SIM_VOCABULARY`: tasks, scene
constants, language, grounding questions; no physics, no ROS). Tooling
(the tiny tokenizer's trainer, random checkpoints) lives in tools/, and building an engine from
plain arguments (engine/runtime.py) needs no ROS.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "oxygen_ros"
LAYERS = ("model", "checkpoints", "policy_io", "engine", "serving", "ros", "tools")
OTHERS = ("sim", "data", "training")


def _above(layer: str) -> tuple[str, ...]:
    return LAYERS[LAYERS.index(layer) + 1 :]


def _modules(*packages: str) -> tuple[str, ...]:
    return tuple(f"oxygen_ros.{p}" for p in packages)


# layer -> the modules it must not import
FORBIDDEN = {
    **{
        layer: _modules(*_above(layer), *OTHERS) + (() if layer == "ros" else ("rclpy",))
        for layer in LAYERS[:-1]
    },
    "sim": _modules(*(p for p in LAYERS if p != "ros"), "training"),
    "data": _modules(*LAYERS, "sim", "training"),
    "training": _modules("engine", "ros", "tools") + ("rclpy",),
}
# the sim modules training may read: numpy only, no physics, no ROS (checked below)
SIM_VOCABULARY = _modules("sim.scene", "sim.tasks", "sim.language", "sim.questions")


def imported_modules_of(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """Absolute names of the modules one import statement imports (relative ones resolved in
    ``package``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif node.level:
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        yield f"{base}.{node.module}" if node.module else base
    else:
        yield node.module


def imported_modules(path: Path, package: str) -> Iterator[str]:
    """Absolute names of the modules ``path`` imports (relative ones resolved in ``package``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from imported_modules_of(node, package)


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``oxygen_ros/engine/frames.py`` -> ``oxygen_ros.engine.frames`` (a package: its __init__)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path, root: Path = PACKAGE) -> str:
    name = module_name(path, root)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downward(layer):
    offending = sorted(
        f"{path.relative_to(PACKAGE / layer)}: {name}"
        for path in _sources(PACKAGE / layer)
        for name in imported_modules(path, _package_of(path))
        if name.startswith(FORBIDDEN[layer])
    )
    assert not offending, f"{layer}/ must not import {FORBIDDEN[layer]}: {offending}"


def test_training_reads_only_the_sims_vocabulary():
    """training/ may import the sim's pure modules only, and those import nothing but each other
    (no physics, no ROS): a training machine needs no simulator."""
    sim_imports = sorted(
        name
        for path in _sources(PACKAGE / "training")
        for name in imported_modules(path, _package_of(path))
        if name.startswith("oxygen_ros.sim")
    )
    assert sim_imports and set(sim_imports) <= set(SIM_VOCABULARY), sim_imports
    for module in SIM_VOCABULARY:
        path = PACKAGE / "sim" / f"{module.rsplit('.', 1)[1]}.py"
        package_imports = {
            name
            for name in imported_modules(path, "oxygen_ros.sim")
            if name.startswith("oxygen_ros")
        }
        assert package_imports <= set(SIM_VOCABULARY), (module, package_imports)
        assert "mujoco" not in set(imported_modules(path, "oxygen_ros.sim")), module


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, top-level and function-local alike.

    ``from package import name`` counts as importing the submodule ``package.name`` when there is
    one, else ``package`` itself; ``import a.b.c`` imports ``a.b.c``.
    """
    paths = _sources(root)
    known = {module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = next(imported_modules_of(node, _package_of(path, root)))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    for alias in node.names
                ]
            edges.update(t for t in targets if t in known)
        name = module_name(path, root)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle per strongly connected group of modules, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle(graph, set(group)) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the first module of ``group`` (breadth-first, inside it)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_no_import_circles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_circle_finder_names_a_circle(tmp_path):
    # Guards the test above: a function-local import closes a circle too.
    package = tmp_path / "oxygen_ros"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text("from . import two\n")
    (package / "a" / "two.py").write_text("def f():\n    from .three import x\n")
    (package / "a" / "three.py").write_text("import oxygen_ros.a.one\nfrom ..a import four\n")
    (package / "a" / "four.py").write_text("from oxygen_ros.a.one import y\n")
    graph = import_graph(package)
    assert graph["oxygen_ros.a.one"] == {"oxygen_ros.a.two"}
    assert graph["oxygen_ros.a.three"] == {"oxygen_ros.a.one", "oxygen_ros.a.four"}
    assert find_cycles(graph) == [
        [
            "oxygen_ros.a.four",
            "oxygen_ros.a.one",
            "oxygen_ros.a.two",
            "oxygen_ros.a.three",
            "oxygen_ros.a.four",
        ]
    ]


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
    import oxygen_ros.policy_io.tokenizer as model_tokenizer
    import oxygen_ros.tools.tiny_tokenizer as tooling

    assert not hasattr(model_tokenizer, "train_tiny_tokenizer")
    assert not hasattr(model_tokenizer, "tiny_tokenizer_corpus")
    assert callable(tooling.train_tiny_tokenizer)


def test_an_empty_checkpoint_dir_says_how_to_make_one():
    from oxygen_ros.engine.runtime import ModelSpec, load_policy

    with pytest.raises(ValueError, match="oxygen-make-checkpoint --preset tiny --out DIR"):
        load_policy(ModelSpec(checkpoint_dir=""))
