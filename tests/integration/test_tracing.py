"""Spans per Generate, per round, per draft and verify call, in one trace across the gRPC hops; exported over
OTLP from separate processes to a collector."""

from opentelemetry import trace

from draft_service.ngram import NgramProposer
from specsplit.client import Client
from specsplit.config import DraftConfig
from specsplit.launch import start_stack

PROMPT = [258, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]


def test_one_trace_across_services(target):
    from tiny import span_exporter

    exporter = span_exporter()  # (the process's one tracer provider, whichever test set it)
    with start_stack(target, [NgramProposer(DraftConfig())]) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=12))
    rounds = sum(1 for c in chunks if c.stats)
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert not [s.name for s in spans if s.name.startswith("/")]  # "{rpc.service}/{rpc.method}", server side too
    generate = [s for s in spans if s.name.startswith("specsplit.orchestrator.generate")]
    assert len(generate) == 1
    gen = generate[0]
    assert gen.attributes["gen_ai.request.model"] == target.name
    assert gen.attributes["gen_ai.usage.output_tokens"] == 12
    trace_id = gen.context.trace_id
    # the SDK's Generate call, the orchestrator's server span and everything below share one trace
    assert len(by_name["specsplit.orchestrator.round"]) == rounds
    assert all(s.context.trace_id == trace_id for s in by_name["specsplit.orchestrator.round"])
    verify_clients = [s for s in by_name["specsplit.v1.VerifierService/Verify"] if s.kind == trace.SpanKind.CLIENT]
    verify_servers = [s for s in by_name["specsplit.v1.VerifierService/Verify"] if s.kind == trace.SpanKind.SERVER]
    assert len(verify_clients) == rounds and len(verify_servers) == rounds
    assert {s.context.trace_id for s in verify_servers} == {trace_id}
    round_ids = {s.context.span_id for s in by_name["specsplit.orchestrator.round"]}
    assert all(s.parent.span_id in round_ids for s in verify_clients)
    client_ids = {s.context.span_id for s in verify_clients}
    assert all(s.parent.span_id in client_ids for s in verify_servers)  # propagated across the hop
    assert {s.context.trace_id for s in by_name["specsplit.verifier.verify"]} == {trace_id}
    propose = by_name.get("specsplit.v1.DraftService/Propose", [])
    assert propose and {s.context.trace_id for s in propose} == {trace_id}
    assert {s.context.trace_id for s in by_name["specsplit.draft.propose"]} == {trace_id}
    sdk_call = [s for s in by_name["specsplit.v1.OrchestratorService/Generate"] if s.kind == trace.SpanKind.CLIENT]
    assert sdk_call and sdk_call[0].context.trace_id == trace_id


def test_feature_bytes_are_span_attributes(target):
    from tiny import span_exporter, tiny_eagle

    exporter = span_exporter()
    with start_stack(target, [tiny_eagle(target)]) as stack:
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=8))
    total = sum(c.stats.feature_bytes for c in chunks if c.stats)
    spans = exporter.get_finished_spans()
    rounds = [s for s in spans if s.name == "specsplit.orchestrator.round"]
    assert total > 0 and sum(s.attributes["specsplit.feature_bytes"] for s in rounds) == total
    sent = [s.attributes.get("specsplit.feature_bytes", 0) for s in spans
            if s.name in ("specsplit.verifier.verify", "specsplit.verifier.prefill")]
    assert sum(sent) == total  # what the verifier sent is what the rounds report
    received = [s.attributes["specsplit.feature_bytes"] for s in spans
                if s.name in ("specsplit.draft.propose", "specsplit.draft.grow")  # whole or streamed trees
                and "specsplit.feature_bytes" in s.attributes]
    assert received and sum(received) <= total  # the draft got them (the last round's are never forwarded)


