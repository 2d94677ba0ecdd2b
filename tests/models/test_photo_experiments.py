"""The photo protocol: a smoke run of stages 1-3 and both CLI commands on a tiny fixture manifest.

The fixture is made here (RGBA discs and squares on noise backgrounds), so the tests need neither
``data/photos`` nor the ImageNet weights (the backbone is built with ``pretrained=False``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.bundle import load_bundle, new_bundle
from models.cli import main
from models.core.boxes import candidate_boxes
from models.core.metrics import corloc, spearman
from models.data.photos import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION
from models.data.types import LabeledImages, exemplar_crops
from models.evaluate import localize_boxes, ranking, ranking_metrics, rect_candidates
from models.experiments import photos as pe
from models.experiments.baselines import finetune
from models.experiments.report import summarize
from models.experiments.speed import measure_speed
from models.features import prototype_of
from models.inference import Localizer
from models.train.embedding import train_embedding

SHIPPED_PHOTO_BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "photo-mammals.pt"

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
    """A manifest in the format of ``models.data.photos`` with 3 classes and noise backgrounds, every split filled."""
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


def corloc_by_definition(pred: torch.Tensor, gt: torch.Tensor) -> float:
    """% of images whose box has IoU >= 0.5 with the ground truth, written out here (not ``models.core.metrics``)."""
    lt, rb = torch.maximum(pred[:, :2], gt[:, :2]), torch.minimum(pred[:, 2:], gt[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area_p, area_g = (pred[:, 2:] - pred[:, :2]).prod(1), (gt[:, 2:] - gt[:, :2]).prod(1)
    hits = inter / (area_p + area_g - inter) >= 0.5
    return 100.0 * int(hits.sum()) / len(gt)


def recomputed_transfer_metrics(bundle, manifest, ts: pe.PhotoTransferSetup, seed: int, m: dict, art: dict) -> dict:
    """Every CorLoc ``photo_transfer`` reported, recomputed from the boxes it names: the artifacts' trajectories,
    and the episodes, searches and baselines run again on the same images and prototype; also checks the
    artifacts against the served path (``Localizer``). -> {metric: recomputed value}."""
    test, proto = art["test"], art["prototype"]
    gt, k, n_best = test.boxes, m["ranking_images"], ts.search_samples + 1
    base, adapted = bundle.new_agent(), bundle.new_agent(art["agent_state"])
    ex = pe.photo_set(bundle, manifest, ts.class_name, "train", ts.exemplars, seed + 1000, crops=True)
    loc = Localizer(bundle, "cpu")
    # The prototype and the greedy episodes are the served ones (Localizer, from the images and crops).
    assert torch.allclose(loc.prototype(exemplar_crops(ex)), proto, atol=1e-5)
    for agent, traj in ((base, art["trajectory_before"]), (adapted, art["trajectory_after"])):
        assert torch.allclose(loc.run(test.images, proto, agent, nearest=False).boxes, traj, atol=1e-3)
        assert torch.equal(localize_boxes(bundle, agent, test, proto), traj)
    before, after = art["trajectory_before"][-1], art["trajectory_after"][-1]
    best_before = localize_boxes(bundle, base, test, proto, samples=ts.search_samples, seed=seed)[-1]
    best_after = localize_boxes(bundle, adapted, test, proto, samples=ts.search_samples, seed=seed)[-1]
    cfg = bundle.config
    cands = rect_candidates(bundle, sides=7, stride=cfg.input.size // 10)
    assert m["ranking_candidates"] == len(cands) and k == min(ts.ranking_images, len(test))
    ft = finetune(bundle, LabeledImages(ex.images, ex.boxes), proto, ts.finetune_iterations, ts.finetune, seed=seed)
    nearest = {tag: localize_boxes(bundle, agent, test, proto, nearest=True)[-1]
               for tag, agent in (("before", base), ("after", adapted))}
    return {
        "corloc_before": corloc_by_definition(before, gt),
        "corloc_after": corloc_by_definition(after, gt),
        "corloc_before_nearest": corloc_by_definition(nearest["before"], gt),
        "corloc_after_nearest": corloc_by_definition(nearest["after"], gt),
        f"corloc_before_best{n_best}": corloc_by_definition(best_before, gt),
        f"corloc_after_best{n_best}": corloc_by_definition(best_after, gt),
        f"corloc_after_best{n_best}_ranking_subset": corloc_by_definition(best_after[:k], gt[:k]),
        "corloc_ranking": corloc_by_definition(
            ranking(bundle, test.subset(torch.arange(k)), proto, cands, batch=1, chunk=1024), gt[:k]),
        "corloc_after_ranking_subset": corloc_by_definition(after[:k], gt[:k]),
        "corloc_finetune": corloc_by_definition(
            localize_boxes(bundle, bundle.new_agent(ft), test, proto)[-1], gt),
        **ranking_metrics(bundle, test, proto, seed=seed, candidates=rect_candidates(bundle)),
    }


def assert_reported_as_recomputed(m: dict, again: dict) -> None:
    assert {k for k in m if k.startswith("corloc")} == {k for k in again if k.startswith("corloc")}
    for key, value in again.items():
        assert m[key] == pytest.approx(value, abs=1e-4), key


def _tiny_setup() -> pe.PhotoTrainSetup:
    s = pe.PhotoTrainSetup(size=SIZE, n_train=10, n_val=6)
    s.embedding.epochs, s.embedding.batch_size, s.embedding.eval_every = 2, 10, 1
    s.agent.iterations, s.agent.eval_every, s.agent.batch_size = 3, 1, 10
    return s


def test_candidates_are_inside_the_image_and_not_only_squares():
    c = candidate_boxes(224, 40.0, sides=8, max_aspect=2.5, min_fraction=0.75)
    wh = c[:, 2:] - c[:, :2]
    assert c.shape[1] == 4 and len(c) > 500
    assert bool((c >= 0).all()) and bool((c <= 224).all()) and bool((wh >= 30).all())
    assert bool((wh[:, 0] / wh[:, 1] > 1.5).any()) and bool((wh[:, 1] / wh[:, 0] > 1.5).any())


def test_stage1_with_the_papers_anchor(manifest):
    setup = _tiny_setup()
    bundle = new_bundle("x", pe.photo_model_config(setup), seed=0)
    train = pe.photo_set(bundle, manifest, "mammals", "train", 10, seed=0)
    val_ex = pe.photo_set(bundle, manifest, "mammals", "val", 5, seed=1, crops=True)
    cfg = replace(setup.embedding, anchor="shuffle_proto")
    out = train_embedding(bundle, train, val_ex, cfg, val_exemplars=val_ex, candidates=rect_candidates(bundle))
    assert out["best_epoch"] in (1, 2) and not any(p.requires_grad for p in bundle.embedder.parameters())
    # without cached crop features the exemplar anchor embeds the crops through the backbone, to the same result
    cached = pe.photo_set(bundle, manifest, "mammals", "train", 10, seed=0, crops=True)
    runs = []
    for data in (train, cached):
        b = new_bundle("x", pe.photo_model_config(setup), seed=0)
        train_embedding(b, data, val_ex, replace(setup.embedding, anchor="shuffle_exemplar"), val_exemplars=val_ex,
                        candidates=rect_candidates(b))
        runs.append(b.embedder.head.state_dict())
    for k, v in runs[0].items():
        assert torch.allclose(v, runs[1][k], atol=1e-5), k


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
    assert_reported_as_recomputed(m, recomputed_transfer_metrics(bundle, manifest, ts, 0, m, art))
    # the validation CorLoc in the provenance is the kept agent's, recomputed
    val = pe.photo_set(bundle, manifest, "mammals", "val", setup.n_val, 0)
    val_ex = pe.photo_set(bundle, manifest, "mammals", "val", setup.exemplars, 500, crops=True)
    traj = localize_boxes(bundle, bundle.new_agent(), val, prototype_of(bundle, val_ex))
    assert prov["agent"]["val/corloc"] == pytest.approx(corloc_by_definition(traj[-1], val.boxes), abs=1e-4)
    other = {**m, "seed": 1, "corloc_after": m["corloc_after"] + 30.0}
    summary = summarize([m, other], "class", leave_out="mammals", mean_key="mean_new_classes")
    assert summary["birds"]["corloc_after"] == {"mean": round(m["corloc_after"] + 15.0, 3), "std": 21.213, "n": 2}
    assert summary["mean_new_classes"]["corloc_after"]["mean"] == round(m["corloc_after"] + 15.0, 3)
    assert summary["birds"]["corloc_after_best16"] == {"mean": round(m["corloc_after_best16"], 3), "std": 0.0, "n": 2}


def test_reported_corloc_is_recomputed_from_its_boxes_on_the_shipped_bundle(manifest):
    """``photo_transfer`` with the trained photo bundle on the fixture photos, where CorLoc is far from 0:
    every reported value equals its recomputation from the definition, so a scaled value fails, and so does
    one taken from other boxes (this draw gives each pair of related metrics different values)."""
    bundle = load_bundle(SHIPPED_PHOTO_BUNDLE)
    ts = pe.PhotoTransferSetup("mammals", unlabeled=4, test=10, ranking_images=2, finetune_iterations=3,
                               search_samples=7)
    ts.adapt.iterations, ts.adapt.batch_size = 1, 4
    m, art = pe.photo_transfer(bundle, manifest, ts, seed=0)
    again = recomputed_transfer_metrics(bundle, manifest, ts, 0, m, art)
    assert_reported_as_recomputed(m, again)
    zero = [k for k, v in again.items() if k.startswith("corloc") and v == 0]
    assert zero == ["corloc_after_best8_ranking_subset"], zero  # the others have hits: scaling them shows
    related = [("before", "after"), ("before", "before_nearest"), ("after", "after_nearest"),
               ("before", "before_best8"), ("after", "after_best8"), ("before_best8", "after_best8"),
               ("before_nearest", "after_nearest"), ("before", "finetune"), ("ranking", "after_ranking_subset"),
               ("after_ranking_subset", "after_best8_ranking_subset")]
    assert all(again[f"corloc_{a}"] != again[f"corloc_{b}"] for a, b in related), again


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
    traj = localize_boxes(bundle, bundle.new_agent(), val, prototype_of(bundle, val_ex))
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
    from models.core.ordinal import sample_pairs

    bundle = new_bundle("x", pe.photo_model_config(pe.PhotoTrainSetup(size=SIZE)), seed=1)
    data = pe.photo_set(bundle, manifest, "fish", "test", 4, seed=3, crops=True)
    proto = prototype_of(bundle, data)
    m = ranking_metrics(bundle, data, proto, pairs=6, seed=5)
    p = sample_pairs(data.boxes, rect_candidates(bundle), 6,
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
    out = measure_speed(bundle, torch.rand(2, 3, SIZE, SIZE), torch.zeros(EMBED), batch_sizes=(1, 2), repeats=1)
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
    reused = json.loads((again / "metrics.json").read_text())
    info = reused["train"]["0"]
    assert info["reused"].endswith("seed0/bundle.pt") and info["val/corloc"] == metrics["train"]["0"]["val/corloc"]
    # The reported numbers are the bundle's: greedy and nearest-box CorLoc of the saved bundle on the same
    # test images and exemplars, recomputed; the summary's means are the rows' values (one seed).
    bundle = load_bundle(run / "seed0" / "bundle.pt")
    test = pe.photo_set(bundle, manifest, "fish", "test", 4, 0)
    proto = prototype_of(bundle, pe.photo_set(bundle, manifest, "fish", "train", 5, 1000, crops=True))
    row = reused["rows"][0]
    for key, nearest in (("corloc_before", False), ("corloc_before_nearest", True)):
        boxes = localize_boxes(bundle, bundle.new_agent(), test, proto, nearest=nearest)[-1]
        assert row[key] == pytest.approx(corloc_by_definition(boxes, test.boxes), abs=1e-4), key
    for result in (metrics, reused):
        for key, stats in result["summary"]["fish"].items():
            assert stats == {"mean": round(result["rows"][0][key], 3), "std": 0.0, "n": 1}, key
    assert not (again / "seed0" / "bundle.pt").exists()
    assert list(run.glob("seed0/paths_fish_*.png"))


def test_stage_commands_run_on_photos(manifest, tmp_path):
    """train-embedding, train-agent, adapt and evaluate take ``--data photos`` as they take cMNIST."""
    data = ["--data", "photos", "--cache", manifest["root"], "--size", str(SIZE), "--device", "cpu"]
    emb, bundle, policy = tmp_path / "e.pt", tmp_path / "b.pt", tmp_path / "p.pt"
    assert main(["train-embedding", *data, "--n-train", "10", "--epochs", "1", "--out", str(emb)]) == 0
    assert "offline photos, class mammals" in load_bundle(emb).provenance["data"]
    assert main(["train-agent", *data, "--bundle", str(emb), "--n-train", "10", "--iterations", "2",
                 "--out", str(bundle)]) == 0
    b = load_bundle(bundle)
    assert b.config.input.channels == 3 and b.provenance["agent"]["best_iteration"] in (1, 2)
    assert main(["adapt", *data, "--class", "birds", "--bundle", str(bundle), "--unlabeled", "4",
                 "--iterations", "1", "--batch-size", "4", "--out", str(policy)]) == 0
    out = tmp_path / "eval.json"
    assert main(["evaluate", *data, "--class", "birds", "--bundle", str(bundle), "--policy", str(policy),
                 "--n-test", "10", "--metrics", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["class"] == "birds" and 0 <= m["corloc"] <= 100 and m["policy"] == str(policy)


def test_training_images_with_distractors_keep_the_objects_box(manifest):
    """``distractors``: other classes' cut-outs pasted beside the object; the box stays the object's (its alpha)."""
    bundle = new_bundle("d", pe.photo_model_config(_tiny_setup()), 0)
    plain = pe.photo_set(bundle, manifest, "mammals", "train", 12, 0)
    mixed = pe.photo_set(bundle, manifest, "mammals", "train", 12, 0, distractors=2)
    again = pe.photo_set(bundle, manifest, "mammals", "train", 12, 0, distractors=2)
    assert mixed.images.shape == plain.images.shape and mixed.boxes.shape == (12, 4)
    assert torch.equal(mixed.images, again.images) and torch.equal(mixed.boxes, again.boxes)  # deterministic
    assert not torch.equal(mixed.images, plain.images)
    side = (mixed.boxes[:, 2:] - mixed.boxes[:, :2]).max(1).values
    assert bool((side <= 0.45 * SIZE + 1).all())  # capped so that the object and a distractor fit side by side
    # the object is the mammals colour in its box; distractors (other colours) sit outside it
    own = torch.tensor(COLORS["mammals"], dtype=torch.float32) / 255
    for im, (x1, y1, x2, y2) in zip(mixed.images, mixed.boxes.round().int().tolist(), strict=True):
        inside = im[:, y1:y2, x1:x2].reshape(3, -1)
        assert bool(((inside - own[:, None]).abs().max(0).values < 0.25).any())
    with_other = [((im - torch.tensor(c, dtype=torch.float32)[:, None, None] / 255).abs().max(0).values < 0.2).any()
                  for im in mixed.images for k, c in COLORS.items() if k != "mammals"]
    assert any(bool(x) for x in with_other)  # some images hold another class's cut-out
