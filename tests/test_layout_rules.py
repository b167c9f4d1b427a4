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


# --------------------------------------------------------------------------- import direction

# docs/architecture.md §1: core <- io <- models <- runtime <- stages <- run <- cli (models write
# through io's one atomic writer and read through its URL helpers). `clients` and
# `reporting` read a finished run directory: clients (what other training code imports) use only
# io, core and models; reporting also the label reader in clients; the runner and `status` use
# reporting (the report at the end of a run, the quarantine summary). `errors` and `config` sit
# at the bottom beside core; `data` (the synthetic corpus) and `schemas` are tools.
# Layer -> the layers its modules may import (besides their own and the root package, whose
# only attribute used below the top is `__version__`).
_BOTTOM = {"errors", "core"}
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "errors": set(),
    "core": set(),
    "config": _BOTTOM,
    "io": _BOTTOM,
    "models": _BOTTOM | {"io"},
    "data": _BOTTOM | {"io", "models"},
    "runtime": _BOTTOM | {"config", "io", "models"},
    "clients": _BOTTOM | {"io", "models"},
    "stages": _BOTTOM | {"config", "io", "models", "runtime", "clients"},
    "reporting": _BOTTOM | {"config", "io", "models", "clients"},
    "run": _BOTTOM | {"config", "io", "models", "runtime", "clients", "stages", "reporting"},
    "schemas": _BOTTOM | {"config", "io"},
}
TOP = {"cli", "__init__", "__main__"}  # may import every layer


def _layer(module: str) -> str | None:
    """The layer of a dotted `pipeline.*` name (None outside the package or for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pipeline" else None


def _layer_violations(layer: str, imported: list[str]) -> set[str]:
    allowed = ALLOWED_IMPORTS[layer] | {layer}
    return {m for m in imported if (other := _layer(m)) is not None and other not in allowed}


def test_every_module_sits_in_a_known_layer():
    found = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")}
    found -= {"__pycache__", "model_configs"}
    assert found <= set(ALLOWED_IMPORTS) | TOP, sorted(found - set(ALLOWED_IMPORTS) - TOP)


def test_imports_follow_the_layer_direction():
    problems = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if layer in TOP:
            continue
        if bad := _layer_violations(layer, _imports(path)):
            problems[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not problems, (
        f"imports against the layer direction (docs/architecture.md §1): {problems}"
    )


def test_the_direction_check_can_fail():
    assert _layer_violations("stages", ["pipeline.run.state.STAGE_KEY_META"]) == {
        "pipeline.run.state.STAGE_KEY_META"
    }
    assert _layer_violations("clients", ["pipeline.stages.publish", "pipeline.io.labels"]) == {
        "pipeline.stages.publish"
    }
    assert _layer_violations("core", ["pipeline", "numpy", "pipeline.core.search.knn"]) == set()
    assert _layer_violations("core", ["pipeline.errors"]) == {"pipeline.errors"}


# --------------------------------------------------------------------------- Ray's private API


def _private_ray(imported: list[str]) -> set[str]:
    """The names of `imported` inside Ray's private modules (`ray._private`, `ray.*._internal`):
    they change without notice between Ray releases; Ray's public settings and APIs do not."""
    return {
        name
        for name in imported
        if name.split(".")[0] == "ray"
        and any(p in ("_private", "_internal") for p in name.split("."))
    }


