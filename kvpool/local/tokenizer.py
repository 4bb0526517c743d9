"""Text <-> token ids with the vocabulary of a GGUF, loaded vocab-only (no weights)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from typing import TextIO

import llama_cpp

from workers.runtime.native import load_native


class Tokenizer:
    """Owns a vocab-only llama model; close() is idempotent."""

    def __init__(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        load_native().set_log_verbose(verbose)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(os.fsencode(path), params)
        if not model:
            raise ValueError(f"llama.cpp could not load the vocabulary of {path}")
        self._model: llama_cpp.llama_model_p | None = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode()
        capacity = len(data) + 16
        tokens = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if count < 0:
            capacity = -count
            tokens = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(self._vocab, data, len(data), tokens, capacity, add_special, parse_special)
        return list(tokens[:count])

    def piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        count = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        if count < 0:
            buffer = ctypes.create_string_buffer(-count)
            count = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:count]

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(token) for token in tokens).decode("utf-8", errors="replace")

    def stream(self, tokens: Iterable[int], out: TextIO) -> list[int]:
        """Write the text of `tokens` to `out` as they come (stopping at end of generation); return them."""
        generated: list[int] = []
        pending = b""
        for token in tokens:
            generated.append(token)
            if self.is_end_of_generation(token):
                break
            pending += self.piece(token)
            try:
                out.write(pending.decode())
            except UnicodeDecodeError:
                continue  # a multi-byte character split across tokens
            pending = b""
            out.flush()
        out.write(pending.decode(errors="replace") + "\n")
        out.flush()
        return generated

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def chat_prompt(self, user_message: str) -> str:
        """The model's own chat template applied to one user message, or the message itself."""
        assert self._model is not None
        template = llama_cpp.llama_model_chat_template(self._model, None)
        if not template:
            return user_message
        message = llama_cpp.llama_chat_message(role=b"user", content=user_message.encode())
        chat = (llama_cpp.llama_chat_message * 1)(message)
        size = len(user_message) * 2 + 256
        buffer = ctypes.create_string_buffer(size)
        written = llama_cpp.llama_chat_apply_template(template, chat, 1, True, buffer, size)
        if written > size:
            buffer = ctypes.create_string_buffer(written)
            written = llama_cpp.llama_chat_apply_template(template, chat, 1, True, buffer, written)
        if written < 0:
            return user_message
        return buffer.raw[:written].decode()

    def close(self) -> None:
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
