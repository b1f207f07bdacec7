"""Transport security for specsplit's gRPC: TLS on servers and channels, optionally mutual (edge boxes proving
who they are to the cloud).

Edge to cloud crosses networks nobody controls, so a deployment turns it on per process:

- a server (verifier, draft, orchestrator) with ``cert`` and ``key`` serves TLS only; with ``client_ca`` too it
  also demands a client certificate that chains to it (mutual TLS), and refuses a connection without one;
- a process's channels (the orchestrator's to verifiers and drafts, a client's to an orchestrator) use TLS when
  ``ca`` is set: the roots a server's certificate must chain to (``"system"``: the system's roots); with ``cert``
  and ``key`` set as well they present that certificate when a server asks for one.

Off by default (loopback, the embedded stack, the tests). Files are PEM. ``specsplit serve`` sets the process's
``TLS`` from its ``--tls-*`` flags / ``SPECSPLIT_TLS_*`` variables with ``configure``; the SDK's clients take
one explicitly.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import ssl
from dataclasses import dataclass

import grpc

from specsplit.errors import InvalidArgument

ENV = {"cert": "SPECSPLIT_TLS_CERT", "key": "SPECSPLIT_TLS_KEY", "ca": "SPECSPLIT_TLS_CA",
       "client_ca": "SPECSPLIT_TLS_CLIENT_CA"}


@dataclass(frozen=True)
class TLS:
    cert: str = ""  # this process's certificate chain: a server's, or the client certificate its channels present
    key: str = ""  # the private key of ``cert``
    ca: str = ""  # channels: roots a server's certificate must chain to ("system": the system's); "": plaintext
    client_ca: str = ""  # servers: demand client certificates chaining to these roots (mutual TLS)

    @classmethod
    def from_env(cls, **given: str | None) -> "TLS":
        """Flags given (None or "" = not given) over ``SPECSPLIT_TLS_*`` variables; not yet checked."""
        values = {name: given.get(name) or os.environ.get(var, "") for name, var in ENV.items()}
        return cls(**values)

    @property
    def serves(self) -> bool:
        return bool(self.cert)

    @property
    def calls(self) -> bool:
        return bool(self.ca)

    def checked(self) -> "TLS":
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.client_ca and not self.cert:
            raise InvalidArgument("--tls-client-ca (mutual TLS) needs the server's own --tls-cert and --tls-key")
        for field in dataclasses.fields(self):
            path = getattr(self, field.name)
            if path and not (field.name == "ca" and path == "system") and not pathlib.Path(path).is_file():
                raise InvalidArgument(f"TLS {field.name.replace('_', ' ')} file not found: {path}")
        try:  # read them now: a bad file is named here, not found out as a failed bind or handshake later
            if self.cert:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            for roots in (self.ca, self.client_ca):
                if roots and roots != "system":
                    ssl.create_default_context(cafile=roots)
        except (ssl.SSLError, ValueError) as err:
            raise InvalidArgument(f"TLS files unusable (PEM certificate and its matching key, PEM CA roots): {err}") \
                from None
        return self

    def for_calls(self) -> "TLS":
        """Checked for a process that makes calls: a certificate without CA roots would call in plaintext."""
        if self.cert and not self.ca:
            raise InvalidArgument("--tls-cert without --tls-ca: this process's calls would go out in plaintext; give "
                                  "--tls-ca (the CA that signed the servers' certificates, or 'system')")
        return self.checked()

    def server_credentials(self) -> grpc.ServerCredentials:
        chain = [(_read(self.key), _read(self.cert))]
        if self.client_ca:
            return grpc.ssl_server_credentials(chain, root_certificates=_read(self.client_ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(chain)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        roots = None if self.ca == "system" else _read(self.ca)
        if self.cert:
            return grpc.ssl_channel_credentials(roots, _read(self.key), _read(self.cert))
        return grpc.ssl_channel_credentials(roots)


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


_process = TLS()


def configure(tls: TLS) -> None:
    """This process's TLS: what ``Server`` and ``open_channel`` use when not given one."""
    global _process
    _process = tls


def current() -> TLS:
    return _process


# What a plaintext call's error says when the server at the other end speaks TLS: it hung up during the handshake.
HUNG_UP = ("Socket closed", "Connection reset", "Broken pipe")


def hung_up_on_plaintext(details: str, tls: TLS | None = None) -> bool:
    """Whether a failed call (its ``details``) looks like a server that serves TLS hanging up on a caller that does
    not use it (``tls``: the caller's; default this process's)."""
    tls = current() if tls is None else tls
    return not tls.calls and any(words in details for words in HUNG_UP)


def call_failure(err: grpc.RpcError) -> str:
    """A failed call of this process in a line for a log or an error: its status, its details, and the flag that may
    mend it when the server hung up on a plaintext call."""
    details = err.details() or ""
    hint = "; if it serves TLS, give this process --tls-ca" if hung_up_on_plaintext(details) else ""
    return f"{err.code().name}: {details}{hint}"
