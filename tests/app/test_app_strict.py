"""A query parameter or form field the route does not take is a 422 naming it (``app.routes.strict``), not
silently ignored; nothing is computed or written. Label Studio's routes and the health probes still ignore them."""

import pytest
from service_fixtures import files, png_bytes, register_set, row_counts, snapshot

URL = "/v1/exemplar-sets"


def test_a_misspelt_query_parameter_is_422_naming_it_and_the_ones_the_route_takes(client):
    set_id = register_set(client)
    path = f"{URL}/{set_id}/localize"
    r = client.post(f"{path}?max_instance=4", files=files(png_bytes()))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "unknown query parameter 'max_instance'" in detail, detail
    assert f"POST {URL}/{{set_id}}/localize takes query parameters:" in detail and "max_instances" in detail
    r = client.post(f"{path}?max_instances=2", files=files(png_bytes()))  # the right name still works
    assert r.status_code == 200 and len(r.json()["results"][0]["instances"]) >= 1
    r = client.get(f"{URL}?limit=5&offest=1&x=2")  # several: all named, sorted
    assert r.status_code == 422 and "unknown query parameters 'offest', 'x'" in r.json()["detail"]
    r = client.get("/v1/bundles?verbose=1")  # a route without parameters takes none
    assert r.status_code == 422 and "takes query parameters: none" in r.json()["detail"]


@pytest.mark.parametrize("form", [{"nmae": "cat"}, {"name": "cat", "treshold": "0.7"}])
def test_an_unknown_form_field_is_422_and_nothing_is_written(client, settings, form):
    register_set(client)
    before = snapshot(settings)
    r = client.post(URL, files=files(png_bytes()), data=form)
    assert r.status_code == 422, r.text
    unknown = next(k for k in form if k not in ("name",))
    assert f"unknown form field '{unknown}'" in r.json()["detail"]
    assert "threshold" in r.json()["detail"]  # the fields it takes
    assert snapshot(settings) == before


def test_a_job_with_an_unknown_field_is_refused_and_not_queued(client, settings):
    set_id = register_set(client)
    before = row_counts(settings.database_url)
    r = client.post(f"{URL}/{set_id}/adaptations", files=files(png_bytes(), png_bytes(seed=1)), data={"lr": "0.01"})
    assert r.status_code == 422 and "unknown form field 'lr'" in r.json()["detail"], r.text
    assert "learning_rate" in r.json()["detail"]
    assert row_counts(settings.database_url) == before


def test_probes_and_label_studio_still_ignore_what_they_do_not_take(client):
    set_id = register_set(client)
    assert client.get("/healthz?probe=1").status_code == 200
    assert client.get(f"/v1/labelstudio/{set_id}/health?project=3").status_code == 200


def test_the_spec_documents_the_422(client):
    spec = client.get("/openapi.json").json()
    assert "422" in spec["paths"]["/v1/bundles"]["get"]["responses"]
    assert "does not take" in spec["paths"]["/v1/bundles"]["get"]["responses"]["422"]["description"]


def test_a_parameter_or_field_sent_twice_is_422_naming_it_and_nothing_is_written(client, settings):
    set_id = register_set(client)
    r = client.post(f"{URL}/{set_id}/localize?samples=1&samples=2", files=files(png_bytes()))
    assert r.status_code == 422 and "query parameter 'samples' given more than once" in r.json()["detail"], r.text
    before = snapshot(settings)
    r = client.post(URL, files=files(png_bytes(), png_bytes(seed=1)), data={"name": ["a", "b"]})
    assert r.status_code == 422 and "form field 'name' given more than once" in r.json()["detail"], r.text
    assert snapshot(settings) == before
    r = client.post(URL, files=files(png_bytes(), png_bytes(seed=1)), data={"name": "a"})  # files: a list
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("field", ["iterations", "activate", "seed", "learning_rate", "source"])
def test_an_empty_form_field_is_422_not_the_default_and_nothing_is_written(client, settings, field):
    """``-F iterations=$N`` with N unset must not run the 200-iteration default."""
    set_id = register_set(client)
    before = snapshot(settings)
    r = client.post(f"{URL}/{set_id}/adaptations", files=files(png_bytes()), data={"iterations": "2", field: ""})
    assert r.status_code == 422, r.text
    assert f"form field {field!r} is empty: give it a value, or leave it out" in r.json()["detail"], r.text
    assert snapshot(settings) == before
    for data in ({"name": ""}, {"threshold": " "}):  # set creation too
        r = client.post(URL, files=files(png_bytes()), data=data)
        assert r.status_code == 422 and "is empty" in r.json()["detail"], r.text
    assert snapshot(settings) == before
    r = client.post(URL, files=files(png_bytes()) + [("files", (None, b""))])  # -F files= (no @): no default
    assert r.status_code == 422 and "form field 'files' is empty: attach a file (curl -F 'files=@" in r.text, r.text
    r = client.post(URL, files=files(png_bytes()) + [("files", (None, b"hello"))])  # -F files=hello: text
    assert r.status_code == 422 and "files takes files, not text" in r.text and "<class" not in r.text, r.text
    png = png_bytes()
    r = client.post(URL, files=files(png) + [("files", ("", png, "image/png"))])  # a file with an empty filename
    assert r.status_code == 422 and "give each file a filename" in r.text and "PNG" not in r.text, r.text
    assert snapshot(settings) == before


@pytest.mark.parametrize("field", ["boxes", "name", "threshold"])
def test_a_file_sent_for_a_text_field_is_422_saying_so_not_the_files_internals(client, settings, field):
    before = snapshot(settings)
    r = client.post(URL, files=files(png_bytes()) + [(field, ("boxes.json", b"[[0, 0, 10, 10]]", "application/json"))])
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["body", field] and err["input"] == "a file (boxes.json, 16 bytes)", err
    assert f"{field} is a text field, not a file" in err["msg"] and f"-F '{field}=<file'" in err["msg"], err
    assert snapshot(settings) == before


