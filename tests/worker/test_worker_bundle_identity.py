"""Bundles known by their content, in the worker: a job of a set whose bundle file was replaced fails with
the reason; checkpoints record their bundle file's sha256 and prototype dimension, and one read with another
file of the same name is refused (by the worker, and by localize with 409)."""

import io
import uuid

import pytest
import torch
from service_fixtures import FAST_JOB, SWAPPED, files, install_bundle, png_bytes, swapped_settings
from sqlalchemy import select, update

from app.inference import read_checkpoint
from app.tables import AdaptationJob, Checkpoint, ExemplarSet
from models.bundle import PolicyMismatch
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job

NAME = SWAPPED


def install(bundle_dir, source):
    install_bundle(bundle_dir, source, NAME)


@pytest.fixture
def settings(tmp_path, versions):
    return swapped_settings(tmp_path, versions, **FAST_JOB)  # jobs that run, not scored


@pytest.fixture
def ctx(settings):
    c = WorkerContext.create(settings)
    yield c
    c.engine.dispose()


def new_job(client, set_id=None, **data):
    if set_id is None:
        set_id = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))).json()["id"]
    data = {"iterations": "3", "seed": "1", "activate": "true", **data}
    r = client.post(f"/v1/exemplar-sets/{set_id}/adaptations", data=data,
                    files=files(*[png_bytes(84, 84, seed=i) for i in range(2)]))
    assert r.status_code == 202, r.text
    return r.json()


def test_a_job_of_a_set_whose_bundle_was_replaced_fails_with_the_reason(client, ctx, settings, versions):
    (_, v1), (v2_path, v2) = versions["v1"], versions["v2"]
    job = new_job(client)
    install(settings.bundle_dir, v2_path)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="w") == "failed"
    error = client.get(f"/v1/adaptations/{job['id']}").json()["error"]
    assert f"bundle {NAME!r} was replaced" in error and v1[:12] in error and v2[:12] in error, error
    assert "Re-create the exemplar set from its crops" in error
    # a set made with the new file adapts
    assert run_adaptation_job(ctx, uuid.UUID(new_job(client)["id"]), worker="w") == "succeeded"


def test_checkpoints_name_their_bundle_file_and_are_refused_by_another(client, ctx, settings, versions):
    (v1_path, v1), (v2_path, v2) = versions["v1"], versions["v2"]
    job = new_job(client)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="w") == "succeeded"
    with ctx.session_factory() as s:
        ckpt = s.scalars(select(Checkpoint).where(Checkpoint.job_id == uuid.UUID(job["id"]))
                         .order_by(Checkpoint.iteration.desc())).first()
    raw = torch.load(io.BytesIO(ctx.store.read(ckpt.blob)), weights_only=True)
    assert raw["bundle"] == NAME and raw["bundle_sha256"] == v1 and raw["prototype_dim"] == 512

    # A set of before migration 0004 (no recorded sha256) follows the installed file, but its adapted
    # checkpoint names v1: with v2 installed, localize refuses it (409) and the base policy still answers.
    set_id = job["exemplar_set_id"]
    with ctx.session_factory.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(set_id)).values(bundle_sha256=None))
    install(settings.bundle_dir, v2_path)
    v2_bundle = ctx.bundles.get(NAME).bundle
    with pytest.raises(PolicyMismatch, match=v2[:12]):
        read_checkpoint(ctx.store, blob=ckpt.blob, sha256=ckpt.sha256, bundle=v2_bundle)
    r = client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()))
    assert r.status_code == 409, r.text
    assert v1[:12] in r.json()["detail"] and v2[:12] in r.json()["detail"] and "checkpoint=base" in r.json()["detail"]
    r = client.post(f"/v1/exemplar-sets/{set_id}/localize", params={"checkpoint": "base"}, files=files(png_bytes()))
    assert r.status_code == 200, r.text
    # a job starting from that checkpoint fails with the reason, and writes nothing
    second = new_job(client, set_id)
    assert run_adaptation_job(ctx, uuid.UUID(second["id"]), worker="w") == "failed"
    with ctx.session_factory() as s:
        row = s.get_one(AdaptationJob, uuid.UUID(second["id"]))
        assert "replaced" in row.error and v1[:12] in row.error
        assert not s.scalars(select(Checkpoint).where(Checkpoint.job_id == row.id)).all()

    install(settings.bundle_dir, v1_path)  # the file back: the checkpoint serves again
    r = client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()))
    assert r.status_code == 200 and r.json()["checkpoint_id"] == str(ckpt.id)
