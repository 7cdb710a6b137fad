"""Keeping Python's cycle collector off a serving process's long-lived heap.

A worker holds the engine's front end, Celery and SQLAlchemy: millions of objects made at start
that live as long as the process. CPython's full collections walk all of them, and while they
do, every thread of the process stops; measured in a worker, they took 50 to 700 ms each and came
every second or two under load, so Celery took no jobs and the engine's outputs waited. After
start-up these objects are frozen (moved where the collector never looks), as vLLM's own
server does after its warm-up; full collections then walk only what was made since.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen in all.

    Call it when start-up is over (models loaded, connections made); calling it again later
    freezes what was made since.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d objects out of the cycle collector's reach", frozen)
    return frozen
