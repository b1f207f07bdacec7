"""The calls a server counts as in flight (what a draining service reports)."""

import grpc
import pytest

from specsplit.errors import Unavailable
from specsplit.serving import calls_in_flight, grpc_errors


class _Context:
    code = details = None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Exception()  # as grpc's: the status is set, the handler ends


class _Servicer:
    def __init__(self):
        self.seen = []  # calls_in_flight() inside each call

    @grpc_errors
    def Unary(self, request, context):
        self.seen.append(calls_in_flight())
        if request == "fail":
            raise Unavailable("down")
        return request

    @grpc_errors
    def Stream(self, request, context):
        self.seen.append(calls_in_flight())
        yield 1
        self.seen.append(calls_in_flight())


def test_calls_count_in_flight_until_they_end_failed_or_not():
    servicer, before = _Servicer(), calls_in_flight()
    servicer.Unary("ok", _Context())
    stream = servicer.Stream(None, _Context())
    next(stream)  # a stream is in flight until it ends
    servicer.Unary("ok", _Context())
    context = _Context()
    with pytest.raises(Exception):  # noqa: B017 - grpc's abort raises a bare Exception
        servicer.Unary("fail", context)
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, "down")
    list(stream)
    assert [n - before for n in servicer.seen] == [1, 1, 2, 2, 1]
    assert calls_in_flight() == before
