"""The Python client (``app.client``) against the real service: in process through FastAPI's TestClient, and
over HTTP with a real uvicorn and Celery worker for ``wait``."""

from __future__ import annotations

import io
import uuid

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from service_fixtures import SMALL_CALIBRATIONS, files, free_port, make_test_settings, migrate, png_bytes, started

from app.client import AdaptationJob, ExemplarSet, Export, QlocClient, QlocError
from app.client_images import encode_image
from app.images import UploadLimits, decode_image
from models.inference import pil_to_tensor


@pytest.fixture
def qloc(client) -> QlocClient:  # type: ignore[no-untyped-def]
    """The client over the app in process (the ``client`` fixture: embedded SQLite and broker)."""
    return QlocClient(http_client=client, sleep=lambda s: None)


def crop() -> bytes:
    return png_bytes(28, 28, seed=9)


def test_every_call_round_trips_through_the_api(qloc: QlocClient, tmp_path) -> None:
    assert qloc.health() == {"status": "ok"}
    assert qloc.ready()["status"] == "ok"
    bundles = qloc.bundles()
    assert (bundles["default"], bundles["default_photo"]) == ("test-digits", None)  # photo-general: not installed
    assert {b["name"]: b["default"] for b in bundles["data"]} == {"test-digits": True, "test-other": False}

    # images as a path, bytes, a PIL image, a uint8 array and a float array
    path = tmp_path / "crop.png"
    path.write_bytes(crop())
    pil = Image.open(io.BytesIO(png_bytes(30, 26, seed=3))).convert("RGB")
    arr8 = np.asarray(Image.open(io.BytesIO(png_bytes(28, 28, seed=4))))
    es = qloc.create_exemplar_set([path, crop(), pil, arr8, arr8.astype(np.float32) / 255.0], name="fours",
                                  bundle="test-other")
    assert isinstance(es, ExemplarSet) and es.name == "fours" and es.bundle == "test-other"
    assert es.num_exemplars == 5 and es.num_labeled == 0
    assert qloc.get_exemplar_set(es.id) == es
    page = qloc.list_exemplar_sets(limit=10)
    assert page.count == 1 and page.data[0].id == es.id

    boxed = qloc.create_exemplar_set(png_bytes(84, 84, seed=1), boxes=[[10, 12, 50, 60]])
    assert boxed.num_labeled == 1 and boxed.bundle == "test-digits"

    scenes = [png_bytes(84, 84, seed=s) for s in (5, 6)]
    answer = qloc.localize(es.id, scenes, trajectory=True)
    assert answer.exemplar_set_id == es.id and len(answer.results) == 2
    for r in answer.results:
        assert (r.width, r.height) == (84, 84) and len(r.box) == 4
        assert 0 <= r.box[0] < r.box[2] <= 84 and 0 <= r.box[1] < r.box[3] <= 84
        assert r.trajectory and r.trajectory[0] == [0, 0, 84, 84] and len(r.trajectory) > 1
    # the same call straight over HTTP answers the same boxes
    raw = qloc.http.post(f"/v1/exemplar-sets/{es.id}/localize", files=files(*scenes)).json()
    assert [r["box"] for r in raw["results"]] == [r.box for r in answer.results]
    sampled = qloc.localize(es.id, scenes[0], samples=3, nearest=True, checkpoint="base")
    assert sampled.samples == 3 and sampled.nearest is True and sampled.results[0].trajectory is None

    job = qloc.create_adaptation(es.id, scenes, iterations=3, seed=7, activate=False)  # no worker: stays queued
    assert isinstance(job, AdaptationJob) and job.status == "queued" and not job.done
    assert job.params["iterations"] == 3 and job.params["activate"] == "false" and job.params["num_images"] == 2
    assert qloc.get_adaptation(job.id).id == job.id
    jobs = qloc.list_adaptations(es.id)
    assert jobs.count == 1 and jobs.data[0].id == job.id
    canceled = qloc.cancel_adaptation(job)
    assert canceled.status == "canceled" and canceled.done
    with pytest.raises(QlocError) as e:
        qloc.cancel_adaptation(job.id)
    assert e.value.status == 409 and "already finished" in e.value.detail

    ckpts = qloc.list_checkpoints(es.id)
    assert [c.kind for c in ckpts.data] == ["base"] and ckpts.data[0].active
    base = qloc.get_checkpoint(ckpts.data[0].id)
    assert base.exemplar_set_id == es.id and base.parent_id is None
    assert qloc.activate_checkpoint(base).active_checkpoint_id == base.id

    qloc.delete_exemplar_set(es.id)
    with pytest.raises(QlocError) as e:
        qloc.get_exemplar_set(es.id)
    assert e.value.status == 404 and e.value.detail == "exemplar set not found"
    assert "HTTP 404: exemplar set not found" in str(e.value)


