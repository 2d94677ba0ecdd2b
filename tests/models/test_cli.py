"""Smoke runs of the real CLI entry point, end to end, on a tiny budget."""

import json
import subprocess
import sys

import pytest
import torch

from models.bundle import load_bundle, load_policy
from models.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, capsys):
    emb = tmp_path / "emb.pt"
    r = run(capsys, "train-embedding", "--epochs", 2, "--out", emb, "--device", "cpu")
    assert 0 <= r["val/ordacc"] <= 100 and emb.exists() and emb.with_suffix(".curves.png").exists()
    bundle_path = tmp_path / "bundle.pt"
    r = run(capsys, "train-agent", "--bundle", emb, "--iterations", 3, "--out", bundle_path)
    assert load_bundle(bundle_path).provenance["agent"]["reward"] == "embedding"
    pol = tmp_path / "policy.pt"
    r = run(capsys, "adapt", "--bundle", bundle_path, "--digit", 2, "--unlabeled", 16, "--iterations", 3,
            "--batch-size", 8, "--episodes", 2, "--out", pol, "--metrics", tmp_path / "adapt.json")
    assert r["iterations"] == 3 and json.loads((tmp_path / "adapt.json").read_text()) == r
    state, meta = load_policy(pol, load_bundle(bundle_path))
    assert meta["digit"] == 2 and all(isinstance(v, torch.Tensor) for v in state.values())
    fig = tmp_path / "paths.png"
    r = run(capsys, "evaluate", "--bundle", bundle_path, "--policy", pol, "--digit", 2, "--n-test", 12,
            "--figure", fig)
    assert 0 <= r["corloc"] <= 100 and fig.stat().st_size > 1000
    r = run(capsys, "evaluate", "--bundle", bundle_path, "--digit", 2, "--n-test", 12, "--split", "val", "--nearest")
    assert r["split"] == "val" and r["nearest"] is True and 0 <= r["corloc"] <= 100
    out = tmp_path / "repro"
    r = run(capsys, "reproduce", "new-digits", "--seeds", 0, 1, "--digits", 2, "--epochs", 1, "--agent-iterations", 2,
            "--adapt-iterations", 2, "--unlabeled", 16, "--n-test", 12, "--finetune-iterations", 3, "--ablation",
            "--out", out)
    summary = r["summary"]
    assert set(summary) == {"2", "mean"} and summary["mean"]["corloc_after"]["n"] == 2
    assert {"corloc_before", "corloc_finetune", "corloc_ranking", "ordacc_proto"} <= set(summary["2"])
    assert set(r["ablation_iou_reward"]) == {"iou", "iou_sign"}
    assert (out / "seed0" / "paths_2_patch_after.png").exists() and (out / "metrics.json").exists()


def test_cli_reports_bad_input(tmp_path, capsys):
    bogus = tmp_path / "x.pt"
    bogus.write_bytes(b"not a bundle")
    assert main(["evaluate", "--bundle", str(bogus), "--n-test", "4"]) == 2
    assert "not a readable qloc-bundle" in capsys.readouterr().err


def test_console_entry_point():
    out = subprocess.run([sys.executable, "-m", "models", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("train-embedding", "train-agent", "adapt", "evaluate", "reproduce", "fetch-photos"):
        assert cmd in out