def test_the_package_imports_nothing_private_of_ray():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if bad := _private_ray(_imports(path)):
            found[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not found, f"imports of Ray's private modules (use Ray's public API): {found}"


def test_the_private_ray_check_can_fail(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import ray.train\n"
        "from ray.train.torch import TorchConfig\n"
        "def f():\n"
        "    from ray._private.ray_logging import global_worker_stdstream_dispatcher\n"
        "    import ray.train.v2._internal.util as util\n"
        "    from ray.train.v2 import _internal\n"
    )
    assert _private_ray(_imports(source)) == {
        "ray._private.ray_logging",
        "ray._private.ray_logging.global_worker_stdstream_dispatcher",
        "ray.train.v2._internal.util",
        "ray.train.v2._internal",
    }


def test_no_test_imports_a_private_name_of_a_stage():
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "pipeline.stages"
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


# --------------------------------------------------------------------------- size limits

MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80  # from the `def` line to the last line, docstring included

# Exceptions to the size limits: "path under pipeline/" or "path::qualified.name" -> why.
# Keep it short; every entry must still exceed its limit (checked below), so fixing one means
# removing it here.
ALLOWED_OVERSIZE: dict[str, str] = {}  # name -> why it may exceed the limits


def _oversize(name: str, source: str) -> dict[str, int]:
    """Module and function names of one module that exceed the limits -> their line counts."""
    found = {}
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found[name] = lines

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = child.end_lineno - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found[f"{name}::{qualname}"] = length
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_modules_and_functions_stay_small():
    oversize = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        oversize.update(_oversize(str(path.relative_to(PACKAGE)), path.read_text()))
    unexpected = {name: n for name, n in oversize.items() if name not in ALLOWED_OVERSIZE}
    assert not unexpected, (
        f"over {MAX_MODULE_LINES} lines per module or {MAX_FUNCTION_LINES} per function "
        f"(split them, or justify an entry in ALLOWED_OVERSIZE): {unexpected}"
    )
    stale = sorted(set(ALLOWED_OVERSIZE) - set(oversize))
    assert not stale, f"no longer over the limit, drop from ALLOWED_OVERSIZE: {stale}"


def test_the_size_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def big(self):\n{body.replace('    ', '        ')}\n"
    source += f"def small():\n    return 1\n\ndef fits():\n{body[: body.rfind(chr(10))]}\n"
    found = _oversize("m.py", source)
    assert found == {"m.py::A.big": MAX_FUNCTION_LINES + 1}
    assert _oversize("m.py", "x = 1\n" * (MAX_MODULE_LINES + 1)) == {"m.py": MAX_MODULE_LINES + 1}
    assert _oversize("m.py", "x = 1\n" * MAX_MODULE_LINES) == {}


# --------------------------------------------------------------------------- module docstrings

# A module docstring states the module's contract in about ten lines and links docs/ for the
# rest (the long form lives in docs/ once); this cap catches essays growing back.
MAX_MODULE_DOCSTRING_LINES = 20


def _long_docstring(source: str) -> int | None:
    """The line count of a module's docstring when it exceeds the cap, else None."""
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    lines = len(docstring.splitlines()) if docstring else 0
    return lines if lines > MAX_MODULE_DOCSTRING_LINES else None


def test_module_docstrings_state_the_contract_briefly():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if (lines := _long_docstring(path.read_text())) is not None:
            long[str(path.relative_to(PACKAGE))] = lines
    assert not long, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (keep the contract, move "
        f"the explanation to docs/): {long}"
    )


def test_the_docstring_check_can_fail():
    body = "\n".join(f"line {i}" for i in range(MAX_MODULE_DOCSTRING_LINES))
    assert _long_docstring(f'"""{body}\none more"""\nx = 1\n') == MAX_MODULE_DOCSTRING_LINES + 1
    assert _long_docstring(f'"""{body}"""\nx = 1\n') is None
    assert _long_docstring("x = 1\n") is None


# --------------------------------------------------------------------------- core imports no Ray


def test_core_does_not_import_ray():
    """Every module of pipeline.core, imported in a fresh interpreter, loads no ray module."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys\n"
        "import pipeline.core as core\n"
        "names = [m.name for m in pkgutil.walk_packages(core.__path__, 'pipeline.core.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not loaded, f'pipeline.core imported {loaded[:5]}'\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert int(out.stdout) >= 15  # the walk found the package's modules (labels/ included)


# --------------------------------------------------------------------------- marker file names


def _marker_literals(source: str, names: set[str]) -> list[str]:
    """String literals (docstrings aside) that spell one of `names` as a file name."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and any(node.value == name or node.value.endswith(f"/{name}") for name in names)
    ]


def test_marker_file_names_are_spelled_once_in_io_layout():
    from pipeline.io import layout

    names = {
        layout.MANIFEST_NAME,
        layout.LEASE_NAME,
        layout.LABEL_PASS_SUMMARY,
        layout.BASELINE_SUMMARY,
        layout.INDEX_DESCRIPTION,
        layout.LABELS_POINTER,
    }
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        literals = _marker_literals(path.read_text(), names)
        if literals and path != PACKAGE / "io" / "layout.py":
            found[str(path.relative_to(PACKAGE))] = literals
    assert not found, f"marker file names spelled outside pipeline/io/layout.py: {found}"
    assert _marker_literals('x = f"{folder}/_label_pass.json"\n', names) == ["/_label_pass.json"]
