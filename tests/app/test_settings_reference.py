"""SETTINGS.md, the settings reference: written from ``app.config.Settings``, current, and naming every variable the
project reads.

A setting whose default, bounds or docstring changed without ``python -m app.settings_reference > SETTINGS.md``
fails here, as does a ``QLOC_*`` name in the code, scripts or docs that is no setting and not listed among the other
variables (a typo in the README, a variable a script reads that nobody documented).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import AliasChoices, Field

from app import settings_reference as ref
from app.config import Settings

REPO = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"QLOC_[A-Z][A-Z0-9_]*[A-Z0-9]")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    skip = ("data/", "bundles/")
    return [REPO / n for n in names if not n.startswith(skip) and (REPO / n).is_file()
            and (REPO / n).suffix not in {".png", ".pt", ".gz", ".jpg", ".ico", ".woff2", ".bin"}]


@pytest.fixture(scope="module")
def named_variables() -> dict[str, set[str]]:
    """Each ``QLOC_*`` name in the tracked files, with the files naming it (the generated reference left out)."""
    found: dict[str, set[str]] = {}
    for path in tracked_text_files():
        if path.name in ("SETTINGS.md", "settings_reference.py", "test_settings_reference.py", "test_config_units.py"):
            continue  # the reference itself, and tests that name made-up variables on purpose
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for name in VARIABLE.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_settings_md_is_what_the_settings_say():
    written = (REPO / "SETTINGS.md").read_text(encoding="utf-8")
    assert written == ref.render(), (
        "SETTINGS.md is stale: run `.venv/bin/python -m app.settings_reference > SETTINGS.md` after changing a setting")


def test_the_command_in_its_docstring_writes_it():
    r = subprocess.run([sys.executable, "-m", "app.settings_reference"], cwd=REPO, capture_output=True, text=True,
                       check=True, timeout=120)
    assert r.stdout == ref.render()


def test_every_setting_has_one_entry_with_its_docstring_in_its_section():
    text = ref.render()
    headings = re.findall(r"^### `([A-Z_]+)`$", text, flags=re.M)
    assert headings == [f"QLOC_{n.upper()}" for n in Settings.model_fields]  # each once, in the class's order
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections == [title for title, _ in ref.SECTIONS] + ["Other variables"]
    # each section starts at its named setting, and the settings in between belong to it
    for title, first in ref.SECTIONS:
        assert f"## {title}\n\n### `QLOC_{first.upper()}`\n" in text
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no docstring: the reference would say nothing of it"
    entry = ref.describe("heartbeat_timeout", Settings.model_fields["heartbeat_timeout"])
    assert entry.startswith("### `QLOC_HEARTBEAT_TIMEOUT`\n\nnumber > 0 · default `10.0`\n\nA running job whose")
    assert "\n" not in entry.split("\n\n", 2)[2]  # the docstring's lines joined into one paragraph


def test_every_variable_the_project_names_is_documented(named_variables):
    settings = {f"QLOC_{n.upper()}" for n in Settings.model_fields}
    others = {name for name, _, _ in ref.OTHER_VARIABLES}
    unknown = {n: sorted(files) for n, files in named_variables.items() if n not in settings | others}
    assert not unknown, f"named but neither a setting nor in OTHER_VARIABLES (a typo, or undocumented): {unknown}"
    assert not settings & others


def test_every_other_variable_is_read_somewhere(named_variables):
    for name, default, doc in ref.OTHER_VARIABLES:
        if name.startswith("QLOC_"):
            assert name in named_variables, f"{name} is documented but nothing names it"
        else:
            assert any(name in p.read_text(encoding="utf-8", errors="replace") for p in tracked_text_files()
                       if p.suffix in {".py", ""} and p.name != "settings_reference.py"), name
        assert default and doc.endswith(".")


def test_types_bounds_and_defaults_are_written_as_the_environment_takes_them():
    fields = Settings.model_fields

    def line(name: str) -> str:
        return ref.describe(name, fields[name]).split("\n")[2]

    assert line("device") == "one of `auto`, `cpu`, `cuda` · default `auto`"
    assert line("localize_samples") == "integer >= 0 <= 63 · default `0`"
    assert line("localize_timeout") == "number > 0 <= 3600 · default `30.0`"
    assert line("localize_nearest") == "`true` or `false`, or unset · default unset"
    assert line("tune_malloc") == "`true` or `false` · default `true`"
    assert line("access_log") == "`true` or `false` · default `false`"
    assert line("queue") == "text matching `^[A-Za-z0-9_.:-]{1,100}$` · default `qloc`"
    assert line("storage_dir") == "path · default `var`"
    assert line("api_keys") == "comma-separated list · default empty"
    assert line("broker_transport_options") == "JSON object · default empty"
    assert line("max_file_bytes") == "integer >= 1 · default `10485760` (10 MiB)"
    assert line("max_json_bytes") == "integer >= 1024 · default `4194304` (4 MiB)"
    assert line("max_request_pixels") == "integer >= 1 · default `256000000`"  # pixels, not bytes
    assert line("labelstudio_fetch_hosts") == "comma-separated list, or unset · default unset"
    assert line("labelstudio_url") == "text, or unset · default unset · also read from `LABEL_STUDIO_URL`"
    assert line("labelstudio_api_key") == "text, or unset · default unset · also read from `LABEL_STUDIO_API_KEY`"


def test_a_field_of_another_kind_is_written_too():
    class Other(Settings):
        bare: int = 3
        hosts: str | None = Field(None, validation_alias=AliasChoices("QLOC_HOSTS", "HOSTS", "SERVERS"))
        """Hosts."""
        ratio: float = Field(0.5, ge=0.0, lt=1.0)
        """A ratio.

        A second paragraph ``ratio`` names ``inference=workers`` and ``not_a_setting``."""
        mode: Literal["a", "b"] | None = None
        """A mode."""

    ratio = ref.describe("ratio", Other.model_fields["ratio"])
    assert ratio.split("\n")[2] == "number >= 0.0 < 1.0 · default `0.5`"
    # paragraphs kept; settings named by their variable, anything else as a plain literal
    assert ratio.endswith("A ratio.\n\nA second paragraph `ratio` names `QLOC_INFERENCE=workers` and "
                          "`not_a_setting`.")
    assert ref.describe("mode", Other.model_fields["mode"]).split("\n")[2] == (
        "one of `a`, `b`, or unset · default unset")
    assert ref.describe("hosts", Other.model_fields["hosts"]).split("\n")[2] == (
        "text, or unset · default unset · also read from `HOSTS`, `SERVERS`")
    assert ref.describe("bare", Other.model_fields["bare"]) == "### `QLOC_BARE`\n\ninteger · default `3`\n\n"


def test_sections_must_name_settings(monkeypatch):
    monkeypatch.setattr(ref, "SECTIONS", ref.SECTIONS + (("Gone", "no_such_setting"),))
    with pytest.raises(ValueError, match="no_such_setting"):
        ref.render()


def test_section_links_are_githubs_anchors():
    assert ref._anchor("API keys and /metrics") == "api-keys-and-metrics"
    assert ref._anchor("Where things live") == "where-things-live"
    text = ref.render()
    for title, _ in ref.SECTIONS:
        assert f"[{title}](#{ref._anchor(title)})" in text
    assert "[other variables](#other-variables)" in text
