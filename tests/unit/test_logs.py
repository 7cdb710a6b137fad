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
