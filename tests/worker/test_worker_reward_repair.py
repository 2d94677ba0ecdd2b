"""Reward repair through the real job path: a set of glyph exemplars (a kind the digit bundle never saw) -> a job
that repairs the head -> checkpoints that carry it -> localize with such a checkpoint runs its head and prototype,
the base checkpoint the bundle's; a job with the reward chosen on its probes reports the choice and still serves
the head it started with."""

import io
import os
import time
import uuid

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from service_fixtures import SMALL_CALIBRATIONS, make_test_settings, migrate
from sqlalchemy import select
from test_worker_adapt_quality import SHIPPED, _png, _upload

from app.inference import BundleRegistry, read_head
from app.storage import BlobStore
from app.tables import Checkpoint
from models.bundle import checkpoint_from_bytes, policy_from_bytes
from models.data.types import exemplar_crops
from models.experiments.datasets import GlyphKind
from models.inference import Localizer
from models.repair import CANDIDATES
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job


def _glyph_service(tmp_path, probes: int, **settings):
    """Settings of a migrated service on the digit bundle with a small reward repair, the bundle, and a glyph
    kind's (K, never seen by it) exemplar crops, 48 unlabeled images and ``probes`` test images. Calibrations on
    ``SMALL_CALIBRATIONS``: these tests check what a job serves (a paired checkpoint's refresh refines every voter's
    answer on each sample: at 128, three quarters of a consensus job's time)."""
    s = make_test_settings(tmp_path, SHIPPED, default_bundle="mnist-digit4", max_files_per_request=64,
                           repair_epochs=12, synthetic_probes=96, adapt_batch_size=16, reward_choice=False,
                           **{**SMALL_CALIBRATIONS, **settings})
    migrate(s.database_url)
    bundle = BundleRegistry(s.bundle_dir, "cpu").get("mnist-digit4").bundle
    kind = GlyphKind("K", "patch")
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, 0))
    return (s, bundle, crops, kind.draw(bundle, "unlabeled", 48, 0, after=5).images,
            kind.draw(bundle, "test", probes, 0).images)


