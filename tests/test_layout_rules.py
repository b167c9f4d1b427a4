"""The package layout rules of docs/architecture.md §1, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
TESTS = Path(__file__).resolve().parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def _stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["pipeline", "stages"] else None


def test_no_stage_imports_another_stage():
    for path in (PACKAGE / "stages").rglob("*.py"):
        own = path.relative_to(PACKAGE / "stages").parts[0].removesuffix(".py")
        others = {_stage_of(m) for m in _imports(path)} - {None, own}
        assert not others, f"{path} imports stage(s) {sorted(others)}: move the shared part down"


def test_no_test_imports_a_private_name_of_a_stage():
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "pipeline.stages"
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
