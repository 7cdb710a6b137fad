"""Document Q&A batches: one document, many questions, one job per question.

Every question's prompt is the template filled with the document and the question, as the user's
turn of a conversation rendered with the model's chat template (after a system prompt asking for
a short answer from the document), or with `raw` as the prompt itself. The default template puts
the document first, so all of a batch's prompts share it as a prefix.
Prefix routing then sends them to one worker and vLLM's prefix cache computes the document
once there. A document that does not fit the model's context with a question and `max_tokens`
is rejected with 400 `context_length_exceeded` naming the limit; nothing is ever truncated.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from api.cancelling import cancel_batch_jobs
from api.openai.chat_prompt import render_chat
from api.schemas import NO_NUL, JobCreate, Message
from api.services import Services
from api.submission import model_of, submit_jobs
from core.apikeys import Principal
from core.batches import BatchStore, new_batch_id
from core.errors import ClientError, ContextLengthExceeded, InvalidRequest, NotFound
from core.files import FileStore
from core.modelinfo import ModelInfo
from core.models import Batch, Job, as_utc, utcnow
from core.prompts import CountedPrompts, count_prompts, count_with_head

DEFAULT_TEMPLATE = "{document}\n\nQuestion: {question}\nAnswer:"
DEFAULT_SYSTEM = "Answer the question using only the document. Reply in one short sentence."
PROMPTING_FIELDS = {"document", "document_file_id", "questions", "prompt_template", "system", "raw"}
"""What makes the prompts, as against how the answers are sampled."""
MAX_QUESTIONS = 5000
KIND = "qa"
QUESTION_MARK = "\x00question\x00"
"""Stands for the question where a batch's prompt is made once (a document holding it too
fails the check in `QaBatchCreate.counted_prompts`)."""


class QaBatchCreate(BaseModel):
    """A document and the questions to ask about it, with the sampling of every answer."""

    model_config = ConfigDict(extra="forbid", strict=True)

    document: str | None = Field(
        default=None, min_length=1, description="The document every question is about."
    )
    document_file_id: str | None = Field(
        default=None,
        pattern=NO_NUL,
        description="Instead of `document`: the id of an uploaded file (UTF-8 text) holding it.",
    )
    questions: list[str] = Field(min_length=1, max_length=MAX_QUESTIONS)
    prompt_template: str = Field(
        default=DEFAULT_TEMPLATE,
        description="How a question's prompt is made: `{document}` and `{question}` are "
        "replaced (each exactly once); put the document first so the prompts share it.",
    )
    system: str | None = Field(
        default=DEFAULT_SYSTEM,
        description="The system prompt before each question (null: none); ignored with `raw`.",
    )
    raw: bool = Field(
        default=False,
        description="Send the filled template as a plain prompt, without the model's chat "
        "template (for base models, or templates of your own).",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="The served model (the default) or a registered LoRA adapter of it.",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=NO_NUL,
        description="An A/B experiment to answer the questions in: the variant chosen by `user` "
        "sets every answer's model and sampling (over what the request says).",
    )
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="Who the batch is for; an experiment gives one user one variant (default: "
        "the key's owner).",
    )
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    cache: bool = True

    @field_validator("questions")
    @classmethod
    def _questions_not_blank(cls, questions: list[str]) -> list[str]:
        for index, question in enumerate(questions):
            if not question.strip():
                raise ValueError(f"question {index} is blank")
        return questions

    @model_validator(mode="after")
    def _one_document(self) -> QaBatchCreate:
        if (self.document is None) == (self.document_file_id is None):
            raise ValueError("give exactly one of document and document_file_id")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _template_has_both_fields(cls, template: str) -> str:
        for field in ("{document}", "{question}"):
            if template.count(field) != 1:
                raise ValueError(f"the template must contain {field} exactly once")
        return template

    def prompt(self, document: str, question: str) -> str:
        """The prompt of one question (plain replacement: braces elsewhere are kept as is)."""
        return self.prompt_template.replace("{document}", document).replace("{question}", question)

    def job(self, document: str, question: str) -> JobCreate:
        """The job that answers one question."""
        text = self.prompt(document, question)
        return JobCreate(
            model=self.model,
            experiment=self.experiment,
            user=self.user,
            prompt=text if self.raw else None,
            messages=None if self.raw else self._messages(text),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
            timeout_s=self.timeout_s,
            cache=self.cache,
        )

    def _messages(self, text: str) -> list[Message]:
        messages = [Message(role="system", content=self.system)] if self.system else []
        messages.append(Message(role="user", content=text))
        return messages

    def counted_prompts(self, model: ModelInfo, document: str) -> CountedPrompts:
        """Every question's prompt, counted, the text before the questions stored once.

        The prompt is made once around a placeholder question and each question put in its
        place; a chat template that treats the text differently (checked on the first and
        last questions) gets every prompt made whole.
        """
        head, _, tail = self.rendered(model, document, QUESTION_MARK).partition(QUESTION_MARK)
        questions = self.questions
        if QUESTION_MARK in tail or any(
            head + questions[i] + tail != self.rendered(model, document, questions[i])
            for i in {0, len(questions) - 1}
        ):
            made = [self.rendered(model, document, question) for question in questions]
            return count_prompts(model, made)
        return count_with_head(model, head, [question + tail for question in questions])

    def rendered(self, model: ModelInfo, document: str, question: str) -> str:
        """The prompt one question's job runs on: the filled template, in the model's chat
        template unless `raw`."""
        text = self.prompt(document, question)
        if self.raw:
            return text
        return render_chat(model, [m.model_dump() for m in self._messages(text)])


class Answer(BaseModel):
    """One question's answer (or where it stands)."""

    index: int
    question: str
    job_id: str
    status: str
    answer: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_prompt_tokens: int | None
    error_code: str | None


