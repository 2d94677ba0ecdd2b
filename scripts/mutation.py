"""Mutation testing of the core with mutmut: one isolated workspace per module, a kill-rate table.

Run it through ``scripts/mutation`` (which bootstraps ``.venv``). For each module it copies the tree
into ``var/mutation/<module>/``, writes a ``[tool.mutmut]`` section that mutates that one file and
selects that module's fast tests, runs ``mutmut run``, and collects the counts and the surviving
mutants into ``var/mutation/summary.json`` and a Markdown table (TESTING.md quotes it).

A timeout counts as killed (the mutant made a test hang or crawl: the suite did not pass), and is
also reported on its own. ``no tests`` means no selected test reaches the mutated function: it
counts against the kill rate. Logging calls are not mutated: their text is not behaviour we pin.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CORE_TESTS = ["tests/models/test_core_behaviour.py", "tests/models/test_boxes_actions.py",
              "tests/models/test_reinforce_metrics.py"]
MODEL_TESTS = ["tests/models/test_rollout_inference_behaviour.py", "tests/models/test_adapt_behaviour.py",
               "tests/models/test_rollout_bundle.py", "tests/models/test_adapt.py"]
WORKER_TESTS = ["tests/worker/test_worker_jobs.py", "tests/worker/test_worker_leases.py",
                "tests/worker/test_worker_outbox.py", "tests/worker/test_worker_job_records.py"]

# localize_batch's several instances and second look, the paired checkpoints, batches against images apart, the refined
# answer (not test_compiled.py: it compiles once per process, which mutmut's one process for every test breaks)
INFERENCE_TESTS = ["tests/models/test_instances.py", "tests/models/test_companion.py",
                   "tests/models/test_inference_batching.py", "tests/models/test_multi.py",
                   "tests/models/test_refine.py"]

# stage 1 and 2 on a few images and epochs (not test_learning.py: its minute of training per mutant is the CI's
# learning check, not a unit test)
TRAINER_TESTS = ["tests/models/test_trainers.py", "tests/models/test_general_bundles.py"]

# the networks' forward paths: shapes, batch-1 paths, layers, and what a rollout computes with them
NET_TESTS = ["tests/models/test_nets.py", "tests/models/test_small_batch_paths.py",
             "tests/models/test_rollout_inference_behaviour.py"]

TEMPLATE_TESTS = ["tests/models/test_template_matching.py", "tests/models/test_templates_math.py"]

# a job's lifecycle on SQL: the state machine's guarded updates, the reaper's requeue / fail / send, leases
# (on SQLite and PostgreSQL; not the Celery end-to-end tests, marked slow)
LIFECYCLE_TESTS = ["tests/app/test_app_jobstates.py", "tests/worker/test_worker_outbox.py",
                   "tests/worker/test_worker_leases.py"]

# Pytest options per module, besides the test files: the worker's Celery end-to-end tests (marked slow) take
# seconds each and only repeat what the job-level tests check of jobs.py, so its mutants skip them.
EXTRA_ARGS = {"jobs": ["-m", "not slow"], "reaper": ["-m", "not slow"], "jobstates": ["-m", "not slow"],
              "pool": ["-m", "not slow"], "adaptation_routes": ["-m", "not slow"],
              # (not the tests that read every tracked file for QLOC_ names: a workspace is no git checkout)
              "config": ["-k", "not variable"], "settings_reference": ["-k", "not variable"],
              # the engine's tests (not the process and script settings of the API's run script)
              "serving": ["-k", "not run_script and not one_process_per_core"],
              "engine_ncc": ["-k", "not run_script and not one_process_per_core"],
              # the Batcher's own tests (a held engine, threads; no model, no HTTP)
              "batching": ["-k", "arrive_while or stops_at_max or waiting_room or failing_batch or one_result_per_item "
                                 "or close_answers or window_holds or idle_engine or on_their_way_hold "
                                 "or each_batch_is_observed or settings_are_checked or batcher_"]}

# mutmut's per-mutant limit, (constant, multiplier): 2 x (the tests' time + constant) x multiplier seconds of CPU. A
# generator's `while` loop, or the client's polling loop, that a mutant never ends would hold a child 10 minutes at the
# default.
DEFAULT_TIMEOUT = (20.0, 15.0)
TIMEOUTS = {"cmnist": (5.0, 2.0), "glyphs": (5.0, 2.0), "photos": (5.0, 2.0), "client": (5.0, 2.0)}

MODULES: dict[str, tuple[str, list[str]]] = {
    "boxes": ("models/core/boxes.py", CORE_TESTS),
    "actions": ("models/core/actions.py", CORE_TESTS),
    "ordinal": ("models/core/ordinal.py", CORE_TESTS),
    "reinforce": ("models/core/reinforce.py", CORE_TESTS),
    "rollout": ("models/rollout.py", MODEL_TESTS),
    "inference": ("models/inference.py", MODEL_TESTS + INFERENCE_TESTS),
    "adapt": ("models/adapt.py", MODEL_TESTS),
    "jobs": ("worker/jobs.py", WORKER_TESTS),
    "platt": ("models/core/platt.py", ["tests/models/test_platt.py", "tests/models/test_calibration.py"]),
    "verifier": ("models/verifier.py", ["tests/models/test_verifier.py"]),
    "guard": ("models/guard.py", ["tests/models/test_probes_guard.py"]),
    "templates": ("models/core/templates.py", TEMPLATE_TESTS + ["tests/models/test_calibration.py"]),
    "matching": ("models/core/matching.py", TEMPLATE_TESTS),
    "instances": ("models/instances.py", ["tests/models/test_instances.py"]),
    "companion": ("models/companion.py", ["tests/models/test_companion.py"]),
    "batching": ("app/batching.py", ["tests/app/test_app_batching.py"]),
    "refine": ("models/refine.py", ["tests/models/test_refine.py"]),
    "repair": ("models/repair.py", ["tests/models/test_repair.py", "tests/models/test_rewards.py"]),
    "calibration": ("models/calibration.py", ["tests/models/test_calibration.py", "tests/models/test_platt.py"]),
    "metrics": ("models/core/metrics.py", ["tests/models/test_reinforce_metrics.py", "tests/models/test_multi.py"]),
    "policy": ("models/policy.py", MODEL_TESTS + TRAINER_TESTS),
    "stage1": ("models/train/embedding.py", TRAINER_TESTS),
    "stage2": ("models/train/agent.py", TRAINER_TESTS),
    "evaluate": ("models/evaluate.py", TRAINER_TESTS + ["tests/models/test_evaluate.py"]),
    "features": ("models/features.py",
                 TRAINER_TESTS + ["tests/models/test_evaluate.py", "tests/models/test_features.py"]),
    "probes": ("models/data/probes.py", ["tests/models/test_probes.py", "tests/models/test_probes_guard.py",
                                          "tests/models/test_calibration.py"]),
    "bundle": ("models/bundle.py", ["tests/models/test_bundle_format.py", "tests/models/test_rollout_bundle.py",
                                    "tests/models/test_bundle_identity.py", "tests/models/test_companion.py"]),
    "samples": ("models/data/calibration_samples.py", ["tests/models/test_calibration_samples.py",
                                                       "tests/models/test_calibration.py"]),
    "images": ("app/images.py", ["tests/app/test_app_images.py", "tests/app/test_app_images_decode.py"]),
    "reaper": ("worker/reaper.py", LIFECYCLE_TESTS + [
        "tests/worker/test_worker_pool.py::test_a_finished_jobs_own_uploads_are_deleted_its_pool_images_kept",
        "tests/worker/test_worker_recovery.py::test_expire_lease_frees_only_the_dead_processs_run"]),
    "jobstates": ("app/jobstates.py", LIFECYCLE_TESTS + ["tests/worker/test_worker_job_records.py"]),
    # answers in other tools' formats: COCO results, Label Studio tasks and its ML backend's protocol
    "export": ("app/export.py", ["tests/app/test_app_export.py", "tests/app/test_labelstudio.py"]),
    # (the protocol's tests through the app take seconds each: the config's and the fetcher's own, by value)
    "labelstudio": ("app/labelstudio.py", [
        "tests/app/test_labelstudio_units.py",
        "tests/app/test_labelstudio.py::test_label_config_picks_the_rectangle_labels_and_the_sets_label",
        "tests/app/test_labelstudio.py::test_project_ids_parse"]),
    # an exemplar set's image pool: the cap under concurrency, a job's snapshot, deletion while jobs hold images
    "pool": ("app/pool.py", ["tests/app/test_app_pool.py", "tests/worker/test_worker_pool.py"]),
    # the service's side of `found`: a new set's calibration, each answer's verdict, the second look's rules
    "app_calibration": ("app/calibration.py", [
        "tests/app/test_app_calibration_units.py", "tests/app/test_app_calibration.py",
        *(f"tests/app/test_app_batching.py::{t}" for t in (
            "test_the_engine_reads_each_sets_ncc_features_with_the_batch_as_the_verdict_would_read_them",
            "test_second_looks_of_concurrent_calls_are_taken_in_one_forward_for_the_doubtful_answers_only",
            "test_the_engine_reads_each_sets_kind_check_with_the_batch_as_the_verdict_would",
            "test_the_engines_second_look_on_a_set_with_a_kind_check_needs_the_check_and_the_ncc_fit_to_doubt"))]),
    # the service's SQL by value, on SQLite and PostgreSQL (the routes' tests reach it through HTTP, minutes a mutant)
    "crud": ("app/crud.py", ["tests/app/test_crud_units.py", "tests/app/test_app_set_reads.py"]),
    # workers mode, the API's side: the wire format, and each way a call to the localize queue ends (the queue's
    # real-worker tests take seconds a mutant)
    "remote": ("app/remote.py", ["tests/app/test_remote_units.py"]),
    # the seam between the routes and the model: bundle and checkpoint checks, which calls share a forward pass
    "serving": ("app/serving.py", ["tests/app/test_serving_units.py", "tests/app/test_app_batching.py"]),
    # what the local engine reads beside the model on the batch it ran: NCC features, kind checks, the second look
    "engine_ncc": ("app/engine_ncc.py", ["tests/app/test_engine_ncc_units.py", "tests/app/test_serving_units.py",
                                         "tests/app/test_app_batching.py"]),
    # workers mode, the worker's side: its tasks in-process behind the API's WorkerInference (a loopback Celery), and
    # the localize task's batching of concurrent calls (the real-worker tests take seconds a mutant)
    "worker_localize": ("worker/localize.py", [
        "tests/worker/test_worker_localize_units.py",
        "tests/worker/test_worker_remote_inference.py::"
        "test_the_localize_task_batches_concurrent_calls_with_the_same_answers"]),
    # the calibration refresh at the end of a job: real jobs in-process (seconds each), what each fit is given, the
    # refreshed checkpoints served
    "calibrations": ("worker/calibrations.py", [
        "tests/worker/test_worker_calibration_refresh.py", "tests/worker/test_worker_calibration.py",
        "tests/worker/test_worker_jobs.py::test_a_set_made_without_a_calibration_gets_its_kind_check_in_its_jobs_calibrations"]),
    # the bundle registry: bundles by name and by content, a replaced file, verifiers, the policy cache; checkpoint and
    # head blobs
    "registry": ("app/inference.py", [
        "tests/app/test_registry_units.py", "tests/app/test_app_bundle_identity.py", "tests/app/test_app_verifier.py",
        "tests/worker/test_worker_bundle_identity.py"]),
    # workers mode: the API's watch on the localize queue's consumers
    "localize_watch": ("app/localize_watch.py", ["tests/app/test_localize_watch_units.py",
                                                 "tests/app/test_remote_units.py"]),
    # the cMNIST generator every cMNIST number is measured on
    "cmnist": ("models/data/cmnist.py", ["tests/models/test_cmnist.py", "tests/models/test_cmnist_generate.py"]),
    # the several-instances benchmark's images (cMNIST; the photo generator's tests need no photo files)
    "multi": ("models/data/multi.py", ["tests/models/test_multi.py"]),
    # the new-kinds benchmark's glyphs, and the photo benchmark's cut-and-paste generator
    "glyphs": ("models/data/glyphs.py", ["tests/models/test_glyphs.py"]),
    "photos": ("models/data/photos.py", ["tests/models/test_photos.py"]),
    # the baselines the benchmarks compare with: the fine-tune baseline, ranking + NMS and the sliding window at a
    # budget, template matching
    "baselines": ("models/experiments/baselines.py", [
        "tests/models/test_multi.py", "tests/models/test_template_matching.py",
        "tests/models/test_photo_experiments.py"]),
    # which split, seed and slice each role of an experiment draws (exemplars, unlabeled, val, test) for each kind
    "datasets": ("models/experiments/datasets.py", [
        "tests/models/test_experiment_roles.py", "tests/models/test_general_cmnist.py", "tests/models/test_glyphs.py",
        "tests/models/test_photo_experiments.py"]),
    # checkpoints deleted with their files, and the head files no checkpoint names (real SQL, a real blob store)
    "retention": ("app/retention.py", ["tests/app/test_retention_units.py"]),
    # the Python client over a scripted transport: each method's request, the retry policy, errors, wait (the round
    # trips through the API in process take seconds each)
    "client": ("app/client.py", [
        "tests/app/test_client_units.py",
        *(f"tests/app/test_app_client.py::{t}" for t in (
            "test_retry_after_is_honoured_and_extra_fields_are_kept", "test_connection_errors_are_retried_then_raised",
            "test_a_set_creation_is_waited_for_past_the_clients_timeout_and_a_lost_answer_says_look_first"))]),
    # what the Python client sends for each kind of image (no server; the round trips are test_app_client.py's)
    "client_images": ("app/client_images.py", [
        "tests/app/test_client_images_units.py",
        *(f"tests/app/test_app_client.py::{t}" for t in (
            "test_16_bit_arrays_and_images_are_sent_so_the_api_sees_their_8_bit_scale",
            "test_pil_images_of_32_bit_modes_are_sent_by_the_array_rules_not_clipped",
            "test_a_pil_image_with_an_exif_orientation_goes_up_as_a_viewer_shows_it",
            "test_arrays_outside_the_scales_they_are_read_on_are_refused_not_clipped",
            "test_a_pil_image_goes_up_as_the_api_would_see_its_file"))]),
    # the blob store (atomic writes, keys that stay under its root) and the small LRU the calibrations are cached in
    "storage": ("app/storage.py", ["tests/app/test_app_storage.py"]),
    "lru": ("app/lru.py", ["tests/app/test_app_lru.py"]),
    # the Celery configuration producer and consumer share, the queues' declaration, the API's enqueue and ping
    "queue": ("app/queue.py", ["tests/worker/test_worker_queue_units.py", "tests/worker/test_worker_celery.py"]),
    # the settings: how they are read, their cross-field refusals, the API's processes; SETTINGS.md written from them
    "config": ("app/config.py", ["tests/app/test_config_units.py", "tests/app/test_settings_reference.py"]),
    "settings_reference": ("app/settings_reference.py", ["tests/app/test_settings_reference.py"]),
    # the v1 routes' refusal of what they do not take, and the form parser that notes text not in the body's charset
    "strict": ("app/routes/strict.py", ["tests/app/test_strict_units.py", "tests/app/test_app_strict.py",
                                        "tests/app/test_app_text_fields.py"]),
    "forms": ("app/forms.py", ["tests/app/test_strict_units.py", "tests/app/test_app_text_fields.py"]),
    # the checkpoint routes (list, read, activate, delete: 404s, 409s, what a rollback serves), and the upload
    # reading every route shares (limits, decoding, rejections, text the databases cannot store)
    "checkpoint_routes": ("app/routes/checkpoints.py", [
        "tests/app/test_checkpoint_routes_units.py", "tests/app/test_app_adaptations.py",
        "tests/app/test_app_exemplar_sets.py", "tests/app/test_app_auth.py",
        "tests/worker/test_worker_job_activation.py",
        "tests/worker/test_worker_jobs.py::test_a_checkpoint_is_deleted_with_its_file_unless_it_is_in_use"]),
    "uploads": ("app/routes/uploads.py", [
        "tests/app/test_uploads_units.py", "tests/app/test_app_exemplar_sets.py", "tests/app/test_app_bad_input.py",
        "tests/app/test_app_images.py", "tests/app/test_app_text_fields.py", "tests/app/test_app_upload_limits.py"]),
    # liveness, readiness (each part's check, the 503 naming what failed), metrics behind a key
    "health": ("app/routes/health.py", [
        "tests/app/test_health_units.py", "tests/app/test_app_auth.py",
        "tests/app/test_app_exemplar_sets.py::test_health_ready_metrics",
        "tests/app/test_app_adaptations.py::test_unreachable_broker_is_503_and_the_job_is_failed"]),
    # the pool's routes: add (all or none, the cap), list, delete one or all (409 while a job holds an image)
    "pool_routes": ("app/routes/pool.py", ["tests/app/test_pool_routes_units.py", "tests/app/test_app_pool.py"]),
    # a job's creation (source, idempotency, the checks before anything is stored, the outbox's send and stamp) and
    # a set's (boxes, crops, negatives, the all-or-none write), change and deletion: the routes' bodies, undecorated
    "adaptation_routes": ("app/routes/adaptations.py", [
        "tests/app/test_adaptation_routes_units.py", "tests/app/test_app_adaptations.py",
        "tests/worker/test_worker_outbox.py"]),
    # Label Studio's backend routes: /setup's record, /predict's tasks, the webhook's job (its image fetching and
    # label config: module labelstudio)
    "labelstudio_routes": ("app/routes/labelstudio.py", [
        "tests/app/test_labelstudio_routes_units.py", "tests/app/test_labelstudio.py",
        "tests/app/test_labelstudio_units.py"]),
    # the localize route: the checkpoint named, the format options, instances kept apart, each format's answer, the
    # pipeline's refusals (404, 409 of a full pool, image_ids' count), the second look, keep=true
    "localize_route": ("app/routes/localize.py", [
        "tests/app/test_localize_routes_units.py", "tests/app/test_app_export.py", "tests/app/test_app_instances.py",
        "tests/app/test_app_calibration.py", "tests/app/test_app_pool.py", "tests/app/test_app_exemplar_sets.py",
        "tests/app/test_app_auth.py",  # another key's set: 404
        "tests/app/test_app_bundle_identity.py",  # the bundle file and prototype dimension a set was made with
        # a request on its way to the engine, and the turns of QLOC_ROUTE_THREADS
        "tests/app/test_app_batching.py::test_a_request_is_on_its_way_to_the_engine_until_it_submits_and_a_refused_"
        "one_leaves_nothing",
        "tests/app/test_app_batching.py::test_localize_takes_turns_for_its_own_work_not_while_it_waits_for_the_model"]),
    # who a request's API key makes its caller (every route's 401s, each key's own rows)
    "deps": ("app/deps.py", ["tests/app/test_deps_units.py", "tests/app/test_app_auth.py"]),
    # the app factory: its middleware (body limits), error handlers (422s cut short, 405s, trailing slashes), wiring
    "main": ("app/main.py", [
        "tests/app/test_main_units.py", "tests/app/test_app_strict.py", "tests/app/test_app_upload_limits.py",
        "tests/app/test_app_text_fields.py",
        "tests/app/test_app_adaptations.py::test_a_422_shows_a_long_invalid_value_cut_short",
        "tests/app/test_app_exemplar_sets.py::test_health_ready_metrics"]),
    "set_routes": ("app/routes/exemplar_sets.py", [
        "tests/app/test_set_routes_units.py", "tests/app/test_app_exemplar_sets.py",
        "tests/app/test_app_exemplar_boxes.py"]),
    # which bundle a set that names none gets (its crops like color photos or not)
    "bundle_choice": ("app/bundle_choice.py", [
        "tests/app/test_bundle_choice_units.py",
        "tests/app/test_set_routes_units.py::test_a_set_naming_no_bundle_gets_the_photo_default_for_crops_like_photos"]),
    "agent_net": ("models/nets/agent.py", NET_TESTS),
    "embedding_net": ("models/nets/embedding.py", NET_TESTS),
}

COPY_EXCLUDES = {".git", ".venv", "var", "photos", "mutants", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def prepare(name: str, workdir: Path) -> None:
    source, tests = MODULES[name]
    if workdir.exists():
        shutil.rmtree(workdir)
    shutil.copytree(ROOT, workdir, ignore=lambda d, names: [n for n in names if n in COPY_EXCLUDES])
    tests = [t for t in tests if (ROOT / t.split("::")[0]).exists()]  # a file, or one test of it (file::name)
    package = source.split("/")[0]
    others = [p for p in ("app", "models", "worker") if p != package]
    timeout_constant, timeout_multiplier = TIMEOUTS.get(name, DEFAULT_TIMEOUT)
    config = f"""

