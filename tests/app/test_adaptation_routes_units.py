"""``app.routes.adaptations.submit_adaptation`` (the body of ``POST /v1/exemplar-sets/{id}/adaptations``) by value,
on SQLite and PostgreSQL with a real ``BlobStore``: each refusal's status and whole message, the job's parameters as
stored, the idempotent replay, and the outbox (sent then stamped; a send that fails answers 503 and fails the job
unless a reaper sent it). The bundle check goes through a workers-mode stand-in (``check_bundle``): the local check
is the registry's (``test_registry_units.py``). Through HTTP, with real queues and workers: ``test_app_adaptations.py``,
``test_app_pool.py``, ``tests/worker/test_worker_outbox.py``."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from fastapi import Response
from service_fixtures import BundleCheck as Remote
from service_fixtures import RecordingQueue as Queue
from service_fixtures import make_test_settings, new_set, png_bytes, refusal, upload_file
from sqlalchemy import select, update

from app import pool
from app.deps import Caller
from app.routes.adaptations import EMPTY_POOL, JobForm, request_digest, submit_adaptation
from app.routes.pool import add_to_pool
from app.routes.uploads import read_images
from app.serving import InferenceRefused
from app.storage import job_image_key, job_prefix
from app.tables import AdaptationJob, ExemplarSet, JobImage

OWNER = Caller("k")


def upload(seed: int):  # type: ignore[no-untyped-def]
    return upload_file(png_bytes(20, 16, seed=seed), f"im{seed}.png")


@pytest.fixture
def settings(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    return make_test_settings(tmp_path, bundle_dir, default_iterations=7, default_learning_rate=0.02,
                              max_iterations=50)


def form(files=(), source=None, iterations=None, learning_rate=None, seed=None, activate="auto", key=None):  # type: ignore[no-untyped-def]
    return JobForm(list(files), source, iterations, learning_rate, seed, activate, key)


def submit(db, settings, store, form_, set_id, *, queue=None, remote=None, caller=OWNER):  # type: ignore[no-untyped-def]
    """``submit_adaptation`` in a session of its own -> (the job as answered, the response's headers)."""
    response = Response()
    with db() as s:
        job = submit_adaptation(set_id, form_, response, s, settings, store, queue or Queue(), None,  # type: ignore[arg-type]
                                caller, remote or Remote())
    return job, response.headers


def job_row(db, job_id: uuid.UUID) -> AdaptationJob:  # type: ignore[no-untyped-def]
    with db() as s:
        row = s.get_one(AdaptationJob, job_id)
        s.expunge(row)
        return row


def test_the_source_rules_and_limits_refuse_before_anything_is_stored(db, settings, store):
    set_id = new_set(db)
    with db() as s:
        before = s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id))
    assert before is None
    cases = [
        (form([upload(1)], source="pool"),
         (422, "source=pool adapts on the set's pool alone: post no files, or use source=both")),
        (form(source="files"),
         (422, "at least one file is required with source=files (source=pool adapts on the set's pool)")),
        (form(source="both"),
         (422, "source=both adapts on posted files and the set's pool: no file was posted (attach them as 'files'), "
               "or use source=pool for the pool alone")),
        (form(), (422, EMPTY_POOL.format(set_id=set_id))),  # no file: the pool, which is empty
        (form(source="pool"), (422, EMPTY_POOL.format(set_id=set_id))),
        (form([upload(1)], iterations=51), (422, "iterations must be at most 50")),
    ]
    for f, want in cases:
        assert refusal(submit, db, settings, store, f, set_id) == want
    assert refusal(submit, db, settings, store, form([upload(1)]), set_id, caller=Caller("someone-else")) == (
        404, "exemplar set not found")
    assert refusal(submit, db, settings, store, form([upload(1)]), uuid.uuid4()) == (404, "exemplar set not found")
    refused = Remote(InferenceRefused(409, "the bundle file was replaced", {"X-Why": "sha"}))
    assert refusal(submit, db, settings, store, form([upload(1)]), set_id, remote=refused) == (
        409, "the bundle file was replaced")
    assert refused.checked == [("b", "a" * 64, 2)]  # the set's bundle, file digest and prototype size
    with db() as s:
        assert s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)) is None
    assert not store.root.exists() or not any(p.is_file() for p in store.root.rglob("*"))


