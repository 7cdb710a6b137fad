"""Logging for every inferq process: one JSON object per line, with job id, tier and worker.

Job-related log calls pass `extra={"job_id": ..., "tier": ...}`; a process-wide context (the
worker's name) is added to every record. `INFERQ_LOG_FORMAT=text` gives plain lines instead.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

FIELDS = ("job_id", "tier", "worker", "attempt", "owner")
"""Record attributes copied into the JSON object when present."""

_context: dict[str, Any] = {}


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _context.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", job_id?, tier?, worker?, ..., "exc"?}` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


CELERY_PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
"""Celery's loggers of one line per task received and per task done."""


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Send every log record to stderr in the chosen format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Celery's "Task … received" and "Task … succeeded" lines repeat inferq's own job lines
    # (started, succeeded, with job id and tier) at two more lines per job; kept for DEBUG.
    quiet = logging.DEBUG if logging.getLevelName(level) == logging.DEBUG else logging.WARNING
    for name in CELERY_PER_TASK_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def set_context(**fields: Any) -> None:
    """Add fields (e.g. `worker=`) to every record this process logs from now on."""
    _context.update(fields)


def job_fields(job_id: str, tier: str, **more: Any) -> dict[str, Any]:
    """The `extra` of a job-related log call."""
    return {"job_id": job_id, "tier": tier, **more}
