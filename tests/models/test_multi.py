"""Several instances per image (issue 13): the generators' exact boxes and overlap rule, AP50 / recall@K on
hand-made cases and against pycocotools, and the ranking + NMS and sliding-window baselines at a budget."""

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.ops import nms

from models.bundle import load_bundle
from models.core.boxes import pairwise_iou
from models.core.metrics import detection_metrics
from models.data.cmnist import CANVAS, DIGIT, load_mnist
from models.data.multi import _conflicts, _paste_patches_around, cmnist_multi, photos_multi, place
from models.data.photos import PasteParams
from models.evaluate import ranking_candidates
from models.experiments.baselines import (
    box_distances,
    nms_detections,
    ranking_candidates_within,
    ranking_nms,
    sliding_window,
    sliding_windows,
    topk_nms,
)
from models.inference import Localizer, normalize

SHIPPED = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


# ---------------------------------------------------------------- generators

def _overlap_px(a: torch.Tensor, b: torch.Tensor) -> float:
    """How deep two boxes overlap: the smaller of their intersection's width and height (0 if apart)."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    return max(0.0, float(min(iw, ih)))


def test_cmnist_multi_boxes_hold_exactly_the_pasted_digits():
    """Without overlap or background, each box's crop *is* an MNIST test digit: of the query for the instances,
    of the labelled other digit for the distractors; no ink lies outside the boxes."""
    b = cmnist_multi(3, "test", 12, seed=5, background="none", max_instances=3, distractors=(0, 1), max_overlap=0)
    images, labels = load_mnist("test")
    flat = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)  # [10000, 784]
    assert b.images.shape == (12, 1, CANVAS, CANVAS)
    for img, inst, dist, dlab in zip(b.images, b.boxes, b.distractor_boxes, b.distractor_labels, strict=True):
        covered = torch.zeros(CANVAS, CANVAS, dtype=torch.bool)
        for box, want in [(x, None) for x in inst] + list(zip(dist, dlab.tolist(), strict=True)):
            x1, y1, x2, y2 = (int(v) for v in box)
            assert (x2 - x1, y2 - y1) == (DIGIT, DIGIT) and x1 >= 0 and x2 <= CANVAS and y1 >= 0 and y2 <= CANVAS
            crop = img[0, y1:y2, x1:x2].reshape(-1)
            match = torch.nonzero((flat - crop).abs().amax(dim=1) < 1e-6).flatten()
            assert len(match) >= 1, "the box must hold one MNIST test image exactly"
            got = {int(labels[i]) for i in match}
            assert got == ({3} if want is None else {want}) and 3 not in (set() if want is None else got)
            covered[y1:y2, x1:x2] = True
        assert float(img[0][~covered].abs().max()) == 0.0
        boxes = torch.cat([inst, dist])
        iou = pairwise_iou(boxes, boxes)
        assert float((iou - torch.eye(len(boxes))).max()) <= 0.0  # touching at most


def test_cmnist_multi_counts_overlap_rule_and_determinism():
    b = cmnist_multi(4, "val", 20, seed=1, min_instances=2, max_instances=3, distractors=(1, 2))
    counts = b.counts
    assert int(counts.min()) >= 2 and int(counts.max()) <= 3 and len(set(counts.tolist())) == 2
    assert {len(d) for d in b.distractor_boxes} == {1, 2}
    assert all(4 not in lab.tolist() for lab in b.distractor_labels)
    assert float(b.images.min()) >= 0.0 and float(b.images.max()) <= 1.0
    for inst, dist in zip(b.boxes, b.distractor_boxes, strict=True):
        boxes = torch.cat([inst, dist])
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert _overlap_px(boxes[i], boxes[j]) <= 4  # the documented bound (max_overlap=4)
    again = cmnist_multi(4, "val", 20, seed=1, min_instances=2, max_instances=3, distractors=(1, 2))
    assert torch.equal(again.images, b.images)
    assert all(torch.equal(x, y) for x, y in zip(again.boxes, b.boxes, strict=True))
    other = cmnist_multi(4, "val", 20, seed=2, min_instances=2, max_instances=3, distractors=(1, 2))
    assert not torch.equal(other.images, b.images)


def test_a_full_canvas_of_seven_digits_fits_and_patches_miss_the_digits():
    b = cmnist_multi(7, "test", 10, seed=0, min_instances=4, max_instances=4, distractors=(3, 3))
    assert (b.counts == 4).all() and all(len(d) == 3 for d in b.distractor_boxes)
    rng = np.random.default_rng(0)
    boxes = [(0, 0, 28, 28), (40, 10, 68, 38)]
    canvas = np.zeros((CANVAS, CANVAS))
    assert _paste_patches_around(canvas, boxes, rng, 4) == 4
    assert canvas.max() > 0
    for x1, y1, x2, y2 in boxes:
        assert canvas[y1:y2, x1:x2].max() == 0.0
    full = np.zeros((CANVAS, CANVAS))  # no room at all: none pasted, and no endless loop
    assert _paste_patches_around(full, [(0, 0, CANVAS, CANVAS)], rng, 4) == 0


def test_place_follows_the_overlap_rule_and_refuses_what_cannot_fit():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = [(int(w), int(h)) for w, h in rng.integers(8, 30, (5, 2))]
        boxes = place(sizes, 64, 3, rng)
        assert [(x2 - x1, y2 - y1) for x1, y1, x2, y2 in boxes] == sizes
        assert all(x1 >= 0 and x2 <= 64 and y1 >= 0 and y2 <= 64 for x1, y1, x2, y2 in boxes)
        for i, (x1, y1, x2, y2) in enumerate(boxes):
            assert not _conflicts(x1, y1, x2 - x1, y2 - y1, boxes[:i], 3)
    with pytest.raises(RuntimeError, match="did not fit"):
        place([(28, 28)] * 10, 84, 0, rng)  # at most 9 disjoint frames


def test_cmnist_multi_defaults_to_fifty_test_images_of_seed_0_and_names_its_query():
    b = cmnist_multi(4)
    assert len(b) == 50 and b.query == 4 and b.images.shape == (50, 1, CANVAS, CANVAS)
    assert torch.equal(b.images, cmnist_multi(4, "test", 50, seed=0).images)
    assert all(lab.dtype == torch.long for lab in b.distractor_labels)


def test_cmnist_multi_splits_draw_apart_and_the_data_directory_given_is_read(tmp_path, monkeypatch):
    from models.data import DATA_DIR_ENV

    train, val = (cmnist_multi(4, s, 32, seed=0) for s in ("train", "val"))
    assert train.counts.tolist() != val.counts.tolist()  # each split's own stream, from the first draw on
    repo = Path(__file__).resolve().parents[2] / "data" / "mnist"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))  # holds no MNIST
    assert len(cmnist_multi(4, n=2, data_dir=str(repo))) == 2
    with pytest.raises(FileNotFoundError):
        cmnist_multi(4, n=2)


def test_cmnist_multi_refuses_what_it_cannot_draw_by_name():
    with pytest.raises(ValueError, match=r"^background must be one of \('patch', 'clutter', 'impulse', 'gaussian', "
                                         r"'none'\), got 'fog'$"):
        cmnist_multi(4, n=1, background="fog")
    with pytest.raises(ValueError, match="^need 1 <= min_instances <= max_instances, got 3, 2$"):
        cmnist_multi(4, n=1, min_instances=3, max_instances=2)
    with pytest.raises(ValueError, match="^need 1 <= min_instances"):
        cmnist_multi(4, n=1, min_instances=0)
    with pytest.raises(ValueError, match=r"^distractors must be \(min, max\) with 0 <= min <= max, got \(2, 1\)$"):
        cmnist_multi(4, n=1, distractors=(2, 1))
    with pytest.raises(ValueError, match="^distractors must be"):
        cmnist_multi(4, n=1, distractors=(-1, 1))
    assert len(cmnist_multi(4, n=1, background="none", distractors=(0, 0))) == 1


def test_place_takes_an_object_as_large_as_the_canvas_and_refuses_a_larger_one_on_either_side():
    rng = np.random.default_rng(0)
    assert place([(84, 84)], 84, 0, rng) == [(0, 0, 84, 84)]
    assert place([(84, 10)], 84, 0, rng)[0][::2] == (0, 84)
    for w, h in ((85, 10), (10, 85)):
        with pytest.raises(ValueError, match=f"^an object of {w}x{h} px does not fit on a 84x84 canvas$"):
            place([(w, h)], 84, 0, rng)


def test_cmnist_multi_draws_the_images_every_several_instances_number_was_measured_on():
    """BENCHMARKS.md's several-instances figures on cMNIST were measured on these images (the generator unchanged
    since 2026-11-26): a change to what it draws (counts, kinds, placement, patches, seeds, numpy's streams) shows
    here. A deliberate change re-runs the benchmark and updates these."""
    import hashlib

    def digest(b) -> str:  # type: ignore[no-untyped-def]
        h = hashlib.sha256(np.ascontiguousarray(b.images.numpy()).tobytes())
        for t in (*b.boxes, *b.distractor_boxes, *b.distractor_labels):
            h.update(np.ascontiguousarray(t.numpy()).tobytes() + b"|")
        return h.hexdigest()[:16]

    assert digest(cmnist_multi(4, "test", n=32, seed=0)) == "aaaf3d27e1dfff20"
    assert digest(cmnist_multi(7, "val", n=8, seed=1, background="clutter", min_instances=2, max_instances=3,
                               distractors=(1, 2))) == "6c3f4966156018f8"


def disc_manifest(root: Path) -> dict:
    """Red discs (a query class) and blue discs (a distractor class), two files each (a disc and an ellipse twice as
    tall as wide), on a green background. Each has a 1-px antenna out to its file's left and top edges, which scaling
    down often thins below the alpha threshold: a cut-out's box then starts inside the pasted square, not at its
    corner."""
    rng = np.random.default_rng(0)

    def disc(side: int, color: tuple[int, int, int], tall: int) -> Image.Image:
        yy, xx = np.mgrid[:side * tall, :side] / np.array([side * tall, side])[:, None, None] - 0.5
        alpha = (np.hypot(xx, yy) < 0.45).astype(np.float64)
        alpha[:, :4], alpha[:3, :] = 0, 0
        alpha[side * tall // 2, :side // 4] = 1.0
        alpha[0, side // 3:side // 2] = 1.0
        rgb = np.broadcast_to(np.array(color, float), (side * tall, side, 3))
        return Image.fromarray(np.dstack([rgb, alpha * 255]).round().astype(np.uint8), "RGBA")

    objects = {}
    for name, color in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        objects[name] = []
        for i in range(2):  # a disc, and an ellipse twice as tall as wide
            disc(30 + 10 * i + int(rng.integers(5)), color, 1 + i).save(root / f"{name}{i}.png")
            objects[name].append({"path": f"{name}{i}.png", "split": "test"})
    Image.new("RGB", (120, 100), (0, 255, 0)).save(root / "bg.png")
    return {"root": str(root), "objects": objects, "backgrounds": [{"path": "bg.png", "split": "test"}]}


def test_photos_multi_boxes_are_the_pasted_cutouts(tmp_path):
    """No jitter, no overlap: the red channel's tight box inside each instance box is that box (the blue one for a
    distractor), and a disc's colour replaces the background under it."""
    manifest = disc_manifest(tmp_path)
    params = PasteParams(object_side=(0.2, 0.3), brightness=0.0, contrast=0.0, saturation=0.0)
    b = photos_multi(manifest, "red", "test", 6, seed=0, size=96, max_overlap=0, params=params)
    assert b.images.shape == (6, 3, 96, 96) and b.images.dtype == torch.float32
    assert all(x.dtype == torch.float32 for x in (*b.boxes, *b.distractor_boxes))
    assert all(x.dtype == torch.long for x in b.distractor_labels)
    assert any(len(d) == 0 for d in b.distractor_boxes)  # an image without distractors still has long labels
    tall = torch.cat([*b.boxes, *b.distractor_boxes])
    assert bool(((tall[:, 3] - tall[:, 1]) > 1.5 * (tall[:, 2] - tall[:, 0])).any())  # the ellipses, placed whole
    for img, inst, dist, lab in zip(b.images, b.boxes, b.distractor_boxes, b.distractor_labels, strict=True):
        assert 1 <= len(inst) <= 4 and 0 <= len(dist) <= 3 and set(lab.tolist()) <= {1}
        for box, channel in [(x, 0) for x in inst] + [(x, 2) for x in dist]:
            x1, y1, x2, y2 = (int(v) for v in box)
            ys, xs = torch.nonzero(img[channel, y1:y2, x1:x2] >= 0.5, as_tuple=True)
            assert (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1) == (0, 0, x2 - x1, y2 - y1)
        opaque = (img[0] > 0.99) | (img[2] > 0.99)  # inside a disc: its colour over the green, not added to it
        assert bool(opaque.any()) and float(img[1][opaque].max()) < 0.01
        assert float(img[1][(img[0] == 0) & (img[2] == 0)].min()) == 1.0  # the background, untouched
    again = photos_multi(manifest, "red", "test", 6, seed=0, size=96, max_overlap=0, params=params)
    assert torch.equal(again.images, b.images)