def test_an_idempotency_key_gives_back_the_same_job(qloc: QlocClient) -> None:
    es = qloc.create_exemplar_set(crop())
    first = qloc.create_adaptation(es.id, png_bytes(), iterations=2, idempotency_key="upload-42")
    again = qloc.create_adaptation(es.id, png_bytes(), iterations=2, idempotency_key="upload-42")
    assert again.id == first.id and qloc.list_adaptations(es.id).count == 1
    with pytest.raises(QlocError) as e:  # the same key for another request
        qloc.create_adaptation(es.id, png_bytes(), iterations=3, idempotency_key="upload-42")
    assert e.value.status == 409 and "Idempotency-Key" in e.value.detail
    other = qloc.create_adaptation(es.id, png_bytes(), iterations=2)  # a fresh key each call: a new job
    assert other.id != first.id


def test_the_image_pool(qloc: QlocClient) -> None:
    es = qloc.create_exemplar_set(crop())
    added = qloc.add_pool_images(es.id, [png_bytes(84, 84, seed=s) for s in (1, 2)])
    assert [im.width for im in added.data] == [84, 84] and added.model_extra["num_pool_images"] == 2
    kept = qloc.localize(es.id, png_bytes(84, 84, seed=3), keep=True)
    assert kept.kept is not None and len(kept.kept) == 1
    listed = qloc.list_pool_images(es.id)
    assert len(listed.data) == 3 and listed.model_extra["count"] == 3
    assert str(listed.data[2].id) == str(kept.kept[0])
    qloc.delete_pool_image(es.id, listed.data[0])
    job = qloc.create_adaptation(es.id, source="pool", iterations=2)  # no files: the pool's 2 images
    assert job.params["num_images"] == 2
    with pytest.raises(QlocError) as e:  # the queued job holds the pool's images
        qloc.clear_pool(es.id)
    assert e.value.status == 409
    qloc.cancel_adaptation(job)
    qloc.clear_pool(es.id)
    assert qloc.list_pool_images(es.id).data == []
    with pytest.raises(QlocError) as e:
        qloc.create_adaptation(es.id)  # an empty pool and no files
    assert e.value.status == 422 and "pool" in e.value.detail


def test_exports_come_back_as_the_server_sends_them_with_the_kept_ids(qloc: QlocClient) -> None:
    es = qloc.create_exemplar_set(crop())
    scenes = [png_bytes(84, 84, seed=s) for s in (5, 6)]
    coco = qloc.export(es, scenes, format="coco", image_ids="11,12", keep=True)
    assert isinstance(coco, Export) and coco.format == "coco" and coco.kept is not None and len(coco.kept) == 2
    raw = qloc.http.post(f"/v1/exemplar-sets/{es.id}/localize", params={"format": "coco", "image_ids": "11,12"},
                         files=files(*scenes)).json()
    assert {k: v for k, v in coco.data.items() if k != "images"} == {k: v for k, v in raw.items() if k != "images"}
    assert [im["id"] for im in coco.data["images"]] == [11, 12]  # the server's JSON as is (only names differ)
    assert [str(i.id) for i in qloc.list_pool_images(es).data] == coco.kept
    studio = qloc.export(es, scenes[0], format="labelstudio")
    assert studio.kept is None and isinstance(studio.data, list | dict)
    with pytest.raises(ValueError, match="call QlocClient.export"):  # not a LocalizeResponse: refused before sending
        qloc.localize(es, scenes, format="coco")
    assert len(qloc.list_pool_images(es).data) == 2


