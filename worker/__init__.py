"""qloc's Celery worker: thin tasks that take a job id; the job logic lives in ``worker.jobs``."""
