"""Smoke runs of the real CLI entry point, end to end, on a tiny budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.bundle import load_bundle, load_policy
from models.cli import main
from models.data.types import exemplar_crops
from models.experiments.cmnist import cmnist
from models.inference import Localizer

SHIPPED = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def library_corloc(bundle_path, *, digit: int, n_test: int, policy=None, split: str = "test", nearest: bool = False,
                   exemplars: int = 5, background: str = "patch", seed: int = 0) -> float:
    """CorLoc as ``qloc evaluate`` defines it, computed through the library: the same cMNIST images
    (exemplars from the train file with seed + 1000), ``Localizer.run`` and IoU >= 0.5 written out here."""
    bundle = load_bundle(bundle_path)
    state = load_policy(policy, bundle)[0] if policy else None
    loc = Localizer(bundle, "cpu")
    proto = loc.prototype(exemplar_crops(cmnist(digit, "train", exemplars, background, seed + 1000)))
    test = cmnist(digit, split, n_test, background, seed)
    pred, gt = loc.run(test.images, proto, bundle.new_agent(state), nearest=nearest).boxes[-1], test.boxes
    lt, rb = torch.maximum(pred[:, :2], gt[:, :2]), torch.minimum(pred[:, 2:], gt[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    union = (pred[:, 2:] - pred[:, :2]).prod(1) + (gt[:, 2:] - gt[:, :2]).prod(1) - inter
    return 100.0 * int((inter / union >= 0.5).sum()) / n_test


@pytest.mark.slow
def test_cli_evaluate_scores_the_shipped_bundle(tmp_path, capsys):
    """``evaluate`` on the trained bundle: a high CorLoc (97.6 on 500 images), equal to the library's own
    computation; with an adapted ``--policy``, the policy's CorLoc, not the base one's."""
    n = 80
    base = run(capsys, "evaluate", "--bundle", SHIPPED, "--digit", 4, "--n-test", n, "--device", "cpu")
    assert base["policy"] == "base" and base["n_test"] == n
    assert base["corloc"] >= 85, base
    assert base["corloc"] == pytest.approx(library_corloc(SHIPPED, digit=4, n_test=n), abs=1e-6)
    assert 80 <= base["ordacc_proto"] <= 100 and 80 <= base["ordacc_inst"] <= 100

    pol = tmp_path / "policy.pt"
    run(capsys, "adapt", "--bundle", SHIPPED, "--digit", 4, "--unlabeled", 8, "--iterations", 1, "--batch-size", 8,
        "--lr", 0.01, "--out", pol, "--device", "cpu")
    adapted = run(capsys, "evaluate", "--bundle", SHIPPED, "--policy", pol, "--digit", 4, "--n-test", n,
                  "--device", "cpu")
    want = library_corloc(SHIPPED, digit=4, n_test=n, policy=pol)
    assert adapted["corloc"] == pytest.approx(want, abs=1e-6)
    assert want != base["corloc"]  # this policy answers differently: evaluating the base one instead fails


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
    assert r["corloc"] == pytest.approx(library_corloc(bundle_path, digit=2, n_test=12, policy=pol), abs=1e-6)
    r = run(capsys, "evaluate", "--bundle", bundle_path, "--digit", 2, "--n-test", 12, "--split", "val", "--nearest")
    assert r["split"] == "val" and r["nearest"] is True and 0 <= r["corloc"] <= 100
    assert r["corloc"] == pytest.approx(library_corloc(bundle_path, digit=2, n_test=12, split="val", nearest=True),
                                        abs=1e-6)
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


def test_fetch_commands_take_their_options():
    from models.cli import build_parser

    for cmd in ("fetch-photos", "fetch-real-photos"):  # the help of a missing manifest says `--cache DIR`
        a = build_parser().parse_args([cmd, "--cache", "/tmp/somewhere", "--force"])
        assert a.cache == "/tmp/somewhere" and a.force
