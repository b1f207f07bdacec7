"""Tracing setup, once per process. Exporters follow the standard OTEL_* variables; none by default.

- OTEL_TRACES_EXPORTER: "none" (default), "console" (to stderr), or "otlp" (needs opentelemetry-exporter-otlp)
- OTEL_SERVICE_NAME: overrides the service name a process passes in
- OTEL_EXPORTER_OTLP_ENDPOINT and friends: read by the OTLP exporter itself
Core code only ever uses the OpenTelemetry API (``trace.get_tracer(__name__)``).
"""

from __future__ import annotations

import os
import sys

from opentelemetry import trace

_configured = False


def setup_tracing(service_name: str) -> bool:
    """Install an SDK tracer provider if OTEL_TRACES_EXPORTER asks for one; return whether it did."""
    global _configured
    exporter_names = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if e.strip()]
    if _configured or not exporter_names or exporter_names == ["none"]:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}))
    for name in exporter_names:
        if name == "console":
            exporter = ConsoleSpanExporter(out=sys.stderr)  # stdout is the program's (generate --json: one object)
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError as err:
                raise SystemExit("OTEL_TRACES_EXPORTER=otlp needs `pip install opentelemetry-exporter-otlp`") from err
            exporter = OTLPSpanExporter()
        elif name == "none":
            continue
        else:
            raise SystemExit(f"OTEL_TRACES_EXPORTER={name!r} is not supported; use none, console or otlp")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True
    return True
