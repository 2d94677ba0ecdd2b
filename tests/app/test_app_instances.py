"""``max_instances`` on localize: several objects per image through the API (in process, the test bundle).

The answer without the parameter is unchanged; with it each result carries up to K instances, best first, in
the full image's pixels, calibrated like the answer, filtered by ``min_confidence``; ``format=coco`` exports
every instance (read back by pycocotools); bad values are a 422 naming the field, with nothing written.
"""

import io
import json
from dataclasses import replace

import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from service_fixtures import TEST_BUNDLES, files, png_bytes, row_counts

from app.remote import decode_answer, decode_call, encode_answer, encode_call
from app.serving import LocalizeAnswer, LocalizeCall
from models.bundle import load_bundle
from models.core.boxes import pairwise_iou
from models.inference import Instance, Localization, Localizer
from models.instances import InstanceConfig, kept_apart

IMAGES = [png_bytes(84, 84, seed=3), png_bytes(200, 120, seed=4)]


def new_set(client, **data):
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9)), data={"name": "sq", **data})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def localize(client, sid, query="", imgs=IMAGES):
    r = client.post(f"/v1/exemplar-sets/{sid}/localize{query}", files=files(*imgs))
    assert r.status_code == 200, r.text
    return r.json()


def test_instances_best_first_separate_in_full_pixels_and_the_answer_unchanged(client):
    sid = new_set(client)
    plain = localize(client, sid)["results"]
    many = localize(client, sid, "?max_instances=5")["results"]
    assert all("instances" not in r for r in plain)
    for p, m in zip(plain, many, strict=True):
        assert {k: v for k, v in m.items() if k != "instances"} == p  # the answer is the same
        inst = m["instances"]
        assert 1 <= len(inst) <= 5
        scores = [i["score"] for i in inst]
        assert scores == sorted(scores) and scores[0] <= p["score"] + 1e-4
        boxes = torch.tensor([i["box"] for i in inst])
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= m["width"] + 1e-3).all()
        assert (boxes[:, 3] <= m["height"] + 1e-3).all()
        iou = pairwise_iou(boxes, boxes) - torch.eye(len(boxes))
        assert iou.max() <= InstanceConfig().nms_iou + 1e-4
        for i in inst:
            assert 0 <= i["confidence"] <= 1 and i["found"] == (i["confidence"] >= 0.5)
    one = localize(client, sid, "?max_instances=1")["results"]
    assert one == plain


def test_instances_equal_the_library(client, settings):
    sid = new_set(client)
    many = localize(client, sid, "?max_instances=4")["results"]
    loc = Localizer(load_bundle(settings.bundle_dir / f"{TEST_BUNDLES[0]}.pt", "cpu"), "cpu")
    proto = loc.prototype([Image.open(io.BytesIO(png_bytes(28, 28, seed=9)))])
    lib = loc.localize([Image.open(io.BytesIO(b)) for b in IMAGES], proto, max_instances=4)
    for api, mine in zip(many, lib, strict=True):  # less those mostly inside or around a better one (the answer's)
        boxes = torch.tensor([[list(i.box) for i in mine.instances]])
        kept = [i for i, k in zip(mine.instances, kept_apart(boxes, torch.ones(boxes.shape[:2], dtype=torch.bool))[0],
                                  strict=True) if k]
        assert len(api["instances"]) == len(kept)
        for a, m in zip(api["instances"], kept, strict=True):
            assert a["box"] == pytest.approx(list(m.box), abs=1e-3) and a["score"] == pytest.approx(m.score, abs=1e-4)


