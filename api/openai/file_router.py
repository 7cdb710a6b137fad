"""`/v1/files`: upload, list, retrieve, download and delete files (OpenAI's Files API).

Purposes a client may upload: `batch` (the input of `/v1/batches`) and `user_data` (a
document for `/v1/qa-batches`, UTF-8 text); batches write their results as files of purpose
`batch_output`. A file's size is bounded by the request body limit
(`INFERQ_MAX_BODY_BYTES`). Another owner's file is 404, as a missing one is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import PrincipalDep, ServicesDep
from api.openai.batch_protocol import unix
from api.openapi import COMMON_ERRORS, error_responses
from core.errors import InvalidRequest, NotFound
from core.files import FileStore, new_stored_file
from core.models import StoredFile

router = APIRouter(prefix="/v1/files", tags=["files"], responses=COMMON_ERRORS)

UploadPurpose = Literal["batch", "user_data"]
"""The purposes a client may upload files for (others are 400, and the document says so)."""

MAX_FILENAME_CHARS = 400


def file_object(stored: StoredFile) -> dict[str, Any]:
    """A file as OpenAI's API shows it."""
    return {
        "id": stored.id,
        "object": "file",
        "bytes": stored.size_bytes,
        "created_at": unix(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "status_details": None,
    }


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: follow `last_id` as `after` while `has_more`."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


async def _get(services: ServicesDep, owner: str, file_id: str, content: bool) -> StoredFile:
    stored = await run_in_threadpool(
        lambda: FileStore(services.db).get(file_id, owner, content=content)
    )
    if stored is None:
        raise NotFound(f"No file with id '{file_id}'.", param="file_id")
    return stored


@router.post("", responses=error_responses(413))
async def upload_file(
    principal: PrincipalDep,
    services: ServicesDep,
    file: Annotated[UploadFile, File(description="The file; for batches, JSON Lines.")],
    purpose: Annotated[UploadPurpose, Form(description="What the file is for.")],
) -> dict[str, Any]:
    """Store an uploaded file (multipart: `file`, `purpose`) for the caller."""
    content = await file.read()
    # A NUL is no use in a name, and PostgreSQL cannot store one in text.
    filename = (file.filename or "upload").replace("\x00", "")[:MAX_FILENAME_CHARS] or "upload"
    stored = new_stored_file(principal.owner, purpose, filename, content)
    await run_in_threadpool(FileStore(services.db).add, stored)
    return file_object(stored)


@router.get("")
async def list_files(
    principal: PrincipalDep,
    services: ServicesDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The caller's files without their content; `after` (a file id) pages on."""
    store = FileStore(services.db)
    anchor = None
    if after is not None:
        anchor = await run_in_threadpool(store.get, after, principal.owner)
        if anchor is None:
            raise InvalidRequest(f"No file with id '{after}' to list after.", param="after")
    files = await run_in_threadpool(
        lambda: store.list_for_owner(
            principal.owner,
            limit=limit + 1,
            purpose=purpose,
            after=anchor,
            newest_first=order == "desc",
        )
    )
    return page([file_object(f) for f in files[:limit]], len(files) > limit)


@router.get("/{file_id}", responses=error_responses(404))
async def retrieve_file(
    file_id: str, principal: PrincipalDep, services: ServicesDep
) -> dict[str, Any]:
    """The file's description."""
    return file_object(await _get(services, principal.owner, file_id, content=False))


@router.get(
    "/{file_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The bytes"},
        **error_responses(404),
    },
)
async def file_content(file_id: str, principal: PrincipalDep, services: ServicesDep) -> Response:
    """The file's bytes, as uploaded or written."""
    stored = await _get(services, principal.owner, file_id, content=True)
    return Response(
        stored.content,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{stored.id}.jsonl"'},
    )


@router.delete("/{file_id}", responses=error_responses(404))
async def delete_file(
    file_id: str, principal: PrincipalDep, services: ServicesDep
) -> dict[str, Any]:
    """Delete the file (batches that used it keep running; their results are other files)."""
    if not await run_in_threadpool(FileStore(services.db).delete, file_id, principal.owner):
        raise NotFound(f"No file with id '{file_id}'.", param="file_id")
    return {"id": file_id, "object": "file", "deleted": True}
