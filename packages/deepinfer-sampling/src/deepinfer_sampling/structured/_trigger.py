"""KMP automaton that finds a trigger token sequence in the generated tokens.

Progress ``p`` is the length of the longest prefix of the trigger that is a suffix of the tokens seen so far, so
overlapping partial matches (trigger ``[a, a, b]`` in ``a a a b``) are found.
"""

from __future__ import annotations

from collections.abc import Sequence


class TriggerAutomaton:
    """Knuth-Morris-Pratt matcher over token ids.

    Args:
        trigger_token_ids: the non-empty token sequence to find.
    """

    def __init__(self, trigger_token_ids: Sequence[int]) -> None:
        self.trigger = tuple(trigger_token_ids)
        # failure[i]: length of the longest proper border of trigger[: i + 1].
        failure = [0] * len(self.trigger)
        border = 0
        for i in range(1, len(self.trigger)):
            while border > 0 and self.trigger[i] != self.trigger[border]:
                border = failure[border - 1]
            if self.trigger[i] == self.trigger[border]:
                border += 1
            failure[i] = border
        self._failure = tuple(failure)

    def step(self, progress: int, token_id: int) -> int:
        """Return the progress after seeing ``token_id`` with ``progress`` tokens of the trigger already matched."""
        if progress == len(self.trigger):
            progress = self._failure[progress - 1]
        while progress > 0 and token_id != self.trigger[progress]:
            progress = self._failure[progress - 1]
        if token_id == self.trigger[progress]:
            progress += 1
        return progress