def test_photos_multi_defaults_and_its_manifest_read_from_its_folder(tmp_path):
    """Fifty 224-px test images of seed 0, 1-4 instances and 0-3 distractors, at most 2 % of the side (4 px) of
    overlap; the manifest read from its folder as given in memory."""
    import json

    manifest = disc_manifest(tmp_path)
    b = photos_multi(manifest, "red")
    assert len(b) == 50 and b.images.shape[1:] == (3, 224, 224) and b.query == "red"
    assert float(b.images.min()) >= 0.0 and float(b.images.max()) <= 1.0
    assert set(b.counts.tolist()) == {1, 2, 3, 4} and {len(d) for d in b.distractor_boxes} == {0, 1, 2, 3}
    from models.data.photos import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION

    (tmp_path / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                                                 "objects": manifest["objects"],
                                                 "backgrounds": manifest["backgrounds"]}))
    same = photos_multi(tmp_path, "red", "test", 50, seed=0, size=224, min_instances=1,
                        max_instances=4, distractors=(0, 3), max_overlap=4)
    assert torch.equal(same.images, b.images)
    assert not torch.equal(photos_multi(manifest, "red", max_overlap=0).images, b.images)


# ---------------------------------------------------------------- metrics

GT = [torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]]), torch.tensor([[50.0, 50, 60, 60]])]


