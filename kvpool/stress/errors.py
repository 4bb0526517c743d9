"""How a session's step fails the run: a contract violation."""

from __future__ import annotations


class ContractViolation(Exception):
    """A daemon answered something the contract does not allow; the run fails."""