def test_every_id_parameter_takes_the_clients_own_models(qloc: QlocClient) -> None:
    es = qloc.create_exemplar_set(crop())
    assert qloc.get_exemplar_set(es) == es
    assert qloc.localize(es, png_bytes(84, 84, seed=5)).exemplar_set_id == es.id
    base = qloc.list_checkpoints(es).data[0]
    assert qloc.get_checkpoint(base) == base
    assert qloc.localize(es, png_bytes(84, 84, seed=5), checkpoint=base).checkpoint_id == base.id
    with pytest.raises(QlocError) as e:  # the base policy stays (adapted ones: tests/worker/test_worker_jobs.py)
        qloc.delete_checkpoint(base)
    assert e.value.status == 409 and "base policy" in e.value.detail
    job = qloc.create_adaptation(es, png_bytes(), iterations=2)
    assert qloc.list_adaptations(es).data[0].id == job.id
    qloc.cancel_adaptation(job)
    assert qloc.add_pool_images(es, png_bytes(84, 84, seed=1)).data and qloc.list_pool_images(es).data
    qloc.clear_pool(es)
    qloc.delete_exemplar_set(es)
    with pytest.raises(QlocError) as e:
        qloc.get_exemplar_set(es)
    assert e.value.status == 404


def test_the_plain_progress_bar_leaves_no_tail_of_a_longer_line(capsys) -> None:
    from app.client_progress import SimpleBar

    bar = SimpleBar(30, "job x")
    for postfix in ("running (setup)", "running", "running (finishing) reward 528.0008", "succeeded reward 528.0008"):
        bar.update_to(30 if "reward" in postfix else 0, 30, postfix)
    screen = capsys.readouterr().out.split("\r")[-1]  # what the last carriage return left on the line
    assert screen.rstrip().endswith("30/30 succeeded reward 528.0008"), screen


def test_progress_as_lines_where_the_output_is_not_a_terminal(capsys) -> None:
    """In a log: a line per tenth of the job and per change of state, not one per poll."""
    from app.client_progress import LineBar, progress_bar

    assert isinstance(progress_bar(200, "job x"), LineBar)  # pytest's captured stderr is no terminal
    bar = LineBar(200, "job x")
    bar.update_to(0, 200, "queued")
    for n in range(0, 201):  # a poll per iteration
        bar.update_to(n, 200, "running reward 1.0")
    bar.update_to(200, 200, "succeeded reward 2.0")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "job x: 0/200 queued" and lines[1] == "job x: 0/200 running reward 1.0"
    assert lines[-1] == "job x: 200/200 succeeded reward 2.0" and len(lines) == 2 + 10 + 1, lines


def test_api_errors_raise_qloc_error_with_the_detail(qloc: QlocClient) -> None:
    with pytest.raises(QlocError) as e:
        qloc.create_exemplar_set(("notes.png", b"these are not pixels"))
    assert e.value.status == 415 and e.value.detail == "notes.png: not a PNG, JPEG or WebP image"
    es = qloc.create_exemplar_set(crop())
    with pytest.raises(QlocError) as e:
        qloc.localize(es.id, crop(), samples=999)
    assert e.value.status == 422 and isinstance(e.value.detail, list)
    assert "samples" in str(e.value) and "less than or equal to 63" in str(e.value)
    with pytest.raises(QlocError) as e:
        qloc.create_exemplar_set(png_bytes(84, 84), boxes=[[0, 0, 500, 10]])
    assert e.value.status == 422 and "inside" in str(e.value)
    with pytest.raises(TypeError):
        qloc.create_exemplar_set(object())