def test_perfect_detections_score_one():
    scores = [torch.tensor([0.9, 0.8]), torch.tensor([0.7])]
    assert detection_metrics(GT, scores, GT, k=4) == {"ap50": 1.0, "recall_at_k": 1.0}


def test_a_false_positive_ranked_first_lowers_ap_not_recall():
    boxes = [torch.cat([torch.tensor([[70.0, 0, 80, 10]]), GT[0]]), GT[1]]
    scores = [torch.tensor([0.99, 0.8, 0.7]), torch.tensor([0.6])]
    m = detection_metrics(boxes, scores, GT, k=4)
    assert m["recall_at_k"] == 1.0 and m["ap50"] < 1.0
    last = detection_metrics(boxes, [torch.tensor([0.1, 0.8, 0.7]), torch.tensor([0.6])], GT, k=4)
    assert last["ap50"] == 1.0  # ranked last, it costs nothing
    dup = detection_metrics([torch.cat([GT[0], GT[0][:1]]), GT[1]], [torch.tensor([0.9, 0.8, 0.95]),
                                                                    torch.tensor([0.6])], GT, k=4)
    assert dup["ap50"] < 1.0  # a second box on a matched instance is a false positive


def test_a_missed_instance_lowers_recall_at_k():
    boxes = [torch.cat([GT[0], torch.tensor([[70.0, 0, 80, 10]])]), GT[1]]
    m = detection_metrics(boxes, [torch.tensor([0.9, 0.5, 0.95]), torch.tensor([0.6])], GT, k=1)
    assert m["recall_at_k"] == pytest.approx(1 / 3)  # image 0 keeps only its false positive
    m2 = detection_metrics(boxes, [torch.tensor([0.9, 0.5, 0.95]), torch.tensor([0.6])], GT, k=2)
    assert m2["recall_at_k"] == pytest.approx(2 / 3)
    nothing = detection_metrics([torch.zeros(0, 4)] * 2, [torch.zeros(0)] * 2, GT, k=4)
    assert nothing == {"ap50": 0.0, "recall_at_k": 0.0}
    padded = detection_metrics(torch.stack([GT[0], torch.cat([GT[1], GT[1]])]),
                               torch.tensor([[0.9, 0.8], [0.7, -float("inf")]]), GT, k=4)
    assert padded == {"ap50": 1.0, "recall_at_k": 1.0}  # a non-finite score is no detection


