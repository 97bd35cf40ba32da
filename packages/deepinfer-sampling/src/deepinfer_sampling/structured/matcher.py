"""Per-request grammar matcher: trigger, bound, grammar and post-stop states, with rollback.

A ``RequestGrammarMatcher`` wraps one ``xgrammar.GrammarMatcher`` and adds the ``so_args`` trigger/bound behaviour
(docs/design/sampling.md, "Grammar arguments", "Bitmask per step"). Its mode moves only forward while accepting tokens;
rollback moves it back::

    FREE ──trigger seen──────────────────────────────► GRAMMAR ──stop token──► FINISHED
      │                                                   ▲
      └──bound token seen──► FORCING ──rest of trigger────┘

- FREE: the trigger has not appeared in the generated tokens (the prompt never counts); every token is allowed and
  trigger progress is tracked with a KMP automaton, so overlapping partial matches are found.
- FORCING: the bound token appeared before the trigger completed. Free generation is over: the mask allows exactly the
  next trigger token until the trigger is complete. (The bound token first advances trigger progress like any other
  token, so a bound equal to ``trigger[0]`` forces only ``trigger[1:]``.)
- GRAMMAR: tokens go to xgrammar; trigger tokens themselves are never fed to it. Without a trigger the matcher starts
  here.
- FINISHED: the grammar accepted a stop token; every later token is accepted and nothing is masked (only reachable
  with ``ignore_eos``).

Rollback of ``n`` tokens restores the mode, trigger progress and xgrammar state as they were before those tokens; it
reaches back at most ``max_rollback_tokens`` tokens. Mask rows are int32 words of 32 tokens each, bit set = allowed
(xgrammar layout, ``bitmask.py``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from deepinfer_sampling.structured._trigger import TriggerAutomaton


class MatcherMode(enum.IntEnum):
    """Where a request is in its constrained-output life cycle (see the module docstring)."""

    FREE = 0
    FORCING = 1
    GRAMMAR = 2
    FINISHED = 3


@dataclass(frozen=True)
class _Before:
    """State before one accepted token, kept for rollback."""

    mode: MatcherMode
    trigger_progress: int
    fed_to_grammar: bool


class RequestGrammarMatcher:
    """Constrained-decoding state of one request.

    Args:
        compiled_grammar: the request's compiled grammar.
        trigger_token_ids: tokens that must appear (in generated output) before the grammar engages; empty means
            constrained from the first token. Must be validated by the caller (non-negative ints).
        bound_token_id: token that ends free generation before the trigger; requires a non-empty trigger.
        max_rollback_tokens: how many accepted tokens ``rollback`` can undo (at least ``nextn + 2``).

    Raises:
        ValueError: on a bound without a trigger or a negative ``max_rollback_tokens``.
    """

    def __init__(
        self,
        compiled_grammar: xgr.CompiledGrammar,
        trigger_token_ids: Sequence[int] = (),
        bound_token_id: int | None = None,
        *,
        max_rollback_tokens: int,
    ) -> None:
        if bound_token_id is not None and not trigger_token_ids:
            raise ValueError(f"bound_token_id={bound_token_id} requires non-empty trigger_token_ids")
        if max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens={max_rollback_tokens} must be >= 0")
        self._grammar = xgr.GrammarMatcher(compiled_grammar)
        self._trigger = TriggerAutomaton(trigger_token_ids) if trigger_token_ids else None
        self._bound_token_id = bound_token_id
        self._mode = MatcherMode.FREE if self._trigger is not None else MatcherMode.GRAMMAR
        self._trigger_progress = 0
        self._max_rollback_tokens = max_rollback_tokens
        self._history: deque[_Before] = deque(maxlen=max_rollback_tokens)

    @property
    def mode(self) -> MatcherMode:
        """Current mode."""
        return self._mode

    @property
    def is_constrained(self) -> bool:
        """Whether the next token is restricted (forced trigger token or grammar)."""
        return self._mode in (MatcherMode.FORCING, MatcherMode.GRAMMAR)

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted a stop token."""
        return self._mode == MatcherMode.FINISHED

    @property
    def num_rollback_tokens(self) -> int:
        """How many of the most recent tokens ``rollback`` can undo now."""
        return len(self._history)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token.

        Returns:
            True if the token is allowed (state advanced); False if rejected (state unchanged).
        """
        before = _Before(self._mode, self._trigger_progress, fed_to_grammar=False)
        if self._mode == MatcherMode.FREE:
            assert self._trigger is not None
            self._trigger_progress = self._trigger.step(self._trigger_progress, token_id)
            if self._trigger_progress == len(self._trigger.trigger):
                self._mode = MatcherMode.GRAMMAR
            elif token_id == self._bound_token_id:
                self._mode = MatcherMode.FORCING
        elif self._mode == MatcherMode.FORCING:
            assert self._trigger is not None
            if token_id != self._trigger.trigger[self._trigger_progress]:
                return False
            self._trigger_progress += 1
            if self._trigger_progress == len(self._trigger.trigger):
                self._mode = MatcherMode.GRAMMAR
        elif self._mode == MatcherMode.GRAMMAR:
            if not self._grammar.accept_token(token_id):
                return False
            before = _Before(before.mode, before.trigger_progress, fed_to_grammar=True)
            if self._grammar.is_terminated():
                self._mode = MatcherMode.FINISHED
        self._history.append(before)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: when ``num_tokens`` is negative or more than ``num_rollback_tokens``.
        """
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens; between 0 and {len(self._history)} are allowed")
        if num_tokens == 0:
            return
        undone = [self._history.pop() for _ in range(num_tokens)]
        num_grammar_tokens = sum(entry.fed_to_grammar for entry in undone)
        if num_grammar_tokens:
            self._grammar.rollback(num_grammar_tokens)
        self._mode = undone[-1].mode
        self._trigger_progress = undone[-1].trigger_progress

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed set for the next token into ``bitmask[row]``.

        Args:
            bitmask: int32 CPU tensor [num_rows, ceil(vocab_size / 32)]; bit ``t % 32`` of word ``t // 32`` set means
                token ``t`` is allowed.
            row: row to write; every word of it is overwritten.
        """
        if self._mode == MatcherMode.GRAMMAR:
            self._grammar.fill_next_token_bitmask(bitmask, row)
        elif self._mode == MatcherMode.FORCING:
            assert self._trigger is not None
            forced = self._trigger.trigger[self._trigger_progress]
            bitmask[row].zero_()
            bit = forced % 32
            # Bit 31 is the int32 sign bit.
            bitmask[row, forced // 32] = -(1 << 31) if bit == 31 else 1 << bit
        else:
            bitmask[row].fill_(-1)

    def fill_bitmask_with_drafts(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int]) -> int:
        """Fill the mask rows of one decode step whose rows score ``draft_token_ids``.

        Row ``first_row`` gets the mask for the next token; row ``first_row + k`` the mask after tentatively accepting
        drafts ``1..k``. Drafting stops at the first draft the matcher rejects (or a negative sentinel id); later rows
        are set to all-allowed because verification can never reach them. The tentative tokens are rolled back.

        Args:
            bitmask: int32 CPU tensor [num_rows, ceil(vocab_size / 32)], rows ``first_row .. first_row +
                len(draft_token_ids)`` are written.
            first_row: the request's first sampling row.
            draft_token_ids: the drafts this step verifies, in order.

        Returns:
            Number of leading drafts the matcher accepted.

        Raises:
            ValueError: when the drafts need more rollback than ``max_rollback_tokens``.
        """
        if len(draft_token_ids) > self._max_rollback_tokens:
            raise ValueError(
                f"{len(draft_token_ids)} drafts exceed max_rollback_tokens={self._max_rollback_tokens}; "
                "raise max_rollback_tokens to at least nextn + 2"
            )
        self.fill_bitmask(bitmask, first_row)
        num_accepted = 0
        for draft in draft_token_ids:
            if draft < 0 or not self.accept_token(draft):
                break
            num_accepted += 1
            self.fill_bitmask(bitmask, first_row + num_accepted)
        bitmask[first_row + num_accepted + 1 : first_row + len(draft_token_ids) + 1].fill_(-1)
        self.rollback(num_accepted)
        return num_accepted
