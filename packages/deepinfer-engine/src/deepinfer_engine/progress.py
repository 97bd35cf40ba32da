"""Progress of one `LLM.generate` call: a tqdm bar over requests with live generated tokens/s, and a one-line
summary on stderr at the end (requests, prompt and generated tokens, wall time, tokens/s; with drafting, the mean
acceptance length and the accepted share of the verified drafts).

Mean acceptance length = tokens a sampling step emits: its accepted drafts plus one sampled token, so over the finished
requests it is 1 + Σ accepted drafts / Σ sampling steps (drafts that a stop condition then cut count as accepted);
1 without drafting."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

__all__ = ["GenerateProgress"]


class GenerateProgress:
    """The bar and the summary of one call.

    Args:
        total: requests of the call.
        enabled: show the bar and print the summary.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_sampling_steps = 0  # of the finished requests, for the acceptance length
        self.num_accepted_draft_tokens = 0
        self.num_verified_draft_tokens = 0
        self.bar = tqdm(total=total, desc="generate", unit="req", disable=not enabled, dynamic_ncols=True)

    def update(self, num_new_tokens: int, num_finished: int) -> None:
        """Count newly generated tokens and finished requests."""
        self.num_generated_tokens += num_new_tokens
        if num_finished:
            self.bar.update(num_finished)
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix_str(f"{self.num_generated_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)

    def count_drafts(self, num_steps: int, num_accepted: int, num_verified: int) -> None:
        """Count a finished request's sampling steps and its accepted and verified draft tokens."""
        self.num_sampling_steps += num_steps
        self.num_accepted_draft_tokens += num_accepted
        self.num_verified_draft_tokens += num_verified

    def acceptance_summary(self) -> str:
        """The summary's drafting part: empty when no draft was verified."""
        if not self.num_verified_draft_tokens:
            return ""
        length = 1 + self.num_accepted_draft_tokens / max(self.num_sampling_steps, 1)
        return (
            f", mean acceptance length {length:.2f} "
            f"({self.num_accepted_draft_tokens} of {self.num_verified_draft_tokens} drafts accepted)"
        )

    def close(self, num_failed: int, interrupted: bool = False) -> None:
        """Close the bar and print the summary line; it says how many requests ended with an error, and when the
        call was interrupted, so it never claims that every request finished when some did not."""
        self.bar.close()
        if not self.enabled:
            return
        wall = time.perf_counter() - self.start
        total = self.bar.total
        done = f"{total} requests"
        if interrupted:
            done = f"interrupted: {total - num_failed} of {total} requests finished"
        elif num_failed:
            done = f"{total} requests ({num_failed} ended with an error)"
        print(
            f"generate: {done}, {self.num_prompt_tokens} prompt tokens, "
            f"{self.num_generated_tokens} generated tokens in {wall:.2f} s "
            f"({self.num_generated_tokens / max(wall, 1e-9):.1f} generated tok/s, "
            f"{(self.num_prompt_tokens + self.num_generated_tokens) / max(wall, 1e-9):.1f} total tok/s)"
            f"{self.acceptance_summary()}",
            file=sys.stderr,
        )