def test_detection_metrics_edge_cases_and_refusals():
    one = torch.tensor([[0.0, 0, 10, 10]])
    # one image holding one ground-truth box is data, not "nothing to score"
    assert detection_metrics([one], [torch.tensor([0.3])], [one], k=1) == {"ap50": 1.0, "recall_at_k": 1.0}
    # IoU exactly 0.5 is a match, as in COCO (>=)
    half = torch.tensor([[0.0, 0, 10, 20]])
    assert detection_metrics([half], [torch.tensor([0.3])], [one], k=1) == {"ap50": 1.0, "recall_at_k": 1.0}
    # no images, or no ground truth: NaN, under the same names
    for m in (detection_metrics([], [], [], k=1),
              detection_metrics([one], [torch.tensor([0.3])], [torch.zeros(0, 4)], k=1)):
        assert set(m) == {"ap50", "recall_at_k"} and all(np.isnan(v) for v in m.values())
    with pytest.raises(ValueError, match="need one entry per image: 1 pred_boxes, 2 pred_scores, 1 gt_boxes"):
        detection_metrics([one], [torch.tensor([0.3])] * 2, [one], k=1)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        detection_metrics([one], [torch.tensor([0.3])], [one], k=0)
    with pytest.raises(ValueError, match=r"pred_boxes \(1, 2, 4\) and pred_scores \(1, 3\) do not match"):
        detection_metrics([torch.zeros(2, 4)], [torch.zeros(3)], [one], k=1)


