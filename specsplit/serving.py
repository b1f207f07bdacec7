"""What every specsplit gRPC server shares: health, reflection, tracing, error mapping, shutdown."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from specsplit.errors import NO_SESSION_KEY, InvalidArgument, SpecSplitError, Unavailable
from specsplit.tls import TLS
from specsplit.tls import current as current_tls

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # trees and prompts are small; KV offload (later) is not
# What a client may send an orchestrator's public port in one message (gRPC's default): a prompt, not a KV cache.
CLIENT_MESSAGE_BYTES = 4 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Each channel its own connections: a new channel to an address whose server stopped a moment ago (a restarted
    # replica, a test's next stack on a reused port) does not inherit that connection's failure and backoff.
    ("grpc.use_local_subchannel_pool", 1),
    # A server that went away is tried again at least every 2 s: gRPC's backoff grows to 120 s by default, so an
    # orchestrator refused work for a minute or more after its verifier was back from a restart.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# A server owns its port: with gRPC's default SO_REUSEPORT a second server on a port in use started "serving" and
# took a share of the connections.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


_in_flight = [0]  # this process's specsplit calls being answered (health checks and reflection not counted)
_in_flight_lock = threading.Lock()


def _count_in_flight(step: int) -> None:
    with _in_flight_lock:
        _in_flight[0] += step


def calls_in_flight() -> int:
    return _in_flight[0]


def grpc_errors(method):
    """Map SpecSplitError to its gRPC status (the one place this happens); works on unary and stream methods. A
    downstream call's error that nothing handled (a verifier's or a draft's) keeps its status, named as downstream,
    instead of becoming UNKNOWN (which a resuming client takes for a broken connection)."""

    def abort(context, err: Exception, stream: bool) -> None:
        # The call ends with this status, the real error recorded on the call's span. A stream's status is set and the
        # stream ends (context.abort raises a bare Exception, which the tracing interceptor's span shows besides the
        # real one); a unary call still needs abort (returning no reply makes grpc log a serialization error).
        if isinstance(err, SpecSplitError):
            code, details = getattr(grpc.StatusCode, err.code_name), str(err)
        else:
            code = err.code() if callable(getattr(err, "code", None)) else None
            if not isinstance(code, grpc.StatusCode):
                raise err
            details = err.details() if callable(getattr(err, "details", None)) else str(err)
            details = f"a downstream call failed: {code.name}: {details}"
        from opentelemetry import trace

        trace.get_current_span().record_exception(err)
        if getattr(err, "specsplit_no_session", False):
            context.set_trailing_metadata(((NO_SESSION_KEY, "1"),))
        if not stream:
            context.abort(code, details)
        context.set_code(code)
        context.set_details(details)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            _count_in_flight(1)
            try:
                yield from method(self, request, context)
            except (SpecSplitError, grpc.RpcError) as err:
                abort(context, err, stream=True)
            finally:
                _count_in_flight(-1)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        _count_in_flight(1)
        try:
            return method(self, request, context)
        except (SpecSplitError, grpc.RpcError) as err:
            abort(context, err, stream=False)
        finally:
            _count_in_flight(-1)

    return unary


# Calls that are not traced: probes and tooling (a load balancer's health checks would each make a trace).
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "grpc.reflection.v1.ServerReflection")


def _traced(method: str) -> bool:
    return method.lstrip("/").split("/", 1)[0] not in UNTRACED_SERVICES


def server_interceptors() -> list:
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(_RpcSpanNames(), filter_=lambda details: _traced(details.method))]


class _RpcSpanNames(trace.TracerProvider):
    """This process's tracer provider (whichever is set when a call comes), but for one thing: server spans are
    named as the RPC semantic conventions and OpenTelemetry's own client spans name them, "{rpc.service}/{rpc.method}"
    (e.g. ``specsplit.v1.VerifierService/Verify``); its gRPC server interceptor names them by the call's path, with a
    leading slash, so a dashboard showed each call's client and server side under two names."""

    def get_tracer(self, *args, **kwargs) -> trace.Tracer:
        return _RpcSpanTracer(args, kwargs)


class _RpcSpanTracer(trace.Tracer):
    def __init__(self, args: tuple, kwargs: dict):
        self._args, self._kwargs = args, kwargs
        self._provider, self._tracer_of_provider = None, None

    def _tracer(self) -> trace.Tracer:
        """The current provider's tracer (made again only when the provider changes, not per call)."""
        provider = trace.get_tracer_provider()
        if provider is not self._provider:
            self._tracer_of_provider, self._provider = provider.get_tracer(*self._args, **self._kwargs), provider
        return self._tracer_of_provider

    def start_span(self, name: str, *args, **kwargs) -> trace.Span:
        return self._tracer().start_span(name.lstrip("/"), *args, **kwargs)

    def start_as_current_span(self, name: str, *args, **kwargs):
        return self._tracer().start_as_current_span(name.lstrip("/"), *args, **kwargs)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _ClientTracing(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamStreamClientInterceptor):
    """A CLIENT span per call, with the trace context injected into the call's metadata.

    Used instead of OpenTelemetry's channel wrapper because that one turns a server stream into a
    plain generator, and an SDK user must be able to ``cancel()`` a stream.
    """

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self._server = {"server.address": host.strip("[]")}
        if port.isdigit():
            self._server["server.port"] = int(port)

    def _start(self, details):
        from opentelemetry import propagate, trace

        if not _traced(details.method):
            return None, details
        service, _, method = details.method.lstrip("/").partition("/")
        tracer = trace.get_tracer("specsplit.rpc")
        span = tracer.start_span(f"{service}/{method}", kind=trace.SpanKind.CLIENT,
                                 attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                                             **self._server})
        metadata = list(details.metadata or [])
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata.extend(carrier.items())
        return span, _CallDetails(details.method, details.timeout, metadata, details.credentials,
                                  details.wait_for_ready, details.compression)

    @staticmethod
    def _end(span, call):
        from opentelemetry.trace import Status, StatusCode

        if span is None:
            return
        code = call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {call.details()}"))
        span.end()

    def _intercept(self, continuation, details, request):
        span, details = self._start(details)
        call = continuation(details, request)
        call.add_done_callback(lambda c: self._end(span, c))
        return call

    intercept_unary_unary = intercept_unary_stream = intercept_stream_stream = _intercept


