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