def test_api_keys(tmp_path, bundle_dir) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings = make_test_settings(tmp_path, bundle_dir, api_keys=["k" * 20, "m" * 20])
    migrate(settings.database_url)
    with TestClient(create_app(settings)) as c:
        with pytest.raises(QlocError) as e:
            QlocClient(http_client=c).list_exemplar_sets()
        assert e.value.status == 401 and "API key" in e.value.detail
        mine, theirs = QlocClient(http_client=c, api_key="k" * 20), QlocClient(http_client=c, api_key="m" * 20)
        es = mine.create_exemplar_set(crop())
        assert mine.list_exemplar_sets().count == 1 and theirs.list_exemplar_sets().count == 0
        with pytest.raises(QlocError) as e:
            theirs.localize(es.id, crop())
        assert e.value.status == 404


def test_a_503_is_retried_with_a_new_key_and_then_raised(tmp_path, bundle_dir) -> None:
    """The broker is down: each try makes a job that fails (503); the client retries with a fresh
    Idempotency-Key (the old one names a failed job), then raises the 503. A key of the caller's is not retried."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings = make_test_settings(tmp_path, bundle_dir, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    migrate(settings.database_url)
    waits: list[float] = []
    with TestClient(create_app(settings)) as c:
        qloc = QlocClient(http_client=c, retries=2, backoff=0.25, sleep=waits.append)
        es = qloc.create_exemplar_set(crop())
        with pytest.raises(QlocError) as e:
            qloc.create_adaptation(es.id, png_bytes())
        assert e.value.status == 503 and "queue is unreachable" in e.value.detail
        assert waits == [0.25, 0.5]
        jobs = qloc.list_adaptations(es.id).data
        assert len(jobs) == 3 and {j.status for j in jobs} == {"failed"}
        waits.clear()
        with pytest.raises(QlocError):
            qloc.create_adaptation(es.id, png_bytes(), idempotency_key="mine")
        assert waits == [] and qloc.list_adaptations(es.id).count == 4
        assert qloc.ready()["status"] == "unavailable"  # readiness answers its 503, not raised


def test_retry_after_is_honoured_and_extra_fields_are_kept() -> None:
    """The protocol alone: a server that is busy twice (Retry-After in seconds, then as a date) then answers
    with a field this client does not know."""
    answers = iter([
        httpx.Response(503, headers={"Retry-After": "2"}, json={"detail": "busy"}),
        httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, json={"detail": "busy"}),
        httpx.Response(200, json={"id": str(uuid.uuid4()), "name": None, "num_exemplars": 1, "num_labeled": 0,
                                  "bundle": "b", "bundle_sha256": None, "active_checkpoint_id": None,
                                  "created_at": "2026-01-01T00:00:00Z", "pool_size": 12}),
    ])
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return next(answers)

    waits: list[float] = []
    http = httpx.Client(base_url="http://qloc.test", transport=httpx.MockTransport(handler))
    qloc = QlocClient(http_client=http, api_key="secret-key-0123456789", sleep=waits.append)
    es = qloc.get_exemplar_set("x")
    assert waits == [2.0, 0.0] and len(seen) == 3  # a date in the past: no wait
    assert all(r.headers["X-API-Key"] == "secret-key-0123456789" for r in seen)
    assert es.model_extra == {"pool_size": 12}


def test_connection_errors_are_retried_then_raised() -> None:
    waits: list[float] = []
    qloc = QlocClient(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.1, sleep=waits.append)
    with qloc, pytest.raises(QlocError) as e:
        qloc.health()
    assert e.value.status is None and "cannot connect" in str(e.value)
    assert waits == pytest.approx([0.1, 0.2, 0.4])


@pytest.mark.slow
def test_wait_follows_a_job_run_by_a_real_worker(tmp_path, bundle_dir, capsys) -> None:
    """uvicorn + a Celery worker on the embedded default: the job is created over HTTP, ``wait`` polls it to
    ``succeeded`` with a progress bar, and the checkpoints it wrote descend from the base."""
    settings = make_test_settings(tmp_path, bundle_dir, synthetic_probes=8, **SMALL_CALIBRATIONS)
    migrate(settings.database_url)
    with started(settings, tmp_path) as stack:
        with QlocClient(stack.base_url) as qloc:
            es = qloc.create_exemplar_set([crop(), png_bytes(28, 28, seed=10)])
            job = qloc.create_adaptation(es.id, [png_bytes(84, 84, seed=s) for s in range(4)], iterations=4,
                                         activate=True)
            updates: list[AdaptationJob] = []
            done = qloc.wait(job, timeout=120, poll=0.2, on_update=updates.append)
            assert done.status == "succeeded", (done, stack.logs())
            assert done.progress.iteration == done.progress.total == 4 and done.checkpoint_id is not None
            assert updates[-1] == done and updates[0].status in ("queued", "running")
            ckpts = qloc.list_checkpoints(es.id).data
            base = ckpts[0]
            assert base.kind == "base" and all(c.kind == "adapted" for c in ckpts[1:]) and len(ckpts) >= 2
            assert ckpts[1].parent_id == base.id and ckpts[1].job_id == job.id
            assert qloc.get_exemplar_set(es.id).active_checkpoint_id == done.checkpoint_id
        err = capsys.readouterr().err
        assert f"job {str(job.id)[:8]}" in err and "4/4" in err


def test_negatives_threshold_and_the_calibrated_answer(qloc: QlocClient) -> None:
    """``negatives`` and ``threshold`` reach the set; every answer carries ``confidence`` and ``found``, typed."""
    es = qloc.create_exemplar_set([crop(), png_bytes(28, 28, seed=10)], negatives=[png_bytes(28, 28, seed=11)],
                                  threshold=0.75)
    raw = qloc.http.get(f"/v1/exemplar-sets/{es.id}").json()
    assert raw["num_negatives"] == 1 and raw["threshold"] == 0.75
    answer = qloc.localize(es.id, [png_bytes(84, 84, seed=5)])
    r = answer.results[0]
    assert r.confidence is not None and 0.0 <= r.confidence <= 1.0
    assert r.found == (r.confidence >= 0.75)
    strict = qloc.localize(es.id, [png_bytes(84, 84, seed=5)], min_confidence=1.0).results[0]
    assert strict.box == r.box and strict.found is (r.confidence >= 1.0)
    changed = qloc.update_exemplar_set(es, threshold=0.0, name="renamed")
    assert changed.threshold == 0.0 and changed.name == "renamed" and changed.num_negatives == 1
    assert qloc.localize(es.id, [png_bytes(84, 84, seed=5)]).results[0].found is True
    assert qloc.update_exemplar_set(es.id, name=None).name is None
    with pytest.raises(QlocError, match="threshold") as e:
        qloc.update_exemplar_set(es, threshold=2)
    assert e.value.status == 422
    with pytest.raises(ValueError, match="finite number"):
        qloc.update_exemplar_set(es, threshold=float("nan"))


def test_max_instances_typed_and_judged_with_the_negatives(qloc: QlocClient) -> None:
    """``max_instances`` reaches the server; each instance is typed, with the confidence the negatives weigh in
    (the first instance's equals the answer's when it is the answer's box)."""
    es = qloc.create_exemplar_set([crop(), png_bytes(28, 28, seed=10)], negatives=[png_bytes(28, 28, seed=11)])
    r = qloc.localize(es.id, [png_bytes(84, 84, seed=5), png_bytes(120, 90, seed=6)], max_instances=3).results
    plain = qloc.localize(es.id, [png_bytes(84, 84, seed=5), png_bytes(120, 90, seed=6)]).results
    for got, one in zip(r, plain, strict=True):
        assert got.box == one.box and one.instances is None
        assert got.instances is not None and 1 <= len(got.instances) <= 3
        assert [i.score for i in got.instances] == sorted(i.score for i in got.instances)
        for inst in got.instances:
            assert inst.confidence is not None and 0.0 <= inst.confidence <= 1.0
            if inst.box == pytest.approx(one.box, abs=1e-3):
                assert inst.confidence == pytest.approx(one.confidence, abs=1e-4)


def test_16_bit_arrays_and_images_are_sent_so_the_api_sees_their_8_bit_scale() -> None:
    """A uint16 array or an ``I;16`` PIL image goes up as a 16-bit PNG (not clipped to 255 on the way), which the
    API reads as the 8-bit image v * 257 -> v; a 3-channel uint16 array is scaled to 8 bits here."""
    eight = (np.random.default_rng(0).random((20, 30)) * 255).astype(np.uint8)
    limits = UploadLimits(max_file_bytes=1_000_000, max_image_pixels=100_000)
    for image in (eight.astype(np.uint16) * 257, Image.fromarray(eight.astype(np.uint16) * 257)):
        name, data, content_type = encode_image(image)
        assert content_type == "image/png" and Image.open(io.BytesIO(data)).mode == "I;16"
        seen = decode_image(data, filename=name, declared_type=content_type, limits=limits).image
        assert np.array_equal(np.asarray(seen), eight)
    _, data, _ = encode_image(np.dstack([eight.astype(np.uint16) * 257] * 3))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)))[..., 0], eight)


