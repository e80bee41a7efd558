"""The interface every quality filter implements (:mod:`densetrain.data.prepare.filters.chain` runs them)."""

from __future__ import annotations


class Filter:
    """A document filter: ``apply(text) -> (kept_text | None, reason | None)``.

    ``kept_text`` is the document, possibly with lines removed; it is None when the document is
    dropped, and then ``reason`` is ``'<name>:<rule>'``. Subclasses are module-level and hold only
    their (dataclass) parameters and values derived from them, so they pickle to worker processes.
    """

    name = ""

    def apply(self, text: str) -> tuple[str | None, str | None]:  # pragma: no cover - interface
        raise NotImplementedError

    def _drop(self, rule: str) -> tuple[None, str]:
        return None, f"{self.name}:{rule}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'p', '')})"
