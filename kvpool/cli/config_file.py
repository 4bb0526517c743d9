"""`--config FILE.toml`: a command's flags read from a TOML file; a flag given on the command line wins.

The file's keys are the flags' long names without the leading dashes, spelled as on the command line
(`n-ctx`, `max-sessions`, `no-direct`), at the top level of the file. A value has the TOML type the flag's
argument has: an integer for an integer flag, an integer or a float for seconds, a string for byte sizes
("1GiB"), paths and choices, a boolean for a switch (`flash-attn = true`; `no-direct = true`). A relative
path is taken relative to the file's directory. An unknown key, a wrong type or a choice not offered is a
ConfigFileError (a ValueError) whose one-line message names the file and the key.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import tomllib

# Flags that make no sense in a file: an inherited descriptor, the file itself.
NOT_IN_FILES = frozenset({"help", "config", "lifeline_fd"})

# TOML value types, as an error names them
_TYPE_NAMES = (
    (bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (list, "an array"),
    (dict, "a table"), (datetime.datetime, "a date-time"), (datetime.date, "a date"), (datetime.time, "a time"),
)


class ConfigFileError(ValueError):
    pass


def file_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key -> the flag's action, for every long flag of `parser` a file may set."""
    keys = {}
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list of its actions
        names = [name for name in action.option_strings if name.startswith("--")]
        if names and action.dest not in NOT_IN_FILES:
            if action.nargs != 0 and action.type not in (None, int, float, pathlib.Path):
                raise TypeError(f"{names[0]}: no TOML type for arguments of type {action.type!r}")
            keys[names[0][2:]] = action
    return keys


def read_table(path: pathlib.Path) -> dict[str, object]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigFileError(f"{path}: cannot read: {error.strerror or error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"{path}: not TOML: {error}") from error


def file_values(path: pathlib.Path, keys: dict[str, argparse.Action]) -> dict[str, object]:
    """Destination -> value, as the command line's parser would have produced it, for every key of the file."""
    values = {}
    for key, value in read_table(path).items():
        action = keys.get(key)
        if action is None:
            raise ConfigFileError(f"{path}: unknown key {key!r}{_spelling_hint(key, keys)}")
        try:
            values[action.dest] = converted(value, action, base=path.parent)
        except ConfigFileError as error:
            raise ConfigFileError(f"{path}: {key} {error}") from None
    return values


def with_file(args: argparse.Namespace, path: pathlib.Path, keys: dict[str, argparse.Action]) -> argparse.Namespace:
    """`args` with every flag the command line left unset (None) taken from the file."""
    merged = argparse.Namespace(**vars(args))
    for dest, value in file_values(path, keys).items():
        if getattr(merged, dest, None) is None:
            setattr(merged, dest, value)
    return merged


def converted(value: object, action: argparse.Action, *, base: pathlib.Path) -> object:
    """The file's value as the flag's parsed argument; ConfigFileError (the rest of a sentence) if it is not one."""
    if action.nargs == 0:  # a switch: true means the flag is given
        return action.const if _expect(value, bool, "a boolean") else not action.const
    if action.type is int:
        parsed: object = _expect(value, int, "an integer")
    elif action.type is float:
        parsed = float(_expect(value, (int, float), "a number"))
    elif action.type is pathlib.Path:
        given = pathlib.Path(_expect(value, str, "a string (a path)"))
        parsed = given if given.is_absolute() else base / given
    else:
        parsed = _expect(value, str, "a string")
    if action.choices is not None and parsed not in action.choices:
        raise ConfigFileError(f"must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return parsed


def _expect(value: object, kinds: type | tuple[type, ...], wanted: str):
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ConfigFileError(f"must be {wanted}, not a boolean ({str(value).lower()})")
    if not isinstance(value, kinds):
        raise ConfigFileError(f"must be {wanted}, not {type_name(value)} ({value!r})")
    return value


def type_name(value: object) -> str:
    return next((name for kind, name in _TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def _spelling_hint(key: str, keys: dict[str, argparse.Action]) -> str:
    dashed = key.replace("_", "-").removeprefix("--")
    if dashed != key and dashed in keys:
        return f" (keys are spelled as the flags, without their dashes: {dashed!r})"
    return " (keys are the command's flags without their dashes: see --help)"
