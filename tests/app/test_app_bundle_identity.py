"""Bundles known by their content, through the API: a set records the sha256 of the bundle file that made
its prototype; once another file is installed under that name the set answers 409 (new sets use the new
file) until the old file is back. In process, real SQL (SQLite), real bundle files replaced on disk."""

import uuid

import pytest
from service_fixtures import SWAPPED, files, install_bundle, png_bytes, swapped_settings
from sqlalchemy import select, update

from app.db import make_engine, make_sessionmaker
from app.inference import BundleRegistry, BundleReplaced
from app.tables import Checkpoint, ExemplarSet

NAME = SWAPPED


def install(bundle_dir, source):
    install_bundle(bundle_dir, source, NAME)


@pytest.fixture
def settings(tmp_path, versions):
    return swapped_settings(tmp_path, versions)


def create_set(client, seed=0):
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=seed)))
    assert r.status_code == 201, r.text
    return r.json()


def localize(client, set_id, **params):
    return client.post(f"/v1/exemplar-sets/{set_id}/localize", params=params,
                       files=files(png_bytes(84, 84, seed=3), png_bytes(120, 90, seed=4)))


def set_row(settings, set_id):
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as s:
            es = s.get_one(ExemplarSet, uuid.UUID(set_id))
            base = s.scalars(select(Checkpoint).where(Checkpoint.exemplar_set_id == es.id,
                                                      Checkpoint.kind == "base")).one()
            return es.bundle_sha256, base.sha256
    finally:
        engine.dispose()


def forget_bundle_sha256(settings, set_id):
    """Make the set one of before migration 0004: no recorded bundle sha256."""
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine).begin() as s:
            s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(set_id)).values(bundle_sha256=None))
    finally:
        engine.dispose()


def test_a_set_records_the_installed_bundles_sha256(client, settings, versions):
    v1 = versions["v1"][1]
    body = create_set(client)
    assert body["bundle"] == NAME and body["bundle_sha256"] == v1
    assert client.get(f"/v1/exemplar-sets/{body['id']}").json()["bundle_sha256"] == v1
    assert [s["bundle_sha256"] for s in client.get("/v1/exemplar-sets").json()["data"]] == [v1]
    assert set_row(settings, body["id"]) == (v1, v1)  # the row, and its base checkpoint as before


def test_a_replaced_bundle_refuses_old_sets_with_a_clear_409_and_serves_new_sets(client, settings, versions):
    (_, v1), (v2_path, v2) = versions["v1"], versions["v2"]
    old = create_set(client)
    assert localize(client, old["id"]).status_code == 200

    install(settings.bundle_dir, v2_path)  # same name, another file: noticed without a restart
    for params in ({}, {"checkpoint": "base"}):
        r = localize(client, old["id"], **params)
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert f"bundle {NAME!r} was replaced" in detail, detail
        assert v1[:12] in detail and v2[:12] in detail and "Re-create the exemplar set from its crops" in detail
    assert client.get(f"/v1/exemplar-sets/{old['id']}").status_code == 200  # reading it still works
    # an adaptation of the old set is refused at once, with the same message, and nothing is queued
    r = client.post(f"/v1/exemplar-sets/{old['id']}/adaptations", files=files(png_bytes()))
    assert r.status_code == 409 and f"bundle {NAME!r} was replaced" in r.json()["detail"], r.text
    assert client.get(f"/v1/exemplar-sets/{old['id']}/adaptations").json()["data"] == []

    new = create_set(client)
    assert new["bundle_sha256"] == v2
    r = localize(client, new["id"])
    assert r.status_code == 200, r.text


def test_restoring_the_old_file_serves_the_old_set_again(client, settings, versions):
    (v1_path, v1), (v2_path, v2) = versions["v1"], versions["v2"]
    old = create_set(client)
    before = localize(client, old["id"]).json()["results"]
    install(settings.bundle_dir, v2_path)
    new = create_set(client)
    assert localize(client, old["id"]).status_code == 409

    install(settings.bundle_dir, v1_path)
    r = localize(client, old["id"])
    assert r.status_code == 200, r.text
    assert r.json()["results"] == before  # the very weights it had: the same answers
    r = localize(client, new["id"])  # now the newer set is the one whose file is gone
    assert r.status_code == 409 and v2[:12] in r.json()["detail"] and v1[:12] in r.json()["detail"]


def test_sets_without_a_recorded_sha256_follow_the_installed_file(client, settings, versions):
    old = create_set(client)
    forget_bundle_sha256(settings, old["id"])
    assert client.get(f"/v1/exemplar-sets/{old['id']}").json()["bundle_sha256"] is None
    install(settings.bundle_dir, versions["v2"][0])
    assert localize(client, old["id"]).status_code == 200  # as before the column existed
    # ... unless the installed file cannot use its prototype at all
    install(settings.bundle_dir, versions["narrow"][0])
    r = localize(client, old["id"])
    assert r.status_code == 409 and "dimension 256" in r.json()["detail"] and "dimension 512" in r.json()["detail"]


def test_the_registry_reloads_a_changed_file_and_keeps_an_unchanged_one(tmp_path, versions):
    (v1_path, v1), (v2_path, v2) = versions["v1"], versions["v2"]
    installed = tmp_path / "registry"
    install(installed, v1_path)
    reg = BundleRegistry(installed, "cpu")
    first = reg.get(NAME)
    assert first.sha256 == v1 == first.bundle.sha256 and reg.get(NAME) is first

    install(installed, v1_path)  # another inode, the same bytes: hashed again, not reloaded
    again = reg.get(NAME, expect_sha256=v1)
    assert again.sha256 == v1 and again.bundle is first.bundle

    install(installed, v2_path)
    second = reg.get(NAME)
    assert second.sha256 == v2 and second.bundle.sha256 == v2 and second.bundle is not first.bundle
    with pytest.raises(BundleReplaced) as refused:
        reg.get(NAME, expect_sha256=v1)
    assert (refused.value.recorded, refused.value.installed) == (v1, v2)

    (installed / f"{NAME}.pt").write_bytes(b"half a file")  # written in place, unreadable: refused, not served
    with pytest.raises(ValueError, match="not a readable qloc-bundle"):
        reg.get(NAME)
    install(installed, v1_path)
    assert reg.get(NAME, expect_sha256=v1).sha256 == v1