def test_pil_images_of_32_bit_modes_are_sent_by_the_array_rules_not_clipped() -> None:
    """Mode ``I`` (how PIL often holds 16-bit data) up to 65535 goes up as 16 bits and within 0..255 as 8 bits, mode
    ``F`` as a float array; PIL's own conversion sent every value above 255 as white (an all-white image)."""
    eight = (np.random.default_rng(2).random((20, 30)) * 255).astype(np.uint8)
    limits = UploadLimits(max_file_bytes=1_000_000, max_image_pixels=100_000)
    for img in (Image.fromarray(eight.astype(np.int32) * 257), Image.fromarray(eight.astype(np.int32)),
                Image.fromarray(eight.astype(np.float32) / 255.0), Image.fromarray(eight.astype(np.float32))):
        assert img.mode in ("I", "F")
        name, data, content_type = encode_image(img)
        seen = decode_image(data, filename=name, declared_type=content_type, limits=limits).image
        assert np.abs(np.asarray(seen).astype(int) - eight).max() <= 0, img.mode
    with pytest.raises(ValueError, match="from 0 to 70000"):
        encode_image(Image.fromarray(np.array([[0, 70000]], dtype=np.int32)))


def test_a_pil_image_with_an_exif_orientation_goes_up_as_a_viewer_shows_it() -> None:
    """A JPEG opened with PIL keeps its EXIF orientation in its metadata only: the client sends it upright, so the
    API sees the same frame (and answers boxes in it) as for the file sent by path."""
    stored = Image.new("RGB", (40, 20), (200, 30, 30))
    stored.paste((20, 20, 220), (0, 0, 10, 20))  # a blue band on the stored image's left
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    buf = io.BytesIO()
    stored.save(buf, "JPEG", exif=exif, quality=95)
    limits = UploadLimits(max_file_bytes=1_000_000, max_image_pixels=100_000)
    by_path = decode_image(buf.getvalue(), filename="f.jpg", declared_type="image/jpeg", limits=limits)
    name, data, content_type = encode_image(Image.open(io.BytesIO(buf.getvalue())))
    by_pil = decode_image(data, filename=name, declared_type=content_type, limits=limits)
    assert (by_pil.width, by_pil.height) == (by_path.width, by_path.height) == (20, 40)
    top = np.asarray(by_pil.image.convert("RGB"))[:8, :, 2].mean()  # the band is on top once upright
    assert top > 150 and np.abs(np.asarray(by_pil.image.convert("RGB")).astype(int)
                               - np.asarray(by_path.image.convert("RGB")).astype(int)).mean() < 4


