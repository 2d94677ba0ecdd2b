"""The layers of ``models/``: a module imports only modules of its own role or a lower one.

Roles, lowest first (``models/__init__.py`` says the same):
0 ``config``, ``core`` (pure tensor math) and ``plots``; 1 ``backbones`` and ``data``; 2 ``nets`` and
``presets``; 3 ``bundle``, ``rollout``, ``instances`` and ``refine``; 4 ``inference`` and ``companion``;
5 ``features`` and ``policy``; 6 ``evaluate`` and ``adapt``; 7 ``train``; 8 ``experiments``; 9 ``cli``.
So data never imports training, training never imports experiments or the CLI, and the production
path (``inference``, ``adapt``) never imports a trainer. ``app`` and ``worker`` are never imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"

RANKS = {
    "config": 0, "core": 0, "plots": 0, "allocator": 0,
    "backbones": 1, "data": 1,
    "nets": 2, "presets": 2,
    "bundle": 3, "rollout": 3, "compiled": 3, "instances": 3, "refine": 3,
    "inference": 4, "companion": 4, "verifier": 4,
    "features": 5, "policy": 5, "calibration": 5,
    "evaluate": 6, "adapt": 6, "guard": 6,
    "train": 7, "repair": 7,
    "experiments": 8,
    "cli": 9, "__main__": 9, "__init__": 0,
}


def role(module: str) -> str:
    """``models.train.agent`` -> ``train``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every ``models.*`` / ``app`` / ``worker`` module ``path`` imports, with its line (also inside functions)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.split(".")[0] in ("models", "app", "worker")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in ("models", "app", "worker")]
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(MODELS.rglob("*.py")):
        me = module_name(path)
        mine = RANKS.get(role(me))
        if mine is None:
            bad.append(f"{me}: role {role(me)!r} has no rank: add it to RANKS and to the models/ layout")
            continue
        for line, target in imports_of(path):
            if target.split(".")[0] != "models":
                bad.append(f"{me}:{line} imports {target}: models/ must not import app or worker")
                continue
            other = RANKS.get(role(target)) if target != "models" else 0
            if other is None and "." in target:  # ``from models.x import name``: the module is models.x
                other = RANKS.get(role(target.rsplit(".", 1)[0]))
            if other is not None and other > mine:
                bad.append(f"{me}:{line} imports {target} (role rank {other} above its own {mine})")
    return bad


def test_no_module_imports_a_higher_role():
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """A data module importing a trainer is reported (the check can fail)."""
    fake = MODELS / "data" / "_layer_probe.py"
    fake.write_text("from models.train.agent import train_agent\n")
    try:
        found = violations()
    finally:
        fake.unlink()
    assert any("_layer_probe" in v and "models.train.agent" in v for v in found)


@pytest.mark.parametrize("target", ["app.config", "worker.jobs"])
def test_the_check_catches_an_import_of_the_service(target):
    fake = MODELS / "core" / "_layer_probe.py"
    fake.write_text(f"import {target}\n")
    try:
        found = violations()
    finally:
        fake.unlink()
    assert any("_layer_probe" in v and target in v for v in found)
