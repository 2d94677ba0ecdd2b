"""A general cMNIST bundle (issue 11): several digits at once, each labeled by kind, through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from models.bundle import load_bundle, new_bundle
from models.cli import main
from models.experiments.datasets import CMnistDigitsKind, CMnistKind
from models.presets import mnist_config


def test_each_role_draws_every_digit_labeled_by_kind():
    bundle = new_bundle("t", mnist_config(), 0)
    kind = CMnistDigitsKind((1, 7, 3))
    train = kind.draw(bundle, "train", 4, seed=0)
    assert len(train) == 12 and train.classes.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # Digit by digit, the very images a one-digit kind draws: the same data discipline.
    one = CMnistKind(7).draw(bundle, "train", 4, seed=0)
    assert torch.equal(train.images[4:8], one.images) and torch.equal(train.boxes[4:8], one.boxes)
    # val_exemplars follow val in the same draw, per digit: no image is in both.
    val = kind.draw(bundle, "val", 3, seed=0)
    vex = kind.draw(bundle, "val_exemplars", 2, seed=0, after=3)
    assert torch.equal(vex.images[2:4], CMnistKind(7).draw(bundle, "val_exemplars", 2, seed=0, after=3).images)
    assert not (val.images[:, None] == vex.images[None]).flatten(2).all(-1).any()
    assert kind.select_with_exemplars() and kind.sizes()["n_train"] == 50
    assert kind.describe().startswith("cMNIST digits 173")


@pytest.mark.parametrize("digits", [(4,), (1, 1), (3, 10)])
def test_bad_digit_lists_are_refused(digits):
    with pytest.raises(ValueError, match="two or more distinct digits"):
        CMnistDigitsKind(digits)


def test_the_cross_kind_weight_reaches_stage_1(monkeypatch, tmp_path):
    import models.cli as cli

    seen = {}

    def fake_train(bundle, train, val, cfg, **kw):  # records the config, trains nothing
        seen["cfg"] = cfg
        return {"val/ordacc": 50.0, "best_epoch": 1, "history": []}

    monkeypatch.setattr(cli, "train_embedding", fake_train)
    out = tmp_path / "e.pt"
    assert main(["train-embedding", "--digits", "1", "2", "--n-train", "10", "--epochs", "1", "--class-weight", "0.25",
                 "--out", str(out)]) == 0
    assert seen["cfg"].class_weight == 0.25
    assert main(["train-embedding", "--digits", "1", "2", "--n-train", "10", "--epochs", "1", "--out", str(out)]) == 0
    assert seen["cfg"].class_weight == 0.0  # the kind's default: off


def test_cli_trains_a_general_bundle(tmp_path, capsys):
    emb, out = tmp_path / "emb.pt", tmp_path / "general.pt"
    assert main(["train-embedding", "--digits", "0", "5", "--n-train", "10", "--epochs", "1", "--device", "cpu",
                 "--class-weight", "0.1", "--name", "mnist-general", "--out", str(emb)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 0 <= r["val/ordacc"] <= 100
    b = load_bundle(emb)
    assert b.name == "mnist-general" and "digits 05" in b.provenance["data"] and "of each digit" in b.provenance["data"]
    assert main(["train-agent", "--digits", "0", "5", "--bundle", str(emb), "--n-train", "10", "--iterations", "2",
                 "--out", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 0 <= r["val/corloc"] <= 100 and load_bundle(out).agent_state is not None
    # A bad list is a usage error of the command, not a traceback.
    assert main(["train-embedding", "--digits", "2", "2", "--out", str(tmp_path / "x.pt")]) == 2
    assert "distinct digits" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()
