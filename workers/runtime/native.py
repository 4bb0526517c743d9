"""The native pieces a worker needs beside llama-cpp-python: ggml entry points and the C callbacks.

`capture.c` is compiled when the package is built or installed (setup.py) into a library beside this
file, loaded with ctypes: a daemon needs neither a compiler nor a writable home. Only a source checkout
that was never built falls back to compiling it on first use, once per source version, into the user's
cache directory (an atomic rename makes concurrent first starts of several workers safe). After editing
capture.c in a checkout, rebuild it with `pip install -e .`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import llama_cpp

CAPTURE_SOURCE = pathlib.Path(__file__).with_name("capture.c")
BUILT_LIBRARY_STEM = "_capture"  # setup.py builds capture.c under this name, beside this file
TARGET_NAME_BYTES = 64


class NativeBuildError(RuntimeError):
    """The C callback shim could not be compiled or loaded."""


class CaptureState(ctypes.Structure):
    """Mirror of `struct kvp_capture` in capture.c (checked against the C sizeof at load)."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("target", ctypes.c_char * TARGET_NAME_BYTES),
        ("stop_after", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("dst", ctypes.c_void_p),
        ("dst_capacity", ctypes.c_size_t),
        ("captured_bytes", ctypes.c_size_t),
        ("captures", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class NativeLibrary:
    """Addresses of the callbacks and ggml functions; one per process, created by load_native()."""

    shim: ctypes.CDLL
    eval_callback: ctypes.c_void_p
    abort_callback: ctypes.c_void_p
    log_callback: int
    ggml_get_name: int
    ggml_nbytes: int
    ggml_backend_tensor_get: int

    def set_log_verbose(self, verbose: bool) -> None:
        """Route llama.cpp's log through the shim: everything when verbose, else errors only."""
        self.shim.kvp_set_log_threshold(1 if verbose else 4)
        llama_cpp.llama_log_set(llama_cpp.llama_log_callback(self.log_callback), ctypes.c_void_p(0))

    def new_capture_state(self, target: str, *, stop_after: bool) -> CaptureState:
        encoded = target.encode()
        if len(encoded) >= TARGET_NAME_BYTES:
            raise ValueError(f"tensor name too long: {target!r}")
        return CaptureState(
            get_name=self.ggml_get_name,
            nbytes=self.ggml_nbytes,
            tensor_get=self.ggml_backend_tensor_get,
            target=encoded,
            stop_after=int(stop_after),
        )


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "kvpool" / "native"


def _compile_shim() -> pathlib.Path:
    source = CAPTURE_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / f"kvpool-capture-{digest}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError("no C compiler found (cc or gcc): kvpool's capture callback needs one")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".partial-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", partial, str(CAPTURE_SOURCE)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeBuildError(f"compiling {CAPTURE_SOURCE.name} failed: {result.stderr.strip()}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _built_library() -> pathlib.Path | None:
    """The library the package build compiled beside this file, or None in a checkout never built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = CAPTURE_SOURCE.with_name(BUILT_LIBRARY_STEM + suffix)
        if candidate.is_file():
            return candidate
    return None


def _capture_library() -> pathlib.Path:
    built = _built_library()
    if built is not None:
        return built
    try:
        return _compile_shim()
    except (NativeBuildError, OSError) as error:
        raise NativeBuildError(
            f"kvpool's capture library was not built with this copy of kvpool (no {BUILT_LIBRARY_STEM}.*.so in "
            f"{CAPTURE_SOURCE.parent}) and compiling {CAPTURE_SOURCE.name} on first use failed: {error}. "
            "Install kvpool with pip (`pip install .`, or `pip install -e .` in a checkout): it compiles the "
            "library once, at install time"
        ) from error


def _ggml_base() -> ctypes.CDLL:
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        candidate = lib_dir / name
        if candidate.exists():
            return ctypes.CDLL(str(candidate))
    raise NativeBuildError(f"libggml-base not found beside libllama in {lib_dir}")


def load_native() -> NativeLibrary:
    shim = ctypes.CDLL(str(_capture_library()))
    shim.kvp_capture_struct_size.restype = ctypes.c_size_t
    if shim.kvp_capture_struct_size() != ctypes.sizeof(CaptureState):
        raise NativeBuildError("CaptureState does not match struct kvp_capture in capture.c")
    ggml = _ggml_base()

    def address(function: object) -> int:
        value = ctypes.cast(function, ctypes.c_void_p).value
        assert value is not None
        return value

    return NativeLibrary(
        shim=shim,
        eval_callback=ctypes.c_void_p(address(shim.kvp_eval_callback)),
        abort_callback=ctypes.c_void_p(address(shim.kvp_abort_callback)),
        log_callback=address(shim.kvp_log_callback),
        ggml_get_name=address(ggml.ggml_get_name),
        ggml_nbytes=address(ggml.ggml_nbytes),
        ggml_backend_tensor_get=address(ggml.ggml_backend_tensor_get),
    )
