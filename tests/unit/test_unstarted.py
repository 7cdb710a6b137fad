"""Reading kombu's record of a taken `run_job` message (`core.queue.unstarted.read_entry`)."""

from __future__ import annotations

import json

from core.celery_compat import RunJobMessages
from core.queue.app import RUN_JOB_TASK, make_celery_app
from core.queue.unstarted import read_entry
from core.settings import Settings


def _entry(message: bytes, queue: str) -> bytes:
    """The unacked hash's entry for a message, as kombu's Redis QoS records it."""
    return json.dumps([json.loads(message), "", queue]).encode()


def test_a_run_job_entry_gives_its_job_its_queue_and_the_message_marked_redelivered() -> None:
    messages = RunJobMessages(make_celery_app(Settings()), RUN_JOB_TASK)
    sent = messages.message("job_1", "inferq.premium", {"inferq_enqueued_at": "1.0"})
    taken = read_entry("tag-1", _entry(sent, "inferq.premium"))
    assert taken is not None
    assert (taken.tag, taken.job_id, taken.queue) == ("tag-1", "job_1", "inferq.premium")
    back = json.loads(taken.redelivered)
    assert back["headers"]["redelivered"] is True
    assert back["properties"]["delivery_info"]["redelivered"] is True
    original = json.loads(sent)
    # A tag of its own, so that the first taker's ack cannot remove the next one's record.
    assert back["properties"].pop("delivery_tag") != original["properties"].pop("delivery_tag")
    # Otherwise the message the worker gets again is the one it was sent.
    del back["headers"]["redelivered"], back["properties"]["delivery_info"]["redelivered"]
    assert back == original


def test_an_entry_of_another_shape_is_left_alone() -> None:
    messages = RunJobMessages(make_celery_app(Settings()), RUN_JOB_TASK)
    sent = json.loads(messages.message("job_1", "inferq.basic", {}))
    not_a_job = dict(sent, body="bm90IGpzb24=")  # base64 of "not json"
    another_task = dict(sent, headers=dict(sent["headers"], task="other.task"))
    prioritized = dict(sent, properties=dict(sent["properties"], priority=5))
    for entry in (
        b"not json",
        json.dumps([sent, ""]).encode(),  # no routing key
        json.dumps([sent, "an-exchange", "inferq.basic"]).encode(),
        json.dumps([not_a_job, "", "inferq.basic"]).encode(),
        json.dumps([another_task, "", "inferq.basic"]).encode(),
        json.dumps([prioritized, "", "inferq.basic"]).encode(),  # kept in another list
        json.dumps({"message": sent}).encode(),
    ):
        assert read_entry("tag", entry) is None
