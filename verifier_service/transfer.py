"""Moving a session's K/V out of and into the verifier as bytes (``verifier_service.offload``): ExportSession copies
its slot's cached positions, ImportSession writes them into a fresh slot (no forward). Both touch the slot store on
the model thread only, as a tick's bookkeeping work, like Release. ``TargetEngine`` (``verifier_service.engine``)
takes these from ``KVTransfer``.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from specsplit.errors import FailedPrecondition, InvalidArgument, NotFound
from specsplit.sampling import SamplingParams
from verifier_service import offload
from verifier_service.work import ExportWork, ImportWork

tracer = trace.get_tracer(__name__)


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class KVTransfer:
    """Export and import of sessions' caches, for ``TargetEngine`` (its session table, scheduler and slot store)."""

    def export_session(self, session_id: str, expected_committed_length: int, dtype: str = "") -> bytes:
        """The session's cached K/V (every committed token but the pending one) as bytes; it stays here."""
        target = offload.target_dtype(dtype)
        session = self.session(session_id)
        with session.lock:
            if session.released:
                raise NotFound(f"session {session_id!r} was released")
            if expected_committed_length != session.committed_length:
                raise FailedPrecondition(f"session {session_id!r} has {session.committed_length} committed tokens, "
                                         f"the export expected {expected_committed_length}")
            with tracer.start_as_current_span("specsplit.verifier.export") as span:
                span.set_attribute("specsplit.committed_length", session.committed_length)
                # The copy is taken on the model thread, between forwards; serializing it is not.
                layers = self._scheduler.submit(ExportWork(session, 0, session=session, dtype=target)).result()
        return offload.layers_to_bytes(layers)

    def import_session(self, session_id: str, token_ids: list[int], blob: bytes, sampling: SamplingParams | None = None,
                       return_features: bool = False, medusa: bool = False) -> tuple[int, float]:
        """A session from an exported cache: like Prefill of ``token_ids``, without the forward (so its
        answer carries no features and no Medusa tree; later Verify answers do, if asked here)."""
        start = time.perf_counter()
        sampling = sampling or SamplingParams()
        sampling.validate(), sampling.check_seeded()
        self._check_new(session_id, token_ids)
        if offload.cached_length(blob) != len(token_ids) - 1:
            raise InvalidArgument(f"KV blob caches {offload.cached_length(blob)} positions; {len(token_ids)} committed "
                                  f"tokens need {len(token_ids) - 1} (all but the pending one)")
        layers = offload.layers_from_bytes(blob, self._num_layers, self._kv_shape)
        if medusa and self.medusa is None:
            raise FailedPrecondition("this verifier has no Medusa heads (start it with --medusa PATH)")
        session = self._sessions.admit(session_id, token_ids, sampling, 0)  # its lock held
        session.return_features, session.medusa = return_features, medusa
        try:
            with tracer.start_as_current_span("specsplit.verifier.import") as span:
                span.set_attribute("specsplit.committed_length", len(token_ids))
                self._scheduler.submit(ImportWork(session, 0, session=session, layers=layers)).result()
        except BaseException:
            self.release(session_id, expected=session)
            raise
        finally:
            session.lock.release()
        return session.committed_length, ms_since(start)

    def _move_kv(self, work: ExportWork | ImportWork) -> None:
        """Copy a session's cached K/V out of its slot (export), or into a fresh slot (import)."""
        session = work.session
        try:
            if isinstance(work, ExportWork):
                result = self._store.read_session(session.slot, session.cached_length, self._num_layers, work.dtype)
            else:
                if session.slot < 0:
                    session.slot = self._store.acquire()
                try:
                    self._store.write_session(session.slot, work.layers, self.dtype, self.device)
                except RuntimeError as err:  # heads or head size differ: a blob of another model
                    raise InvalidArgument(f"KV blob does not fit this model: {err}") from None
                session.exact_kv = all(t.dtype == self.dtype for pair in work.layers if pair is not None for t in pair)
                session.answered_at = time.perf_counter()
                result = session.committed_length
        except BaseException as err:
            self._fail(work, err)
            return
        work.future.set_result(result)
