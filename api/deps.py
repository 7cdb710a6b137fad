"""FastAPI dependencies: the services, and the principal behind the request's key."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from api.services import Services
from core.apikeys import Principal, hash_key
from core.errors import AuthenticationFailed


async def get_services(connection: HTTPConnection) -> Services:
    """The services built at start-up."""
    services: Services = connection.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def _presented_key(connection: HTTPConnection) -> str | None:
    authorization = connection.headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return connection.headers.get("x-api-key") or None


async def get_principal(connection: HTTPConnection, services: ServicesDep) -> Principal:
    """Who is calling: a live key's owner and tier; 401 (one body for all failures) otherwise.

    Works for HTTP requests and WebSocket handshakes alike.
    """
    key = _presented_key(connection)
    if key is None:
        raise AuthenticationFailed()
    key_hash = hash_key(key)
    principal = services.principals.get(key_hash)
    if principal is None:
        principal = await run_in_threadpool(services.keys.authenticate, key)
        if principal is None:
            raise AuthenticationFailed()
        services.principals.put(key_hash, principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
