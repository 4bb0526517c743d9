"""What a decode step's hop does less of (issue 29, item 4): the same rules, taken without numpy where a request
carries a few token ids, and request ids drawn without a system call."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.client.channels import REQUEST_ID_MASK, DirectChannels
from kvpool.wire.checks import SHORT_TOKEN_LIST, token_ids
from kvpool.wire.errors import RequestFailed

N_VOCAB = 100


def _outcome(tokens: object) -> tuple[str, np.ndarray | str]:
    try:
        ids = token_ids(tokens, N_VOCAB, length=7)
    except RequestFailed as failure:
        assert failure.length == 7
        return "refused", f"{failure.code}: {failure}"
    return "taken", ids


@pytest.mark.parametrize(
    "tokens",
    [
        [5], [0, 99], [], [99, 3, 0], [100], [-1], [3, 100], [1] * SHORT_TOKEN_LIST, [1] * SHORT_TOKEN_LIST + [100],
        [True], [1, 2.0], [[1]], [1, None], [2**63], [2**64], [-1, 2**63],
    ],
)
def test_a_short_list_of_ids_is_checked_as_its_array_is(tokens):
    """Python's check of a short list of ints and numpy's of any other sequence agree: what is taken (int32, the
    same ids) and what is refused (bad_request, the same message, the session's length)."""
    kind, got = _outcome(tokens)
    reference_kind, reference = _outcome(tuple(tokens))  # a tuple takes numpy's path whatever it holds
    if tokens in ([2**64], [-1, 2**63]):  # numpy holds these only as objects ("integers" in its message): refused both ways
        assert kind == reference_kind == "refused" and got.startswith("bad_request") and reference.startswith("bad_request")
        return
    assert kind == reference_kind
    if kind == "taken":
        assert got.dtype == np.int32 and reference.dtype == np.int32 and np.array_equal(got, reference)
    else:
        assert got == reference


def test_a_long_list_and_an_array_take_numpys_path():
    ids = list(range(SHORT_TOKEN_LIST + 1))
    assert np.array_equal(token_ids(ids, N_VOCAB, length=0), np.arange(SHORT_TOKEN_LIST + 1, dtype=np.int32))
    with pytest.raises(RequestFailed, match=r"in \[0, 100\)"):
        token_ids(ids[:-1] + [N_VOCAB], N_VOCAB, length=0)
    assert token_ids(np.array([3, 4], np.int64), N_VOCAB, length=0).dtype == np.int32


def test_direct_request_ids_are_odd_distinct_and_within_62_bits():
    """A cancel names a direct append by its request id: never 0, never repeated by one client, within the
    wire's 62 bits; two clients start at random points."""
    first, second = DirectChannels(lambda address: None, OSError), DirectChannels(lambda address: None, OSError)
    drawn = [first._next_request_id() for _ in range(10_000)]
    assert len(set(drawn)) == len(drawn)
    assert all(value % 2 == 1 and 0 < value < 2**62 for value in drawn)
    assert second._next_request_id() not in drawn
    wrapping = DirectChannels(lambda address: None, OSError)
    wrapping._request_ids = iter(range(2**62 - 3, 2**62 + 5, 2))  # the counter passing 2^62 wraps to small odd ids
    assert [wrapping._next_request_id() for _ in range(4)] == [2**62 - 3, 2**62 - 1, 1, 3]
    assert REQUEST_ID_MASK == 2**62 - 1
