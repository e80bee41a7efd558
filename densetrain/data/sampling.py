"""Deterministic selection under a byte budget: split a budget fairly over parts, and pick whole
documents evenly through a list. Used to cap the demo corpus and to sample the BPE training text.

Both depend only on sizes and order, never on a random state, so the same inputs give the same
selection on every machine.
"""

from __future__ import annotations

from typing import Callable


def spread(items: list, budget: int, size: Callable[[object], int]) -> list:
    """At most ``budget`` (in the unit of ``size``) of whole items, chosen evenly across the list
    (error diffusion: each item earns ``size * budget / total`` credit, and is taken when the credit
    covers it). The first item is always taken when it fits (e.g. Genesis of the Bible)."""
    sizes = [size(d) for d in items]
    total = sum(sizes)
    if total <= budget:
        return items
    frac = budget / total
    # Starting with one document's worth of credit keeps the first document.
    out, credit, used = [], float(sizes[0]) if sizes else 0.0, 0
    for d, n in zip(items, sizes):
        credit += n * frac
        if n <= credit and used + n <= budget:
            out.append(d)
            credit -= n
            used += n
    return out


def fair_shares(sizes: list[int], budget: int) -> list[int]:
    """Split ``budget`` (bytes) over parts of ``sizes`` bytes: equal shares, except that a part
    smaller than its share is taken whole and leaves the rest to the others (max-min fairness)."""
    shares = [0] * len(sizes)
    left, remaining = budget, len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        shares[i] = min(sizes[i], left // remaining)
        left -= shares[i]
        remaining -= 1
    return shares
