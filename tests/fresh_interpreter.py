"""Run a snippet in a fresh Python interpreter and report which modules it loaded: the
import-cost rules (what a Ray worker or the training controller must not import)."""

from __future__ import annotations

import json
import subprocess
import sys

_REPORT = """
import json as _json, sys as _sys
_watched = {watched!r}
print(_json.dumps(sorted(w for w in _watched
                         if any(m == w or m.startswith(w + ".") for m in _sys.modules))))
"""


def run_fresh(script: str, watched: set[str]) -> tuple[list[str], list[str]]:
    """(the lines `script` printed, the modules of `watched` it loaded, with or without
    submodules)."""
    code = script + _REPORT.format(watched=sorted(watched))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    *printed, loaded = out.stdout.strip().splitlines()
    return printed, json.loads(loaded)
