"""Adaptation jobs through the API without a worker: creation, idempotency, polling, cancel, enqueueing."""

import uuid
from contextlib import contextmanager

from kombu import Connection
from service_fixtures import files, png_bytes, row_counts
from sqlalchemy import create_engine, delete, update
from sqlalchemy.orm import Session

from app.queue import ADAPT_TASK
from app.tables import AdaptationJob, Checkpoint, ExemplarSet


@contextmanager
def client_db(settings):
    """A session on the API's database, committed on leaving."""
    engine = create_engine(settings.database_url)
    try:
        with Session(engine) as s, s.begin():
            yield s
    finally:
        engine.dispose()


def make_set(client):
    return client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()


def queued_messages(settings):
    """The task messages waiting in the (SQLite) broker queue: (task name, job id)."""
    out = []
    with Connection(settings.broker_url, transport_options={"connect_args": {"timeout": 30}}) as conn:
        q = conn.SimpleQueue(settings.queue, no_ack=False)
        try:
            while True:
                msg = q.get(timeout=0.2)
                out.append((msg.headers["task"], msg.headers["argsrepr"]))
        except q.Empty:
            pass
        finally:
            q.close()
    return out


def test_create_poll_and_enqueue(client, settings):
    es = make_set(client)
    r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes(), png_bytes(seed=1)),
                    data={"iterations": "3", "learning_rate": "0.01", "seed": "7", "activate": "false"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/adaptations/{job['id']}"
    assert job["status"] == "queued"
    assert job["progress"] == {"iteration": 0, "total": 3, "mean_reward": None, "phase": None}
    assert job["params"] == {"iterations": 3, "learning_rate": 0.01, "seed": 7, "activate": "false", "num_images": 2,
                             "num_pool_images": 0, "base_checkpoint_id": es["active_checkpoint_id"]}
    assert job["verdict"] is None and job["validation"] is None  # until the job finished
    assert job["checkpoint_id"] is None and job["started_at"] is None and job["error"] is None
    assert client.get(f"/v1/adaptations/{job['id']}").json() == job
    listed = client.get(f"/v1/exemplar-sets/{es['id']}/adaptations").json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == job["id"]
    assert queued_messages(settings) == [(ADAPT_TASK, f"['{job['id']}']")]
    assert 'qloc_jobs{status="queued"} 1.0' in client.get("/metrics").text


def test_activate_is_read_in_any_case_and_anything_else_is_422(client):
    """``activate`` is an enum (auto|true|false), read in any case: Python's ``str(True)`` is ``True``."""
    es = make_set(client)
    url = f"/v1/exemplar-sets/{es['id']}/adaptations"
    for sent, stored in (("True", "true"), ("FALSE", "false"), ("Auto", "auto")):
        r = client.post(url, files=files(png_bytes()), data={"iterations": "2", "activate": sent})
        assert r.status_code == 202 and r.json()["params"]["activate"] == stored, r.text
    r = client.post(url, files=files(png_bytes()), data={"iterations": "2", "activate": "yes"})
    assert r.status_code == 422 and "'auto', 'true' or 'false'" in r.text


def test_idempotency_key(client, settings):
    es = make_set(client)
    url = f"/v1/exemplar-sets/{es['id']}/adaptations"
    body = {"files": files(png_bytes(), png_bytes(seed=1)), "data": {"iterations": "3"}}
    first = client.post(url, headers={"Idempotency-Key": "abc"}, **body)
    again = client.post(url, headers={"Idempotency-Key": "abc"}, **body)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    counts = row_counts(settings.database_url)
    assert counts["adaptation_jobs"] == 1 and counts["job_images"] == 2

    other = client.post(url, headers={"Idempotency-Key": "abc"}, files=files(png_bytes(seed=5)))
    assert other.status_code == 409
    no_key = client.post(url, **body)
    assert no_key.status_code == 202 and no_key.json()["id"] != first.json()["id"]
    assert row_counts(settings.database_url)["adaptation_jobs"] == 2
    assert len(queued_messages(settings)) == 2


def test_cancel_queued_job(client):
    es = make_set(client)
    job = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes())).json()
    r = client.post(f"/v1/adaptations/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "canceled" and r.json()["cancel_requested"]
    assert r.json()["error"] == "canceled on request"  # as a job canceled while it ran
    assert client.get(f"/v1/adaptations/{job['id']}").json()["status"] == "canceled"


def test_deleting_a_set_with_unfinished_jobs_is_409_naming_them_and_deletes_nothing(client, settings):
    es = make_set(client)
    url = f"/v1/exemplar-sets/{es['id']}"
    jobs = [client.post(f"{url}/adaptations", files=files(png_bytes(seed=i)), data={"iterations": "3"}).json()["id"]
            for i in range(2)]
    before = row_counts(settings.database_url)
    r = client.delete(url)
    assert r.status_code == 409 and f"2 queued or running adaptation jobs ({jobs[0]}, {jobs[1]})" in r.json()["detail"]
    assert "POST /v1/adaptations/{job_id}/cancel" in r.json()["detail"]
    assert row_counts(settings.database_url) == before
    with client_db(settings) as s:  # a cancel asked of a running job: it ends at its next iteration
        s.execute(update(AdaptationJob).where(AdaptationJob.id.in_([uuid.UUID(j) for j in jobs]))
                  .values(status="running", cancel_requested=True))
    r = client.delete(url)
    assert r.status_code == 409 and f"{jobs[0]} (cancel requested: ending)" in r.json()["detail"]
    assert "wait until they have ended" in r.json()["detail"]


def test_unreachable_broker_is_503_and_the_job_is_failed(tmp_path, bundle_dir):
    from fastapi.testclient import TestClient
    from service_fixtures import make_test_settings, migrate

    from app.main import create_app

    settings = make_test_settings(tmp_path, bundle_dir, broker_url="redis://127.0.0.1:1/0")
    migrate(settings.database_url)
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["broker"].startswith("error")
        es = make_set(c)
        r = c.post(f"/v1/exemplar-sets/{es['id']}/adaptations", files=files(png_bytes()))
        assert r.status_code == 503
        jobs = c.get(f"/v1/exemplar-sets/{es['id']}/adaptations").json()["data"]
        assert [j["status"] for j in jobs] == ["failed"] and "enqueue" in jobs[0]["error"]


def test_a_503_for_an_unreachable_queue_leaves_the_idempotency_key_for_the_retry(client, monkeypatch):
    """The job the broker could not take is recorded failed and answered 503 "retry later": the retry with the
    same key makes the job once the broker is back (it answered 202 with the failed job, which never runs)."""
    from app.queue import JobQueue

    es = make_set(client)
    url, key = f"/v1/exemplar-sets/{es['id']}/adaptations", {"Idempotency-Key": "retry-me"}
    real = JobQueue.enqueue_adaptation

    def down(self, job_id):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(JobQueue, "enqueue_adaptation", down)
    assert client.post(url, headers=key, files=files(png_bytes())).status_code == 503
    monkeypatch.setattr(JobQueue, "enqueue_adaptation", real)
    r = client.post(url, headers=key, files=files(png_bytes()))
    assert r.status_code == 202 and r.json()["status"] == "queued", r.text
    again = client.post(url, headers=key, files=files(png_bytes()))
    assert again.status_code == 202 and again.json()["id"] == r.json()["id"]  # now the key is this job's
    assert sorted(j["status"] for j in client.get(url).json()["data"]) == ["failed", "queued"]


def test_a_422_shows_a_long_invalid_value_cut_short(client, settings):
    es = make_set(client)
    before = row_counts(settings.database_url)
    r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", headers={"Idempotency-Key": "k" * 60_000},
                    files=files(png_bytes()))
    assert r.status_code == 422 and len(r.content) < 2_000, len(r.content)
    (err,) = r.json()["detail"]
    assert err["loc"] == ["header", "Idempotency-Key"] and err["input"] == "k" * 200 + "... (60000 characters)"
    assert row_counts(settings.database_url) == before
    r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "x"}, files=files(png_bytes()))
    assert r.status_code == 422 and r.json()["detail"][0]["input"] == "x"  # short ones as they were