def test_a_job_is_stored_with_its_defaults_sent_then_stamped(db, settings, store):
    set_id = new_set(db)
    queue = Queue()
    job, headers = submit(db, settings, store, form([upload(1), upload(2)], iterations=50), set_id, queue=queue)
    assert queue.sent == [job.id] and headers["Location"] == f"/v1/adaptations/{job.id}"
    assert (job.status, job.exemplar_set_id, job.params.iterations, job.params.learning_rate, job.params.seed,
            job.params.activate, job.params.num_images, job.params.num_pool_images) == (
        "queued", set_id, 50, 0.02, 0, "auto", 2, 0)
    row = job_row(db, job.id)
    with db() as s:
        active = s.get_one(ExemplarSet, set_id).active_checkpoint_id
        images = s.scalars(select(JobImage).where(JobImage.job_id == job.id).order_by(JobImage.position)).all()
        assert [(i.position, i.filename, i.width, i.height) for i in images] == [(0, "im1.png", 20, 16),
                                                                                 (1, "im2.png", 20, 16)]
        assert [i.blob for i in images] == [job_image_key(set_id, job.id, k, ".png") for k in range(2)]
        assert all(store.exists(i.blob) for i in images)
    assert row.enqueued_at is not None and row.base_checkpoint_id == active and row.owner == "k"
    assert row.idempotency_key is None and len(row.request_sha256) == 64
    # the server's defaults where the form gives none; a seed, a rate and activate as given
    job, _ = submit(db, settings, store, form([upload(3)], learning_rate=0.5, seed=9, activate="false"), set_id)
    assert (job.params.iterations, job.params.learning_rate, job.params.seed, job.params.activate) == (
        7, 0.5, 9, "false")


def test_a_job_on_the_pool_takes_the_pool_as_it_is(db, settings, store):
    set_id = new_set(db)
    empty, _ = submit(db, settings, store, form([upload(1)], source="both"), set_id)  # both, on an empty pool
    assert (empty.params.num_images, empty.params.num_pool_images) == (1, 0)
    with db() as s:
        add_to_pool(s, store, settings, s.get_one(ExemplarSet, set_id), read_images([upload(7)], settings))
    one, _ = submit(db, settings, store, form(), set_id)  # a pool of one image is a pool
    assert (one.params.num_images, one.params.num_pool_images) == (1, 1)
    set_id = new_set(db)
    with db() as s:
        es = s.get_one(ExemplarSet, set_id)
        add_to_pool(s, store, settings, es, read_images([upload(4), upload(5), upload(6)], settings))
    job, _ = submit(db, settings, store, form(), set_id)  # no file: the pool
    assert (job.params.num_images, job.params.num_pool_images) == (3, 3)
    both, _ = submit(db, settings, store, form([upload(1)], source="both"), set_id)
    assert (both.params.num_images, both.params.num_pool_images) == (4, 3)
    files, _ = submit(db, settings, store, form([upload(1)]), set_id)  # files given: the files alone
    assert (files.params.num_images, files.params.num_pool_images) == (1, 0)


