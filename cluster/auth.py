"""Who may talk to the server: a bearer token and TLS on every client surface.

* **API key.** With ``ServerConfig.api_key`` set, every gRPC call but the health service
  needs the metadata ``authorization: Bearer <key>`` (else ``UNAUTHENTICATED``), and every
  HTTP route but ``/health`` needs the header ``Authorization: Bearer <key>`` (else 401 with
  OpenAI's error JSON, code ``invalid_api_key``). ``/metrics`` follows the key (it reveals
  load and the model; Prometheus sends it with ``authorization: {credentials: ...}``);
  ``/health`` and ``grpc.health.v1.Health`` stay open for load balancers and probes. Keys
  are compared in constant time (:func:`hmac.compare_digest`); an unauthenticated gRPC
  request is never parsed.
* **TLS.** ``tls_cert`` + ``tls_key`` (PEM files) serve gRPC and HTTP over TLS;
  ``tls_client_ca`` additionally requires a client certificate signed by that CA (mutual
  TLS) on both.
* **Exposure.** The default host is 127.0.0.1; binding another address without a key logs
  a warning (:func:`exposure_warning`).
* **Host block store.** The same key check guards ``pagedserve.v1.HostBlockStore``
  (:class:`ApiKeyServerInterceptor`, for its thread-pool server) and the same TLS options
  serve it (:func:`ssl_server_credentials`); :func:`loopback_certificate` makes the
  certificate of the store a cluster starts for itself on 127.0.0.1.

Nothing here unpickles or evaluates client data: gRPC carries protobuf, HTTP carries JSON.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

API_KEY_ENV = "PAGEDSERVE_API_KEY"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
OPEN_HTTP_PATHS = frozenset({"/health"})
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"

__all__ = [
    "API_KEY_ENV",
    "ApiKeyInterceptor",
    "ApiKeyMiddleware",
    "ApiKeyServerInterceptor",
    "bearer_matches",
    "check_tls_files",
    "exposure_warning",
    "grpc_server_credentials",
    "is_loopback",
    "loopback_certificate",
    "read_pem",
    "ssl_server_credentials",
    "uvicorn_ssl_options",
]


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file.

    Raises:
        ValueError: the file cannot be read (the message names ``what`` and the path).
    """
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from exc


def check_tls_files(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """Load the TLS files once, before anything starts, so a bad path, a key that does not
    match the certificate or an unreadable CA is one clear error.

    Raises:
        ValueError: naming the file and the problem.
    """
    if cert is None or key is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load tls_cert {cert!r} with tls_key {key!r}: {exc}") from exc
    if client_ca is not None:
        try:
            ctx.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load tls_client_ca {client_ca!r}: {exc}") from exc


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <api_key>`` (scheme case-insensitive,
    constant-time comparison of the key)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(
    host: str, api_key: str | None, risk: str = "can generate and abort requests"
) -> str | None:
    """The warning to log when ``host`` is reachable from other machines and no API key
    guards it (``risk``: what anyone who connects can then do); ``None`` when binding is
    safe by this rule."""
    if api_key or is_loopback(host):
        return None
    return (
        f"serving on {host}, which other machines can reach, without an API key: anyone who "
        f"can connect {risk}. Set --api-key (or {API_KEY_ENV}) and consider "
        "--tls-cert/--tls-key."
    )


def grpc_server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS credentials of the gRPC server; with ``client_ca`` clients must present a
    certificate signed by it (mutual TLS).

    Raises:
        ValueError: a file cannot be read.
    """
    ca = read_pem(client_ca, "tls_client_ca") if client_ca else None
    return ssl_server_credentials(read_pem(cert, "tls_cert"), read_pem(key, "tls_key"), ca)


def ssl_server_credentials(
    cert: bytes, key: bytes, client_ca: bytes | None
) -> grpc.ServerCredentials:
    """:func:`grpc_server_credentials` from PEM bytes instead of files."""
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def loopback_certificate(valid_days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh self-signed certificate for ``127.0.0.1`` / ``localhost`` and its private
    key (EC P-256), as PEM ``(cert, key)``, made in memory (nothing is written). A
    cluster serving TLS gives it to the host block store it starts on loopback; its
    workers trust exactly this certificate.
    """
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedserve host block store")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def uvicorn_ssl_options(cert: str | None, key: str | None, client_ca: str | None) -> dict:
    """The ``uvicorn.Config`` keyword arguments for TLS (empty without a certificate)."""
    if cert is None or key is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key}
    if client_ca:
        options["ssl_ca_certs"] = client_ca
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options


async def _deny_unary(request: Any, context: Any) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request_iterator: Any, context: Any) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _deny_sync(request_or_iterator: Any, context: Any) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _call_allowed(details: grpc.HandlerCallDetails, api_key: str) -> bool:
    """Whether the call is to an open service (health) or carries the key."""
    if (details.method or "").startswith(OPEN_GRPC_PREFIXES):
        return True
    metadata = dict(details.invocation_metadata or ())
    return bearer_matches(metadata.get("authorization"), api_key)


def _refusal(handler: Any, deny_unary: Any, deny_stream: Any) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s call shape that answers UNAUTHENTICATED: raw bytes in
    (the request is never parsed), the response serializer kept."""
    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, None, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_stream, None, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_unary, None, serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, None, serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without ``authorization: Bearer <api_key>`` metadata with
    ``UNAUTHENTICATED`` (the health service stays open). The refused call's request bytes
    are not deserialized.

    Args:
        api_key: the shared secret (non-empty).
    """

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or _call_allowed(handler_call_details, self._api_key):
            return handler  # allowed, or an unknown method (gRPC answers UNIMPLEMENTED)
        return _refusal(handler, _deny_unary, _deny_stream)


class ApiKeyServerInterceptor(grpc.ServerInterceptor):
    """:class:`ApiKeyInterceptor` for a thread-pool ``grpc.server`` (the host block store):
    calls without ``authorization: Bearer <api_key>`` get ``UNAUTHENTICATED`` unparsed.

    Args:
        api_key: the shared secret (non-empty).
    """

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._api_key = api_key

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or _call_allowed(handler_call_details, self._api_key):
            return handler
        return _refusal(handler, _deny_sync, _deny_sync)


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests other than ``/health`` need ``Authorization: Bearer
    <api_key>``; others get 401 with OpenAI's error object (``code: invalid_api_key``) and
    ``WWW-Authenticate: Bearer``.

    Args:
        app: the wrapped ASGI app.
        api_key: the shared secret (non-empty).
    """

    def __init__(self, app: Any, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_HTTP_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if bearer_matches(header, self._api_key):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
