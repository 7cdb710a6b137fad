"""Structured logs: one JSON object per line, with the job's and the worker's fields."""

from __future__ import annotations

import json
import logging

import pytest

from core import logs


def test_a_job_log_line_is_json_with_job_tier_and_worker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure_logging("INFO", "json")
    logs.set_context(worker="gpu0@host")
    try:
        logging.getLogger("inferq.test").info(
            "job %s started", "job_1", extra=logs.job_fields("job_1", "premium", attempt=2)
        )
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("inferq.test").exception("failed")
    finally:
        logs._context.clear()
        logging.getLogger().handlers.clear()
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["message"] == "job job_1 started"
    assert (first["job_id"], first["tier"], first["attempt"]) == ("job_1", "premium", 2)
    assert first["worker"] == "gpu0@host" and first["level"] == "INFO"
    assert second["worker"] == "gpu0@host" and "ValueError: boom" in second["exc"]
    assert "job_id" not in second


@pytest.mark.parametrize(("level", "shown"), [("INFO", False), ("DEBUG", True)])
def test_celery_lines_per_task_only_at_debug(
    capsys: pytest.CaptureFixture[str], level: str, shown: bool
) -> None:
    logs.configure_logging(level, "json")
    try:
        for name in logs.CELERY_PER_TASK_LOGGERS:
            logging.getLogger(name).info("Task inferq.run_job[1] received")
        logging.getLogger("celery.app.trace").error("Task inferq.run_job[1] raised")
    finally:
        logging.getLogger().handlers.clear()
        for name in logs.CELERY_PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
    lines = [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines()]
    received = ["Task inferq.run_job[1] received"] * len(logs.CELERY_PER_TASK_LOGGERS)
    assert lines == [*(received if shown else []), "Task inferq.run_job[1] raised"]