class QaBatchOut(BaseModel):
    """A Q&A batch: where its questions stand, and the answers so far."""

    id: str
    object: Literal["qa_batch"] = "qa_batch"
    status: Literal["in_progress", "completed", "cancelling", "cancelled"]
    tier: str
    created_at: datetime
    total: int
    counts: dict[str, int] = Field(description="Questions per job state.")
    answers: list[Answer] | None = Field(
        default=None, description="In question order; left out with `answers=false`."
    )


RESULT_FIELDS = list(Answer.model_fields)


async def _document(services: Services, owner: str, body: QaBatchCreate) -> str:
    """The batch's document: given in the body, or read from the caller's uploaded file."""
    if body.document is not None:
        return body.document
    file_id = body.document_file_id or ""
    stored = await run_in_threadpool(FileStore(services.db).get, file_id, owner, content=True)
    if stored is None:
        raise NotFound(f"No file with id '{file_id}'.", param="document_file_id")
    try:
        text = bytes(stored.content).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"File '{file_id}' is not UTF-8 text.", param="document_file_id"
        ) from exc
    if not text.strip():
        raise InvalidRequest(f"File '{file_id}' is empty.", param="document_file_id")
    return text


async def create_batch(services: Services, principal: Principal, body: QaBatchCreate) -> Batch:
    """Store the batch and one job per question, all in one transaction, and enqueue them."""
    document = await _document(services, principal.owner, body)
    row = Batch(
        id=new_batch_id("qab"),
        kind=KIND,
        owner=principal.owner,
        tier=principal.tier.value,
        status="in_progress",
        request_total=len(body.questions),
        created_at=utcnow(),
        document=document,
        questions=body.questions,
        prompt_template=body.prompt_template,
        sampling_params=body.model_dump(exclude=PROMPTING_FIELDS),
    )
    # Every question's job asks the same of the engine; its prompt is made below, for the
    # model the job runs on (an experiment's variant may choose it).
    job = body.job(document, body.questions[0])
    model = model_of(services, principal, job)
    prompts = await run_in_threadpool(body.counted_prompts, model, document)
    try:
        await submit_jobs(
            services, principal, [job] * len(body.questions), batch_row=row, prompts=prompts
        )
    except ClientError as exc:
        # Said of `jobs[i]` by the job checks; the batch's caller sent a document and questions.
        index, _, message = exc.message.partition(": ")
        if isinstance(exc, ContextLengthExceeded):
            exc.message = (
                f"The document with question {index.removeprefix('jobs')} does not fit the "
                f"model: {message} Documents are never truncated: split the document into "
                "parts that fit and submit a batch for each."
            )
            exc.param = "document"
        elif exc.param and exc.param.startswith("jobs["):
            exc.message = message
            exc.param = exc.param.partition(".")[2] or None
        raise
    return row


async def get_batch(services: Services, owner: str, batch_id: str) -> Batch:
    """The caller's batch, or 404."""
    batch = await run_in_threadpool(BatchStore(services.db).get, batch_id, owner, KIND)
    if batch is None:
        raise NotFound(f"No Q&A batch with id '{batch_id}'.", param="batch_id")
    return batch


async def describe(services: Services, batch: Batch, *, answers: bool) -> QaBatchOut:
    """The batch as clients see it."""
    store = BatchStore(services.db)
    counts = await run_in_threadpool(store.counts, batch.id)
    unfinished = sum(n for status, n in counts.items() if not status.is_final)
    if batch.status == "cancelling":
        status = "cancelling" if unfinished else "cancelled"
    else:
        status = "in_progress" if unfinished else "completed"
    listed = None
    if answers:
        listed = answers_of(batch, await run_in_threadpool(store.jobs, batch.id))
    return QaBatchOut(
        id=batch.id,
        status=status,  # type: ignore[arg-type]
        tier=batch.tier,
        created_at=as_utc(batch.created_at),
        total=batch.request_total,
        counts={status.value: n for status, n in counts.items()},
        answers=listed,
    )


def answers_of(batch: Batch, jobs: list[Job]) -> list[Answer]:
    """Each question with its job's state and text."""
    questions = batch.questions or []
    return [
        Answer(
            index=job.batch_index or 0,
            question=questions[job.batch_index or 0],
            job_id=job.id,
            status=job.status,
            answer=job.output_text,
            finish_reason=job.finish_reason,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            cached_prompt_tokens=job.cached_prompt_tokens,
            error_code=job.error_code,
        )
        for job in jobs
    ]


def render(answers: list[Answer], fmt: Literal["jsonl", "csv"]) -> str:
    """The answers as JSON Lines or CSV (a header row, then one row per question)."""
    if fmt == "jsonl":
        return "".join(json.dumps(a.model_dump(), ensure_ascii=False) + "\n" for a in answers)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=RESULT_FIELDS)
    writer.writeheader()
    for answer in answers:
        writer.writerow(answer.model_dump())
    return out.getvalue()


async def cancel_batch(services: Services, batch: Batch) -> None:
    """Cancel every question not answered yet: queued ones at once, running ones in the engine."""
    store = BatchStore(services.db)
    await run_in_threadpool(store.set_status, batch.id, "cancelling")
    batch.status = "cancelling"
    await cancel_batch_jobs(services, batch.id)
