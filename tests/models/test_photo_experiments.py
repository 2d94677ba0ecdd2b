"""The photo protocol: a smoke run of stages 1-3 and both CLI commands on a tiny fixture manifest.

The fixture is made here (RGBA discs and squares on noise backgrounds), so the tests need neither
``var/photos`` nor the ImageNet weights (the backbone is built with ``pretrained=False``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from models import photo_experiments as pe
from models.bundle import load_bundle, new_bundle
from models.cli import main
from models.metrics import corloc, spearman
from models.photos import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION

SIZE = 32
EMBED = 32
COLORS = {"mammals": (200, 120, 40), "birds": (40, 90, 220), "fish": (230, 230, 40)}


def _cutout(rng, side: int, color, disc: bool) -> Image.Image:
    yy, xx = np.mgrid[:side, :side] / side - 0.5
    alpha = np.clip((0.45 - np.hypot(xx, yy)) * side, 0, 1) if disc else np.ones((side, side))
    rgb = np.clip(np.array(color, float) + rng.normal(0, 15, (side, side, 3)), 0, 255)
    return Image.fromarray(np.dstack([rgb, alpha * 255]).round().astype(np.uint8), "RGBA")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> dict:
    """A manifest in the format of ``models.photos`` with 3 classes and noise backgrounds, every split filled."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    objects: dict[str, list] = {}
    for c, color in COLORS.items():
        objects[c] = []
        for i, split in enumerate(["train", "train", "val", "test"]):
            rel = f"objects/{c}/{i}.png"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            _cutout(rng, 40 + 8 * i, color, disc=i % 2 == 0).save(root / rel)
            objects[c].append({"path": rel, "split": split})
    backgrounds = []
    for i, split in enumerate(["train", "train", "val", "test"]):
        rel = f"backgrounds/{i}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        arr = np.clip(np.array((60, 140, 70)) + rng.normal(0, 35, (90, 120, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(root / rel, quality=95)
        backgrounds.append({"path": rel, "split": split})
    data = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "objects": objects, "backgrounds": backgrounds}
    (root / MANIFEST).write_text(json.dumps(data))
    return {**data, "root": str(root)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits on a busy CI machine (>10x faster here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def tiny_networks(monkeypatch):
    """Random backbone weights (no ImageNet weights package needed) and a small head, for speed."""
    real = pe.photo_model_config

    def cfg(setup):
        c = real(setup)
        c.encoder.options = {**c.encoder.options, "pretrained": False}
        c.head.hidden, c.head.out_features = 64, EMBED
        c.agent.embed_dim = EMBED
        return c
    monkeypatch.setattr(pe, "photo_model_config", cfg)


def _tiny_setup() -> pe.PhotoTrainSetup:
    s = pe.PhotoTrainSetup(size=SIZE, n_train=10, n_val=6)
    s.embedding.epochs, s.embedding.batch_size, s.embedding.eval_every = 2, 10, 1
    s.agent.iterations, s.agent.eval_every, s.agent.batch_size = 3, 1, 10
    return s


def test_candidates_are_inside_the_image_and_not_only_squares():
    c = pe.photo_candidates(224, 40.0)
    wh = c[:, 2:] - c[:, :2]
    assert c.shape[1] == 4 and len(c) > 500
    assert bool((c >= 0).all()) and bool((c <= 224).all()) and bool((wh >= 30).all())
    assert bool((wh[:, 0] / wh[:, 1] > 1.5).any()) and bool((wh[:, 1] / wh[:, 0] > 1.5).any())


def test_stage1_with_the_papers_anchor(manifest):
    setup = _tiny_setup()
    bundle = new_bundle("x", pe.photo_model_config(setup), seed=0)
    train = pe.photo_set(bundle, manifest, "mammals", "train", 10, seed=0)
    val_ex = pe.photo_set(bundle, manifest, "mammals", "val", 5, seed=1, crops=True)
    out = pe.train_photo_embedding(bundle, train, val_ex, val_ex, setup.embedding, anchor="shuffle_proto")
    assert out["best_epoch"] in (1, 2) and not any(p.requires_grad for p in bundle.embedder.parameters())
    with pytest.raises(ValueError, match="crops=True"):
        pe.train_photo_embedding(bundle, train, val_ex, val_ex, setup.embedding, anchor="shuffle_exemplar")


def test_pipeline_smoke(manifest):
    torch.manual_seed(0)
    setup = _tiny_setup()
    logs = []
    bundle = pe.train_photo_bundle("photo-tiny", manifest, setup, seed=0, log=lambda s, r: logs.append(s))
    assert {"embedding", "agent"} <= set(logs)
    prov = bundle.provenance
    assert 0 <= prov["embedding"]["val/ordacc"] <= 100 and 0 <= prov["agent"]["val/corloc"] <= 100
    assert bundle.config.agent.use_prototype == setup.use_prototype
    ts = pe.PhotoTransferSetup("birds", unlabeled=6, test=6, ranking_images=1, finetune_iterations=2)
    ts.adapt.iterations, ts.adapt.batch_size = 2, 4
    m, art = pe.photo_transfer(bundle, manifest, ts, seed=0)
    for k in ("corloc_before", "corloc_after", "corloc_ranking", "corloc_finetune", "ordacc", "ordacc_inst",
              "corloc_before_best16", "corloc_after_best16", "corloc_after_best16_ranking_subset",
              "corloc_before_nearest", "corloc_after_nearest"):
        assert 0 <= m[k] <= 100, k
    assert -1 <= m["spearman"] <= 1 and m["adapt_seconds"] > 0
    steps = bundle.config.env.steps
    assert art["trajectory_after"].shape == (steps + 1, 6, 4)
    summary = pe.summarize([m, {**m, "seed": 1}], "mammals")
    assert summary["birds"]["corloc_after"]["n"] == 2 and "mean_new_classes" in summary
    assert summary["birds"]["corloc_after_best16"]["n"] == 2


def test_stage2_restarts_keep_the_best_on_validation(manifest):
    one = _tiny_setup()
    one.agent_restarts = 1
    single = pe.train_photo_bundle("a", manifest, one, seed=0).provenance["agent"]
    setup = _tiny_setup()
    setup.agent_restarts = 3
    bundle = pe.train_photo_bundle("b", manifest, setup, seed=0)
    prov = bundle.provenance["agent"]
    runs = prov["restarts_val_corloc"]
    assert len(runs) == 3 and runs[0] == single["val/corloc"]  # restart 0 is the single run
    assert prov["val/corloc"] == max(runs) and prov["restart"] == runs.index(max(runs))
    # the kept weights are the chosen run's: they score its val CorLoc again
    val = pe.photo_set(bundle, manifest, "mammals", "val", setup.n_val, 0)
    val_ex = pe.photo_set(bundle, manifest, "mammals", "val", setup.exemplars, 500, crops=True)
    traj = pe.localize(bundle, bundle.new_agent(), val.feats, pe.prototype_of(bundle, val_ex))
    assert corloc(traj[-1], val.boxes) == prov["val/corloc"]
    setup.agent_restarts = 0
    with pytest.raises(ValueError, match="agent_restarts"):
        pe.train_photo_bundle("c", manifest, setup, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipeline_on_cuda(manifest):
    """Stages 1-3 and every metric with the networks and feature maps on the GPU, boxes on the CPU."""
    setup = _tiny_setup()
    setup.agent_restarts = 2
    bundle = pe.train_photo_bundle("photo-cuda", manifest, setup, seed=0, device="cuda")
    assert next(bundle.embedder.parameters()).is_cuda and not bundle.agent_state["policy.weight"].is_cuda
    ts = pe.PhotoTransferSetup("birds", unlabeled=6, test=6, ranking_images=2, finetune_iterations=2)
    ts.adapt.iterations, ts.adapt.batch_size = 2, 4
    m, _ = pe.photo_transfer(bundle, manifest, ts, seed=0)
    for k in ("corloc_before", "corloc_after", "corloc_ranking", "corloc_finetune", "corloc_after_best16",
              "corloc_after_nearest"):
        assert 0 <= m[k] <= 100, k


def test_ranking_metrics_agree_with_a_reference_loop(manifest):
    """Vectorized OrdAcc / Spearman == per-image reference on the same sampled pairs."""
    from models.ordinal import sample_pairs

    bundle = new_bundle("x", pe.photo_model_config(pe.PhotoTrainSetup(size=SIZE)), seed=1)
    data = pe.photo_set(bundle, manifest, "fish", "test", 4, seed=3, crops=True)
    proto = pe.prototype_of(bundle, data)
    m = pe.ranking_metrics(bundle, data, proto, pairs=6, seed=5)
    cfg = bundle.config
    p = sample_pairs(data.boxes, pe.photo_candidates(SIZE, cfg.env.min_side, sides=10), 6,
                     generator=torch.Generator().manual_seed(5))
    agree, rhos = [], []
    with torch.no_grad():
        for i in range(4):  # the slow, obvious way
            e = bundle.embedder.embed(data.feats[i:i + 1], torch.cat([p.pos[i], p.neg[i]])[None])[0]
            d = (e - proto).norm(dim=-1)
            agree += [float(d[j] < d[6 + j]) for j in range(6)]
            rhos.append(float(spearman(d.double(), torch.cat([p.pos_iou[i], p.neg_iou[i]]).double())))
    assert m["ordacc"] == pytest.approx(100 * sum(agree) / len(agree), abs=1e-4)
    assert m["spearman"] == pytest.approx(sum(rhos) / len(rhos), abs=1e-5)


def test_speed_reports_both_throughputs(manifest):
    bundle = new_bundle("x", pe.photo_model_config(pe.PhotoTrainSetup(size=SIZE)), seed=1)
    out = pe.measure_speed(bundle, torch.rand(2, 3, SIZE, SIZE), torch.zeros(EMBED), batch_sizes=(1, 2), repeats=1)
    assert out["localize_images_per_s_batch2"] > 0 and out["backbone_images_per_s_batch1"] > 0


def test_cli_photo_train_and_reproduce(manifest, tmp_path, monkeypatch):
    tiny = ["--size", str(SIZE), "--n-train", "10", "--n-val", "4", "--epochs", "1", "--batch-size", "10",
            "--pairs", "2", "--agent-iterations", "1", "--agent-batch-size", "10", "--cache", manifest["root"]]
    out = tmp_path / "photo-tiny.pt"
    assert main(["photo-train", "--out", str(out), *tiny]) == 0
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["command"].startswith("qloc photo-train") and "val/corloc" in info["metrics"]
    assert load_bundle(out).name == "photo-tiny"
    run = tmp_path / "run"
    assert main(["photo-reproduce", "--seeds", "0", "--classes", "fish", "--out", str(run), *tiny,
                 "--adapt-iterations", "1", "--unlabeled", "4", "--n-test", "4", "--ranking-images", "1",
                 "--finetune-iterations", "1", "--speed-repeats", "1", "--agent-episodes", "2",
                 "--adapt-episodes", "2", "--agent-restarts", "2"]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert [r["class"] for r in metrics["rows"]] == ["fish"]
    assert "fish" in metrics["summary"] and metrics["speed"]["backbone_images_per_s_batch1"] > 0
    words = metrics["command"].split()
    assert {"--agent-episodes 2", "--adapt-episodes 2", "--agent-restarts 2"} <= {
        f"{a} {b}" for a, b in zip(words, words[1:], strict=False)}
    assert len(metrics["train"]["0"]["val/corloc_restarts"]) == 2
    # --reuse: stages 1-2 from the run above's seed bundle, no training
    again = tmp_path / "again"
    assert main(["photo-reproduce", "--seeds", "0", "--classes", "fish", "--out", str(again), "--reuse", str(run),
                 "--cache", manifest["root"], "--size", str(SIZE), "--adapt-iterations", "1", "--unlabeled", "4",
                 "--n-test", "4", "--ranking-images", "1", "--finetune-iterations", "1", "--speed-repeats", "1"]) == 0
    info = json.loads((again / "metrics.json").read_text())["train"]["0"]
    assert info["reused"].endswith("seed0/bundle.pt") and info["val/corloc"] == metrics["train"]["0"]["val/corloc"]
    assert not (again / "seed0" / "bundle.pt").exists()
    assert list(run.glob("seed0/paths_fish_*.png"))
