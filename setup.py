"""The one build step pyproject.toml cannot declare: compiling workers' capture.c (metadata lives there).

capture.c is not a CPython extension module: it defines no PyInit function and links against nothing (the
ggml functions it calls are passed in as pointers), and workers' native.py loads it with ctypes. It is
declared as an Extension all the same so that build_ext compiles it in every build: a wheel, `pip install .`
and `pip install -e .` (where it lands in place, beside its source). On POSIX build_ext neither needs nor
checks a PyInit symbol.
"""

import pathlib

from setuptools import Extension, setup


def capture_library() -> Extension:
    """capture.c, wherever it sits under workers/, built beside itself as `_capture<EXT_SUFFIX>`:
    the name native.py looks for next to its own file."""
    (source,) = pathlib.Path("workers").rglob("capture.c")
    module = ".".join(source.with_name("_capture").parts)
    return Extension(module, [source.as_posix()], extra_compile_args=["-O2"])


setup(ext_modules=[capture_library()])
