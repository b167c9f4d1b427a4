"""Logging convention (pipeline.runtime.console): module loggers, one console, workers configure
nothing."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.runtime.console import ensure_console, setup_console, setup_worker_logging

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
ROOT = PACKAGE.parent

# The modules that own what reaches the terminal: they may print and configure logging.
CONSOLE_MODULES = {"runtime/console.py", "cli.py"}
# Module -> why it touches a logger other than its own. Every entry must still be needed.
ALLOWED_LOGGER_CHANGES = {
    "models/loading.py": "filters open_clip's root-logger narration during a build, then restores",
}
LOGGING_CONFIG_CALLS = {"basicConfig", "disable", "captureWarnings", "dictConfig", "fileConfig"}
ROOT_SHORTCUTS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
LOGGER_CHANGES = {"setLevel", "addHandler", "removeHandler", "addFilter", "removeFilter"}


def _modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text(), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _is_logging_attr(node: ast.AST, names: set[str]) -> bool:
    """`logging.<name>` or `logging.config.<name>` for a name in `names`."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.value, ast.Name | ast.Attribute)
        and ast.unparse(node.value) in ("logging", "logging.config")
    )


def _problems(name: str, tree: ast.Module) -> list[str]:
    """What in one module breaks the convention."""
    found = []
    console = name in CONSOLE_MODULES
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    module_logger = False
    for statement in tree.body:  # logger = logging.getLogger(__name__) at module level
        if isinstance(statement, ast.Assign) and [ast.unparse(t) for t in statement.targets] == [
            "logger"
        ]:
            module_logger = ast.unparse(statement.value) == "logging.getLogger(__name__)"
            if not module_logger:
                found.append(f"module logger is {ast.unparse(statement.value)}")
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Call):
            call = node.func
            if isinstance(call, ast.Name) and call.id == "print" and not console:
                found.append(f"line {line}: print(...)")
            if _is_logging_attr(call, LOGGING_CONFIG_CALLS) and not console:
                found.append(f"line {line}: {ast.unparse(call)}(...) configures logging")
            if _is_logging_attr(call, ROOT_SHORTCUTS):
                found.append(f"line {line}: {ast.unparse(call)}(...) logs on the root logger")
            if _is_logging_attr(call, {"getLogger"}) and not console:
                args = [ast.unparse(a) for a in node.args]
                if args != ["__name__"] and name not in ALLOWED_LOGGER_CHANGES:
                    found.append(f"line {line}: logging.getLogger({', '.join(args)})")
            if (
                isinstance(call, ast.Attribute)
                and call.attr in LOGGER_CHANGES
                and not console
                and name not in ALLOWED_LOGGER_CHANGES
            ):
                found.append(f"line {line}: {ast.unparse(call)}(...) reconfigures a logger")
            if (
                isinstance(call, ast.Attribute)
                and ast.unparse(call.value) == "logger"
                and not module_logger
            ):
                found.append(f"line {line}: logger.{call.attr} without a module logger")
        if (
            isinstance(node, ast.Name)
            and node.id == "print"
            and id(node) not in called
            and not console
        ):
            found.append(f"line {line}: print passed as a value (a log=print callback?)")
    return found


def test_library_modules_log_through_module_loggers_and_never_print():
    modules = _modules()
    assert "runtime/console.py" in modules and "run/runner.py" in modules and len(modules) > 30
    problems = {name: _problems(name, tree) for name, tree in modules.items()}
    assert {name: found for name, found in problems.items() if found} == {}
    for name in ALLOWED_LOGGER_CHANGES:
        tree = modules[name]
        assert any(
            isinstance(node, ast.Attribute) and node.attr in LOGGER_CHANGES
            for node in ast.walk(tree)
        ), f"{name} no longer changes a logger: drop it from the allowed list"
    # Every module that logs names its logger after itself (records sit under `pipeline`).
    logging_modules = [
        name
        for name, tree in modules.items()
        if "logger = logging.getLogger(__name__)" in ast.unparse(tree)
    ]
    for expected in (
        "run/runner.py",
        "stages/embed/driver.py",
        "stages/labels/driver.py",
        "stages/train/loop.py",
        "stages/train/driver.py",
        "run/submit.py",
    ):
        assert expected in logging_modules