@pytest.mark.parametrize("query, message", [
    ("image_ids=5", "image_ids is for format=coco: not used with format=json"),
    ("format=labelstudio&category_id=3", "category_id is for format=coco: not used with format=labelstudio"),
    ("format=coco&label=x", "label is for format=labelstudio: not used with format=coco"),
    ("format=coco&trajectory=true", "trajectory=true is answered only with format=json"),
    ("format=coco&image_ids=11,11", "image_ids repeats 11: COCO image ids must be unique"),
])
def test_what_the_asked_format_would_drop_is_422(client, settings, query, message):
    set_id = register_set(client)
    before = snapshot(settings)
    r = client.post(f"{URL}/{set_id}/localize?{query}&keep=true", files=files(png_bytes(), png_bytes(seed=1)))
    assert r.status_code == 422 and message in r.json()["detail"], r.text
    assert snapshot(settings) == before  # keep=true stored nothing


def test_an_urlencoded_form_to_a_route_that_takes_files_is_415_saying_so(client, settings):
    before = snapshot(settings)
    r = client.post(URL, data={"name": "x"})  # curl -d name=x
    assert r.status_code == 415 and "not an urlencoded form (curl -d)" in r.json()["detail"], r.text
    assert snapshot(settings) == before


def test_an_empty_label_is_422_not_the_sets_name(client):
    set_id = register_set(client)
    r = client.post(f"{URL}/{set_id}/localize?format=labelstudio&label=", files=files(png_bytes()))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "label"], r.text
    for label, says in (("%20%20", "label is empty"), ("a%00b", "NUL")):
        r = client.post(f"{URL}/{set_id}/localize?format=labelstudio&label={label}", files=files(png_bytes()))
        assert r.status_code == 422 and says in r.text, r.text


def test_keep_with_an_export_format_gives_the_kept_ids_in_a_header(client):
    set_id = register_set(client)
    r = client.post(f"{URL}/{set_id}/localize?format=coco&keep=true", files=files(png_bytes(), png_bytes(seed=1)))
    assert r.status_code == 200, r.text
    kept = r.headers["X-Qloc-Kept"].split(",")
    listed = client.get(f"{URL}/{set_id}/images").json()
    assert len(kept) == 2 and {i["id"] for i in listed["data"]} == set(kept)
    r = client.post(f"{URL}/{set_id}/localize?format=coco", files=files(png_bytes()))
    assert "X-Qloc-Kept" not in r.headers


def test_a_json_body_to_a_form_route_is_415_saying_it_takes_a_form(client, settings):
    before = snapshot(settings)
    r = client.post(URL, json={"name": "cat"})
    assert r.status_code == 415, r.text
    assert "takes multipart/form-data" in r.json()["detail"] and "application/json" in r.json()["detail"]
    assert snapshot(settings) == before
    set_id = register_set(client)
    r = client.post(f"{URL}/{set_id}/adaptations", data={"source": "pool"})  # a form without files: read as one
    assert r.status_code == 422 and "pool" in r.json()["detail"], r.text


def test_a_method_a_path_does_not_take_is_405_naming_every_method_it_takes(client):
    """``Allow`` and the detail list every method of the path (Starlette named the first route's only)."""
    set_id = register_set(client)
    for method, url, allowed in (("PUT", f"/v1/exemplar-sets/{set_id}", "DELETE, GET, PATCH"),
                                 ("PUT", "/v1/exemplar-sets", "GET, POST"),
                                 ("OPTIONS", f"/v1/exemplar-sets/{set_id}/images", "DELETE, GET, POST"),
                                 ("PUT", "/healthz", "GET, HEAD")):
        r = client.request(method, url)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (url, r.headers)
        assert r.json()["detail"] == f"{method} is not allowed on {url}: it takes {allowed}"


def test_a_trailing_slash_is_a_json_404_naming_the_path_without_it(client, settings):
    """Not an empty 307 (``curl -F`` without ``-L`` printed nothing, and nothing was created)."""
    before = snapshot(settings)
    r = client.post("/v1/exemplar-sets/", files=files(png_bytes(28, 28)), follow_redirects=False)
    assert r.status_code == 404 and "without the trailing slash, /v1/exemplar-sets" in r.json()["detail"]
    assert snapshot(settings) == before
    assert client.get("/v1/nothing-here/").json() == {"detail": "Not Found"}


def test_the_checkpoint_parameter_takes_what_the_path_takes_and_says_so_in_words(client):
    """``active`` / ``base`` in any case, an id in any spelling the path's ids take; anything else a 422 saying
    what it takes (not a regular expression)."""
    import uuid

    set_id = register_set(client)
    url = f"/v1/exemplar-sets/{set_id}/localize"
    base = client.get(f"/v1/exemplar-sets/{set_id}/checkpoints").json()["data"][0]["id"]
    for name in ("ACTIVE", "Base", base.upper(), uuid.UUID(base).hex, f"{{{base}}}"):
        r = client.post(url, params={"checkpoint": name}, files=files(png_bytes(84, 84)))
        assert r.status_code == 200 and r.json()["checkpoint_id"] == base, (name, r.text)
    r = client.post(url, params={"checkpoint": "latest"}, files=files(png_bytes(84, 84)))
    assert r.status_code == 422 and "checkpoint is `active`, `base` or a checkpoint id" in r.text
    assert "pattern" not in r.text
    r = client.post(url, params={"checkpoint": str(uuid.uuid4())}, files=files(png_bytes(84, 84)))
    assert r.status_code == 404