def test_the_same_key_replays_its_job_and_another_request_with_it_is_409(db, settings, store):
    set_id = new_set(db)
    queue = Queue()
    first, _ = submit(db, settings, store, form([upload(1)], key="k-1"), set_id, queue=queue)
    again, headers = submit(db, settings, store, form([upload(1)], key="k-1"), set_id, queue=queue)
    assert again.id == first.id and queue.sent == [first.id]  # not a second job, not sent again
    assert headers["Idempotent-Replayed"] == "true" and headers["Location"] == f"/v1/adaptations/{first.id}"
    # a replay answers the job it made even where the request would be refused now (past a lowered limit)
    lowered = settings.model_copy(update={"max_iterations": 1})
    assert submit(db, lowered, store, form([upload(1)], key="k-1"), set_id)[0].id == first.id
    for other in (form([upload(2)], key="k-1"), form([upload(1)], seed=1, key="k-1"),
                  form([upload(1)], source="both", key="k-1")):
        assert refusal(submit, db, settings, store, other, set_id) == (
            409, "Idempotency-Key already used for a different request")
    # the same key, files and fields for another set of the same owner: another request
    assert refusal(submit, db, settings, store, form([upload(1)], key="k-1"), new_set(db)) == (
        409, "Idempotency-Key already used for a different request")
    # keys are per API key: another owner's same key is a new job
    other_set = new_set(db, owner="k2")
    theirs, _ = submit(db, settings, store, form([upload(1)], key="k-1"), other_set, caller=Caller("k2"))
    assert theirs.id != first.id


def test_a_send_that_fails_answers_503_and_fails_the_job_unless_a_reaper_sent_it(db, settings, store):
    set_id = new_set(db)
    status, detail = refusal(submit, db, settings, store, form([upload(1)], key="k-9"), set_id,
                             queue=Queue(ConnectionError("down")))
    assert (status, detail) == (503, "the job queue is unreachable; retry later")
    with db() as s:
        (failed,) = s.scalars(select(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id)).all()
        assert (failed.status, failed.error, failed.idempotency_key) == (
            "failed", "could not enqueue the job: ConnectionError", None)  # the key is free for the retry
    retried, _ = submit(db, settings, store, form([upload(1)], key="k-9"), set_id)
    assert retried.id != failed.id and retried.status == "queued"

    class SentByAReaper(Queue):  # the send fails here, but a reaper sent the job (and stamped it) meanwhile
        def enqueue_adaptation(self, job_id: uuid.UUID) -> None:
            with db.begin() as s:
                s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id)
                          .values(enqueued_at=job_row(db, retried.id).enqueued_at))
            raise ConnectionError("down")

    job, headers = submit(db, settings, store, form([upload(2)]), set_id, queue=SentByAReaper())
    assert job.status == "queued" and headers["Location"] == f"/v1/adaptations/{job.id}"
    assert job_row(db, job.id).status == "queued"


def test_a_send_not_stamped_still_answers_the_job(db, settings, store, monkeypatch):
    """Sent, but the stamp's write fails: the job is answered (the reaper sends it again: a harmless duplicate)."""
    import app.routes.adaptations as routes

    def broken(session, *, job_id):  # noqa: ANN001, ANN202
        raise RuntimeError("the database went away")

    monkeypatch.setattr(routes.crud, "mark_enqueued", broken)
    set_id = new_set(db)
    queue = Queue()
    job, headers = submit(db, settings, store, form([upload(1)]), set_id, queue=queue)
    assert queue.sent == [job.id] and headers["Location"] == f"/v1/adaptations/{job.id}"
    row = job_row(db, job.id)
    assert row.status == "queued" and row.enqueued_at is None


SCORE = {"corloc": 50.0, "mean_iou": 0.5, "n": 8}
VALIDATION = {"probes": {"select": 8, "held": 8}, "faithfulness": {"ordacc": 90.0},
              "base": {"select": SCORE, "held": SCORE, "labeled": None}, "best": None, "checkpoints": [],
              "stopped_early": False,
              "activated_iteration": None, "message": "the verdict in words"}
"""A guard's report as a job row holds it (the fields a report of a job without checkpoints has)."""


