"""The Celery app that `inferq flower` hands to Flower (`celery -A inferq.flower flower`).

inferq's own app, made from the settings: Flower reaches Redis as every other part does (through
Sentinel, where `INFERQ_REDIS_URL` names one), and no URL, with its password, shows in the
process list.
"""

from __future__ import annotations

from core.queue.app import celery_app

app = celery_app()
