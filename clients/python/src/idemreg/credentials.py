"""Bearer-token and TLS credentials, as the Go client's BearerToken."""

from __future__ import annotations

from typing import Any, Callable, Optional

import grpc

from idemreg import errors


def check_token(token: str) -> None:
    """Refuses a token gRPC metadata cannot carry, never quoting it: empty,
    or a space, control or non-ASCII byte (a trailing newline read from a
    file, say), as the Go client does."""
    if not token:
        raise errors.UnauthenticatedError("BearerToken: the token is empty; the token was not sent", code=grpc.StatusCode.UNAUTHENTICATED, reason="UNAUTHENTICATED")
    for i, c in enumerate(token):
        if c <= " " or c > "~":
            raise errors.UnauthenticatedError(
                f"BearerToken: the token has a space, control or non-ASCII character at offset {i} "
                "(trim what was read from a file or variable); the token was not sent",
                code=grpc.StatusCode.UNAUTHENTICATED,
                reason="UNAUTHENTICATED",
            )


class _Bearer(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._header = "Bearer " + token

    def __call__(self, context: Any, callback: Callable[..., None]) -> None:
        callback((("authorization", self._header),), None)

    def __repr__(self) -> str:
        return "BearerToken(redacted)"


def bearer_token(token: str) -> grpc.CallCredentials:
    """Call credentials sending ``authorization: Bearer <token>``. gRPC sends
    call credentials only over a secure channel (TLS, or local
    credentials): combine them with :func:`channel_credentials`."""
    check_token(token)
    return grpc.metadata_call_credentials(_Bearer(token), name="idemreg-bearer")


def channel_credentials(
    *,
    token: Optional[str] = None,
    root_certificates: Optional[bytes] = None,
    private_key: Optional[bytes] = None,
    certificate_chain: Optional[bytes] = None,
) -> grpc.ChannelCredentials:
    """TLS (the system's roots unless ``root_certificates``; a client
    certificate with ``private_key`` and ``certificate_chain``), with the
    bearer token on every call when ``token`` is given."""
    creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, bearer_token(token))
    return creds


class Target:
    """How a client reaches the registry: a channel's target and options.

    ``token`` on a plaintext target (``tls=False``) is refused unless
    ``insecure_token`` says nobody but the two ends can read the traffic (a
    registry on 127.0.0.1, or a sidecar that encrypts between hosts):
    anyone who sees the connection can take the token.
    """

    def __init__(
        self,
        target: str,
        *,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[bytes] = None,
        private_key: Optional[bytes] = None,
        certificate_chain: Optional[bytes] = None,
        insecure_token: bool = False,
        options: Optional[list[tuple[str, Any]]] = None,
    ) -> None:
        self.target = target
        self.options = list(options or [])
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.credentials: Optional[grpc.ChannelCredentials] = None
        secure = tls or root_certificates is not None or private_key is not None
        if secure:
            self.credentials = channel_credentials(
                token=token, root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
            )
        elif token is not None:
            if not insecure_token:
                raise ValueError(
                    "a bearer token over a plaintext channel: use tls=True, or insecure_token=True "
                    "where nobody but the two ends can read the traffic"
                )
            check_token(token)
            self.metadata = (("authorization", "Bearer " + token),)

    def __repr__(self) -> str:
        return f"Target({self.target!r}, secure={self.credentials is not None}, token={'redacted' if self.metadata or self.credentials else None})"