def test_a_finished_generation_does_not_wait_for_the_release_of_its_cache(target):
    """A finished session's cache is freed by a Release call the end of its stream does not wait for: with the verifier
    200 ms away (the benchmark's delaying TCP relay), the Release, still in the generation's trace, ends after the
    Generate span, and it does free the cache (a round trip less per generation, nothing left behind)."""
    from tiny import delay_relay, hf_greedy, span_exporter, wait_for

    from specsplit.launch import start_draft, start_orchestrator, start_verifier

    exporter = span_exporter()
    verifier = start_verifier(target)
    draft = start_draft(NgramProposer(DraftConfig()))
    try:
        with delay_relay(verifier.address, 200) as relay:
            orchestrator = start_orchestrator(relay.address, [draft.address], target.tokenizer)
            try:
                chunks = list(Client(orchestrator.address).generate(prompt_token_ids=PROMPT, max_new_tokens=12))
                assert wait_for(lambda: orchestrator.core.generating() == 0 and verifier.core.num_sessions() == 0)
            finally:
                orchestrator.stop(0)
                orchestrator.core.close()
    finally:
        draft.stop(0)
        verifier.stop(0)
        verifier.core.close()
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(target.model, PROMPT, 12)
    spans = exporter.get_finished_spans()
    exporter.shutdown()
    (gen,) = [s for s in spans if s.name.startswith("specsplit.orchestrator.generate")]
    (release,) = [s for s in spans if s.name == "specsplit.v1.VerifierService/Release" and s.kind == trace.SpanKind.CLIENT]
    assert release.context.trace_id == gen.context.trace_id and release.parent.span_id == gen.context.span_id
    assert release.end_time - release.start_time >= 200e6  # ns: it paid the round trip
    assert release.end_time > gen.end_time  # after the generation had ended