def test_detection_metrics_pad_images_with_no_detection_whatever_the_scores_sign():
    """Scores may be negative (``-distance``): an image with fewer detections than another is padded with
    absent ones, never with a detection that scores 0 and outranks them all."""
    a, b = torch.tensor([[0.0, 0, 10, 10]]), torch.tensor([[20.0, 20, 30, 30]])
    m = detection_metrics([torch.cat([a, b]), b], [torch.tensor([-1.0, -5.0]), torch.tensor([-2.0])], [a, b], k=4)
    assert m == {"ap50": 1.0, "recall_at_k": 1.0}  # ranked: TP (-1), TP (-2), FP (-5)


def _coco(pred_boxes, pred_scores, gt_boxes, k):  # noqa: ANN001, ANN202
    coco_mod = pytest.importorskip("pycocotools.coco")
    cocoeval = pytest.importorskip("pycocotools.cocoeval")

    def xywh(b: list[float]) -> list[float]:
        return [b[0], b[1], b[2] - b[0], b[3] - b[1]]

    anns = [{"id": j + 1, "image_id": i + 1, "category_id": 1, "bbox": xywh(b), "iscrowd": 0,
             "area": (b[2] - b[0]) * (b[3] - b[1])}
            for j, (i, b) in enumerate((i, b) for i, g in enumerate(gt_boxes) for b in g.tolist())]
    dets = [{"image_id": i + 1, "category_id": 1, "bbox": xywh(b), "score": s}
            for i, (bs, ss) in enumerate(zip(pred_boxes, pred_scores, strict=True))
            for b, s in zip(bs.tolist(), ss.tolist(), strict=True)]
    with contextlib.redirect_stdout(io.StringIO()):
        gt = coco_mod.COCO()
        gt.dataset = {"images": [{"id": i + 1} for i in range(len(gt_boxes))], "annotations": anns,
                      "categories": [{"id": 1}]}
        gt.createIndex()
        ev = cocoeval.COCOeval(gt, gt.loadRes(dets), "bbox")
        ev.params.iouThrs, ev.params.maxDets = np.array([0.5]), [k]
        ev.params.areaRng, ev.params.areaRngLbl = [[0, 1e10]], ["all"]
        ev.evaluate()
        ev.accumulate()
    return float(ev.eval["precision"][0, :, 0, 0, 0].mean()), float(ev.eval["recall"][0, 0, 0, 0])