def test_a_job_repairs_its_reward_and_localize_serves_the_checkpoint_with_it(tmp_path):
    from app.main import create_app

    s, bundle, crops, unlabeled, probe = _glyph_service(tmp_path, 2)
    ctx = WorkerContext.create(s)
    try:
        with TestClient(create_app(s)) as client:
            sid = client.post("/v1/exemplar-sets", files=_upload([_png(c) for c in crops])).json()["id"]
            base = client.post(f"/v1/exemplar-sets/{sid}/localize", files=_upload([_png(im) for im in probe])).json()
            r = client.post(f"/v1/exemplar-sets/{sid}/adaptations", data={"activate": "true"},
                            files=_upload([_png(im) for im in unlabeled]))
            assert r.status_code == 202, r.text
            assert run_adaptation_job(ctx, uuid.UUID(r.json()["id"]), worker="test") == "succeeded"
            job = client.get(f"/v1/adaptations/{r.json()['id']}").json()
            v = job["validation"]
            assert v["reward"] == "repaired head" and v["repair"]["kept"], v["repair"]
            assert v["repair"]["after"]["ordacc"] > v["repair"]["before"]["ordacc"] + 2
            assert v["faithfulness"]["spearman"] < v["repair"]["before"]["spearman"]  # the guard's, repaired
            ckpt = client.get(f"/v1/checkpoints/{job['checkpoint_id']}").json()
            adapted = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"checkpoint": ckpt["id"]},
                                  files=_upload([_png(im) for im in probe])).json()
            again_base = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"checkpoint": "base"},
                                     files=_upload([_png(im) for im in probe])).json()
            # A job that starts from that (active) checkpoint without repairing again keeps serving its head.
            r2 = client.post(f"/v1/exemplar-sets/{sid}/adaptations", data={"activate": "false"},
                             files=_upload([_png(im) for im in unlabeled[:16]]))
            assert r2.json()["params"]["base_checkpoint_id"] == ckpt["id"]
            # ... and with the reward chosen on its probes (QLOC_REWARD_CHOICE), which the job reports
            ctx2 = WorkerContext.create(s.model_copy(update={"reward_repair": False, "reward_choice": True}))
            try:
                assert run_adaptation_job(ctx2, uuid.UUID(r2.json()["id"]), worker="test") == "succeeded"
            finally:
                ctx2.engine.dispose()
            job2 = client.get(f"/v1/adaptations/{r2.json()['id']}").json()
            assert job2["validation"]["reward"] == "bundle head" and job2["validation"]["repair"] is None
            choice = job2["validation"]["reward_choice"]
            assert choice["chosen"] in CANDIDATES and set(choice["candidates"]) == set(CANDIDATES), choice
            assert all(set(f) == {"ordacc", "spearman"} for f in choice["candidates"].values())
            assert job["validation"]["reward_choice"] is None  # off (the default): reported as such
    finally:
        ctx.engine.dispose()
    assert again_base["results"] == base["results"]  # the base checkpoint still runs the bundle's head
    assert adapted["refined"] is True and base["refined"] is False and again_base["refined"] is False

    with ctx.session_factory() as session:
        row = session.get(Checkpoint, uuid.UUID(ckpt["id"]))
        data = BlobStore(s.storage_dir).read_verified(row.blob, row.sha256)
        row2 = session.get(Checkpoint, uuid.UUID(job2["checkpoint_id"]))
        data2 = BlobStore(s.storage_dir).read_verified(row2.blob, row2.sha256)
    store = BlobStore(s.storage_dir)
    agent, _, reward = checkpoint_from_bytes(data, bundle, load_head=lambda ref: read_head(store, ref))
    assert reward is not None and reward.refine  # format 3: the head, the prototype under it, refined answers
    reward2 = checkpoint_from_bytes(data2, bundle, load_head=lambda ref: read_head(store, ref))[2]
    # format 6: the head is stored once, apart, for every checkpoint of both jobs (the second starts from the first)
    assert torch.load(io.BytesIO(data), weights_only=True)["format_version"] == 6
    heads = list((s.storage_dir / "exemplar-sets" / sid / "heads").iterdir())
    assert len(heads) == 1 and len(data) < heads[0].stat().st_size
    assert reward2 is not None and torch.equal(reward2.prototype, reward.prototype) and reward2.refine
    assert all(torch.equal(v, reward.head[k]) for k, v in reward2.head.items())
    repaired = Localizer(bundle.with_head(reward.head, refine=True), "cpu")
    assert torch.allclose(reward.prototype, repaired.prototype(crops), atol=1e-4)
    pils = [Image.open(io.BytesIO(_png(im))) for im in probe]  # what the API decoded
    expected = repaired.localize(pils, reward.prototype, agent)
    for got, want in zip(adapted["results"], expected, strict=True):
        assert torch.allclose(torch.tensor(got["box"]), torch.tensor(want.box), atol=1e-3), (got, want)
        assert abs(got["score"] - want.score) < 1e-3
    unrefined = Localizer(bundle.with_head(reward.head), "cpu").localize(pils, reward.prototype, agent)
    assert all(w.score <= u.score + 1e-6 for w, u in zip(expected, unrefined, strict=True))
    # and the same agent with the bundle's head and the set's prototype would score otherwise
    plain = Localizer(bundle, "cpu").localize(pils, Localizer(bundle, "cpu").prototype(crops), agent)
    assert any(abs(p.score - w.score) > 1e-2 for p, w in zip(plain, expected, strict=True))

    # the shared head file goes with the last checkpoint that uses it (DELETE /v1/checkpoints/{id}), also while a job
    # of the set is unfinished (a head written before it began is not one it may still name)
    with TestClient(create_app(s)) as client:
        listed = client.get(f"/v1/exemplar-sets/{sid}/checkpoints").json()["data"]
        written = [c["id"] for c in listed if c["kind"] == "adapted"]
        assert len(written) >= 2
        heads[0].rename(heads[0].with_suffix(".away"))  # a head file missing: the checkpoint is there, unreadable
        r = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"checkpoint": written[0]},
                        files=_upload([_png(im) for im in probe]))
        assert r.status_code == 503 and "cannot be read" in r.json()["detail"], r.text  # not "deleted" (404)
        heads[0].with_suffix(".away").rename(heads[0])
        assert client.post(f"/v1/checkpoints/{listed[0]['id']}/activate").status_code == 200  # the base
        queued = client.post(f"/v1/exemplar-sets/{sid}/adaptations", data={"activate": "false"},
                             files=_upload([_png(im) for im in unlabeled[:4]]))
        assert queued.status_code == 202  # no worker runs it here: it stays queued
        an_hour_ago = time.time() - 3600  # written well before that job (a minute's margin for the clocks)
        os.utime(heads[0], (an_hour_ago, an_hour_ago))
        for i, cid in enumerate(written):
            assert client.delete(f"/v1/checkpoints/{cid}").status_code == 204
            assert len(list(heads[0].parent.glob("*.pt"))) == (1 if i < len(written) - 1 else 0), i


