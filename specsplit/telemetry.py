"""Tracing and metrics setup, once per process. Exporters follow the standard OTEL_* variables; none by default.

- OTEL_TRACES_EXPORTER: "none" (default), "console" (to stderr), or "otlp" (needs opentelemetry-exporter-otlp)
- OTEL_METRICS_EXPORTER: the same choices, for ``specsplit.metrics``; OTEL_METRIC_EXPORT_INTERVAL (ms, default
  60000) is how often they are sent; or "prometheus" (needs opentelemetry-exporter-prometheus): served for scraping
  at http://OTEL_EXPORTER_PROMETHEUS_HOST:OTEL_EXPORTER_PROMETHEUS_PORT/metrics (default localhost:9464)
- OTEL_SDK_DISABLED=true: none of the above, whatever they say
- OTEL_SERVICE_NAME: overrides the service name a process passes in
- OTEL_EXPORTER_OTLP_PROTOCOL (or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / _METRICS_PROTOCOL): grpc (default) or
  http/protobuf; OTEL_EXPORTER_OTLP_ENDPOINT and friends: read by the OTLP exporters themselves
Core code only ever uses the OpenTelemetry API (``trace.get_tracer(__name__)``, ``specsplit.metrics``).
"""

from __future__ import annotations

import importlib
import os
import sys

from opentelemetry import metrics, trace

_configured: set[str] = set()


def setup_telemetry(service_name: str) -> None:
    """Tracing and metrics for this process, as the OTEL_* variables ask (none with OTEL_SDK_DISABLED=true)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    setup_tracing(service_name)
    setup_metrics(service_name)


def shutdown_telemetry() -> None:
    """Export what the SDK providers still hold, and stop them (their atexit hooks do it at a normal exit)."""
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        shutdown = getattr(provider, "shutdown", None)  # (the API's default providers have none)
        if shutdown is not None:
            shutdown()


def _exporters(variable: str, kinds: tuple[str, ...] = ("none", "console", "otlp")) -> list[str]:
    names = [e.strip() for e in os.environ.get(variable, "none").split(",") if e.strip()]
    for name in names:
        if name not in kinds:
            raise SystemExit(f"{variable}={name!r} is not supported; use {', '.join(kinds)}")
    return [name for name in names if name != "none"]


def _resource(service_name: str):
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})


OTLP_PROTOCOLS = {"grpc": "grpc", "http/protobuf": "http"}  # the standard variable's values -> exporter package


def _otlp(kind: str):
    """The OTLP exporter of ``kind`` ("traces", "metrics") over the protocol OTEL_EXPORTER_OTLP_<KIND>_PROTOCOL or
    OTEL_EXPORTER_OTLP_PROTOCOL names (grpc, the default, or http/protobuf: a collector's port 4318)."""
    variable = f"OTEL_EXPORTER_OTLP_{kind.upper()}_PROTOCOL"
    protocol = os.environ.get(variable) or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    package = OTLP_PROTOCOLS.get(protocol.strip())
    if package is None:
        raise SystemExit(f"{variable} / OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use "
                         f"{' or '.join(OTLP_PROTOCOLS)}")
    module = f"opentelemetry.exporter.otlp.proto.{package}.{'trace' if kind == 'traces' else 'metric'}_exporter"
    try:
        exporter = getattr(importlib.import_module(module), "OTLPSpanExporter" if kind == "traces" else
                           "OTLPMetricExporter")
    except ImportError as err:
        raise SystemExit(f"OTEL_{kind.upper()}_EXPORTER=otlp over {protocol} needs `pip install "
                         f"opentelemetry-exporter-otlp` (or opentelemetry-exporter-otlp-proto-{package})") from err
    return exporter()


def _prometheus():
    """A reader whose metrics prometheus_client serves at /metrics on its own HTTP port."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as err:
        raise SystemExit("OTEL_METRICS_EXPORTER=prometheus needs `pip install opentelemetry-exporter-prometheus`") \
            from err
    host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
    port = int(os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
    try:
        start_http_server(port, addr=host)
    except OSError as err:
        raise SystemExit(f"cannot serve Prometheus metrics on {host}:{port} ({err}); set OTEL_EXPORTER_PROMETHEUS_PORT "
                         "to a free port (one per process)") from None
    return PrometheusMetricReader()


def setup_tracing(service_name: str) -> bool:
    """Install an SDK tracer provider if OTEL_TRACES_EXPORTER asks for one; return whether it did."""
    names = _exporters("OTEL_TRACES_EXPORTER")
    if "traces" in _configured or not names:
        return False
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=_resource(service_name))
    for name in names:
        # console: stdout is the program's (generate --json: one object)
        exporter = ConsoleSpanExporter(out=sys.stderr) if name == "console" else _otlp("traces")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured.add("traces")
    return True


def setup_metrics(service_name: str) -> bool:
    """Install an SDK meter provider if OTEL_METRICS_EXPORTER asks for one; return whether it did."""
    names = _exporters("OTEL_METRICS_EXPORTER", ("none", "console", "otlp", "prometheus"))
    if "metrics" in _configured or not names:
        return False
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = [PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr) if name == "console"
                                             else _otlp("metrics")) for name in names if name != "prometheus"]
    if "prometheus" in names:
        readers.append(_prometheus())
    metrics.set_meter_provider(MeterProvider(metric_readers=readers, resource=_resource(service_name)))
    _configured.add("metrics")
    return True
