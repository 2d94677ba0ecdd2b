"""``format=coco`` and ``format=labelstudio`` on localize: checked by pycocotools and Label Studio's converter."""

import json

import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from service_fixtures import files, png_bytes

LS_CONFIG = """<View>
  <Image name="image" value="$image"/>
  <RectangleLabels name="label" toName="image"><Label value="sq"/></RectangleLabels>
</View>"""


def new_set(client, **data):
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9)), data={"name": "sq", **data})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_coco_results_load_in_pycocotools_and_score_ap(client, tmp_path):
    sid = new_set(client)
    imgs = [png_bytes(seed=i) for i in range(3)] + [png_bytes(120, 90, seed=7)]
    plain = client.post(f"/v1/exemplar-sets/{sid}/localize", files=files(*imgs)).json()["results"]
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=coco&image_ids=11,12,13,14&category_id=3",
                    files=files(*imgs))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [i["id"] for i in body["images"]] == [11, 12, 13, 14]
    assert [(i["file_name"], i["width"], i["height"]) for i in body["images"]] == [
        (p["filename"], p["width"], p["height"]) for p in plain]
    assert body["categories"] == [{"id": 3, "name": "sq"}]
    for a, p in zip(body["annotations"], plain, strict=True):
        x1, y1, x2, y2 = p["box"]
        assert a["bbox"] == pytest.approx([x1, y1, x2 - x1, y2 - y1], abs=0.01)
        assert a["score"] == pytest.approx(p["confidence"], abs=1e-5)
    # ground truth: two images whose object is the box answered, two whose object is elsewhere
    gt = {"images": body["images"], "categories": body["categories"], "annotations": []}
    for k, a in enumerate(body["annotations"]):
        x, y, w, h = a["bbox"] if k < 2 else [0, 0, 3, 3]
        gt["annotations"].append({"id": k + 1, "image_id": a["image_id"], "category_id": 3, "bbox": [x, y, w, h],
                                  "area": w * h, "iscrowd": 0})
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    coco_gt = COCO(str(path))
    coco_dt = coco_gt.loadRes(body["annotations"])
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    ap50 = ev.stats[1]
    assert 0.2 < ap50 <= 1.0  # 2 of 4 objects found exactly: AP50 depends on their scores' rank, never 0


def test_coco_refuses_a_wrong_number_of_image_ids_and_min_confidence_filters(client):
    sid = new_set(client)
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=coco&image_ids=1",
                    files=files(png_bytes(seed=1), png_bytes(seed=2)))
    detail = "image_ids has 1 ids for 2 files: one per file, in upload order"
    assert (r.status_code, r.json()["detail"]) == (422, detail)
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=coco&image_ids=1,x", files=files(png_bytes(seed=1)))
    assert r.status_code == 422
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=coco&min_confidence=1", files=files(png_bytes(seed=1)))
    assert r.status_code == 200 and r.json()["annotations"] == []  # nothing is certain
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=xml", files=files(png_bytes(seed=1)))
    assert r.status_code == 422


def test_labelstudio_tasks_convert_with_label_studio_converter(client, tmp_path):
    from label_studio_converter import Converter

    sid = new_set(client, threshold="0")  # every answer found: every task has its rectangle
    imgs = [png_bytes(seed=1), png_bytes(160, 100, seed=2)]
    plain = client.post(f"/v1/exemplar-sets/{sid}/localize", files=files(*imgs)).json()["results"]
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=labelstudio", files=files(*imgs))
    assert r.status_code == 200, r.text
    tasks = r.json()
    assert len(tasks) == 2
    for t, p in zip(tasks, plain, strict=True):
        (pred,) = t["predictions"]
        (region,) = pred["result"]
        assert region["type"] == "rectanglelabels" and region["value"]["rectanglelabels"] == ["sq"]
        assert (region["original_width"], region["original_height"]) == (p["width"], p["height"])
        assert 0 <= region["value"]["x"] <= 100 and 0 < region["value"]["width"] <= 100
        assert pred["score"] == pytest.approx(p["confidence"])
    # Label Studio's own converter reads them as annotations (the import format of predictions is the same)
    export = [{"id": k + 1, "data": {"image": f"/data/upload/{t['data']['image']}"},
               "annotations": [{"id": k + 1, "result": t["predictions"][0]["result"]}]} for k, t in enumerate(tasks)]
    src = tmp_path / "export.json"
    src.write_text(json.dumps(export))
    conv = Converter(LS_CONFIG, str(tmp_path), download_resources=False)
    conv.convert_to_coco(str(src), str(tmp_path / "coco"), is_dir=False)
    out = json.loads((tmp_path / "coco" / "result.json").read_text())
    assert len(out["annotations"]) == 2
    for a, p in zip(out["annotations"], plain, strict=True):
        x1, y1, x2, y2 = p["box"]
        assert a["bbox"] == pytest.approx([x1, y1, x2 - x1, y2 - y1], abs=0.05)


def test_labelstudio_not_found_answers_have_an_empty_result(client):
    sid = new_set(client, threshold="1")  # nothing reaches it
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?format=labelstudio&label=cat", files=files(png_bytes(seed=1)))
    assert r.status_code == 200
    assert r.json()[0]["predictions"][0]["result"] == []