def test_detection_metrics_agree_with_pycocotools():
    g = torch.Generator().manual_seed(0)

    def boxes(n: int) -> torch.Tensor:
        xy = torch.randint(0, 60, (n, 2), generator=g).float()
        return torch.cat([xy, xy + torch.randint(10, 40, (n, 2), generator=g).float()], 1)

    for _ in range(25):
        gt = [boxes(int(torch.randint(0, 4, (1,), generator=g))) for _ in range(5)]
        if sum(len(x) for x in gt) == 0:
            continue
        pred = []
        for x in gt:  # jittered copies of the ground truth and random boxes: hits, near misses, false positives
            src = torch.cat([x, boxes(3)])
            m = int(torch.randint(1, 7, (1,), generator=g))
            pred.append(src[torch.randint(0, len(src), (m,), generator=g)]
                        + torch.randint(-5, 6, (m, 4), generator=g).float())
        scores = [torch.rand(len(p), generator=g).round(decimals=1) for p in pred]  # with ties
        k = int(torch.randint(1, 6, (1,), generator=g))
        ours = detection_metrics(pred, scores, gt, k)
        ap, rec = _coco(pred, scores, gt, k)
        assert ours["ap50"] == pytest.approx(ap, abs=1e-12) and ours["recall_at_k"] == pytest.approx(rec, abs=1e-12)


# ---------------------------------------------------------------- baselines

def test_topk_nms_is_torchvisions_nms_cut_at_k():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(3, 60, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 8 + torch.rand(3, 60, 2, generator=g) * 20], -1)  # [3, 60, 4]
    dist = torch.rand(3, 60, generator=g)
    for iou in (0.2, 0.5):
        idx, valid = topk_nms(boxes, dist, 6, iou)
        for i in range(3):  # the reference: one image at a time
            ref = nms(boxes[i], -dist[i], iou)[:6]
            assert idx[i][valid[i]].tolist() == ref.tolist()
            assert int(valid[i].sum()) == min(6, len(nms(boxes[i], -dist[i], iou)))
    idx, valid = topk_nms(boxes[0, :2], dist[:, :2], 4, 0.5)  # shared boxes; fewer than k -> invalid rows
    assert valid[:, 2:].sum() == 0 and valid[:, 0].all()
    far = dist.clone()
    far[0, :] = torch.inf  # no candidate in image 0; in image 1, only the boxes at finite distance
    far[1, 10:] = torch.inf
    idx, valid = topk_nms(boxes, far, 6, 0.5)
    assert not valid[0].any() and (idx[1][valid[1]] < 10).all() and valid[2].any()
    assert idx[1][valid[1]].tolist() == nms(boxes[1, :10], -far[1, :10], 0.5)[:6].tolist()


