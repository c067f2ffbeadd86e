"""The doors in front of the app (why each: ``docs/concepts/serving.md``, "Security defaults")::

    request ─► head size (431) ─► Host allow-list (400) ─► CORS (--allowed-origins) ─► API key (401) ─► app

h11 bounds only a head still *arriving*; one that arrives whole is measured here. The Host check is
against DNS rebinding (a page on ``evil.example`` resolved to 127.0.0.1 still sends its own name).

Why not Starlette's ``TrustedHostMiddleware``: it refuses with a plain-text ``Invalid host header``
(no error object, no ``code`` a client can act on) and redirects a name to its allowed ``www.`` form
(``python bench/serve_libraries.py --only host``; the error object: ``test_serve_extra_routes.py``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# outside /v1/ and keyed too: extra_routes.py's, and what shows other users' activity
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/", "/live/events", "/metrics"})


def default_allowed_hosts(bound_host: str) -> tuple[str, ...]:
    """The names a client on this machine uses for the server: the bound address and localhost."""
    return tuple(dict.fromkeys((bound_host.strip("[]").lower(), *LOCAL_HOSTS)))


def host_name(header: str) -> str:
    """``Host`` without its port, lower case: ``[::1]:8000`` -> ``::1``, ``A.com:80`` -> ``a.com``."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    try:                                     # a bare IPv6 address
        ipaddress.IPv6Address(h)
        return h
    except ValueError:
        return h


class Guard:
    """ASGI middleware: the Host allow-list, then (``/v1/*``) the API key, around ``app``."""

    def __init__(self, app, *, allowed_hosts: tuple[str, ...] | None, api_key: str | None,
                 max_header_bytes: int | None = None, open_metrics: bool = False) -> None:
        self.app = app
        self.keyed = KEYED_PATHS - {"/metrics"} if open_metrics else KEYED_PATHS
        self.max_header_bytes = max_header_bytes
        self.allowed = None if allowed_hosts is None or "*" in allowed_hosts else \
            frozenset(host_name(h) for h in allowed_hosts)
        self._key = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or ()
        if self.max_header_bytes is not None:
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + \
                sum(len(k) + len(v) + 4 for k, v in raw)           # "name: value\r\n"
            if size > self.max_header_bytes:
                return await _refuse(send, 431, f"the request line and headers exceed "
                                                f"{self.max_header_bytes:,} bytes (--max-header-bytes)",
                                     "request_header_fields_too_large")
        headers = dict(raw)
        if self.allowed is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                return await _refuse(send, 400, f"the Host header names {host or 'nothing'!r}, which this "
                                                "server does not answer to (--allowed-hosts)",
                                     "invalid_host")
        path = scope.get("path", "")
        guarded = (path.startswith("/v1/") or path in self.keyed) and scope.get("method") != "OPTIONS"
        if self._key is not None and guarded:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                return await _refuse(send, 401, "a valid API key is required: send Authorization: Bearer "
                                                "<key> (the server's --api-key)", "invalid_api_key",
                                     {"www-authenticate": "Bearer"})
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str, extra: dict | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}, ensure_ascii=True).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def wrap(app, *, allowed_hosts: tuple[str, ...] | None, api_key: str | None,
         allowed_origins: tuple[str, ...] = (), max_header_bytes: int | None = None,
         open_metrics: bool = False):
    """``app`` behind the head size, the Host check, CORS (when ``allowed_origins``) and the API key,
    in that order."""
    inner = Guard(app, allowed_hosts=None, api_key=api_key, open_metrics=open_metrics)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        inner = CORSMiddleware(inner, allow_origins=list(allowed_origins), allow_methods=["*"],
                               allow_headers=["*"], allow_credentials=False)
    return Guard(inner, allowed_hosts=allowed_hosts, api_key=None, max_header_bytes=max_header_bytes)
