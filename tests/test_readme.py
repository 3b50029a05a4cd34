"""README's and docs/' promises that code can check: CI runs README's test command verbatim, README stays a
reference (≤ 15000 bytes), every relative link resolves, and the turn walk in docs/architecture.md names
files and functions that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 15000


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, "the first screen has exactly two commands: set up + run, set up + test"
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_stays_a_reference() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move details into docs/"


def _prose(path: Path) -> str:
    """The Markdown text outside fenced code blocks."""
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", _prose(path), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or (anchor and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.name}: links that do not resolve: {broken}"


def _defined(path: Path) -> set[str]:
    """Module-level functions, classes and assignments of ``path``, and ``Class.method`` for its methods."""
    functions = ast.FunctionDef | ast.AsyncFunctionDef
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            names |= {f"{node.name}.{b.name}" for b in node.body if isinstance(b, functions)}
        elif isinstance(node, functions):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_architecture_names_exist() -> None:
    """Every ``path.py : name`` in docs/architecture.md is a file of the repository defining that name."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    refs = [re.sub(r"\s+", " ", r) for r in re.findall(r"`([\w/]+\.py\s*:\s*[\w.]+)`", text)]
    assert len(refs) > 20, "the turn walk names its stops as `file : function`"
    missing = []
    for ref in refs:
        path, name = (part.strip() for part in ref.split(":"))
        if not (ROOT / path).is_file() or name not in _defined(ROOT / path):
            missing.append(ref)
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
