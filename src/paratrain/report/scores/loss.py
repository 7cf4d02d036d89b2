"""The validation loss as a score (lower is better)."""

from __future__ import annotations

from paratrain.report.scores.base import Score

SCORES = {"loss": Score("loss", lambda t: t.loss, higher_is_better=False, share=False)}
