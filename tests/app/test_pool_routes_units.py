"""``app.routes.pool``'s helpers by value, on SQLite and PostgreSQL with a real blob store: the answers of the races
the HTTP tests cannot time (the set deleted, or the pool filled, between the route's check and its write), whose
set another key owns, and the pool's state once its set is gone. The routes themselves: ``test_app_pool.py``."""

from __future__ import annotations

import io
import uuid

import pytest
from PIL import Image
from service_fixtures import make_test_settings, new_set, refusal

from app import crud
from app.images import UploadLimits, decode_image
from app.routes.pool import _delete, add_to_pool, get_set, state
from app.storage import BlobStore
from app.tables import ExemplarSet


@pytest.fixture
def settings(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    return make_test_settings(tmp_path, bundle_dir, max_pool_images=2, max_pool_bytes=10_000)


def image(seed: int = 0):  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    Image.new("L", (8, 8), seed).save(buf, "PNG")
    return decode_image(buf.getvalue(), filename=f"{seed}.png", declared_type="image/png",
                        limits=UploadLimits(10_000, 10_000))


def files(store: BlobStore) -> list:
    return sorted(p for p in store.root.rglob("*") if p.is_file())


def test_a_set_is_found_for_its_owner_or_without_keys_and_is_a_404_for_another_key(db):
    set_id = new_set(db)  # owned by key "k"
    with db() as s:
        assert get_set(s, set_id, "k").id == set_id and get_set(s, set_id, None).id == set_id
        assert refusal(get_set, s, set_id, "another key") == (404, "exemplar set not found")
        assert refusal(get_set, s, uuid.uuid4(), None) == (404, "exemplar set not found")


def test_a_pool_filled_meanwhile_is_a_409_saying_so_and_stores_nothing(db, settings, store):
    set_id = new_set(db)
    with db() as s:
        add_to_pool(s, store, settings, get_set(s, set_id, None), [image(1), image(2)])
        held = files(store)
        code, message = refusal(add_to_pool, s, store, settings, get_set(s, set_id, None), [image(3)])
        assert code == 409 and message.startswith("the set's image pool is full: it holds 2 images ("), message
        assert files(store) == held and crud.get_exemplar_set(s, set_id=set_id, owner=None).num_pool_images == 2


def test_a_set_deleted_meanwhile_is_a_404_and_its_pool_reads_empty(db, settings, store):
    set_id = new_set(db)
    with db() as s:
        es = get_set(s, set_id, None)  # the route has read the set...
        s.expunge(es)
        s.commit()
        with db.begin() as other:  # ...when another request deletes it
            other.delete(other.get(ExemplarSet, set_id))
        assert refusal(add_to_pool, s, store, settings, es, [image(1)]) == (404, "exemplar set not found")
        assert files(store) == []
        assert state(s, settings, set_id) == {"num_pool_images": 0, "pool_bytes": 0, "max_pool_images": 2,
                                              "max_pool_bytes": 10_000}
        assert refusal(_delete, s, store, set_id, None) == (404, "exemplar set not found")


def test_deleting_an_image_not_in_the_pool_is_a_404_naming_the_image(db, settings, store):
    set_id = new_set(db)
    with db() as s:
        added = add_to_pool(s, store, settings, get_set(s, set_id, None), [image(1)])
        assert state(s, settings, set_id) == {"num_pool_images": 1, "pool_bytes": added[0].size,
                                              "max_pool_images": 2, "max_pool_bytes": 10_000}
        assert refusal(_delete, s, store, set_id, uuid.uuid4()) == (404, "image not found in this set's pool")
        assert len(files(store)) == 1
        _delete(s, store, set_id, added[0].id)
        assert files(store) == [] and state(s, settings, set_id)["num_pool_images"] == 0