def test_budgeted_candidates_stay_within_the_budget():
    bundle = load_bundle(SHIPPED)
    for budget in (1, 60, 190):
        c = ranking_candidates_within(bundle, budget)
        assert 0 < len(c) <= budget and c.shape[1] == 4
        assert (c[:, 2:] - c[:, :2] >= bundle.config.env.min_side * 0.5).all()
    assert torch.equal(ranking_candidates_within(bundle, 949), ranking_candidates(bundle))
    assert len(ranking_candidates_within(bundle, 190)) >= 180  # close to the budget, not a coarse per_side step
    for budget in (1, 5, 30, 190):
        w = sliding_windows(84, (28.0, 26.0), budget)
        assert 0 < len(w) <= budget and budget - len(w) < 2 * int(budget ** 0.5) + 1
        assert torch.equal(w[:, 2:] - w[:, :2], torch.tensor([28.0, 26.0]).expand(len(w), 2))
        assert float(w[:, :2].min()) >= 0 and float(w[:, 2].max()) <= 84 and float(w[:, 3].max()) <= 84
    w = sliding_windows(84, (28.0, 28.0), 16)
    assert float(w[:, 0].min()) == 0 and float(w[:, 2].max()) == 84  # edge to edge


def test_baselines_return_at_most_k_boxes_best_first():
    loc = Localizer(load_bundle(SHIPPED), "cpu")
    b = cmnist_multi(4, "val", 3, seed=0)
    with torch.inference_mode():
        feats = loc.embedder.features(normalize(b.images, loc.spec))
    proto = torch.randn(loc.bundle.config.head.out_features, generator=torch.Generator().manual_seed(0))
    cands = ranking_candidates_within(loc.bundle, 60)
    for det in (ranking_nms(loc.bundle, feats, proto, 4, cands, 0.3),
                sliding_window(loc.bundle, feats, proto, 4, (28.0, 28.0), 60, 0.3)):
        assert det.boxes.shape == (3, 4, 4) and det.valid.shape == det.distances.shape == (3, 4)
        assert det.evaluations <= 60
        d = det.distances.masked_fill(~det.valid, torch.inf)
        assert (d[:, 1:] >= d[:, :-1]).all()  # best (nearest) first
        for i in range(3):
            kept = det.boxes[i][det.valid[i]]
            iou = pairwise_iou(kept, kept) - torch.eye(len(kept))
            assert float(iou.max()) <= 0.3
    dist = box_distances(loc.bundle, feats, cands, proto)
    per_image = torch.stack([box_distances(loc.bundle, feats[i:i + 1], cands, proto)[0] for i in range(3)])
    assert torch.allclose(dist, per_image, atol=1e-4)
    # by value: each box's embedding distance to the prototype, and with one prototype per image each image's own
    with torch.inference_mode():
        emb = loc.embedder.embed(feats, cands.expand(3, -1, -1))  # [3, C, D]
    assert torch.allclose(dist, (emb - proto).norm(dim=-1), atol=1e-4)
    protos = torch.randn(3, proto.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.allclose(box_distances(loc.bundle, feats, cands, protos, max_boxes=50),
                          (emb - protos[:, None]).norm(dim=-1), atol=1e-4)
    best = nms_detections(cands, dist, 1)
    assert torch.equal(best.boxes[:, 0], cands[dist.argmin(dim=1)])  # K = 1: the ranking baseline's answer


def test_nms_detections_count_every_candidate_as_an_evaluation_and_leave_no_distance_on_a_missing_detection():
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [40, 40, 50, 50], [60, 0, 70, 10], [0, 60, 10, 70]])
    distances = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [9.0, torch.inf, torch.inf, torch.inf, torch.inf]])
    det = nms_detections(boxes, distances, k=3)
    assert det.evaluations == 5  # the compute measure: every candidate embedded, not the k kept
    assert det.valid.tolist() == [[True, True, True], [True, False, False]]
    assert torch.equal(det.boxes[0], boxes[[0, 2, 3]])  # box 1 overlaps box 0 (IoU 0.68 > 0.5): suppressed
    assert det.distances[0].tolist() == pytest.approx([0.1, 0.3, 0.4]) and det.distances[1, 0] == 9.0
    assert bool(torch.isinf(det.distances[1, 1:]).all())
    idx, valid = topk_nms(boxes, distances, 3)
    assert idx.tolist() == [[0, 2, 3], [0, 0, 0]]  # a missing detection's index is 0


