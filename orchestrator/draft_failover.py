"""A failed draft never fails a generation: the session runs target-only for a while, then tries the draft again (or
its twin, the next configured draft of the same kind); one that lost the session (restarted; its idle sweep ended it)
is started again at the next round. A mixin of ``orchestrator.drafts.DraftMixin`` (it uses ``self.drafts``,
``self._draft_info_of``, ``self._start_draft`` and ``self.config``)."""

from __future__ import annotations

import logging
import time

from opentelemetry import trace

from orchestrator.placement import OUT_OF_STEP, traced_thread
from orchestrator.session import LiveSession
from specsplit.rpc import RpcError

log = logging.getLogger("orchestrator.generation")


class DraftFailover:
    def _draft_replica_after(self, draft):
        """The next draft service of the same kind (a replica; any kind if this one's is unknown), in order."""
        if len(self.drafts) < 2:
            return draft
        kind = self._draft_info_of(draft)
        same = [d for d in self.drafts if d is draft or kind is None or self._draft_info_of(d) == kind]
        return same[(same.index(draft) + 1) % len(same)]

    def _draft_failed(self, session: LiveSession, err) -> None:
        """Run target-only for ``draft_retry_rounds`` rounds or ``draft_retry_s`` seconds (doubling at each failure),
        whichever ends first; one that answered but lost the session or is out of step with it (``OUT_OF_STEP``) is
        started again at the next round, unless that was done less than ``draft_retry_rounds`` rounds ago."""
        code = err.code() if hasattr(err, "code") else err
        details = err.details() if hasattr(err, "details") else ""
        state = session.state
        at_once = code in OUT_OF_STEP and state.round - session.restarted_at >= self.config.draft_retry_rounds
        if at_once:
            session.restarted_at, pause, wait_s = state.round, 1, float("inf")  # the next round, whatever the time
        else:
            pause, retry_s = self.config.draft_retry_rounds, self.config.draft_retry_s
            wait_s = session.draft_backoff_s = min(max(2 * session.draft_backoff_s, retry_s), 32 * retry_s)
        log.warning("draft %s failed for session %s (%s%s); %s", session.draft.address, session.id, code,
                    f": {details}" if details else "", "it is started again next round" if at_once else
                    f"target-only decoding for {pause} rounds or {wait_s:g} s")
        trace.get_current_span().add_event("specsplit.draft_fallback", {"rpc.grpc.status_code": code.value[0],
                                                                        "specsplit.draft_pause_rounds": pause})
        session.draft_retry_at = time.monotonic() + wait_s
        state.draft_down_until = state.round + pause

    def _restart_draft(self, session: LiveSession) -> None:
        """The draft failed earlier and its pause is over: start the session again (the service may have restarted:
        from all tokens) on the next draft replica; one that failed and is left is told to end the session, in the
        background (alive, it would hold the session's cache until its idle timeout)."""
        failed = session.draft
        session.draft = self._draft_replica_after(failed)
        if session.draft is not failed:
            self._end_in_background(failed, session.id)
        self._start_draft(session, first=False)

    def _end_draft(self, session: LiveSession) -> None:
        if session.draft is None:
            return
        if session.state.draft_down_until:  # it failed: it may not answer before the deadline, so no one waits
            self._end_in_background(session.draft, session.id)
            return
        try:
            session.draft.end(session.id, timeout=self.config.draft_timeout_s)
        except RpcError:
            pass

    def _end_in_background(self, draft, session_id: str) -> None:
        def end() -> None:
            try:
                draft.end(session_id, timeout=self.config.draft_timeout_s)
            except Exception:  # noqa: BLE001 - best effort (the draft may be gone, the channel closed meanwhile)
                pass

        traced_thread(end, f"specsplit-draft-end-{session_id}")
