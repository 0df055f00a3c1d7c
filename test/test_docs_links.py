"""README.md and docs/*.md point at things that exist.

* every relative link and image resolves to a file of the repository, and an ``#anchor`` to a
  heading of the page it names (GitHub's heading ids); a file path written as code
  (``config/x.yaml``, ``ros/node.py``) under one of the repository's or the package's folders
  exists;
* every ``oxygen-*`` command (and ``oxygen_node``) is a console script of setup.py; written as
  code, every ``--flag`` after such a command (up to ``--ros-args``) is defined in its tool's
  source, every ``oxygen-bench SUBCOMMAND`` is one of the bench's subcommands, every
  ``make TARGET`` is a Makefile target.

A failure names the file and line of each broken reference.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from test_messages import CONSOLE_SCRIPTS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
COMMAND = re.compile(r"(?<![\w./-])(oxygen(?:-[a-z0-9]+)+|oxygen_node)(?![\w.-])")
BENCH_SUBCOMMAND = re.compile(r"(?<![\w-])oxygen-bench\s+([a-z][\w-]*)")
COMMAND_LINE = re.compile(r"(?<![\w./-])(oxygen(?:-[a-z0-9]+)+)(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
FILE_PATH = re.compile(
    r"(?<![\w./~$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|json|txt|sh|rviz|md|xml))\b"
)
MAKE_TARGET = re.compile(r"(?<![\w-])make\s+([a-z][\w-]*)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def markdown_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block) for each line of a Markdown file."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        yield number, line, fenced


def heading_anchors(path: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated id suffixed -1, -2, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line, fenced in markdown_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: why' for every relative link or image in ``path`` that resolves to nothing."""
    problems = []
    for number, line, fenced in markdown_lines(path):
        if fenced:
            continue
        where = f"{path.relative_to(root)}:{number}"
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{where}: {target!r}: no file {linked}")
            elif root not in linked.parents and linked != root:
                problems.append(f"{where}: {target!r}: outside the repository")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                problems.append(f"{where}: {target!r}: no heading #{anchor} in {linked.name}")
    return problems


def code_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, code) for every fenced line and every inline code span."""
    for number, line, fenced in markdown_lines(path):
        if fenced:
            yield number, line
        else:
            for _, code in CODE_SPAN.findall(line):
                yield number, code


def bench_subcommands() -> set[str]:
    """The keys of oxygen_ros/tools/bench.py's BENCHES, read without importing torch."""
    tree = ast.parse((ROOT / "oxygen_ros/tools/bench.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "BENCHES" for t in node.targets
        ):
            return {key.value for key in node.value.keys}
    raise AssertionError("oxygen_ros/tools/bench.py has no BENCHES dict")


def tool_sources() -> dict[str, str]:
    """Each console script's source text: its module, the shared argument types, and for
    oxygen-bench every bench module."""
    shared = (ROOT / "oxygen_ros/tools/cli.py").read_text()
    sources = {}
    for entry in CONSOLE_SCRIPTS:
        name, target = entry.split("=")
        files = [ROOT / (target.split(":")[0].replace(".", "/") + ".py")]
        if name == "oxygen-bench":
            files += sorted((ROOT / "oxygen_ros/tools/benches").glob("*.py"))
        sources[name] = "\n".join([shared, *(f.read_text() for f in files if f.exists())])
    return sources


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def test_docs_are_found():
    names = {p.name for p in DOCS}
    assert {"README.md", "robot_guide.md", "ros_interfaces.md"} <= names


def test_every_relative_link_and_image_resolves():
    problems = [problem for path in DOCS for problem in link_problems(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_repository_path_written_as_code_exists():
    bases = (ROOT, ROOT / "oxygen_ros")  # repository paths, and package paths like ros/node.py
    problems = []
    for path in DOCS:
        for number, code in code_texts(path):
            for named in FILE_PATH.findall(code):
                top = named.split("/")[0]
                ours = [base for base in bases if (base / top).is_dir()]
                if ours and not any((base / named).exists() for base in ours):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: no file {named}")
    assert not problems, "\n".join(problems)


def test_readme_links_the_robot_guide():
    targets = [t for _, line, _ in markdown_lines(ROOT / "README.md") for t in LINK.findall(line)]
    assert "docs/robot_guide.md" in targets


def test_every_named_command_is_an_entry_point():
    scripts = {entry.split("=")[0] for entry in CONSOLE_SCRIPTS}
    problems = [
        f"{path.relative_to(ROOT)}:{number}: {name} is not a console script of setup.py"
        for path in DOCS
        for number, line, _ in markdown_lines(path)
        for name in COMMAND.findall(line)
        if name not in scripts
    ]
    assert not problems, "\n".join(problems)


def test_every_bench_subcommand_and_make_target_exists():
    subcommands, targets = bench_subcommands(), make_targets()
    problems = []
    for path in DOCS:
        for number, code in code_texts(path):
            where = f"{path.relative_to(ROOT)}:{number}"
            problems += [
                f"{where}: oxygen-bench has no subcommand {name!r}"
                for name in BENCH_SUBCOMMAND.findall(code)
                if name not in subcommands
            ]
            problems += [
                f"{where}: the Makefile has no target {name!r}"
                for name in MAKE_TARGET.findall(code)
                if name not in targets
            ]
    assert not problems, "\n".join(problems)


def test_every_flag_of_a_named_command_is_defined():
    sources = tool_sources()
    problems = []
    for path in DOCS:
        for number, code in code_texts(path):
            for command, rest in COMMAND_LINE.findall(code):
                if command not in sources:
                    continue  # test_every_named_command_is_an_entry_point names it
                rest = COMMAND.split(rest.split("--ros-args")[0])[0]  # up to the next command
                problems += [
                    f"{path.relative_to(ROOT)}:{number}: {command} defines no {flag}"
                    for flag in FLAG.findall(rest)
                    if f'"{flag}"' not in sources[command] and flag != "--help"
                ]
    assert not problems, "\n".join(problems)


def test_checker_names_file_and_line_of_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "README.md"
    page.write_text(
        "fine: [a](docs/there.md#a-heading-with-code) [b](https://example.org/x)\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "broken: ![img](docs/missing.png) and [c](docs/there.md#no-such-heading)\n"
    )
    problems = link_problems(page, root=tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("README.md:6: 'docs/missing.png'")
    assert problems[1].startswith("README.md:6: 'docs/there.md#no-such-heading'")
