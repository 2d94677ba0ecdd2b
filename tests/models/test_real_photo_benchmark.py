"""The real-photo benchmark's per-class function (``benchmarks/real_photos.py``) runs on one class, 2 photos a split."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.data.realphotos import load_annotations, real_photo_dir

ROOT = Path(__file__).resolve().parents[2]
DATA = load_annotations()
FETCHED = all((real_photo_dir() / "images" / im["file_name"]).is_file() for im in DATA["images"])


def _benchmark():
    spec = importlib.util.spec_from_file_location("real_photos_benchmark", ROOT / "benchmarks" / "real_photos.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not FETCHED, reason="run `qloc fetch-real-photos` for the real photos")
def test_evaluate_class_runs_on_two_photos_per_split():
    from models.bundle import load_bundle
    from models.inference import Localizer

    rp = _benchmark()
    torch.set_num_threads(1)
    bundle = load_bundle(ROOT / "bundles" / "photo-mammals.pt", "cpu")
    opts = rp.Options(seeds=(0,), guard_seeds=(), max_images=2, template_fractions=(0.3, 0.6),
                      adapt=replace(rp.Options().adapt, iterations=2))
    rows = rp.evaluate_class(Localizer(bundle, "cpu"), "birds", opts)
    methods = [r["method"] for r in rows]
    assert set(methods) == set(rp.ANSWER_METHODS + rp.BASELINES + ("adapted_greedy", "adapted_nearest"))
    for r in rows:
        for s in ("val", "test"):
            assert r[s]["n"] == 2
            assert 0.0 <= r[s]["corloc"] <= 100.0 and 0.0 <= r[s]["mean_iou"] <= 1.0
        if r["method"] in rp.ANSWER_METHODS + rp.BASELINES:
            assert r["latency_ms"] > 0 and len(r["val"]["iou"]) == 2
        else:
            assert r["val"]["corloc_seeds"] and r["adapt_seconds"][0] > 0
    summary = rp.summarize(rows, ("val", "test"))
    assert summary["nearest"]["test"]["n"] == 2 and "latency_ms" in summary["nearest"]
