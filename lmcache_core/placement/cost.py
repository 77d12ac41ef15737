"""The prefill cost model: compute seconds a chunk costs at its position in a prompt.

Prefilling token ``n`` of a prompt costs a constant (the weights' matmuls) plus a part
that grows with ``n`` (attention over the ``n`` tokens before it)::

    seconds(token n) = (1 + n / attn_tokens) / tokens_per_s

so a chunk of ``c`` tokens starting at token ``s`` costs
``(c + c * (s + (c - 1) / 2) / attn_tokens) / tokens_per_s`` and a hit on it saves that.
``tokens_per_s`` is the short-prompt prefill throughput; ``attn_tokens`` the prompt
length at which attention costs as much as the rest. :meth:`PrefillCost.fit` learns both
from measured (prompt tokens, prefill seconds) pairs (an engine's timings or a
calibration run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefillCost"]


@dataclass(frozen=True)
class PrefillCost:
    """Compute seconds of prefill; see the module docstring for the model."""

    tokens_per_s: float = 8000.0
    attn_tokens: float = 16384.0

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0 or not self.attn_tokens > 0:
            raise ValueError(
                f"tokens_per_s and attn_tokens must be > 0, got {self.tokens_per_s}, {self.attn_tokens}"
            )

    def chunk_seconds(self, start_token: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens that follow ``start_token`` earlier ones."""
        mean_ctx = start_token + (tokens - 1) / 2.0
        return tokens * (1.0 + mean_ctx / self.attn_tokens) / self.tokens_per_s

    def prompt_seconds(self, tokens: int) -> float:
        """Seconds to prefill a whole prompt of ``tokens`` tokens."""
        return self.chunk_seconds(0, tokens)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> PrefillCost:
        """Least-squares fit of ``seconds = a*n + b*n*(n-1)/2`` to (prompt tokens,
        seconds) pairs; needs two or more distinct lengths and a positive fit."""
        xs = [(float(n), n * (n - 1) / 2.0) for n, _ in samples]
        ys = [float(s) for _, s in samples]
        s11 = sum(x1 * x1 for x1, _ in xs)
        s12 = sum(x1 * x2 for x1, x2 in xs)
        s22 = sum(x2 * x2 for _, x2 in xs)
        r1 = sum(x1 * y for (x1, _), y in zip(xs, ys, strict=True))
        r2 = sum(x2 * y for (_, x2), y in zip(xs, ys, strict=True))
        det = s11 * s22 - s12 * s12
        if len({n for n, _ in samples}) < 2 or det <= 0:
            raise ValueError("PrefillCost.fit needs samples at two or more prompt lengths")
        a = (r1 * s22 - r2 * s12) / det
        b = (s11 * r2 - s12 * r1) / det
        if a <= 0:
            raise ValueError(f"the samples give a non-positive per-token cost ({a:.3g} s)")
        if b <= 0:  # no measurable growth with length: attention cost negligible
            return cls(tokens_per_s=1.0 / a, attn_tokens=1e12)
        return cls(tokens_per_s=1.0 / a, attn_tokens=a / b)
