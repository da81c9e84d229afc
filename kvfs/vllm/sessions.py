"""Sessions named the way OpenAI clients name a conversation: an ASGI middleware of the server.

vLLM's OpenAI server hands the connector only ``kv_transfer_params`` (and ``vllm_xargs``);
it does not pass the ``user`` field or request headers to the engine. This middleware
(``--middleware kvfs.vllm.sessions.SessionNames``, which ``kvfs-serve`` adds) names the
session of a chat, completion or responses request that does not name one, before vLLM
parses it. Precedence: an explicit ``kv_transfer_params.session``, then the
``X-Session-Id`` header, then the OpenAI ``user`` field. Streaming or not makes no
difference: only the request body is rewritten, the reply passes through untouched.

Tenants per API key (``kvfs-serve --tenant-per-api-key``, which sets
``KVFS_TENANT_PER_API_KEY=1``): the request's ``cache_salt``, its tenant, is derived from
its bearer token (and the salt it sent, which then only splits that key's tenant), so a
client cannot reach another key's sessions by sending another salt. Meant with vLLM's
``--api-key`` (several keys, one tenant each), which refuses unknown tokens.

No vLLM import: it is a plain ASGI callable over the app vLLM builds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("kvfs.vllm")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the generation endpoints whose body carries ``kv_transfer_params``
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
HEADER = b"x-session-id"
TENANT_ENV = "KVFS_TENANT_PER_API_KEY"


def key_tenant(token: str, salt: object) -> str:
    """The ``cache_salt`` of a request made with API key ``token`` (and client ``salt``):
    within vLLM's limit (128 characters, no ``@ / \\`` or NUL)."""
    doc = json.dumps([token, salt if isinstance(salt, str) else None]).encode()
    return "key-" + hashlib.sha256(b"kvfs-tenant\0" + doc).hexdigest()[:48]


def session_name(body: dict, header: str | None) -> str | None:
    """The session a request body names after the precedence rule, or None."""
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("session") is not None:
        return None  # named explicitly: left as it is
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) and user else None


class SessionNames:
    """Puts the session named by ``X-Session-Id`` or ``user`` into ``kv_transfer_params``."""

    def __init__(self, app: ASGIApp, per_api_key: bool | None = None) -> None:
        self.app = app
        self.per_api_key = (os.environ.get(TENANT_ENV) == "1") if per_api_key is None else per_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path not in PATHS:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:  # the whole body: vLLM's request model parses it whole anyway
            msg = await receive()
            if msg["type"] != "http.request":
                await self.app(scope, _replay([msg], receive), send)
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        raw = b"".join(chunks)
        new = _named(raw, _header(scope), _bearer(scope) if self.per_api_key else None)
        if new is not raw:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", [])
                                if k.lower() != b"content-length"]
            scope["headers"].append((b"content-length", str(len(new)).encode()))
        await self.app(scope, _replay([{"type": "http.request", "body": new,
                                        "more_body": False}], receive), send)


def _header(scope: Scope, name: bytes = HEADER) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1").strip() or None
    return None


def _bearer(scope: Scope) -> str:
    """The request's API key ("" without one: the tenant of requests without a key)."""
    scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _named(raw: bytes, header: str | None, token: str | None = None) -> bytes:
    """``raw`` with the session (and, given the API key ``token``, the tenant) set, or
    ``raw`` itself when nothing changes (a body that does not parse is vLLM's to refuse)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict):
        return raw
    name = session_name(body, header)
    if name is None and token is None:
        return raw
    if name is not None:
        kv = body.get("kv_transfer_params")
        body["kv_transfer_params"] = {**(kv if isinstance(kv, dict) else {}), "session": name}
    if token is not None:
        body["cache_salt"] = key_tenant(token, body.get("cache_salt"))
    return json.dumps(body).encode()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` first, then the client's own (a disconnect)."""
    pending = list(messages)

    async def again() -> Message:
        return pending.pop(0) if pending else await receive()
    return again
