"""The calibration refresh at the end of a job (``worker.calibrations.refreshed_calibrations``) by value: one real job
runs in-process and its run is kept, then the refresh is called again on it with ``calibrate_policy`` watched (a spy
that calls through), so that what each fit is given -- the checkpoint's policy, its answers erased from the job's
images, the guard's probes, the set's crops, threshold, negatives and templates, the job's seed and the service's
sample count -- is pinned by value, and each way the refresh gives up.

What a refreshed checkpoint serves is ``tests/worker/test_worker_calibration.py``."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from service_fixtures import FAST_JOB, files, png_bytes

from app.inference import prototype_from_bytes, read_checkpoint
from app.tables import Checkpoint
from models.calibration import answers, stored_negative_templates
from models.data.probes import erase_boxes
from models.inference import Localizer
from models.verifier import KindCheck
from worker import calibrations, jobs
from worker.context import WorkerContext
from worker.jobs import run_adaptation_job
from worker.probes import set_examples


@pytest.fixture
def settings(settings):
    """A job's guard on 16 probes (``FAST_JOB``'s), the calibration on 12 samples of its own, no reward repair (the
    set's negatives then apply; a kept repair's case is ``test_a_repaired_head_...``), images decoded at most 32 px
    on a side (the set's second crop, 48 px, is read downscaled)."""
    return settings.model_copy(update={"synthetic_probes": FAST_JOB["synthetic_probes"], "calibration_samples": 12,
                                       "reward_repair": False, "decode_max_side": 32})


@pytest.fixture
def finished(client, settings, monkeypatch):  # type: ignore[no-untyped-def]
    """A job run to its end on a set with two negative exemplars (templates of their own) and a threshold of 0.7
    -> (its run, the checkpoint ids its refresh was asked for, what it returned, the worker context)."""
    kept = {}
    real = jobs.refreshed_calibrations

    def keep(run, ids):  # type: ignore[no-untyped-def]
        kept.update(run=run, ids=set(ids), out=real(run, ids))
        return kept["out"]

    monkeypatch.setattr(jobs, "refreshed_calibrations", keep)
    ctx = WorkerContext.create(settings)
    es = client.post("/v1/exemplar-sets", data={"threshold": "0.7"},
                     files=files(png_bytes(28, 28, seed=9), png_bytes(48, 40, seed=10))
                     + files(png_bytes(28, 28, seed=4), png_bytes(24, 30, seed=5), field="negative_files")).json()
    r = client.post(f"/v1/exemplar-sets/{es['id']}/adaptations", data={"iterations": "4", "seed": "5"},
                    files=files(*[png_bytes(84, 84, seed=i) for i in range(4)]))
    assert r.status_code == 202, r.text
    assert run_adaptation_job(ctx, uuid.UUID(r.json()["id"]), worker="test") == "succeeded"
    yield kept["run"], kept["ids"], kept["out"], ctx
    ctx.engine.dispose()


class Spy:
    """``calibrate_policy``'s place: records each call's arguments and calls through."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.real = calibrations.calibrate_policy

    def __call__(self, loc, prototype, crops, **kw):  # type: ignore[no-untyped-def]
        self.calls.append({"loc": loc, "prototype": prototype, "crops": crops, **kw})
        return self.real(loc, prototype, crops, **kw)


def test_each_checkpoint_is_fit_on_its_own_answers_erased_and_the_jobs_probes(finished, settings, monkeypatch):
    run, asked, out, ctx = finished
    named = {cid for cid in asked if cid in run.checkpoint_ids.values()}
    assert named and set(out) == named  # the checkpoints it may serve, each refreshed
    by_id = {cid: it for it, cid in run.checkpoint_ids.items()}
    for cid, cal in out.items():
        assert cal["iteration"] == by_id[cid] and cal["threshold"] == 0.7
    spy = Spy()
    monkeypatch.setattr(calibrations, "calibrate_policy", spy)
    policies = []
    real_answers = calibrations.answers
    monkeypatch.setattr(calibrations, "answers", lambda loc, agent, *a, **kw: policies.append(agent) or real_answers(
        loc, agent, *a, **kw))
    cid = run.last_checkpoint_id
    again = calibrations.refreshed_calibrations(run, {cid, uuid.uuid4(), None})
    assert set(again) == {cid} and again[cid] == out[cid]  # the same fit, for the asked ones it wrote
    (c,) = spy.calls
    es, setup = run.exemplar_set, run.setup
    assert (c["n"], c["seed"], c["threshold"]) == (12, 5, 0.7)  # the service's samples, the job's seed, the set's
    assert c["positives"] is setup.guard.probes and c["prototype"] is setup.prototype
    with ctx.session_factory() as s:
        row = s.get_one(Checkpoint, cid)
        agent = read_checkpoint(ctx.store, blob=row.blob or "", sha256=row.sha256, bundle=setup.bundle)[0]
        crops, _ = set_examples(s, ctx.store, set_id=es.id, spec=setup.bundle.config.input,
                                max_side=settings.decode_max_side)
    assert c["agent_state"].keys() == agent.keys()
    assert all(torch.equal(c["agent_state"][k], v) for k, v in agent.items())  # the checkpoint's own policy
    assert len(c["crops"]) == 2 and all(torch.equal(a, b) for a, b in zip(c["crops"], crops, strict=True))
    assert max(c["crops"][1].shape[1:]) == 32  # decoded as the service decodes: downscaled
    # the checkpoint's answers are erased: read with its policy (the job moved it from the bundle's)
    (policy,) = policies
    assert all(torch.equal(v, agent[k]) for k, v in policy.state_dict().items())
    assert any(not torch.equal(v, agent[k]) for k, v in setup.bundle.agent_state.items() if k in agent)
    loc = c["loc"]
    assert loc.bundle is setup.bundle and c["nearest"] == loc.default_nearest
    boxes, _ = answers(loc, loc.agent(agent), setup.prototype, run.images01, nearest=loc.default_nearest)
    assert torch.equal(c["backgrounds01"], erase_boxes(run.images01, boxes, torch.Generator().manual_seed(5)))
    assert not torch.equal(c["backgrounds01"], run.images01)
    # the set's negatives apply: the job kept the bundle's head, which embedded them
    assert setup.reward == "bundle head"
    assert torch.equal(c["negative_embeddings"], prototype_from_bytes(es.negatives).view(-1, es.prototype_dim))
    want_templates = stored_negative_templates(es.calibration)
    assert want_templates is not None and torch.equal(c["negative_templates"], want_templates)
    assert c["verifier"] is None  # the set has its calibration: its kind check is its own, not made again


def test_a_repaired_head_drops_the_sets_negatives_and_serves_its_own_reward(finished, monkeypatch):
    """A job that kept its reward repair: the set's negatives were embedded by another head (not used), and the
    checkpoints are fit as localize serves them, with the job's reward (``AdaptationRun.reward``)."""
    run, _, _, _ = finished
    served = SimpleNamespace(agent=lambda state: ("served agent", state), default_nearest=True)
    rewards = []

    def localizer(bundle, device):  # type: ignore[no-untyped-def]
        if bundle is run.bundle:
            return SimpleNamespace(with_reward=lambda reward: rewards.append(reward) or served)
        return Localizer(bundle, device)

    fits, read = [], []
    monkeypatch.setattr(calibrations, "Localizer", localizer)
    monkeypatch.setattr(run, "reward", lambda: "the job's reward")
    monkeypatch.setattr(run, "setup", replace(run.setup, repair=SimpleNamespace(kept=True)))
    monkeypatch.setattr(calibrations, "answers", lambda loc, agent, *a, **kw: read.append((loc, agent)) or (
        torch.zeros(len(run.images01), 4), torch.zeros(len(run.images01))))
    monkeypatch.setattr(calibrations, "calibrate_policy", lambda loc, p, crops, **kw: fits.append({"loc": loc, **kw})
                        or SimpleNamespace(templates=None, to_dict=lambda: {"fit": True}))
    cid = run.last_checkpoint_id
    out = calibrations.refreshed_calibrations(run, {cid})
    (c,) = fits
    assert rewards == ["the job's reward"] and c["loc"] is served and read[0][0] is served
    assert read[0][1][0] == "served agent" and c["nearest"] is True
    assert c["negative_embeddings"] is None  # not the set's: another head embedded them
    assert out == {cid: {"fit": True, "iteration": run.last_iteration}}


def test_a_set_without_a_calibration_gets_its_kind_check_made_and_a_stored_one_is_kept(finished, monkeypatch):
    run, _, _, ctx = finished
    spy = Spy()
    monkeypatch.setattr(calibrations, "calibrate_policy", spy)
    check = KindCheck([1.0, 0.0], [[0.0, 1.0]], "square", 0.99, "v")
    verifier = SimpleNamespace(sha256="v", check=lambda crops, negatives: check)
    monkeypatch.setattr(ctx.bundles, "verifier", lambda name: verifier if name == run.exemplar_set.bundle else None)
    row = run.exemplar_set
    stored = {**row.calibration, "kind": check.to_dict()}
    monkeypatch.setattr(run, "exemplar_set", replace_row(row, calibration=stored))
    cid = run.last_checkpoint_id
    out = calibrations.refreshed_calibrations(run, {cid})
    assert spy.calls[-1]["verifier"] is None and out[cid]["kind"] == check.to_dict()  # the stored check, kept
    monkeypatch.setattr(run, "exemplar_set", replace_row(row, calibration=None))
    calibrations.refreshed_calibrations(run, {cid})
    assert spy.calls[-1]["verifier"] is verifier and spy.calls[-1]["negative_templates"] is None


def replace_row(row, **values):  # type: ignore[no-untyped-def]
    """A detached copy of an ORM row's columns with ``values`` in place."""
    cols = {c.key: getattr(row, c.key) for c in row.__table__.columns}
    return SimpleNamespace(**(cols | values))


def test_the_refresh_gives_up_without_failing_the_job(finished, monkeypatch, caplog):
    run, _, _, _ = finished
    cid = run.last_checkpoint_id
    assert calibrations.refreshed_calibrations(run, {uuid.uuid4()}) == {}  # none of its checkpoints asked
    with caplog.at_level(logging.ERROR, logger="worker.calibrations"):
        for attr in ("setup", "images01"):  # a job that failed before its setup or its images: nothing to refresh
            with monkeypatch.context() as m:
                m.setattr(run, attr, None)
                assert calibrations.refreshed_calibrations(run, {cid}) == {}
        with monkeypatch.context() as m:
            m.delattr(run, "images01")  # failed before it decoded them
            assert calibrations.refreshed_calibrations(run, {cid}) == {}
    assert caplog.text == ""  # not a failure of the refresh

    def broken(*a, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError("fit failed")

    monkeypatch.setattr(calibrations, "calibrate_policy", broken)
    with caplog.at_level(logging.ERROR, logger="worker.calibrations"):
        assert calibrations.refreshed_calibrations(run, {cid}) == {}
    assert f"job {run.job_id}: calibration refresh failed" in caplog.text and "fit failed" in caplog.text