def test_a_job_starts_from_the_active_checkpoint_as_it_is_when_the_job_is_stored(client, settings, monkeypatch):
    """An activation and the deletion of the checkpoint active before it, while a job's request is on its way, do not
    make the job start from the deleted checkpoint (500 on its foreign key): it starts from the one active now."""
    import app.routes.adaptations as route

    sid = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))).json()["id"]
    base = client.get(f"/v1/exemplar-sets/{sid}/checkpoints").json()["data"][0]["id"]
    other = uuid.uuid4()
    with client_db(settings) as s:  # an adapted checkpoint row to activate (its file is never read here)
        s.add(Checkpoint(id=other, exemplar_set_id=uuid.UUID(sid), parent_id=uuid.UUID(base), kind="adapted",
                         iteration=1, sha256="0" * 64, metrics={}, blob=f"exemplar-sets/{sid}/x.pt"))
        s.commit()
    assert client.post(f"/v1/checkpoints/{other}/activate").status_code == 200
    key = route.job_image_key

    def meanwhile(*args, **kwargs):  # as the job's files are written (its read transaction ended), another client
        with client_db(settings) as s:  # activates the base and deletes the checkpoint active before
            s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(sid))
                      .values(active_checkpoint_id=uuid.UUID(base)))
            s.execute(delete(Checkpoint).where(Checkpoint.id == other))
            s.commit()
        return key(*args, **kwargs)

    monkeypatch.setattr(route, "job_image_key", meanwhile)
    r = client.post(f"/v1/exemplar-sets/{sid}/adaptations", files=files(png_bytes()), data={"iterations": "2"})
    assert r.status_code == 202, r.text
    assert r.json()["params"]["base_checkpoint_id"] == base