def test_arrays_outside_the_scales_they_are_read_on_are_refused_not_clipped() -> None:
    """A float array is read as [0, 1] (all of it within) or else [0, 255]; an integer one as [0, 255]: values
    outside, NaN or infinity are a ValueError saying so, not an image clipped to black or white."""
    ramp = np.linspace(0.0, 1.0, 12).reshape(3, 4)
    as_01 = np.asarray(Image.open(io.BytesIO(encode_image(ramp)[1])))
    as_255 = np.asarray(Image.open(io.BytesIO(encode_image(ramp * 255)[1])))
    assert np.array_equal(as_01, as_255) and as_01.max() == 255
    for bad, message in ((ramp * 2 - 0.5, "from -0.5 to 1.5"), (ramp * 300, "from 0 to 300"),
                         (np.full((3, 4), np.nan), "NaN"), (np.arange(12).reshape(3, 4) * 30, "from 0 to 330"),
                         (np.arange(12).reshape(3, 4) - 1, "from -1 to 10")):
        with pytest.raises(ValueError, match=message):
            encode_image(bad)


@pytest.mark.parametrize("mode", ["LA", "P", "1", "RGBA", "PA"])
def test_a_pil_image_goes_up_as_the_api_would_see_its_file(mode: str) -> None:
    """A PIL image with transparency or a palette is sent as a PNG in its own mode (PA as RGBA), so the API
    composites it onto the bundle's fill as it would the same image sent as a file: the model's input is the
    same either way (the client used to flatten every such mode to RGB, transparent pixels included)."""
    rng = np.random.default_rng(1)
    rgba = Image.fromarray((rng.random((12, 16, 4)) * 255).astype(np.uint8), "RGBA")
    img = {"LA": rgba.convert("LA"), "P": rgba.convert("RGB").convert("P"), "1": rgba.convert("1"),
           "RGBA": rgba, "PA": rgba.convert("RGB").convert("P").convert("PA")}[mode]
    if mode == "P":
        img.info["transparency"] = 3
    as_file = io.BytesIO()
    (img.convert("RGBA") if mode == "PA" else img).save(as_file, "PNG")  # PNG cannot hold PA
    limits = UploadLimits(max_file_bytes=1_000_000, max_image_pixels=100_000)
    name, data, content_type = encode_image(img)
    sent = decode_image(data, filename=name, declared_type=content_type, limits=limits).image
    direct = decode_image(as_file.getvalue(), filename="f.png", declared_type="image/png", limits=limits).image
    for channels in (1, 3):
        assert torch.equal(pil_to_tensor(sent, channels, (0.5,)), pil_to_tensor(direct, channels, (0.5,)))


