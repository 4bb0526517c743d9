"""A sequence's saved state restores exactly into a fresh context (the warm tier's primitive)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from kvpool.state.shared import SEALS
from tests.conftest import EVEN_SPLIT
from workers.runtime.errors import BadInput, RestoreFailed
from workers.runtime.model import ShardModel

N_CTX = 128


def _rows(model: ShardModel, prompt: list[int]):
    """What each shard takes: the prompt's token ids on a first shard, fixed hidden states elsewhere."""
    if model.shape.is_first:
        return {"tokens": np.asarray(prompt, np.int32)}
    rng = np.random.default_rng(len(prompt))
    return {"hidden": (rng.standard_normal((len(prompt), model.shape.n_embd)) * 0.5).astype(np.float32)}


def _next(model: ShardModel, context, start: int, token: int) -> np.ndarray:
    return context.append(start, **_rows(model, [token]))


@pytest.fixture(scope="module", params=["whole", "middle", "last"])
def model(request, model_path, shard_sets):
    path = {"whole": model_path, "middle": shard_sets[EVEN_SPLIT][1].path, "last": shard_sets[EVEN_SPLIT][2].path}[request.param]
    with ShardModel(path) as loaded:
        yield loaded


def test_a_restored_sequence_continues_bit_identically(model, prompt_ids):
    prompt = prompt_ids[0]
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
        expected = _next(model, original, len(prompt), 42)
    with model.new_context(N_CTX) as restored:
        assert restored.restore_state(blob, len(prompt)) == len(prompt)
        assert np.array_equal(_next(model, restored, len(prompt), 42), expected)


def test_a_restore_cut_shorter_equals_a_truncate(model, prompt_ids):
    prompt = prompt_ids[1]
    keep = len(prompt) // 2
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
        original.truncate(keep)
        expected = _next(model, original, keep, 7)
    with model.new_context(N_CTX) as restored:
        assert restored.restore_state(blob, keep) == keep
        assert np.array_equal(_next(model, restored, keep, 7), expected)


def test_refused_states_raise_restore_failed(model, prompt_ids):
    prompt = prompt_ids[0]
    with model.new_context(N_CTX) as original:
        original.append(0, **_rows(model, prompt))
        blob = original.save_state()
    for broken in (blob[: len(blob) // 2], b"\x00" * 16):
        with model.new_context(N_CTX) as target, pytest.raises(RestoreFailed):
            target.restore_state(broken, len(prompt))
    with model.new_context(N_CTX) as target, pytest.raises(RestoreFailed):
        target.restore_state(blob, len(prompt) + 1)  # more positions than the state holds
    with model.new_context(N_CTX) as busy:
        busy.append(0, **_rows(model, prompt))
        with pytest.raises(BadInput):
            busy.restore_state(blob, len(prompt))


def test_check_cells_passes_llama_cpps_own_states_and_refuses_any_other_positions(model, prompt_ids):
    """kvpool.state.sequence.check_cells, the rule every restore passes in both modes (issue 26 item 5): a state
    llama.cpp wrote (after a truncate and a re-append too, so its cells need not be in order) holds [0, n)
    once each; shifted, negative, duplicated or missing positions, a length beyond n, or a cell of another
    sequence are StateFormatError."""
    import dataclasses

    from kvpool.state.sequence import StateFormatError, check_cells, parse_state, write_state

    prompt = prompt_ids[1]
    with model.new_context(N_CTX) as context:
        context.append(0, **_rows(model, prompt))
        context.truncate(5)
        context.append(5, **_rows(model, prompt[5:9]))
        blob = context.save_state()
    assert check_cells(blob, 9) == 9 and check_cells(blob, 0) == 9
    with pytest.raises(StateFormatError, match="9 positions, 10 expected"):
        check_cells(blob, 10)
    state = parse_state(blob)
    (stream,) = [stream for stream in state.streams if stream.n_cells]

    def forged(positions=None, seq_ids=None) -> bytes:
        changed = dataclasses.replace(stream, positions=stream.positions if positions is None else positions,
                                      seq_ids=stream.seq_ids if seq_ids is None else seq_ids)
        return write_state(dataclasses.replace(state, streams=tuple(changed if s is stream else s for s in state.streams)))

    positions = stream.positions
    for bad in (positions + 1, np.where(positions == 0, -1, positions), np.where(positions == 1, 0, positions),
                np.where(positions == 8, 9, positions)):
        with pytest.raises(StateFormatError, match="out of place"):
            check_cells(forged(positions=bad.astype(np.int32)), 1)
    with pytest.raises(StateFormatError, match="a cell of sequence"):
        check_cells(forged(seq_ids=((state.seq_id + 1,),) + stream.seq_ids[1:]), 1)
    with pytest.raises(StateFormatError, match="names 2 sequences"):
        check_cells(forged(seq_ids=((state.seq_id, state.seq_id + 1),) + stream.seq_ids[1:]), 1)
    for cut in (len(blob) // 2, len(blob) - 1):
        with pytest.raises(StateFormatError):
            check_cells(blob[:cut], 1)
    with pytest.raises(StateFormatError):
        check_cells(blob + b"\0", 1)


def test_a_state_written_into_a_memfd_is_the_saved_bytes_between_its_room(model, prompt_ids):
    """A park's save (workers.runtime.sequence_io.save_sequence_to_memfd): llama.cpp writes into the memfd
    itself, `head` bytes in, `tail` bytes left after; the bytes are save_state's, and the memfd can be sealed
    against writes (no mapping of it is left writable)."""
    prompt = prompt_ids[0]
    with model.new_context(N_CTX) as context:
        context.append(0, **_rows(model, prompt))
        fd, size = context.save_state_to_memfd(13, 4)
        try:
            assert os.fstat(fd).st_size == 13 + size + 4
            data = os.pread(fd, 13 + size + 4, 0)
            assert data[13 : 13 + size] == context.save_state() and data[:13] == bytes(13) and data[-4:] == bytes(4)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # EBUSY if a writable mapping were left
        finally:
            os.close(fd)