def open_channel(address: str, tls: TLS | None = None) -> grpc.Channel:
    """A client channel with specsplit's options, propagating trace context on every call; TLS when ``tls``
    (default: this process's, ``specsplit.tls.configure``) has a CA."""
    return grpc.intercept_channel(_channel(grpc, address, tls), _ClientTracing(address))


def open_aio_channel(address: str, tls: TLS | None = None) -> grpc.aio.Channel:
    """``open_channel`` for asyncio clients (OpenTelemetry's aio interceptors carry the trace context)."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return _channel(grpc.aio, address, tls, interceptors=aio_client_interceptors(
        filter_=lambda details: _traced(details.method if isinstance(details.method, str) else
                                        details.method.decode())))


def _channel(api, address: str, tls: TLS | None, **kwargs):
    """``api.secure_channel`` or ``api.insecure_channel`` (api: grpc or grpc.aio) with specsplit's options."""
    tls = tls or current_tls()
    if tls.calls:
        return api.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS, **kwargs)
    return api.insecure_channel(address, options=CHANNEL_OPTIONS, **kwargs)


def check_address(address: str, listen: bool = True) -> str:
    """HOST:PORT with a port in 0..65535 to listen on (0: any free port), 1..65535 to call; a bracketed IPv6 host is
    fine."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and (0 if listen else 1) <= int(port) <= 65535):
        ports = "port 0-65535, 0: any free port" if listen else "port 1-65535"
        raise InvalidArgument(f"not a HOST:PORT address ({ports}): {address!r}")
    return address


def check_can_listen(address: str) -> None:
    """Unavailable if this host cannot listen on ``address`` now (a port in use, a foreign address): a server checks
    before loading its model, not after."""
    host, _, port = check_address(address).rpartition(":")
    if int(port) == 0:
        return
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as gRPC binds)
            probe.bind(sockaddr)
    except OSError as err:
        raise Unavailable(f"could not listen on {address}: {err.strerror or err}") from None


class Server:
    """A started gRPC server with health and reflection; ``stop`` flips health then drains."""

    def __init__(self, address: str, services: list[tuple[object, callable, str]], max_workers: int = 32,
                 tls: TLS | None = None, max_receive_bytes: int = MAX_MESSAGE_BYTES):
        """services: (servicer, add_XServicer_to_server, full service name); tls: default this process's
        (``specsplit.tls.configure``): TLS only when it has a certificate; max_receive_bytes: the largest message it
        takes (larger: RESOURCE_EXHAUSTED before any of it is parsed)."""
        self.core = None  # the domain object behind the servicer, for in-process owners (tests, embedding)
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers)
        self._servicers = [servicer for servicer, _, _ in services]
        self.grpc_server = grpc.server(
            self._executor,
            interceptors=server_interceptors(),
            options=[*options, ("grpc.max_receive_message_length", max_receive_bytes)],
        )
        names = []
        for servicer, add, name in services:
            add(servicer, self.grpc_server)
            names.append(name)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc_server)
        tls = tls or current_tls()
        self.tls = tls.serves
        check_address(address)
        try:
            if tls.serves:
                self.port = self.grpc_server.add_secure_port(address, tls.server_credentials())
            else:
                self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise Unavailable(f"could not listen on {address}: in use, or not an address of this host")
        host = address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"
        self.grpc_server.start()
        self.names = names
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 says of the server and its services (load balancers and probes read it); once the
        server is stopping, NOT_SERVING whatever this says."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            self.health.set(name, status)

    def announce_stop(self, seconds: float) -> None:
        """Health NOT_SERVING from now on, while calls are still taken for ``seconds`` (so that a load balancer or a
        probe polling health sees it and sends no more before ``stop`` refuses them)."""
        self.health.enter_graceful_shutdown()
        time.sleep(seconds)

    def stop(self, grace: float = 5.0) -> None:
        """Drain for up to ``grace`` seconds, then end the servicers' own threads (their idle sweeps) and the worker
        pool: a stopped server holds no thread, and through none of them its engine and its caches."""
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(grace).wait()
        for servicer in self._servicers:
            close = getattr(servicer, "close", None)
            if close is not None:
                close()
        self._executor.shutdown(wait=False)

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()
