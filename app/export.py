"""Localize answers in other tools' formats (``format=`` on localize): COCO detection results, Label Studio tasks.

COCO (``format=coco``): ``{"images": [...], "categories": [...], "annotations": [...]}``. ``annotations`` is a
COCO *results* list -- ``[{"image_id", "category_id", "bbox": [x, y, w, h], "score"}]``, pixels of the full
image, what ``pycocotools``' ``COCO.loadRes`` takes -- with ``score`` the calibrated confidence (higher is
better). ``images`` maps each image id to its upload: ``{"id", "file_name", "width", "height"}``, ids given by
``image_ids`` (one per file, in upload order; default 1..N). Label Studio (``format=labelstudio``): a list of
tasks, one per image, ``{"data": {"image": filename}, "predictions": [{"model_version", "score", "result"}]}``;
a found answer is one ``rectanglelabels`` result with ``x, y, width, height`` in percent of the image and
``original_width`` / ``original_height`` in pixels, as Label Studio imports predictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.schemas import InstanceResult, LocalizationResult, Rerank


def _score(r: LocalizationResult | InstanceResult) -> float:
    """COCO's score, higher is better: the confidence; without a calibration, 1 / (1 + distance)."""
    return float(r.confidence) if r.confidence is not None else 1.0 / (1.0 + max(0.0, r.score))


def _detections(r: LocalizationResult) -> list[LocalizationResult | InstanceResult]:
    """What an image's answer exports: its instances (``max_instances``), else its one answer; with instances, the
    answer first too where a second look moved it to a box not among them (``rerank=templates``' window, which
    instances never list), in place of the least likely instance: never more boxes than ``max_instances`` asked
    for."""
    if r.instances is None:
        return [r]
    if r.reranked and all(list(i.box) != list(r.box) for i in r.instances):
        if not r.instances:
            return [r]
        least = min(range(len(r.instances)), key=lambda k: (_score(r.instances[k]), -k))  # ties: the later one
        return [r, *(i for k, i in enumerate(r.instances) if k != least)]
    return list(r.instances)


def coco(results: list[LocalizationResult], *, image_ids: list[int], category_id: int, category_name: str,
         only_found: bool) -> dict[str, Any]:
    """COCO detection results with the images' ids and the category (``only_found``: drop answers not found)."""
    images = [{"id": i, "file_name": r.filename, "width": r.width, "height": r.height}
              for i, r in zip(image_ids, results, strict=True)]
    annotations = []
    for i, r in zip(image_ids, results, strict=True):
        for d in _detections(r):
            if only_found and not d.found:
                continue
            x1, y1, x2, y2 = d.box
            annotations.append({"image_id": i, "category_id": category_id,
                                "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                                "score": round(_score(d), 6)})
    return {"images": images, "categories": [{"id": category_id, "name": category_name}],
            "annotations": annotations}


def labelstudio(results: list[LocalizationResult], *, label: str, from_name: str, to_name: str,
                model_version: str, only_found: bool = True) -> list[dict[str, Any]]:
    """Label Studio tasks with one prediction each: a ``rectanglelabels`` region per found answer (per found
    instance with ``max_instances``; every one with ``only_found=False``), or an empty result (nothing seen)."""
    tasks = []
    for k, r in enumerate(results):
        regions = []
        for j, d in enumerate(_detections(r)):
            if only_found and not d.found:
                continue
            x1, y1, x2, y2 = d.box
            regions.append({"id": f"qloc-{k}" if r.instances is None else f"qloc-{k}-{j}", "from_name": from_name,
                            "to_name": to_name, "type": "rectanglelabels", "original_width": r.width,
                            "original_height": r.height, "image_rotation": 0,
                            "value": {"x": 100.0 * x1 / r.width, "y": 100.0 * y1 / r.height,
                                      "width": 100.0 * (x2 - x1) / r.width, "height": 100.0 * (y2 - y1) / r.height,
                                      "rotation": 0, "rectanglelabels": [label]},
                            "score": _score(d)})
        tasks.append({"data": {"image": r.filename or f"image-{k + 1}"},
                      "predictions": [{"model_version": model_version, "score": _score(r), "result": regions}]})
    return tasks


@dataclass(frozen=True)
class AnswerOptions:
    """Localize's options about the answer's confidence and format (the route's query parameters)."""

    min_confidence: float | None = None
    rerank: Rerank = "templates"
    format: str = "json"
    image_ids: str | None = None
    category_id: int = 1
    label: str | None = None

    def ids(self, n: int) -> list[int]:
        return [int(v) for v in self.image_ids.split(",")] if self.image_ids else list(range(1, n + 1))