def test_the_checks_can_fail():
    bad = ast.parse(
        textwrap.dedent(
            """
            import logging

            def run(log=print):
                print("x")
                logging.basicConfig()
                logging.getLogger().setLevel(logging.WARNING)
                logging.info("root")
                logger.info("no module logger")
            """
        )
    )
    found = "\n".join(_problems("stages/example.py", bad))
    for expected in (
        "print(...)",
        "print passed as a value",
        "logging.basicConfig(...) configures logging",
        "logging.getLogger()",
        "reconfigures a logger",
        "logs on the root logger",
        "without a module logger",
    ):
        assert expected in found, (expected, found)
    assert _problems("cli.py", ast.parse("print('shown')")) == []
    assert _problems("run/runner.py", ast.parse("logger = logging.getLogger('x')")) == [
        "module logger is logging.getLogger('x')",
        "line 1: logging.getLogger('x')",
    ]


@pytest.fixture
def pipeline_logger():
    """The `pipeline` logger, restored afterwards (handlers, level, propagation)."""
    logger = logging.getLogger("pipeline")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_console_shows_info_bare_and_warnings_with_level_and_name(pipeline_logger, capsys):
    setup_console()
    setup_console()  # twice: still one handler
    log = logging.getLogger("pipeline.stages.example")
    log.info("embed: 3 shards on 1 actor(s)")
    log.info("\nsummary\n  shards:       3")
    log.debug("hidden unless verbose")
    log.warning("  [2/3] 00001: FAILED (not a tar)")
    out, err = capsys.readouterr()
    assert out == "embed: 3 shards on 1 actor(s)\n\nsummary\n  shards:       3\n"
    assert err == "WARNING pipeline.stages.example: [2/3] 00001: FAILED (not a tar)\n"
    assert pipeline_logger.propagate is False  # shown once, whatever the root logger has

    setup_console(verbose=True)
    log.debug("detail")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("stage failed")
    out, err = capsys.readouterr()
    assert out == "DEBUG pipeline.stages.example: detail\n"
    assert err.startswith("ERROR pipeline.stages.example: stage failed\nTraceback")
    assert "ValueError: boom" in err
    assert sum(type(h).__name__ == "ConsoleHandler" for h in pipeline_logger.handlers) == 1


def test_worker_setup_configures_the_pipeline_logger_only(pipeline_logger, capsys):
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    setup_worker_logging()
    logging.getLogger("pipeline.stages.train").info("  round 1 A epoch 0: loss 2.7")
    assert capsys.readouterr().out == "  round 1 A epoch 0: loss 2.7\n"
    assert (list(root.handlers), root.level) == before


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_building_a_model_leaves_the_root_logger_alone():
    """open_clip logs through `logging.info`, which would call basicConfig: a worker that
    builds a model must not end up with a root handler, nor show open_clip's narration."""
    result = _python(
        """
        import logging
        from pipeline.models import ModelSpec, load_clip

        load_clip(ModelSpec("ncl-tiny", None, seed=0), "cpu")
        root = logging.getLogger()
        assert root.handlers == [] and root.level == logging.WARNING, root.handlers
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-3000:]
    assert "INFO" not in result.stderr and "initialized randomly" not in result.stderr


def test_run_job_shows_the_console_only_when_nothing_configured_logging(pipeline_logger):
    # Under pytest the root logger has capture handlers: the application's choice stands.
    assert logging.getLogger().handlers
    before = list(pipeline_logger.handlers)
    ensure_console()
    assert pipeline_logger.handlers == before
    result = _python(
        """
        import logging
        from pipeline.runtime.console import ensure_console

        ensure_console()
        logging.getLogger("pipeline.run.runner").info("shown")
        logging.getLogger().addHandler(logging.NullHandler())
        logging.getLogger("pipeline").handlers.clear()
        logging.getLogger("pipeline").setLevel(logging.NOTSET)
        ensure_console()  # configured now: a no-op
        logging.getLogger("pipeline.run.runner").info("not shown")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "shown\n"
