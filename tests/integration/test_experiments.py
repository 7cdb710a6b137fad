"""A/B experiments through the real stack: one variant per user, shares near the weights, the
variant applied to and recorded on each job, feedback, metrics and the report."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict

from sqlalchemy import func, select

from core.models import Job
from core.tiers import Tier
from tests.support import Stack, scrape, value, wait_final

USERS = 200
JOBS = 1000


def test_an_experiment_gives_each_user_one_variant_near_its_weight_and_reports_it(
    stack: Stack,
) -> None:
    key = stack.create_key(Tier.PREMIUM)
    bodies = [
        {
            "prompt": f"Greeting {i}: hello",
            "experiment": "greeting",
            "user": f"user-{i % USERS}",
            "max_tokens": 4,
            "ignore_eos": True,
        }
        for i in range(JOBS)
    ]
    with stack.client(key) as client:
        response = client.post("/v1/jobs/batch", json={"jobs": bodies})
        assert response.status_code == 202, response.text
        finals = [wait_final(client, job["id"]) for job in response.json()["data"]]

        variants_of: dict[str, set[str]] = defaultdict(set)
        for body, job in zip(bodies, finals, strict=True):
            assert job["status"] == "succeeded" and job["experiment"] == "greeting"
            variants_of[body["user"]].add(job["variant"])
            # The variant sets the job: "short" answers in two tokens, whatever was asked.
            tokens = 2 if job["variant"] == "short" else 4
            assert job["sampling_params"]["max_tokens"] == tokens
            assert job["usage"]["completion_tokens"] == tokens
        assert all(len(variants) == 1 for variants in variants_of.values())
        users = Counter(variants.pop() for variants in variants_of.values())
        assert set(users) == {"control", "short"}
        assert abs(users["short"] / USERS - 0.10) <= 0.05, users
        jobs = Counter(job["variant"] for job in finals)

        # Clients score answers: control's first 20 get 1, short's first 10 get 0.
        scored = [j for j in finals if j["variant"] == "control"][:20]
        scored += [j for j in finals if j["variant"] == "short"][:10]
        for job in scored:
            score = 1.0 if job["variant"] == "control" else 0.0
            posted = client.post(f"/v1/jobs/{job['id']}/feedback", json={"score": score})
            assert posted.status_code == 200 and posted.json()["feedback_score"] == score

    with stack.client(stack.create_key(Tier.PREMIUM)) as stranger:
        other = stranger.post(f"/v1/jobs/{finals[0]['id']}/feedback", json={"score": 5.0})
        assert other.status_code == 404  # another owner's job
        unknown = stranger.post("/v1/jobs", json={"prompt": "hi", "experiment": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "experiment_not_found"
    with stack.db.session() as session:
        assert session.scalar(select(func.count()).where(Job.experiment == "nope")) == 0

    worker = scrape(stack.worker_metrics_url)
    api = scrape(f"{stack.api_url}/metrics")
    for variant in ("control", "short"):
        arm = {"experiment": "greeting", "variant": variant}
        ended = value(worker, "inferq_experiment_jobs_total", status="succeeded", **arm)
        assert ended == jobs[variant]
        assert value(worker, "inferq_experiment_ttft_seconds_count", **arm) == jobs[variant]
    feedback = {"experiment": "greeting", "variant": "control"}
    assert value(api, "inferq_experiment_feedback_score_count", **feedback) == 20
    assert value(api, "inferq_experiment_feedback_score_sum", **feedback) == 20

    printed = subprocess.run(
        [sys.executable, "-m", "inferq", "experiments", "report", "greeting"],
        env=stack.local.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    rows = {line.split()[0]: line.split() for line in printed.stdout.splitlines()[1:]}
    assert rows["control"][1:3] == [str(jobs["control"]), str(users["control"])]
    assert rows["short"][1:3] == [str(jobs["short"]), str(users["short"])]
    assert rows["control"][3] == "0.0%" and rows["short"][3] == "0.0%"  # error rates
    assert "1.00 [1.00, 1.00] (n=20)" in " ".join(rows["control"])
    assert "0.00 [0.00, 0.00] (n=10)" in " ".join(rows["short"])


def test_a_qa_batch_in_an_experiment_answers_every_question_as_its_users_variant(
    stack: Stack,
) -> None:
    key = stack.create_key(Tier.PREMIUM)
    with stack.client(key) as client:
        # A user of each variant, as single jobs of the experiment find them.
        probes = [
            {"prompt": "Probe", "experiment": "greeting", "user": f"reader-{i}", "max_tokens": 1}
            for i in range(60)
        ]
        response = client.post("/v1/jobs/batch", json={"jobs": probes})
        assert response.status_code == 202, response.text
        user_of = {
            job["variant"]: probe["user"]
            for probe, job in zip(probes, response.json()["data"], strict=True)
        }
        assert set(user_of) == {"control", "short"}

        questions = ["Who wrote it?", "When?", "Why?"]
        for variant, user in user_of.items():
            batch = {
                "document": "The report was written by Ada in 1843 to explain the engine.",
                "questions": questions,
                "experiment": "greeting",
                "user": user,
                "max_tokens": 4,
            }
            created = client.post("/v1/qa-batches", json=batch)
            assert created.status_code == 202, created.text
            answers = client.get(f"/v1/qa-batches/{created.json()['id']}").json()["answers"]
            assert [answer["question"] for answer in answers] == questions
            for answer in answers:
                job = wait_final(client, answer["job_id"])
                assert job["status"] == "succeeded", job
                assert (job["experiment"], job["variant"]) == ("greeting", variant)
                # The variant sets every answer: "short" allows two tokens whatever was asked.
                allowed = 2 if variant == "short" else 4
                assert job["sampling_params"]["max_tokens"] == allowed
                assert 0 < job["usage"]["completion_tokens"] <= allowed

        unknown = client.post(
            "/v1/qa-batches",
            json={"document": "A text.", "questions": ["What?"], "experiment": "missing"},
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "experiment_not_found"
    with stack.db.session() as session:
        assert session.scalar(select(func.count()).where(Job.experiment == "missing")) == 0
