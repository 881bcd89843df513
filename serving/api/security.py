"""Access control and transport security: API keys, per-key tenancy and limits, TLS.

- `ApiKeys`: the accepted keys (`--api-key`, repeatable, or the VLLM_API_KEY environment variable, as vLLM
  reads it). `match(header)` checks an `Authorization: Bearer KEY` value against every key with
  `hmac.compare_digest` (constant time in the key's content, and all keys are always compared).
- Tenancy: with keys on, every key is its own namespace. `Tenant.salt(client_salt)` derives the prefix-cache
  salt from the key on the server (a hash the client never sees) combined with the client's `cache_salt`, and
  `Tenant.scoped(id)` prefixes session and request ids, so no prefix hit, cached-token count, session
  placement, request id or Abort ever crosses keys. Without keys there is one anonymous tenant and ids pass
  through unchanged.
- `KeyLimiter`: per-key caps on open requests and on queued prompt tokens (admitted but not yet producing
  output); over a cap -> `LimitExceeded` (HTTP 429 / RESOURCE_EXHAUSTED with a retry hint). The global 503
  (the engine's waiting queue) still applies on top.
- `server_ssl_context` / `grpc_credentials`: TLS for both servers from --ssl-keyfile / --ssl-certfile, with
  client-certificate verification (mutual TLS) when --ssl-ca-certs is given.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import threading
from dataclasses import dataclass, field

ENV_API_KEY = "VLLM_API_KEY"
RETRY_AFTER_S = 1


class ApiKeys:
    def __init__(self, keys):
        self.keys = [k for k in dict.fromkeys(keys) if k]
        if any(len(k) < 1 or any(c.isspace() for c in k) for k in self.keys):
            raise ValueError("API keys must be non-empty and contain no whitespace")
        self._encoded = [k.encode() for k in self.keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, authorization: str | None) -> str | None:
        """The key an `Authorization` header value carries, or None (every key is compared)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        found = None
        for raw, key in zip(self._encoded, self.keys):
            if hmac.compare_digest(given, raw) and found is None:
                found = key
        return found


def keys_from(cli_keys: list[str] | None) -> ApiKeys:
    """--api-key values, else the VLLM_API_KEY environment variable."""
    keys = list(cli_keys or [])
    if not keys and os.environ.get(ENV_API_KEY):
        keys = [os.environ[ENV_API_KEY]]
    return ApiKeys(keys)


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to: a key's namespace, or the anonymous tenant (no keys configured)."""
    key: str | None = None
    id: str = field(default="")

    @staticmethod
    def of(key: str | None) -> Tenant:
        if key is None:
            return ANONYMOUS
        return Tenant(key, hashlib.sha256(b"dsv41-tenant\0" + key.encode()).hexdigest()[:24])

    def salt(self, client_salt: str | None) -> str | None:
        if not self.id:
            return client_salt
        return f"tenant:{self.id}" + ("" if client_salt is None else f"|{client_salt}")

    def scoped(self, value: str | None) -> str | None:
        """A session or request id inside this tenant's namespace (None stays None)."""
        if value is None or not self.id:
            return value
        return f"{self.id}:{value}"

    def unscoped(self, value: str) -> str:
        prefix = f"{self.id}:" if self.id else ""
        return value[len(prefix):] if prefix and value.startswith(prefix) else value


ANONYMOUS = Tenant()


class LimitExceeded(Exception):
    """A per-key limit (HTTP 429 / RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after = retry_after


class KeyLimiter:
    """Per-tenant caps on open requests and queued prompt tokens (0: no cap). Thread-safe."""

    def __init__(self, max_requests: int = 0, max_queued_tokens: int = 0):
        self.max_requests, self.max_queued_tokens = max_requests, max_queued_tokens
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.queued: dict[str, int] = {}

    def admit(self, tenant: Tenant, prompt_tokens: dict[str, int]) -> Ticket:
        """Reserve room for one submission (its sub-requests' prompt tokens); raises LimitExceeded."""
        t = tenant.id
        total = sum(prompt_tokens.values())
        with self._lock:
            n, q = self.requests.get(t, 0), self.queued.get(t, 0)
            if self.max_requests and n + 1 > self.max_requests:
                raise LimitExceeded(f"too many concurrent requests for this API key (limit {self.max_requests}); "
                                    f"retry after {RETRY_AFTER_S} s")
            if self.max_queued_tokens and q + total > self.max_queued_tokens and q > 0:
                raise LimitExceeded(f"too many queued prompt tokens for this API key ({q} queued + {total} > limit "
                                    f"{self.max_queued_tokens}); retry after {RETRY_AFTER_S} s")
            self.requests[t] = n + 1
            self.queued[t] = q + total
        return Ticket(self, t, dict(prompt_tokens))

    def _release(self, t: str, requests: int, tokens: int):
        with self._lock:
            self.requests[t] = self.requests.get(t, 0) - requests
            self.queued[t] = self.queued.get(t, 0) - tokens


class Ticket:
    """One admitted submission: `started(rid)` when a sub-request produces output, `close()` at the end."""

    def __init__(self, limiter: KeyLimiter, tenant_id: str, pending: dict[str, int]):
        self.limiter, self.tenant_id, self.pending = limiter, tenant_id, pending
        self.closed = False

    def started(self, request_id: str):
        n = self.pending.pop(request_id, 0)
        if n and not self.closed:
            self.limiter._release(self.tenant_id, 0, n)

    def close(self):
        if not self.closed:
            self.closed = True
            self.limiter._release(self.tenant_id, 1, sum(self.pending.values()))
            self.pending = {}


class LimitedStream:
    """An engine OutputStream whose ticket is updated as outputs arrive and closed when the stream ends."""

    def __init__(self, stream, ticket: Ticket):
        self._stream, self._ticket = stream, ticket
        self.request_ids = stream.request_ids

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            out = await self._stream.__anext__()
        except BaseException:
            self._ticket.close()
            raise
        self._ticket.started(out.request_id)
        if self._stream.finished:
            self._ticket.close()
        return out

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def abort(self):
        self._stream.abort()
        self._ticket.close()


# ---------------------------------------------------------------------------------------------- TLS
def server_ssl_context(certfile: str, keyfile: str, ca_certs: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    if ca_certs:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(ca_certs)
    return ctx


def grpc_credentials(certfile: str, keyfile: str, ca_certs: str | None = None):
    import grpc

    with open(keyfile, "rb") as f:
        key = f.read()
    with open(certfile, "rb") as f:
        cert = f.read()
    root = None
    if ca_certs:
        with open(ca_certs, "rb") as f:
            root = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=root, require_client_auth=root is not None)


# ---------------------------------------------------------------------------------------------- start-up checks
def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h in ("localhost", ""):
        return h == "localhost"
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(i[4][0]).is_loopback for i in socket.getaddrinfo(h, None))
        except OSError:
            return False


def exposure_warning(host: str, keys: ApiKeys) -> str | None:
    """The start-up warning for a server reachable from the network without an API key."""
    if keys or is_loopback(host):
        return None
    return (f"WARNING: listening on {host} without an API key: anyone who can reach this address can use the "
            f"server and share its prefix cache. Set --api-key (or {ENV_API_KEY}) and --ssl-certfile/--ssl-keyfile.")
