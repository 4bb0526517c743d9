"""The books' integrity checks raise IntegrityError (not assert: `python -O` would remove those checks)."""

from __future__ import annotations


class IntegrityError(Exception):
    """The daemon's books do not balance."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
