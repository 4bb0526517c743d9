"""The table every section's rows go into (`Row`, `render_table`) and the formats its cells share."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    section: str
    what: str
    kvpool: str
    reference: str
    ratio: str
    target: str = ""


def verdict(value: float, target: float) -> str:
    return f">= {target:.2f}: {'met' if value >= target else 'MISSED'}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "n/a"


def render_table(rows: Sequence[Row]) -> str:
    lines = ["| # | measurement | kvpool | reference | ratio | target |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.section} | {r.what} | {r.kvpool} | {r.reference} | {r.ratio} | {r.target} |" for r in rows]
    return "\n".join(lines)


def headline(value: float, target: float | None = None, *, at_most: bool = False) -> dict:
    """One entry of the JSON's "ratios": the value, its target (None: none; a floor, or with `at_most` a
    ceiling) and whether it was met."""
    met = None if target is None else (value <= target if at_most else value >= target)
    return {"value": value, "target": target, "at_most": at_most, "met": met}