def test_separate_processes_export_one_trace_and_metrics_over_otlp(model_dir):
    """What dashboards get: each service (and the CLI client) in its own process exports its spans and metrics over
    OTLP to a collector (here a minimal real OTLP/gRPC receiver); one generation is one trace across them, and the
    orchestrator's committed-token counter adds up to the tokens the client got."""
    import collections
    import concurrent.futures
    import json
    import time

    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    from processes import cli, serve

    received = collections.defaultdict(list)  # service.name -> [(trace id, span name)]
    counted = {}  # (service.name, metric) -> the latest cumulative sum (or histogram count)

    def service(resource) -> str:
        return next(a.value.string_value for a in resource.attributes if a.key == "service.name")

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            for resource_spans in request.resource_spans:
                for scope in resource_spans.scope_spans:
                    received[service(resource_spans.resource)] += [(s.trace_id.hex(), s.name) for s in scope.spans]
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            for resource_metrics in request.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        points = metric.sum.data_points or metric.histogram.data_points
                        total = sum(p.as_int if metric.HasField("sum") else p.count for p in points)
                        counted[service(resource_metrics.resource), metric.name] = total
            return metrics_service_pb2.ExportMetricsServiceResponse()

    collector = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), collector)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    otel = dict(OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp", OTEL_METRIC_EXPORT_INTERVAL="200",
                OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_INSECURE="true",
                OTEL_BSP_SCHEDULE_DELAY="50")
    path, _ = model_dir
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path), **otel)
        procs.append(verifier)
        draft, draft_addr = serve("draft", "--draft", "ngram", **otel)
        procs.append(draft)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--drafts", draft_addr,
                                "--target-model", str(path), **otel)
        procs.append(orch)
        out = cli("generate", "abcabcabcabc", "--orchestrator", orch_addr, "--max-new-tokens", "8", "--json",
                  "--no-chat-template", **otel)
        assert out.returncode == 0, out.stderr
        tokens = json.loads(out.stdout)["token_ids"]
        wanted = {"specsplit-cli", "specsplit-orchestrator", "specsplit-verifier", "specsplit-draft"}
        committed = ("specsplit-orchestrator", "specsplit.tokens.committed")
        deadline = time.monotonic() + 20
        while (not wanted <= received.keys() or counted.get(committed) != len(tokens)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wanted <= received.keys(), dict(received)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
        collector.stop(0)
    generate = {t for t, name in received["specsplit-orchestrator"] if name.startswith("specsplit.orchestrator.generate")}
    assert len(generate) == 1
    (trace_id,) = generate
    assert any(t == trace_id for t, _ in received["specsplit-cli"])  # the client's span opened the trace
    for name in ("specsplit-verifier", "specsplit-draft"):
        assert any(t == trace_id for t, _ in received[name]), (name, received[name])
    assert counted[committed] == len(tokens), counted
    assert counted["specsplit-orchestrator", "specsplit.generations"] == 1
    assert counted["specsplit-verifier", "specsplit.verifier.forward.duration"] >= 1


def test_otlp_over_http_protobuf_reaches_an_http_collector(model_dir):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (a collector's HTTP port, 4318): spans go as protobuf POSTs to
    /v1/traces (before, the gRPC exporter was used whatever the variable said, and an HTTP-only collector got
    nothing); a protocol no exporter speaks is refused with a clear message."""
    import http.server
    import json
    import threading

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from processes import cli

    spans = []  # (service.name, span name) of every span posted

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server handler name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    name = next(a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name")
                    spans.extend((name, s.name) for scope in resource_spans.scope_spans for s in scope.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path, loaded = model_dir
    otel = dict(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
                OTEL_BSP_SCHEDULE_DELAY="50")
    try:
        out = cli("generate", "abcabcabcabc", "--target-model", str(path), "--draft", "ngram", "--max-new-tokens", "8",
                  "--json", "--no-chat-template", **otel)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"]
        names = {name for _, name in spans}
        assert any(n.startswith("specsplit.orchestrator.generate") for n in names), names  # flushed at exit
        assert "specsplit.v1.VerifierService/Verify" in names, names
        refused = cli("generate", "hi", "--target-model", str(path), **otel | dict(OTEL_EXPORTER_OTLP_PROTOCOL="http/json"))
        assert refused.returncode != 0 and "http/json" in refused.stderr and "http/protobuf" in refused.stderr
    finally:
        server.shutdown()


def test_metrics_count_what_the_stream_reports(target):
    """specsplit.metrics through an SDK meter provider: rounds, committed, drafted and accepted tokens add up to the
    stream's own round stats; the verifier's session gauge returns to where it was once the session is released."""
    import collections

    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from draft_service.proposers import ModelProposer
    from tiny import wait_for

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    def totals() -> collections.Counter:
        out = collections.Counter()
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:  # a sum's value, a histogram's count
                        out[metric.name] += point.value if hasattr(point, "value") else point.count
        return out

    before = totals()
    with start_stack(target, [ModelProposer(target, DraftConfig())]) as stack:  # the target as its own draft: accepted
        chunks = list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=20))
        stats = [c.stats for c in chunks if c.stats]
        wait_for(lambda: totals()["specsplit.verifier.sessions"] == before["specsplit.verifier.sessions"])
        after = totals()
    delta = {name: after[name] - before[name] for name in after}
    assert delta["specsplit.tokens.committed"] == sum(len(c.token_ids) for c in chunks) == 20
    assert delta["specsplit.rounds"] == len(stats) == delta["specsplit.round.duration"]
    assert delta["specsplit.draft.tokens"] == sum(s.num_draft_tokens for s in stats)
    assert delta["specsplit.draft.tokens.accepted"] == sum(s.num_accepted for s in stats) > 0
    assert delta["specsplit.generations"] == 1 and delta["specsplit.time_to_first_token"] == 1
    assert delta["specsplit.verifier.forward.duration"] >= len(stats)
    # the draft's forwards in its streamed rounds, by what they were for (never stopped: nothing made them moot)
    assert delta["specsplit.draft.forward.duration"] >= len(stats)
    phases = {(point.attributes["phase"], point.attributes["stopped"])
              for resource in reader.get_metrics_data().resource_metrics for scope in resource.scope_metrics
              for metric in scope.metrics if metric.name == "specsplit.draft.forward.duration"
              for point in metric.data.data_points}
    assert ("grow", False) in phases and phases <= {(p, False) for p in ("grow", "given", "span", "provisional")}


def test_prometheus_scrapes_the_orchestrator_and_the_verifier(model_dir):
    """OTEL_METRICS_EXPORTER=prometheus: each process serves /metrics on its own port for a Prometheus scrape."""
    import json
    import re
    import urllib.request

    from processes import cli, serve
    from redis_server import free_port

    path, _ = model_dir
    ports = {"verifier": free_port(), "orchestrator": free_port()}
    env = {name: dict(OTEL_METRICS_EXPORTER="prometheus", OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                      OTEL_EXPORTER_PROMETHEUS_PORT=str(port)) for name, port in ports.items()}
    procs = []
    try:
        verifier, verifier_addr = serve("verifier", "--target-model", str(path), **env["verifier"])
        procs.append(verifier)
        orch, orch_addr = serve("orchestrator", "--verifier", verifier_addr, "--target-model", str(path),
                                **env["orchestrator"])
        procs.append(orch)
        out = cli("generate", "abcabcabcabc", "--orchestrator", orch_addr, "--max-new-tokens", "8", "--json",
                  "--no-chat-template")
        assert out.returncode == 0, out.stderr
        tokens = json.loads(out.stdout)["token_ids"]
        scraped = {name: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                   for name, port in ports.items()}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
    committed = re.search(r"^specsplit_tokens_committed_total\{[^}]*\} (\S+)$", scraped["orchestrator"], re.M)
    assert committed and float(committed.group(1)) == len(tokens), scraped["orchestrator"]
    forwards = re.search(r"^specsplit_verifier_forward_duration_milliseconds_count\{?[^}]*\}? (\S+)$",
                         scraped["verifier"], re.M)
    assert forwards and float(forwards.group(1)) >= 1, scraped["verifier"]


def test_generate_with_prometheus_metrics_starts_its_draft_process(model_dir):
    """`specsplit generate` serves its Prometheus port itself; the model draft it starts in a child process exports no
    Prometheus metrics (before, the child tried the same port and did not start: exit 2)."""
    import json

    from processes import cli
    from redis_server import free_port
    from tiny import hf_greedy

    path, loaded = model_dir
    out = cli("generate", "hello world", "--target-model", str(path), "--max-new-tokens", "8", "--json", "--draft",
              "half", "--draft-threads", "1", OTEL_METRICS_EXPORTER="prometheus",
              OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT=str(free_port()))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == hf_greedy(loaded.model, result["prompt_token_ids"], 8)


def test_otel_sdk_disabled_turns_every_exporter_off():
    """OTEL_SDK_DISABLED=true: no exporter starts, whatever the other variables say (a taken Prometheus port made
    the service exit)."""
    import socket

    from processes import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc, _ = serve("draft", "--draft", "ngram", OTEL_SDK_DISABLED="true", OTEL_METRICS_EXPORTER="prometheus",
                        OTEL_TRACES_EXPORTER="console", OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                        OTEL_EXPORTER_PROMETHEUS_PORT=str(taken.getsockname()[1]))
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_failed_calls_show_their_error_and_health_checks_make_no_traces(target):
    """A dashboard's view of a refused request: the server span of the Generate call carries the real error (not
    the bare Exception grpc's abort raises), the client span its status and details and which server it called; a
    load balancer's health checks (here one) make no spans at all."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tiny import span_exporter

    from specsplit.serving import open_channel

    exporter = span_exporter()
    with start_stack(target, []) as stack:
        health = health_pb2_grpc.HealthStub(open_channel(stack.address))
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        try:
            list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=10**6))
            raise AssertionError("not refused")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if "Health" in s.name]
    (server,) = [s for s in spans if s.name == "specsplit.v1.OrchestratorService/Generate"
                 and s.kind == trace.SpanKind.SERVER]
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # (the caller's
    # fault: by the conventions not an error status on a server span)
    assert [e.attributes["exception.type"] for e in server.events if e.name == "exception"] == [
        "specsplit.errors.InvalidArgument"]
    (refused,) = [s for s in spans if s.name.startswith("specsplit.orchestrator.generate")]
    assert refused.attributes["error.type"] == "InvalidArgument"
    assert refused.attributes["gen_ai.request.model"] == target.name
    (client,) = [s for s in spans if s.name == "specsplit.v1.OrchestratorService/Generate"
                 and s.kind == trace.SpanKind.CLIENT]
    host, port = stack.address.rsplit(":", 1)
    assert client.attributes["rpc.service"] == "specsplit.v1.OrchestratorService"
    assert client.attributes["rpc.method"] == "Generate"
    assert (client.attributes["server.address"], client.attributes["server.port"]) == (host, int(port))
    assert "INVALID_ARGUMENT" in client.status.description and "over this server's limit" in client.status.description


def test_the_draft_s_prompt_prefill_is_a_span_of_the_session_s_trace(target):
    """The draft prefills a new prompt in the background; its span is in the generation's trace (it was missing, and
    a first round's wait for it showed unexplained)."""
    from tiny import span_exporter, tiny_loaded

    from draft_service.proposers import ModelProposer

    exporter = span_exporter()
    with start_stack(target, [ModelProposer(tiny_loaded(seed=3), DraftConfig())]) as stack:
        list(Client(stack.address).generate(prompt_token_ids=PROMPT, max_new_tokens=8))
    spans = exporter.get_finished_spans()
    exporter.shutdown()
    (gen,) = [s for s in spans if s.name.startswith("specsplit.orchestrator.generate")]
    (prefill,) = [s for s in spans if s.name == "specsplit.draft.prefill"]
    assert prefill.context.trace_id == gen.context.trace_id
    assert prefill.attributes["specsplit.prompt_tokens"] == len(PROMPT)
