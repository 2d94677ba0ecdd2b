"""The settings reference, ``SETTINGS.md``, written from ``app.config.Settings`` itself.

Every ``QLOC_*`` setting with its type, bounds, default and the field's own docstring, so the reference cannot
drift from the code; then the environment variables the scripts and the tests read besides the settings.
Regenerate it after changing a setting (``tests/app/test_settings_reference.py`` fails until then)::

    .venv/bin/python -m app.settings_reference > SETTINGS.md
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import AliasChoices
from pydantic.fields import FieldInfo

from app.config import MiB, Settings

PREFIX = Settings.model_config["env_prefix"]

SECTIONS: tuple[tuple[str, str], ...] = (
    ("Where things live", "database_url"),
    ("Where the model runs for requests", "inference"),
    ("Localize in the API process", "batch_window_ms"),
    ("API keys and /metrics", "api_keys"),
    ("Upload limits", "max_file_bytes"),
    ("Adaptation jobs", "default_iterations"),
    ("Job lifecycle and recovery", "job_soft_time_limit"),
    ("Label Studio ML backend", "labelstudio_url"),
)
"""The reference's sections, each named by its first setting; the settings follow in ``Settings``' order."""

OTHER_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("QLOC_HOST", "`127.0.0.1`", "Address the API listens on (`scripts/run`, `scripts/run api`)."),
    ("QLOC_PORT", "`8000`", "Port the API listens on (`scripts/run`, `scripts/run api`)."),
    ("QLOC_LOG_LEVEL", "`INFO`", "Log level of the Celery worker that `scripts/run` starts."),
    ("QLOC_BOOTSTRAP", "`1`", "`0`: `scripts/run` uses the Python on `PATH` instead of creating and using the "
                            "virtualenv (the Docker image)."),
    ("QLOC_VENV", "`.venv`", "The virtualenv `scripts/bootstrap` creates and `scripts/run` uses."),
    ("QLOC_PYTHON", "`python3.11`, else `python3`", "The interpreter `scripts/bootstrap` creates the virtualenv with."),
    ("QLOC_DATA_DIR", "`data`", "The ML core's data folder: MNIST (shipped), the photos that `qloc fetch-photos` and "
                              "`qloc fetch-real-photos` fetch."),
    ("QLOC_TEST_WORKERS", "`2`", "pytest-xdist workers of `scripts/test` (`0`: one process)."),
    ("QLOC_TEST_POSTGRES_URL", "`postgresql+psycopg://postgres@127.0.0.1:5432/test`",
     "The PostgreSQL the tests make their databases on."),
    ("QLOC_TEST_REDIS_URL", "`redis://127.0.0.1:6379/0`", "The Redis the tests use (each with its own key prefix)."),
    ("QLOC_FUZZ_EXAMPLES", "`25`", "Schemathesis examples per operation and database in the fuzz test (`500`: a deep "
                                 "run)."),
    ("QLOC_CHROMIUM", "`/usr/bin/chromium`", "The Chromium binary the browser tests drive."),
    ("TORCHINDUCTOR_CACHE_DIR", "`$QLOC_STORAGE_DIR/compile-cache`",
     "Where the compiled episodes are cached (`QLOC_COMPILE_EPISODE`); torch's own variable."),
    ("PROMETHEUS_MULTIPROC_DIR", "a fresh temporary folder",
     "Where several API processes (`QLOC_API_WORKERS`) add up their `/metrics`; prometheus-client's variable."),
)
"""Environment variables read outside ``Settings``: (name, default, what it does), in Markdown."""


def env_name(name: str) -> str:
    return f"{PREFIX}{name}".upper()


def _paragraphs(doc: str) -> str:
    """A field docstring as Markdown: its lines joined, blank lines kept as paragraph breaks, each setting it names
    by its field name (``batch_window_ms``, ``inference=workers``) named by its variable."""
    blocks = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    text = "\n\n".join(" ".join(line.strip() for line in b.splitlines()) for b in blocks)

    def variable(m: re.Match) -> str:
        return f"`{env_name(m[1])}{m[2] or ''}`" if m[1] in Settings.model_fields else m[0]

    text = re.sub(r"``([a-z_]+)(=[^`]*)?``", variable, text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)  # reST's literals as Markdown's


def _bounds(field: FieldInfo) -> list[str]:
    ops = {annotated_types.Ge: ("ge", ">="), annotated_types.Gt: ("gt", ">"), annotated_types.Le: ("le", "<="),
           annotated_types.Lt: ("lt", "<")}
    out = []
    for m in field.metadata:
        if type(m) in ops:
            attr, op = ops[type(m)]
            out.append(f"{op} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            out.append(f"matching `{m.pattern}`")
    return out


def _kind(annotation: Any) -> str:
    """How a value of this type is written in the environment."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _kind(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return "comma-separated list"
    if origin is dict:
        return "JSON object"
    return {bool: "`true` or `false`", int: "integer", float: "number", str: "text", Path: "path"}[annotation]


def _default(name: str, field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value in ([], {}):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    text = f"`{value}`"
    if name.endswith("_bytes") and value % MiB == 0:
        text += f" ({value // MiB} MiB)"
    return text


def describe(name: str, field: FieldInfo) -> str:
    """One setting's entry: its variable, how it is written, its default, its docstring."""
    optional = type(None) in typing.get_args(field.annotation)
    kind = " ".join([_kind(field.annotation), *_bounds(field)]) + (", or unset" if optional else "")
    lines = [f"### `{env_name(name)}`", "", f"{kind} · default {_default(name, field)}"]
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        others = [a for a in alias.choices if isinstance(a, str) and a.upper() != env_name(name)]
        lines[-1] += " · also read from " + ", ".join(f"`{a}`" for a in others)
    return "\n".join([*lines, "", _paragraphs(field.description or "")])


def render() -> str:
    fields = Settings.model_fields
    starts = {first: title for title, first in SECTIONS}
    unknown = set(starts) - set(fields)
    if unknown:
        raise ValueError(f"SECTIONS name settings that do not exist: {sorted(unknown)}")
    out = [
        "# qloc settings",
        "",
        "<!-- Written by `python -m app.settings_reference > SETTINGS.md` from `app/config.py`: edit the field's "
        "docstring there, not this file. -->",
        "",
        f"The service, its workers and `scripts/run` read one settings object, `app.config.Settings`, from environment "
        f"variables named `{PREFIX.upper()}` + the setting's name in capitals. Booleans are `true` / `false` (or `1` / "
        "`0`), lists comma-separated, objects JSON. A value out of its bounds stops the process at start with one line "
        "per refused setting, naming it and its rule, never its value (`scripts/run` checks them before it starts "
        "anything). Settings of a distributed deployment (PostgreSQL, Redis, workers mode) are in "
        "`docker-compose.yml`.",
        "",
        "Sections: " + ", ".join(f"[{title}](#{_anchor(title)})" for title, _ in SECTIONS)
        + ", [other variables](#other-variables).",
    ]
    for name, field in fields.items():
        if name in starts:
            out += ["", f"## {starts[name]}"]
        out += ["", describe(name, field)]
    out += ["", "## Other variables", "",
            "Read by the scripts, the tests or libraries, not by `Settings`.", "",
            "| variable | default | what it does |", "| --- | --- | --- |"]
    out += [f"| `{name}` | {default} | {doc} |" for name, default, doc in OTHER_VARIABLES]
    return "\n".join(out) + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


if __name__ == "__main__":
    print(render(), end="")