def test_min_confidence_filters_instances_and_coco_exports_each(client, tmp_path):
    sid = new_set(client)
    many = localize(client, sid, "?max_instances=6")["results"]
    confs = sorted(i["confidence"] for r in many for i in r["instances"])
    cut = confs[len(confs) // 2]
    kept = localize(client, sid, f"?max_instances=6&min_confidence={cut}")["results"]
    for r, k in zip(many, kept, strict=True):  # the request's bar decides found in place of the set's threshold
        assert k["instances"] == [{**i, "found": True} for i in r["instances"] if i["confidence"] >= cut]
    body = client.post(f"/v1/exemplar-sets/{sid}/localize?max_instances=6&format=coco",
                       files=files(*IMAGES)).json()
    assert len(body["annotations"]) == sum(len(r["instances"]) for r in many)
    gt = {"images": body["images"], "categories": body["categories"],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10], "area": 100,
                           "iscrowd": 0}]}
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    dt = COCO(str(path)).loadRes(body["annotations"])
    assert len(dt.getAnnIds()) == len(body["annotations"])
    def regions(query: str) -> list[int]:
        got = client.post(f"/v1/exemplar-sets/{sid}/localize?max_instances=6&format=labelstudio{query}",
                          files=files(*IMAGES)).json()
        return [len(t["predictions"][0]["result"]) for t in got]
    assert regions("") == [sum(i["found"] for i in r["instances"]) for r in many]  # the found ones, by the threshold
    assert regions("&min_confidence=0") == [len(r["instances"]) for r in many]  # a bar of 0: every instance


@pytest.mark.parametrize("value", ["0", "33", "-1", "two", "1.5"])
def test_max_instances_out_of_range_is_a_422_naming_it_and_nothing_is_written(client, settings, value):
    sid = new_set(client)
    before = row_counts(settings.database_url)
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?max_instances={value}&keep=true", files=files(*IMAGES))
    assert r.status_code == 422
    assert any(e["loc"][-1] == "max_instances" for e in r.json()["detail"])
    assert row_counts(settings.database_url) == before


def test_instances_travel_to_localize_workers_and_back():
    call = LocalizeCall(bundle="b", bundle_sha256=None, prototype_dim=2, prototype=b"\0" * 8, checkpoint=None,
                        images=[], max_instances=7)
    assert decode_call(encode_call(call)).max_instances == 7
    old = encode_call(call)
    del old["max_instances"]  # a call from an API of the version before
    assert decode_call(old).max_instances == 1
    answer = LocalizeAnswer([Localization((1.0, 2.0, 3.0, 4.0), 0.5, None,
                                          [Instance((1.0, 2.0, 3.0, 4.0), 0.5), Instance((5.0, 6.0, 9.0, 9.0), 0.7)]),
                             Localization((0.0, 0.0, 1.0, 1.0), 0.1)], nearest=False)
    assert decode_answer(encode_answer(answer)) == answer
    refined = LocalizeAnswer(answer.results, nearest=False, refined=True)  # a repaired checkpoint's answers
    assert decode_answer(encode_answer(refined)) == refined
    older = encode_answer(answer)
    del older["refined"]  # from a worker of the version before
    assert decode_answer(older).refined is False
    # rerank=templates where the engine does not look: the route's windows go with the call, back as template instances
    windows = replace(call, images=[Image.new("L", (8, 8))] * 2, extra_boxes=[(1.0, 2.0, 5.0, 6.0), None])
    assert decode_call(encode_call(windows)).extra_boxes == [(1.0, 2.0, 5.0, 6.0), None]
    assert decode_call(old).extra_boxes is None
    candidates = [Instance((1.0, 2.0, 3.0, 4.0), 0.5), Instance((1.0, 2.0, 5.0, 6.0), 0.6, template=True)]
    looked = LocalizeAnswer([Localization((1.0, 2.0, 3.0, 4.0), 0.5, None, candidates)], nearest=False)
    assert decode_answer(json.loads(json.dumps(encode_answer(looked)))) == looked
    two = encode_answer(looked)
    two["results"][0]["instances"] = [i[:2] for i in two["results"][0]["instances"]]  # a worker of the version before
    assert [i.template for i in decode_answer(two).results[0].instances] == [False, False]
