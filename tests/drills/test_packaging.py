"""kvpool as a user installs it: a wheel built from this checkout, installed into a fresh virtualenv, run
from outside the checkout on a host with no C compiler on PATH and a home nothing can be written to.

The fresh venv gets the wheel only (--no-deps); a .pth file makes this environment's site-packages visible
to it for the dependencies (llama-cpp-python, numpy, ...). Python does not process .pth files found in a
directory that a .pth line added, so this environment's editable kvpool stays out: `kvpool` and `workers`
resolve to the wheel's copies, which the tests check.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

import pytest

import workers.runtime.native as native
from kvpool.shard.header import read_shard_info
from tests.support.daemons import run_to_completion

REPO = pathlib.Path(__file__).resolve().parents[2]
# Hang guards only: building the wheel and the fresh venv takes seconds, `kvpool shard` a few more.
COMMAND_HANG_GUARD_S = 600
pytestmark = pytest.mark.timeout(4 * COMMAND_HANG_GUARD_S)

# Not part of a source tree: what a build or an editable install left in the checkout is not copied,
# so the wheel is built from the sources alone (a stale build/ would otherwise leak into it).
TOP_LEVEL_LEFTOVERS = {".git", ".venv", "build", "dist", "evidence", ".kvpool", ".pytest_cache", ".hypothesis"}
LEFTOVERS_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "*.gguf")
# What the installed copy reports about itself: where kvpool and workers come from and which library loaded.
WHERE_FROM = """
import json, kvpool, workers.runtime.native as native
library = native.load_native()
print(json.dumps({"kvpool": kvpool.__file__, "native": native.__file__, "library": library.shim._name}))
"""


@dataclass(frozen=True, slots=True)
class FreshInstall:
    python: pathlib.Path
    kvpool: pathlib.Path
    site_packages: pathlib.Path
    unwritable_home: pathlib.Path
    env: dict[str, str]  # no compiler on PATH, an unwritable home and cache, nothing of the checkout
    cwd: pathlib.Path  # outside the checkout

    def run(self, *command: str | pathlib.Path) -> subprocess.CompletedProcess:
        return run_to_completion([str(part) for part in command], timeout_s=COMMAND_HANG_GUARD_S, env=self.env, cwd=self.cwd)


def _checked(command: list[str | pathlib.Path], **kwargs) -> subprocess.CompletedProcess:
    result = run_to_completion([str(part) for part in command], timeout_s=COMMAND_HANG_GUARD_S, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result


def _copy_sources(destination: pathlib.Path) -> pathlib.Path:
    def leftovers(directory: str, names: list[str]) -> set[str]:
        top = TOP_LEVEL_LEFTOVERS if pathlib.Path(directory) == REPO else set()
        return top | set(LEFTOVERS_ANYWHERE(directory, names))

    shutil.copytree(REPO, destination, ignore=leftovers)
    return destination


def _build_wheel(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """With this environment's setuptools (no build isolation, so no download)."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _checked([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out, source])
    (wheel,) = out.glob("kvpool-*.whl")
    return wheel


def _site_packages(python: pathlib.Path) -> pathlib.Path:
    printed = _checked([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout
    return pathlib.Path(printed.strip())


def _unwritable_directory(root: pathlib.Path) -> pathlib.Path:
    """A path below a regular file: nothing can be created there, not even by root (whom modes don't stop)."""
    blocker = root / "not-a-directory"
    blocker.write_text("")
    return blocker / "home"


def _stripped_environment(root: pathlib.Path, home: pathlib.Path) -> dict[str, str]:
    empty_path = root / "path-without-compilers"
    empty_path.mkdir()
    dropped = {"PYTHONPATH", "PYTHONHOME", "CC", "VIRTUAL_ENV"}
    env = {name: value for name, value in os.environ.items() if name not in dropped}
    return env | {
        "PATH": str(empty_path),
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PYTHONNOUSERSITE": "1",
        "KVPOOL_WORK_DIR": str(root / "work"),
    }


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> FreshInstall:
    root = tmp_path_factory.mktemp("packaging")
    wheel = _build_wheel(_copy_sources(root / "source"), root / "dist")
    venv = root / "venv"
    _checked([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    _checked([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "--no-deps", "--no-index", wheel])
    site_packages = _site_packages(python)
    dependencies = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    (site_packages / "kvpool-test-dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    home = _unwritable_directory(root)
    cwd = root / "elsewhere"
    cwd.mkdir()
    return FreshInstall(python, venv / "bin" / "kvpool", site_packages, home, _stripped_environment(root, home), cwd)


def test_the_host_has_no_compiler_and_no_writable_home(fresh_install):
    path = fresh_install.env["PATH"]
    assert [shutil.which(name, path=path) for name in ("cc", "gcc", "clang")] == [None, None, None]
    with pytest.raises(OSError):
        pathlib.Path(fresh_install.env["XDG_CACHE_HOME"]).mkdir(parents=True)


def test_the_installed_copy_loads_its_built_capture_library(fresh_install):
    result = fresh_install.run(fresh_install.python, "-c", WHERE_FROM)
    assert result.returncode == 0, result.stderr
    where = {name: pathlib.Path(value).resolve() for name, value in json.loads(result.stdout).items()}
    site_packages = fresh_install.site_packages.resolve()
    assert where["kvpool"] == site_packages / "kvpool" / "__init__.py"
    assert where["native"].is_relative_to(site_packages / "workers")
    assert where["library"].parent == where["native"].parent
    assert where["library"].name.startswith(native.BUILT_LIBRARY_STEM + ".")


def test_kvpool_help_lists_every_command(fresh_install):
    result = fresh_install.run(fresh_install.kvpool, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "shard", "generate", "demo", "status", "bench", "stress"):
        assert command in result.stdout


def test_kvpool_shard_writes_the_shard(fresh_install, model_path, tmp_path):
    out = tmp_path / "first.gguf"
    result = fresh_install.run(fresh_install.kvpool, "shard", model_path, "--layers", "0:10", "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\t")[0] == str(out)
    info = read_shard_info(out)
    assert (info.layers.start, info.layers.stop) == (0, 10)


@pytest.fixture
def unbuilt_checkout(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """native.py as in a source checkout never built: capture.c beside it, no library."""
    source = tmp_path / "workers" / "capture.c"
    source.parent.mkdir()
    shutil.copyfile(native.CAPTURE_SOURCE, source)
    monkeypatch.setattr(native, "CAPTURE_SOURCE", source)
    monkeypatch.delenv("CC", raising=False)
    return source


def test_an_unbuilt_checkout_compiles_the_library_on_first_use(unbuilt_checkout, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    library = pathlib.Path(native.load_native().shim._name)
    assert library.parent == tmp_path / "cache" / "kvpool" / "native"


@pytest.mark.parametrize("missing", ["compiler", "writable cache"])
def test_an_unbuilt_checkout_that_cannot_compile_says_how_to_build(unbuilt_checkout, tmp_path, monkeypatch, missing):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if missing == "compiler":
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(_unwritable_directory(tmp_path)))
    with pytest.raises(native.NativeBuildError, match=r"was not built.*pip install -e \.") as raised:
        native.load_native()
    assert str(unbuilt_checkout.parent) in str(raised.value)