@pytest.mark.parametrize("rule", ["agree", "consensus"])
def test_a_paired_job_writes_its_start_into_its_checkpoints_and_localize_serves_the_pair(tmp_path, rule):
    """``QLOC_PAIR_START=always`` (photo bundles' default, here on the digit bundle to stay fast): a job whose repair
    was kept writes checkpoints carrying its start (the bundle's agent and head, the set's prototype), says so in
    their metrics, and localize with one answers each image as ``Localizer.with_reward`` serves it: with
    ``QLOC_PAIR_RULE=agree`` (format 4, the default) the checkpoint's box or the start's; with ``consensus`` (format
    5) the last checkpoint carries every earlier one's agent, and each box is the start's or one of theirs."""
    from app.main import create_app

    s, bundle, crops, unlabeled, probe = _glyph_service(tmp_path, 8, pair_start="always", default_iterations=20,
                                                        pair_rule=rule, checkpoint_every=5, early_stop_patience=0)
    ctx = WorkerContext.create(s)
    try:
        with TestClient(create_app(s)) as client:
            created = client.post("/v1/exemplar-sets", files=_upload([_png(c) for c in crops])).json()
            sid = created["id"]
            r = client.post(f"/v1/exemplar-sets/{sid}/adaptations", data={"activate": "true"},
                            files=_upload([_png(im) for im in unlabeled]))
            assert run_adaptation_job(ctx, uuid.UUID(r.json()["id"]), worker="test") == "succeeded"
            job = client.get(f"/v1/adaptations/{r.json()['id']}").json()
            assert job["validation"]["reward"] == "repaired head", job["validation"]["repair"]
            ckpt = client.get(f"/v1/checkpoints/{job['checkpoint_id']}").json()
            assert ckpt["metrics"]["answers"] == ("paired with its start" if rule == "agree"
                                                  else "consensus of its start and its job's checkpoints")
            adapted = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"checkpoint": ckpt["id"]},
                                  files=_upload([_png(im) for im in probe])).json()
    finally:
        ctx.engine.dispose()
    with ctx.session_factory() as session:
        row = session.get(Checkpoint, uuid.UUID(ckpt["id"]))
        data = BlobStore(s.storage_dir).read_verified(row.blob, row.sha256)
    assert torch.load(io.BytesIO(data), weights_only=True)["format_version"] == 6  # 4 / 5 with the head inside
    agent, _, reward = checkpoint_from_bytes(data, bundle, load_head=lambda ref: read_head(BlobStore(s.storage_dir),
                                                                                          ref))
    st = reward.start
    assert st is not None and st.agent is None and st.head is None and not st.refine  # the bundle's own policy
    with ctx.session_factory() as session:  # the job's checkpoints, oldest first: the consensus' earlier voters
        rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == row.job_id)
                               .order_by(Checkpoint.iteration)).all()
        earlier = [policy_from_bytes(BlobStore(s.storage_dir).read_verified(r.blob, r.sha256), bundle)[0]
                   for r in rows[:-1]]
    assert rows[-1].id == row.id and len(rows) == 4
    if rule == "consensus":
        assert len(st.consensus) == 3
        assert all(torch.equal(a[k], b[k]) for a, b in zip(st.consensus, earlier, strict=True) for k in a)
    else:
        assert st.consensus is None
    base = Localizer(bundle, "cpu")
    assert torch.allclose(st.prototype, base.prototype(crops), atol=1e-4)  # the set's prototype, the bundle's head
    pils = [Image.open(io.BytesIO(_png(im))) for im in probe]  # what the API decoded
    paired = base.with_reward(reward)
    expected = paired.localize(pils, reward.prototype, agent)
    alone = Localizer(bundle.with_head(reward.head, refine=True), "cpu").localize(pils, reward.prototype, agent)
    start = base.localize(pils, st.prototype)
    voters = [Localizer(bundle.with_head(reward.head, refine=True), "cpu").localize(pils, reward.prototype, e)
              for e in (earlier if rule == "consensus" else [])]
    for i, (got, want, a, b) in enumerate(zip(adapted["results"], expected, alone, start, strict=True)):
        assert torch.allclose(torch.tensor(got["box"]), torch.tensor(want.box), atol=1e-3), (got, want)
        assert want.box in (a.box, b.box, *(v[i].box for v in voters))  # the start's, or a checkpoint's answer
