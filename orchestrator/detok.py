"""Incremental detokenization with stop strings: emit only text that can no longer change."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextStream:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # all generated tokens so far
    emitted: str = ""  # text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_token_ids: list[int]) -> tuple[list[int], str, bool]:
        """Append tokens; return (tokens kept, new text, hit a stop string).

        On a stop string, tokens after the one that completed it are dropped and the text ends just
        before the stop string.
        """
        start = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        text = self._decode(self.token_ids)
        if self._find_stop(text) is not None:
            # Shortest token prefix whose text contains a stop string; the text ends before the first stop string in
            # it (as when the tokens come one at a time: however the rounds group them, the same text).
            for end in range(start + 1, len(self.token_ids) + 1):
                hit = self._find_stop(text := self._decode(self.token_ids[:end]))
                if hit is not None:
                    break
            del self.token_ids[end:]
            final = text[:hit]
            delta = final[len(self.emitted):] if final.startswith(self.emitted) else ""
            self.emitted = final
            return self.token_ids[start:], delta, True
        stable = self._stable_prefix(text)
        delta = stable[len(self.emitted):] if len(stable) > len(self.emitted) else ""
        self.emitted += delta
        return list(new_token_ids), delta, False

    def mark(self) -> tuple[int, str]:
        """Where the stream is: ``rewind`` goes back there (a round whose tokens were not sent after all)."""
        return len(self.token_ids), self.emitted

    def rewind(self, mark: tuple[int, str]) -> None:
        del self.token_ids[mark[0]:]
        self.emitted = mark[1]

    def finish(self) -> str:
        """Everything not yet emitted (end of generation: nothing can change any more)."""
        text = self._decode(self.token_ids)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stop if s and s in text]
        return min(hits) if hits else None

    def _stable_prefix(self, text: str) -> str:
        """Text minus an undecodable tail (a split UTF-8 sequence) and minus a partial stop string."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:
            for n in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:n]):
                    end -= n
                    break
        return text[:end]