def test_a_set_creation_is_waited_for_past_the_clients_timeout_and_a_lost_answer_says_look_first() -> None:
    """A set is made whether or not its creation is waited for (a photo set's calibration takes minutes on a loaded
    machine): the client waits at least ``CREATE_SET_TIMEOUT`` for it; a creation whose answer is lost is not
    retried and says the server may have made it."""
    import httpx

    from app.client import CREATE_SET_TIMEOUT, QlocClient, QlocError

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.extensions["timeout"]["read"]))
        if request.url.path == "/v1/exemplar-sets" and len(seen) > 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(404, json={"detail": "nope"})

    http = httpx.Client(base_url="http://qloc", timeout=5.0, transport=httpx.MockTransport(answer))
    with QlocClient(http_client=http, sleep=lambda s: None) as qloc:
        with pytest.raises(QlocError):
            qloc.create_exemplar_set([png_bytes(28, 28)])
        with pytest.raises(QlocError, match="the server may have done it all the same"):
            qloc.create_exemplar_set([png_bytes(28, 28)])
        with pytest.raises(QlocError):
            qloc.get_exemplar_set("0" * 32)
    assert seen == [("/v1/exemplar-sets", CREATE_SET_TIMEOUT)] * 2 + [(f"/v1/exemplar-sets/{'0' * 32}", 5.0)]