def test_a_job_is_shown_with_everything_its_row_holds_and_a_phase_only_while_it_runs():
    """``to_public`` of a finished and of a running job (the selected HTTP tests show queued ones). Its validation is
    the guard's report, shown as stored (``tests/models/test_probes_guard.py`` pins the report)."""
    from datetime import UTC, datetime

    from app.routes.adaptations import to_public

    at = [datetime(2026, 12, 7, h, tzinfo=UTC) for h in (1, 2, 3)]
    row = AdaptationJob(id=uuid.uuid4(), exemplar_set_id=uuid.uuid4(), status="succeeded", progress_iteration=40,
                        iterations=40, mean_reward=-0.25, phase="finishing", checkpoint_id=uuid.uuid4(), error=None,
                        learning_rate=0.002, seed=3, activate="auto", num_images=12, num_pool_images=5,
                        base_checkpoint_id=uuid.uuid4(), verdict="improved", validation=VALIDATION, attempts=2,
                        cancel_requested=False, created_at=at[0], started_at=at[1], finished_at=at[2])
    shown = to_public(row).model_dump()
    assert shown == {
        "id": row.id, "exemplar_set_id": row.exemplar_set_id, "status": "succeeded",
        "progress": {"iteration": 40, "total": 40, "mean_reward": -0.25, "phase": None},  # not running: no phase
        "checkpoint_id": row.checkpoint_id, "error": None,
        "params": {"iterations": 40, "learning_rate": 0.002, "seed": 3, "activate": "auto", "num_images": 12,
                   "num_pool_images": 5, "base_checkpoint_id": row.base_checkpoint_id},
        "verdict": "improved", "validation": {**VALIDATION, "activated_checkpoint_id": None, "reward": None,
                                              "repair": None, "reward_choice": None},
        "attempts": 2, "cancel_requested": False,
        "created_at": at[0], "started_at": at[1], "finished_at": at[2]}
    row.status, row.finished_at, row.phase = "running", None, "adapting"
    assert to_public(row).progress.phase == "adapting"


def test_a_pool_emptied_before_the_job_takes_the_sets_lock_is_a_422_that_stores_nothing(db, settings, store,
                                                                                       monkeypatch):
    set_id = new_set(db)
    with db() as s:
        add_to_pool(s, store, settings, s.get_one(ExemplarSet, set_id), read_images([upload(4)], settings))
    real, emptied = pool.lock, []

    def emptied_first(session, sid):  # noqa: ANN001, ANN202 -- another request empties the pool meanwhile
        if not emptied:
            emptied.append(sid)
            with db() as other:
                pool.delete_images(other, set_id=sid)  # (it takes the lock too: this one, then the real one)
                other.commit()
        real(session, sid)

    monkeypatch.setattr(pool, "lock", emptied_first)
    assert refusal(submit, db, settings, store, form(), set_id) == (422, EMPTY_POOL.format(set_id=set_id))
    with db() as s:
        assert s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)) is None


def test_a_request_that_loses_the_race_for_its_key_answers_the_winners_job_and_leaves_no_file(db, settings, store,
                                                                                             monkeypatch):
    """Two requests with one Idempotency-Key at once: both find no job under it, the second's insert breaks the key's
    uniqueness; it answers the first one's job (a replay) and its own files go."""
    import app.routes.adaptations as routes

    set_id = new_set(db)
    first, _ = submit(db, settings, store, form([upload(1)], key="race"), set_id)
    looks = []
    real = routes.crud.get_job_by_idempotency_key

    def not_yet_there_at_first(session, *, owner, key):  # noqa: ANN001, ANN202
        looks.append(key)
        return None if len(looks) == 1 else real(session, owner=owner, key=key)

    monkeypatch.setattr(routes.crud, "get_job_by_idempotency_key", not_yet_there_at_first)
    queue = Queue()
    job, headers = submit(db, settings, store, form([upload(1)], key="race"), set_id, queue=queue)
    assert job.id == first.id and headers["Idempotent-Replayed"] == "true" and queue.sent == []
    assert looks == ["race", "race"]
    with db() as s:
        jobs = s.scalars(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)).all()
    assert jobs == [first.id]
    jobs_root = store.path(job_prefix(set_id, first.id)).parent
    assert sorted(p.name for p in jobs_root.iterdir()) == [str(first.id)]  # the loser's folder went