def test_topk_nms_suppresses_above_iou_one_half_by_default_and_answers_nothing_without_a_candidate():
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 13], [0, 0, 10, 18]])  # IoU with the first: 0.77, 0.56
    near = torch.tensor([[0.1, 0.2, 0.3]])
    assert topk_nms(boxes, near, 3)[0].tolist() == [[0, 0, 0]] and topk_nms(boxes, near, 3)[1].tolist() == [
        [True, False, False]]
    assert topk_nms(boxes, near, 3, iou_threshold=0.6)[0].tolist() == [[0, 2, 0]]
    none = torch.full((2, 3), torch.inf)
    idx, valid = topk_nms(boxes, none, 4)
    assert idx.shape == valid.shape == (2, 4) and idx.dtype == torch.long and valid.dtype == torch.bool
    assert not bool(valid.any()) and not bool(idx.any())


def test_sliding_windows_grid_the_budget_and_centre_a_single_window():
    one = sliding_windows(84, (28, 20), 1)
    assert one.tolist() == [[28.0, 32.0, 56.0, 52.0]] and one.dtype == torch.float32  # centred
    assert len(sliding_windows(84, (28, 28), 6)) == 6  # 3 x 2 fits 6
    assert len(sliding_windows(84, (28, 28), 5)) == 4  # 3 x 2 does not fit 5: 2 x 2
    assert len(sliding_windows(84, (28, 28), 11)) == 9  # 4 x 3 = 12 does not fit 11: 3 x 3
    wins = sliding_windows(84, (28, 28), 12)
    assert len(wins) == 12 and sorted({float(x) for x in wins[:, 0]}) == [0.0, 19.0, 37.0, 56.0]
    assert sorted({float(y) for y in wins[:, 1]}) == [0.0, 28.0, 56.0]  # edge to edge, 4 across and 3 down
    with pytest.raises(ValueError, match="^a budget of 0 boxes per image is too small: need at least 1$"):
        sliding_windows(84, (28, 28), 0)


def test_the_finetune_baseline_defaults_to_100_iterations_of_the_iou_reward_from_seed_0():
    """The paper's fine-tune baseline: the base policy tuned with the IoU reward on the exemplar images."""
    from models.bundle import new_bundle
    from models.data.cmnist import CMnistSpec, generate
    from models.data.types import LabeledImages
    from models.experiments.baselines import finetune
    from models.policy import PolicyConfig
    from models.presets import mnist_config

    bundle = new_bundle("ft", mnist_config(), seed=0)
    ex = generate(CMnistSpec(3, "train", 1, "patch", seed=0))
    exemplars = LabeledImages(ex.images, ex.boxes)
    proto = torch.randn(bundle.prototype_dim)
    default = finetune(bundle, exemplars, proto)
    explicit = finetune(bundle, exemplars, proto, 100, PolicyConfig(reward="iou"), seed=0)
    assert all(torch.equal(default[k], explicit[k]) for k in default)
    assert any(not torch.equal(default[k], bundle.agent_state[k]) for k in default)  # it did learn
