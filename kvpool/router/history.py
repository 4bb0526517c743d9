"""What a routed session holds on its daemons: its token ids and the partition that built them (the row
count of each append, in order). A replay repeats the partition, because on a CPU build a one-row append
and the same row inside a longer prefill do not give the same bits."""

from __future__ import annotations


class AppendHistory:
    """The token ids and the partition; sum(partition) == len(tokens) always."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._appends: list[int] = []

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def partition(self) -> tuple[int, ...]:
        return tuple(self._appends)

    def token_slice(self, start: int, rows: int) -> list[int]:
        return self._tokens[start : start + rows]

    def record(self, tokens: list[int]) -> None:
        """One append got through every daemon."""
        self._tokens.extend(tokens)
        self._appends.append(len(tokens))

    def replay_partition(self, exact: bool) -> list[int]:
        """The appends a replay sends from position 0: the partition (exact), or one prefill of every token."""
        if not exact:
            return [self.length] if self._tokens else []
        return list(self._appends)

    def replay_partition_from(self, length: int, exact: bool) -> list[int] | None:
        """The appends a tail replay sends from position `length` on, or None when `length` falls inside an
        append (an exact replay then has to start over from 0)."""
        if not 0 <= length <= self.length:
            return None
        if not exact:
            return [self.length - length] if length < self.length else []
        kept = 0
        for index, rows in enumerate(self._appends):
            if kept == length:
                return list(self._appends[index:])
            kept += rows
        return [] if kept == length else None

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): the append that `length` cuts keeps its first rows."""
        del self._tokens[length:]
        kept, appends = 0, []
        for rows in self._appends:
            if kept + rows > length:
                rows = length - kept
            if rows == 0:
                break
            appends.append(rows)
            kept += rows
        self._appends = appends

    def clear(self) -> None:
        self._tokens.clear()
        self._appends.clear()