[tool.mutmut]
source_paths = ["{package}"]
only_mutate = ["{source}"]
also_copy = {toml_list([*others, "bundles", "data", "migrations", "scripts", "alembic.ini", "SETTINGS.md"])}
pytest_add_cli_args_test_selection = {toml_list(tests)}
pytest_add_cli_args = {toml_list(["-p", "no:cacheprovider", "-q", "-x", *EXTRA_ARGS.get(name, [])])}
timeout_constant = {timeout_constant}
timeout_multiplier = {timeout_multiplier}
do_not_mutate_patterns = ['^\\s*log\\.(debug|info|warning|error|exception)\\(']
"""
    with open(workdir / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write(config)


def run_module(name: str, workdir: Path, children: int) -> dict:
    prepare(name, workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    mutmut = [sys.executable, "-m", "mutmut"]
    t0 = time.monotonic()
    with open(workdir / "mutmut-run.log", "w", encoding="utf-8") as log:
        subprocess.run([*mutmut, "run", "--max-children", str(children)], cwd=workdir, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - t0
    subprocess.run([*mutmut, "export-cicd-stats"], cwd=workdir, env=env, capture_output=True, check=False)
    stats_file = workdir / "mutants" / "mutmut-cicd-stats.json"
    if not stats_file.exists():
        raise SystemExit(f"{name}: mutmut produced no stats; see {workdir / 'mutmut-run.log'}")
    stats = json.loads(stats_file.read_text())
    listing = subprocess.run([*mutmut, "results"], cwd=workdir, env=env, capture_output=True, text=True,
                             check=False).stdout
    survivors = [line.split(":")[0].strip() for line in listing.splitlines()
                 if line.strip().endswith(("survived", "no tests"))]
    diffs = {}
    for name_ in survivors:
        shown = subprocess.run([*mutmut, "show", name_], cwd=workdir, env=env, capture_output=True, text=True,
                               check=False).stdout
        diffs[name_] = [line for line in shown.splitlines() if line.startswith(("-", "+"))
                        and not line.startswith(("---", "+++"))]
    killed = stats["killed"] + stats["timeout"] + stats.get("segfault", 0)
    total = stats["total"] - stats.get("skipped", 0)
    return {"module": MODULES[name][0], "total": total, "killed": killed, "timeout": stats["timeout"],
            "survived": stats["survived"], "no_tests": stats["no_tests"], "suspicious": stats["suspicious"],
            "kill_rate": round(100.0 * killed / max(total, 1), 1), "seconds": round(seconds),
            "survivors": diffs}


def table(results: list[dict]) -> str:
    rows = ["| module | mutants | killed (timeouts) | survived | no tests | kill rate |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        rows.append(f"| `{r['module']}` | {r['total']} | {r['killed']} ({r['timeout']}) | {r['survived']} | "
                    f"{r['no_tests']} | {r['kill_rate']:.1f} % |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", metavar="MODULE", help=f"of {', '.join(MODULES)} (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "var" / "mutation")
    p.add_argument("--children", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    p.add_argument("--floor", type=float, default=85.0, help="exit 1 when a module's kill rate is below this")
    args = p.parse_args(argv)
    unknown = sorted(set(args.modules) - set(MODULES))
    if unknown:
        p.error(f"unknown modules {unknown}; choose from {list(MODULES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.modules or list(MODULES):
        r = run_module(name, args.out / name, args.children)
        print(f"{r['module']}: {r['kill_rate']:.1f} % killed of {r['total']} ({r['seconds']} s)", flush=True)
        results.append(r)
        (args.out / f"{name}.json").write_text(json.dumps(r, indent=2))
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    for r in results:
        for name, diff in r["survivors"].items():
            print(f"  surviving: {name}: {' | '.join(diff)}")
    return 0 if all(r["kill_rate"] >= args.floor for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
