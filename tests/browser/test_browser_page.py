"""The page at ``/`` in a real Chromium, on the real service with a real worker: create a set (crops, and a
box drawn with the mouse), localize and compare the drawn boxes with the API's answer, play the agent's
trajectory, adapt and follow the job to ``succeeded``, roll back to the base checkpoint, and read the API's
errors on the page."""

from __future__ import annotations

import base64
import io
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from service_fixtures import Stack, files, png_bytes

from app.client import QlocClient
from models.config import EnvConfig
from models.core.actions import ACTION_NAMES, apply_actions

pytestmark = pytest.mark.slow


def write(dir: Path, name: str, data: bytes) -> str:
    path = dir / name
    path.write_bytes(data)
    return str(path)


def crop(seed: int = 9) -> bytes:
    return png_bytes(28, 28, seed=seed)


def open_page(page, set_id: str | None = None) -> None:  # type: ignore[no-untyped-def]
    page.goto("/")
    page.wait_for_selector("body[data-ready=true]")
    if set_id:
        page.select_option("#set-select", set_id)
        page.wait_for_selector(f'#set-info[data-set-id="{set_id}"]')


def previews(page, n: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until the exemplar drop zone shows ``n`` previews (a timeout fails the test)."""
    page.wait_for_function(f"document.querySelectorAll('#exemplar-previews figure').length === {n}")
    assert page.locator("#exemplar-previews figure").count() == n


def attr_box(locator) -> list[float]:  # type: ignore[no-untyped-def]
    return [float(locator.get_attribute(f"data-{k}")) for k in ("x1", "y1", "x2", "y2")]


def test_create_a_set_from_crops_and_from_a_drawn_box(page, stack: Stack, tmp_path: Path) -> None:
    open_page(page)
    options = page.locator("#bundle-select option")
    assert options.all_inner_texts() == ["auto: test-digits, or test-other for photos",
                                         "test-digits (default)", "test-other"]
    assert page.input_value("#bundle-select") == ""  # auto: no bundle sent, the server picks

    name = f"fours-{uuid.uuid4().hex[:6]}"
    page.fill("#set-name", name)
    page.select_option("#bundle-select", "test-other")
    page.set_input_files("#exemplar-files", [write(tmp_path, "a.png", crop(9)), write(tmp_path, "b.png", crop(10))])
    previews(page, 2)  # the previews are drawn once the files are read (asynchronously)
    page.click("#create-btn")
    page.wait_for_function("document.querySelector('#set-info').dataset.setId !== ''")
    set_id = page.get_attribute("#set-info", "data-set-id")
    with QlocClient(stack.base_url) as qloc:
        es = qloc.get_exemplar_set(set_id)
    assert (es.name, es.bundle, es.num_exemplars, es.num_labeled) == (name, "test-other", 2, 0)
    assert page.input_value("#set-select") == set_id
    previews(page, 0)  # the drop zone is emptied

    # A whole 84x84 image, dropped on the zone (a real drop event), with its box drawn by dragging the mouse.
    page.check("input[name=mode][value=boxes]")
    page.evaluate("""async (b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "scene.png", {type: "image/png"}));
        const drop = new DragEvent("drop", {dataTransfer: dt, bubbles: true});
        document.querySelector("#exemplar-drop").dispatchEvent(drop);
    }""", base64.b64encode(png_bytes(84, 84, seed=1)).decode())
    svg = page.locator("#exemplar-previews svg")
    svg.wait_for()
    page.wait_for_function("document.querySelector('#exemplar-previews svg').getAttribute('viewBox') === '0 0 84 84'")
    page.click("#create-btn")  # no box yet: refused on the page, nothing sent
    assert "draw the object's box on every image (missing: scene.png)" in page.inner_text("#errors")
    bb = svg.bounding_box()
    scale = bb["width"] / 84
    page.mouse.move(bb["x"] + 10 * scale, bb["y"] + 12 * scale)
    page.mouse.down()
    page.mouse.move(bb["x"] + 40 * scale, bb["y"] + 30 * scale, steps=4)
    page.mouse.move(bb["x"] + 60 * scale, bb["y"] + 70 * scale, steps=4)
    page.mouse.up()
    drawn = [float(v) for v in page.get_attribute("#exemplar-previews svg", "data-box").strip("[]").split(",")]
    assert drawn == pytest.approx([10, 12, 60, 70], abs=1)
    with page.expect_request(lambda r: r.url.endswith("/v1/exemplar-sets") and r.method == "POST") as sent:
        page.click("#create-btn")
    assert f'name="boxes"\r\n\r\n[[{",".join(str(int(v)) for v in drawn)}]]' in sent.value.post_data
    page.wait_for_function(f"document.querySelector('#set-info').dataset.setId !== '{set_id}'")
    with QlocClient(stack.base_url) as qloc:
        boxed = qloc.get_exemplar_set(page.get_attribute("#set-info", "data-set-id"))
    assert boxed.num_exemplars == 1 and boxed.num_labeled == 1
    assert boxed.name is None and boxed.bundle == "test-other"  # the name field was emptied, the bundle kept


def test_auto_sends_no_bundle_and_the_server_picks_by_the_crops(page, stack: Stack, tmp_path: Path) -> None:
    open_page(page)
    for mode, expected in (("RGB", "test-other"), ("L", "test-digits")):  # the stack's photo default, its default
        pixels = np.zeros((120, 120, 3), np.uint8)  # a color photo's size (a 28-px color crop: the default)
        pixels[:, :60, 0] = pixels[:, 60:, 2] = 220  # red | blue
        buf = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(buf, "PNG")
        page.set_input_files("#exemplar-files", [write(tmp_path, f"{mode}.png", buf.getvalue())])
        previews(page, 1)
        before = page.get_attribute("#set-info", "data-set-id") or ""  # the set shown: one made before, or none
        with page.expect_request(lambda r: r.url.endswith("/v1/exemplar-sets") and r.method == "POST") as sent:
            page.click("#create-btn")
        assert 'name="bundle"' not in sent.value.post_data
        page.wait_for_function(f"!['', {before!r}].includes(document.querySelector('#set-info').dataset.setId)")
        assert f"on bundle {expected}." in page.inner_text("#status")
        with QlocClient(stack.base_url) as qloc:
            assert qloc.get_exemplar_set(page.get_attribute("#set-info", "data-set-id")).bundle == expected
        assert page.input_value("#bundle-select") == ""  # auto stays chosen


def test_localize_draws_the_apis_boxes_and_plays_the_trajectory(page, stack: Stack, tmp_path: Path) -> None:
    with QlocClient(stack.base_url) as qloc:
        set_id = str(qloc.create_exemplar_set([crop(9), crop(10)]).id)
    scenes = [png_bytes(84, 84, seed=21), png_bytes(120, 84, seed=22)]
    paths = [write(tmp_path, f"scene{i}.png", b) for i, b in enumerate(scenes)]
    open_page(page, set_id)
    with page.expect_response(lambda r: "/localize" in r.url) as answered:
        page.set_input_files("#localize-files", paths)
    answer = answered.value.json()
    assert answered.value.status == 200 and "trajectory=true" in answered.value.url
    page.wait_for_selector("figure.result >> nth=1")
    # the API, asked directly, gives the same boxes the page got
    with QlocClient(stack.base_url) as qloc:
        direct = qloc.localize(set_id, scenes, trajectory=True)
    assert [r.box for r in direct.results] == [r["box"] for r in answer["results"]]

    for i, r in enumerate(answer["results"]):
        fig = page.locator(f"figure.result[data-index='{i}']")
        assert fig.get_attribute("data-filename") == f"scene{i}.png"
        rect = fig.locator("rect.final-box")
        assert attr_box(rect) == r["box"]
        x1, y1, x2, y2 = r["box"]
        assert [float(rect.get_attribute(k)) for k in ("x", "y", "width", "height")] == \
            pytest.approx([x1, y1, x2 - x1, y2 - y1])
        # where it is drawn on the screen: the box scaled from the image's pixels to the picture's
        pic, drawn = fig.locator("svg").bounding_box(), rect.bounding_box()
        s = pic["width"] / r["width"]
        assert pic["height"] == pytest.approx(r["height"] * s, abs=1)
        centre = [drawn["x"] - pic["x"] + drawn["width"] / 2, drawn["y"] - pic["y"] + drawn["height"] / 2]
        assert centre == pytest.approx([(x1 + x2) / 2 * s, (y1 + y2) / 2 * s], abs=1)
        stroke = 3  # style.css: the box's outline, drawn half outside it
        assert [drawn["width"], drawn["height"]] == pytest.approx([(x2 - x1) * s + stroke, (y2 - y1) * s + stroke],
                                                                  abs=1)
        assert f"score {r['score']:.3f}" in fig.inner_text()

    # several objects per image: every instance the API gives is drawn, best first
    page.fill("#opt-instances", "3")
    with page.expect_response(lambda r: "/localize" in r.url) as answered:
        page.click("#localize-btn")
    many = answered.value.json()
    assert answered.value.status == 200 and "max_instances=3" in answered.value.url
    page.wait_for_function(f"document.querySelectorAll('rect.instance-box').length === "
                           f"{sum(len(r['instances']) for r in many['results'])}")
    for i, r in enumerate(many["results"]):
        rects = page.locator(f"figure.result[data-index='{i}'] rect.instance-box").all()
        drawn_boxes = [float(x.get_attribute(k)) for x in rects for k in ("x", "y", "width", "height")]
        assert drawn_boxes == pytest.approx(
            [v for b in (inst["box"] for inst in r["instances"]) for v in (b[0], b[1], b[2] - b[0], b[3] - b[1])])
    page.fill("#opt-instances", "1")
    with page.expect_response(lambda r: "/localize" in r.url):
        page.click("#localize-btn")
    page.wait_for_function("document.querySelectorAll('rect.instance-box').length === 0")

    # play image 0's episode: every step is shown in turn, ending on the last box
    traj = answer["results"][0]["trajectory"]
    fig = page.locator("figure.result[data-index='0']")
    assert int(fig.get_attribute("data-steps")) == len(traj) - 1 >= 2
    page.evaluate("""() => {
        const fig = document.querySelector("figure.result[data-index='0']");
        window.seenSteps = [];
        new MutationObserver(() => window.seenSteps.push(Number(fig.dataset.step)))
            .observe(fig, {attributes: true, attributeFilter: ["data-step"]});
    }""")
    fig.locator("button.play").click()
    page.wait_for_function("document.querySelector(\"figure.result[data-index='0']\").dataset.playing === 'true'")
    page.wait_for_function("document.querySelector(\"figure.result[data-index='0']\").dataset.playing === 'false'",
                           timeout=15_000)
    seen = page.evaluate("window.seenSteps")
    assert seen == list(range(len(traj))), seen
    step = fig.locator("rect.step-box")
    assert [float(v) for v in step.get_attribute("data-box").strip("[]").split(",")] == pytest.approx(traj[-1])
    # the action names, told from the boxes: the named action applied to each box gives the next one
    actions = [li.get_attribute("data-action") for li in fig.locator("ol.actions li").all()]
    assert len(actions) == len(traj) - 1
    env = EnvConfig()
    w, h = answer["results"][0]["width"], answer["results"][0]["height"]
    for k, name in enumerate(actions):
        moved = apply_actions(torch.tensor([traj[k]]), torch.tensor([ACTION_NAMES.index(name)]), w, h,
                              env.alpha, env.min_side, env.resize)
        assert moved[0].tolist() == pytest.approx(traj[k + 1], abs=1e-3), (k, name, traj[k], traj[k + 1])
    assert fig.locator(".action-name").inner_text().startswith(f"step {len(traj) - 1}: ")
    # the slider shows any step
    fig.locator("input[type=range]").fill("1")
    assert fig.get_attribute("data-step") == "1"
    assert fig.locator("ol.actions li.current").get_attribute("data-action") == actions[0]


def test_adapt_and_follow_the_job_to_succeeded(page, stack: Stack, tmp_path: Path) -> None:
    with QlocClient(stack.base_url) as qloc:
        set_id = str(qloc.create_exemplar_set([crop(9), crop(10)]).id)
    open_page(page, set_id)
    page.evaluate("""() => {
        const el = document.querySelector("#job-status");
        window.seenStatus = [];
        new MutationObserver(() => {
            const s = el.dataset.status;
            if (s && window.seenStatus[window.seenStatus.length - 1] !== s) window.seenStatus.push(s);
        }).observe(el, {attributes: true, attributeFilter: ["data-status"]});
    }""")
    page.set_input_files("#adapt-files", [write(tmp_path, f"u{s}.png", png_bytes(84, 84, seed=s)) for s in range(4)])
    page.fill("#adapt-iterations", "4")
    page.select_option("#adapt-activate", "true")
    page.click("#adapt-btn")
    page.wait_for_selector("#job-status[data-status=succeeded]", timeout=90_000)
    seen = page.evaluate("window.seenStatus")
    assert seen[0] == "queued" and seen[-1] == "succeeded", seen
    assert page.get_attribute("#job-progress", "value") == "4" and page.get_attribute("#job-progress", "max") == "4"
    info = page.inner_text("#job-info")
    assert "4 / 4" in info and "mean reward" in info
    job_id = page.get_attribute("#job-id", "title")
    with QlocClient(stack.base_url) as qloc:
        job = qloc.get_adaptation(job_id)
        ckpts = qloc.list_checkpoints(set_id).data
    assert job.status == "succeeded" and job.validation is not None
    assert job.validation["message"] in page.inner_text("#job-validation")
    assert f"reward {job.progress.mean_reward:.4f}"[7:] in info
    assert page.is_hidden("#job-cancel")
    # the checkpoints it wrote are listed, the final one active (activate=true), each descending from the base
    rows = page.locator("#checkpoints tbody tr")
    rows.nth(len(ckpts) - 1).wait_for()
    assert [r.get_attribute("data-id") for r in rows.all()] == [str(c.id) for c in ckpts]
    active = page.locator("#checkpoints tbody tr[data-active=true]")
    assert active.get_attribute("data-id") == str(job.checkpoint_id)
    assert active.locator("td.lineage").inner_text().startswith("base → ")
    assert "corloc" in active.locator("td.metrics").inner_text().lower()


def test_activate_the_base_checkpoint(page, stack: Stack) -> None:
    with QlocClient(stack.base_url) as qloc:
        es = qloc.create_exemplar_set([crop(9), crop(10)])
        job = qloc.wait(qloc.create_adaptation(es.id, [png_bytes(84, 84, seed=s) for s in range(4)], iterations=2,
                                               activate=True), timeout=90, poll=0.2, progress=False)
        assert job.status == "succeeded" and qloc.get_exemplar_set(es.id).active_checkpoint_id == job.checkpoint_id
        base = qloc.list_checkpoints(es.id).data[0]
    open_page(page, str(es.id))
    row = page.locator(f"#checkpoints tbody tr[data-id='{base.id}']")
    assert row.get_attribute("data-active") == "false" and row.get_attribute("data-kind") == "base"
    row.locator("button.activate").click()
    page.wait_for_selector(f"#checkpoints tbody tr[data-id='{base.id}'][data-active=true]")
    assert page.locator("#checkpoints tbody tr[data-active=true]").count() == 1
    assert "is now the set's active policy" in page.inner_text("#status")
    with QlocClient(stack.base_url) as qloc:
        assert qloc.get_exemplar_set(es.id).active_checkpoint_id == base.id
    assert row.locator("button.activate").is_disabled()


def test_the_page_lists_every_set_past_the_apis_largest_page(page, stack: Stack) -> None:
    """More sets than one page of the API (200): the newest, made last, is listed and can be chosen."""
    from datetime import timedelta

    with QlocClient(stack.base_url) as qloc:
        one = qloc.create_exemplar_set(crop(), name="first")
    from sqlalchemy import create_engine, select

    from app.tables import ExemplarSet
    engine = create_engine(stack.settings.database_url)
    with engine.begin() as conn:  # 200 copies of its row (one creation each would take minutes)
        row = dict(conn.execute(select(ExemplarSet.__table__).where(ExemplarSet.id == one.id)).mappings().one())
        copies = [{**row, "id": uuid.uuid4(), "name": f"copy {i}", "active_checkpoint_id": None,
                   "created_at": row["created_at"] + timedelta(seconds=i + 1)} for i in range(200)]
        conn.execute(ExemplarSet.__table__.insert(), copies)
    engine.dispose()
    newest = copies[-1]["id"]
    open_page(page)
    assert page.locator("#set-select option").count() >= 202  # "choose a set" + every set
    page.select_option("#set-select", str(newest))
    page.wait_for_selector(f'#set-info[data-set-id="{newest}"]')


def test_errors_from_the_api_are_shown(page, stack: Stack) -> None:
    with QlocClient(stack.base_url) as qloc:
        set_id = str(qloc.create_exemplar_set(crop()).id)
    open_page(page, set_id)
    page.set_input_files("#localize-files", files=[{"name": "notes.png", "mimeType": "image/png",
                                                    "buffer": b"these are not pixels"}])
    error = page.locator("#errors .error").first
    error.wait_for()
    assert error.get_attribute("data-status") == "415"
    assert error.inner_text().startswith("Localizing: HTTP 415: notes.png: not a PNG, JPEG or WebP image")
    error.locator("button").click()  # dismissed
    assert page.locator("#errors .error").count() == 0

    page.set_input_files("#localize-files", files=[{"name": "notes.txt", "mimeType": "text/plain",
                                                    "buffer": b"hello"}])
    page.wait_for_selector("#errors .error[data-status='415']")
    assert "notes.txt: content type 'text/plain' is not PNG, JPEG or WebP" in page.inner_text("#errors")

    page.fill("#opt-samples", "999")  # FastAPI's list of issues, made readable
    page.set_input_files("#localize-files", files=[{"name": "a.png", "mimeType": "image/png", "buffer": crop()}])
    page.wait_for_selector("#errors .error[data-status='422']")
    assert "samples: Input should be less than or equal to 63" in page.inner_text("#errors")
    assert page.locator("figure.result").count() == 0

    page.fill("#opt-samples", "")  # the retry goes through: the errors of its earlier tries are gone
    page.set_input_files("#localize-files", files=[{"name": "a.png", "mimeType": "image/png", "buffer": crop()}])
    page.wait_for_selector("figure.result")
    assert page.locator("#errors .error").count() == 0

    # a set deleted behind the page's back: 404
    assert httpx.delete(f"{stack.base_url}/v1/exemplar-sets/{set_id}").status_code == 204
    page.set_input_files("#localize-files", files=[{"name": "a.png", "mimeType": "image/png", "buffer": crop()}])
    page.wait_for_selector("#errors .error[data-status='404']")
    assert "HTTP 404: exemplar set not found" in page.inner_text("#errors")
    # sanity: the same upload straight to the API is refused with that detail
    assert httpx.post(f"{stack.base_url}/v1/exemplar-sets/{set_id}/localize",
                      files=files(crop())).json() == {"detail": "exemplar set not found"}
