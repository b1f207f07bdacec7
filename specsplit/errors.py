"""Domain errors. Each carries the gRPC status it maps to; the mapping happens in one
place (``specsplit.serving.grpc_errors``), so core code never imports grpc."""

from __future__ import annotations


class SpecSplitError(Exception):
    code_name = "INTERNAL"


class InvalidArgument(SpecSplitError):
    code_name = "INVALID_ARGUMENT"


class NotFound(SpecSplitError):
    code_name = "NOT_FOUND"


class FailedPrecondition(SpecSplitError):
    code_name = "FAILED_PRECONDITION"


class ResourceExhausted(SpecSplitError):
    code_name = "RESOURCE_EXHAUSTED"


class Unavailable(SpecSplitError):
    code_name = "UNAVAILABLE"
