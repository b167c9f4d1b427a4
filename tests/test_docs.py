"""The user-facing documents: the generated config reference is current, the README stays a
short product page without machine-specific paths or commit hashes (issue 36)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from pipeline.config import JobConfig
from pipeline.schemas import CONFIG_DOC, render_config_reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# A commit-looking token: 7 to 40 hex digits with at least one digit and one letter a-f, on its
# own (not inside a longer word, a path or a number such as 2e-3).
HEX_TOKEN = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
ABSOLUTE_PATH = re.compile(r"(?<![\w.:])/(?:work|home|root|Users|tmp/ncl)/")


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_config_reference_is_current():
    committed = (ROOT / CONFIG_DOC).read_text()
    assert committed == render_config_reference(), (
        "docs/config.md is stale: run `make schemas` (ncl-pipeline schemas) and commit it"
    )


def test_config_reference_lists_every_key_with_a_description():
    rendered = render_config_reference()
    for key in _leaf_keys(JobConfig):
        row = next((line for line in rendered.splitlines() if line.startswith(f"| `{key}` |")), "")
        assert row, f"{key} has no row in the rendered reference"
        description = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert description.strip(), f"{key} has no description in pipeline/config/sections.py"


def test_readme_is_a_short_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/"


def test_readme_has_no_absolute_paths():
    for number, line in enumerate(README.read_text().splitlines(), 1):
        assert not ABSOLUTE_PATH.search(line), f"README.md:{number}: absolute path: {line}"


def test_readme_has_no_commit_hashes():
    for number, line in enumerate(README.read_text().splitlines(), 1):
        # URLs may carry hashes of their own (anchors, digests); prose must not.
        prose = re.sub(r"https?://\S+", "", line)
        found = HEX_TOKEN.findall(prose)
        assert not found, f"README.md:{number}: commit-looking token {found}: {line}"


def test_hex_token_pattern():
    assert HEX_TOKEN.findall("measured at 6fb5645 (see 20a3c7e)") == ["6fb5645", "20a3c7e"]
    assert HEX_TOKEN.findall("commit " + "ab12" * 10) == ["ab12" * 10]
    for clean in ["lr 2e-3", "00000.tar", "IVF8192,SQ8", "sha256", "1234567", "deadbeefcafe"[:6]]:
        assert not HEX_TOKEN.findall(clean), clean