def test_exports_hold_a_second_looks_window_that_instances_do_not_list():
    """With ``max_instances``, a doubtful answer moved by ``rerank=templates`` to template matching's window (never
    among the instances) is exported too, first, in place of the least likely instance (no more boxes than the
    instances asked for); an answer moved to one of its instances is exported once."""
    from app.export import coco, labelstudio
    from app.schemas import InstanceResult, LocalizationResult

    inst = [InstanceResult(box=[10.0, 10.0, 30.0, 30.0], score=1.0, confidence=0.3, found=False),
            InstanceResult(box=[50.0, 50.0, 70.0, 70.0], score=2.0, confidence=0.7, found=True)]
    window = LocalizationResult(filename="a.png", width=100, height=100, box=[40.0, 0.0, 60.0, 20.0], score=3.0,
                                confidence=0.9, found=True, reranked=True, instances=inst)
    moved = window.model_copy(update={"box": [50.0, 50.0, 70.0, 70.0], "confidence": 0.7})  # to instance 2
    kept = window.model_copy(update={"reranked": None, "box": [10.0, 10.0, 30.0, 30.0], "confidence": 0.3,
                                     "found": False})
    every = coco([window], image_ids=[1], category_id=1, category_name="x", only_found=False)["annotations"]
    assert [a["bbox"] for a in every] == [[40.0, 0.0, 20.0, 20.0], [50.0, 50.0, 20.0, 20.0]]  # 0.3 left out: 2 boxes
    out = coco([window, moved, kept], image_ids=[1, 2, 3], category_id=1, category_name="x", only_found=True)
    assert [(a["image_id"], a["bbox"]) for a in out["annotations"]] == [
        (1, [40.0, 0.0, 20.0, 20.0]), (1, [50.0, 50.0, 20.0, 20.0]), (2, [50.0, 50.0, 20.0, 20.0]),
        (3, [50.0, 50.0, 20.0, 20.0])]
    tasks = labelstudio([window, moved], label="x", from_name="label", to_name="image", model_version="v")
    assert [[(r["value"]["x"], r["value"]["y"]) for r in t["predictions"][0]["result"]] for t in tasks] == [
        [(40.0, 0.0), (50.0, 50.0)], [(50.0, 50.0)]]
    assert len({r["id"] for r in tasks[0]["predictions"][0]["result"]}) == 2


def test_export_fields_by_value():
    """The exported numbers themselves, on answers made by hand: COCO's boxes and scores rounded as documented, a
    score without a calibration, Label Studio's percent box on a box off the image's top edge, its fixed fields, the
    task name of an upload without a file name, the default image ids; with instances, the least likely one gives
    way to a second look's window wherever it stands in the list (ties: the later one)."""
    from app.export import AnswerOptions, coco, labelstudio
    from app.schemas import InstanceResult, LocalizationResult

    r = LocalizationResult(filename="a.png", width=200, height=100, box=[10.123456, 20.987654, 60.5, 70.25],
                           score=3.0, confidence=0.123456789, found=True)
    (a,) = coco([r], image_ids=[7], category_id=1, category_name="x", only_found=False)["annotations"]
    assert a["bbox"] == [10.12, 20.99, 50.38, 49.26] and a["score"] == 0.123457
    uncalibrated = [r.model_copy(update={"confidence": None, "score": s}) for s in (3.0, -1.0)]
    scores = [a["score"] for a in coco(uncalibrated, image_ids=[1, 2], category_id=1, category_name="x",
                                       only_found=False)["annotations"]]
    assert scores == [0.25, 1.0]  # 1 / (1 + distance), a distance below 0 read as 0
    with pytest.raises(ValueError):
        coco([r], image_ids=[1, 2], category_id=1, category_name="x", only_found=False)

    (task,) = labelstudio([r.model_copy(update={"filename": None})], label="x", from_name="label", to_name="image",
                          model_version="v")
    assert task["data"] == {"image": "image-1"}
    (region,) = task["predictions"][0]["result"]
    value = dict(region["value"])
    assert (value.pop("rotation"), value.pop("rectanglelabels")) == (0, ["x"])
    assert value == pytest.approx({"x": 5.061728, "y": 20.987654, "width": 25.188272, "height": 49.262346}, rel=1e-6)
    assert (region["image_rotation"], region["score"]) == (0, pytest.approx(0.123456789))
    second = labelstudio([r, r.model_copy(update={"filename": None})], label="x", from_name="label",
                         to_name="image", model_version="v")
    assert [t["data"]["image"] for t in second] == ["a.png", "image-2"]
    assert AnswerOptions().ids(3) == [1, 2, 3] and AnswerOptions(image_ids="5,9").ids(2) == [5, 9]

    def inst(x, confidence):
        return InstanceResult(box=[x, 0.0, x + 10.0, 10.0], score=1.0, confidence=confidence, found=True)

    window = LocalizationResult(filename="a.png", width=100, height=100, box=[40.0, 40.0, 60.0, 60.0], score=1.0,
                                confidence=0.9, found=True, reranked=True)
    for confidences, kept in (((0.8, 0.2, 0.5), [0.0, 20.0]), ((0.5, 0.5, 0.9), [0.0, 20.0])):
        answer = window.model_copy(update={"instances": [inst(10.0 * k, c) for k, c in enumerate(confidences)]})
        boxes = [a["bbox"][0] for a in coco([answer], image_ids=[1], category_id=1, category_name="x",
                                            only_found=False)["annotations"]]
        assert boxes == [40.0, *kept]