def test_a_set_deleted_before_the_job_takes_its_lock_is_a_404_that_leaves_no_file(db, settings, store, monkeypatch):
    from app import crud
    from app.storage import exemplar_set_prefix

    set_id = new_set(db)
    real, deleted = pool.lock, []

    def deleted_first(session, sid):  # noqa: ANN001, ANN202 -- another request deletes the set meanwhile
        if not deleted:
            deleted.append(sid)
            with db.begin() as other:
                crud.delete_exemplar_set(other, set_id=sid)
            store.delete_tree(exemplar_set_prefix(sid))
            store.put(f"{exemplar_set_prefix(sid)}/jobs/late/images/000.png", b"a write that re-made the folders")
        real(session, sid)

    monkeypatch.setattr(pool, "lock", deleted_first)
    queue = Queue()
    assert refusal(submit, db, settings, store, form([upload(1), upload(2)]), set_id, queue=queue) == (
        404, "exemplar set not found (deleted during this request)")
    assert queue.sent == [] and not store.path(exemplar_set_prefix(set_id)).exists()
    with db() as s:
        assert s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)) is None


def test_the_request_digest_is_pinned_by_value():
    """Every job row stores it (``request_sha256``): changed by an upgrade, a retry of a job made before would be
    answered 409. The JSON it hashes, written out: keys sorted, the set id, the parameters, each file's name and
    sha256, in order."""
    set_id = uuid.UUID(int=1)
    body = ('{"activate": "auto", "exemplar_set_id": "00000000-0000-0000-0000-000000000001", "files": [["a.png", '
            '"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"], ["b.png", '
            '"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"]], "iterations": 5}')
    files = [upload_file(b"abc", "a.png"), upload_file(b"", "b.png")]
    assert request_digest(set_id, {"iterations": 5, "activate": "auto"}, files, [b"abc", b""]) == (
        hashlib.sha256(body.encode()).hexdigest())


def test_a_job_stores_the_digest_of_its_request_with_its_source_unless_it_is_files(db, settings, store):
    set_id = new_set(db)
    params = {"iterations": 7, "seed": 0, "activate": "auto", "learning_rate": 0.02}  # the stored defaults
    raw = [png_bytes(20, 16, seed=1)]
    for source in (None, "files"):  # files given: source=files or none is the same request
        job, _ = submit(db, settings, store, form([upload(1)], source=source), set_id)
        assert job_row(db, job.id).request_sha256 == request_digest(set_id, params, [upload(1)], raw)
    with db() as s:
        add_to_pool(s, store, settings, s.get_one(ExemplarSet, set_id), read_images([upload(4)], settings))
    for source in (None, "pool"):  # no file: the pool, named or not
        job, _ = submit(db, settings, store, form(source=source), set_id)
        assert job_row(db, job.id).request_sha256 == request_digest(set_id, {**params, "source": "pool"}, [], [])
    job, _ = submit(db, settings, store, form([upload(1)], source="both"), set_id)
    assert job_row(db, job.id).request_sha256 == request_digest(set_id, {**params, "source": "both"}, [upload(1)],
                                                                raw)


def test_an_empty_pool_is_refused_before_the_bundle_check(db, settings, store):
    set_id = new_set(db)
    refused = Remote(InferenceRefused(409, "the bundle file was replaced"))
    for f in (form(), form(source="pool")):
        assert refusal(submit, db, settings, store, f, set_id, remote=refused) == (
            422, EMPTY_POOL.format(set_id=set_id))
    assert refused.checked == []


def test_a_failed_write_leaves_no_job_and_none_of_its_files_and_says_why(db, settings, store, monkeypatch):
    """A disk that fills up at the second image, the set still there: the error is the write's (a 500 by the app's
    handler), not a 404, and the first image is removed with the job's folder."""
    set_id = new_set(db)
    real, written = store.put, []

    def full_at_the_second(key: str, data: bytes) -> str:
        if written:
            raise OSError(28, "No space left on device")
        written.append(key)
        return real(key, data)

    monkeypatch.setattr(store, "put", full_at_the_second)
    with pytest.raises(OSError, match="No space left"):
        submit(db, settings, store, form([upload(1), upload(2)]), set_id)
    assert len(written) == 1 and not store.exists(written[0])
    with db() as s:
        assert s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)) is None
    assert not any(p.is_file() for p in store.root.rglob("*"))
