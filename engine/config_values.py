"""How a setting's value is read: sizes with units, loader values coerced to their field's kind,
checks that name the field, and the sources (TOML files, ``KVTIER_*`` variables).

``engine/config.py`` declares the settings and their rules; this module knows nothing of which
settings exist (the caller passes their names and kinds). Pure and synchronous; safe on any thread.
Every error is a ``ValueError`` naming the field (or the variable / file it came from) and the value.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, FrozenSet, Iterator, Mapping, Optional, Sequence, Tuple, Union

logger = logging.getLogger("kvtier.engine")

__all__ = ["FieldKinds", "parse_size", "coerce", "read_toml", "env_settings", "naming_variables", "ENV",
           "require_int", "require_bool", "require_float", "require_seconds", "require_fraction", "require_choice"]

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30


@dataclass(frozen=True)
class FieldKinds:
    """Which fields hold which kind of value, for ``coerce``; ``optional`` ones accept ``none``."""

    sizes: FrozenSet[str]
    ints: FrozenSet[str]
    floats: FrozenSet[str]
    bools: FrozenSet[str]
    optional: FrozenSet[str]


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

# Binary units are what memory and slabs are sized in; decimal ones are accepted because disk
# vendors and `df -H` speak them, and silently reading "64MB" as MiB would be a 5% surprise.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": _KiB,
    "kib": _KiB,
    "m": _MiB,
    "mib": _MiB,
    "g": _GiB,
    "gib": _GiB,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: Union[str, int], name: str = "size") -> int:
    """Bytes from an int or a string: ``"4096"``, ``"256MiB"``, ``"1.5GiB"``, ``"64 MB"``.

    Binary suffixes (``KiB``/``MiB``/``GiB``/``TiB``, or bare ``K``/``M``/``G``/``T``) are powers of
    1024; ``kB``/``MB``/``GB``/``TB`` are powers of 1000. Case-insensitive. The result must be a whole,
    non-negative number of bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{name} must be an int or a size string like '256MiB', got {text!r}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"{name} must be a size like 268435456, '256MiB', '1GiB' or '64MB', got {text!r}"
        )
    number = Fraction(match.group(1).replace("_", "").rstrip(".") or "0")
    total = number * _SIZE_UNITS[unit]
    if total.denominator != 1:
        raise ValueError(f"{name} must be a whole number of bytes, got {text!r} = {float(total)}")
    return int(total)


def coerce(name: str, value: Any, source: Optional[str], kinds: "FieldKinds") -> Any:
    """Turn a loader's value (often a string) into the field's type (``kinds`` says which);
    validation comes later."""
    if source is None:
        label = name
    elif source.startswith(ENV):
        label = f"{name} (from {source[len(ENV):]}{name.upper()})"
    else:
        label = f"{name} (from {source})"
    if value is None:
        return None
    if name in kinds.optional and isinstance(value, str) and value.strip().lower() in ("", "none"):
        # One meaning in every loader and for every optional setting: unset. (A directory really
        # named "none" is spelled "./none".)
        return None
    if name in kinds.sizes:
        return parse_size(value, label)
    if name in kinds.ints:
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                raise ValueError(f"{label} must be an int, got {value!r}") from None
        return value
    if name in kinds.floats:
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise ValueError(f"{label} must be a number, got {value!r}") from None
        return value
    if name in kinds.bools:
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
            raise ValueError(
                f"{label} must be a bool (true/false, 1/0, yes/no, on/off), got {value!r}"
            )
        return value
    return value


# -- field checks (ValueError naming field and value) --------------------------------------------


def require_int(name: str, value: object, minimum: Optional[int]) -> None:
    # bool is an int subclass; `True` bytes is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def require_float(name: str, value: object) -> float:
    if not isinstance(value, float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return value


def require_seconds(name: str, value: object) -> None:
    seconds = require_float(name, value)
    if not (0.0 < seconds < math.inf):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")


def require_fraction(name: str, value: object, upper_open: bool = False) -> None:
    fraction = require_float(name, value)
    if upper_open:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    elif not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def require_choice(name: str, value: object, choices: Tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


# -- sources -------------------------------------------------------------------------------------


ENV = "env:"  # source tag of settings read from the environment: "env:" + the variable prefix


@contextlib.contextmanager
def naming_variables(settings: Mapping[str, Any], prefix: str) -> Iterator[None]:
    """A validation error about a setting that came from the environment names its variable:
    ``host_capacity_bytes must be positive, got 0 (from KVTIER_HOST_CAPACITY_BYTES)``."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        for name in sorted(settings, key=len, reverse=True):
            if message.startswith(name + " ") or message.startswith(name + "="):
                raise ValueError(f"{message} (from {prefix}{name.upper()})") from None
        raise


# Variables with the prefix that are not settings but are read elsewhere (the fault tests' seed).
_OTHER_VARIABLES = frozenset({"FAULT_SEED"})
_warned_variables: set = set()


def env_settings(field_names: Sequence[str], known: Sequence[str], environ: Optional[Mapping[str, str]],
                 prefix: str) -> Dict[str, str]:
    """The ``{prefix}{NAME}`` variables of ``field_names`` in ``environ`` (``os.environ`` if
    ``None``), by field name; the other prefixed variables not in ``known`` are warned about."""
    env = os.environ if environ is None else environ
    found: Dict[str, str] = {}
    for name in field_names:
        key = prefix + name.upper()
        if key in env:
            found[name] = env[key]
    _warn_unknown_variables(env, prefix, known)
    return found


def _warn_unknown_variables(env: Mapping[str, str], prefix: str, names: Sequence[str]) -> None:
    """A typo such as ``KVTIER_CACHEDIR`` would otherwise leave the setting at its default without
    a word: log it once per process, naming the nearest setting's variable."""
    known = [prefix + name.upper() for name in names]
    for key in env:
        if not key.startswith(prefix) or key in known or key[len(prefix):] in _OTHER_VARIABLES:
            continue
        if key in _warned_variables:
            continue
        _warned_variables.add(key)
        nearest = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {nearest[0]}?" if nearest else f"the settings are {prefix}<FIELD_NAME>, e.g. {known[0]}"
        logger.warning("environment variable %s is not a kvtier setting and is ignored; %s", key, hint)


def read_toml(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - only on 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ValueError(
                f"cannot read {os.fspath(path)!r}: TOML needs Python >= 3.11 (tomllib) or the "
                "'tomli' package on Python 3.10"
            ) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{os.fspath(path)!r} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # tomllib decodes first: a binary file fails here
        raise ValueError(f"{os.fspath(path)!r} is not valid TOML: not UTF-8 text ({exc.reason})") from None
    except IsADirectoryError:
        raise ValueError(f"{os.fspath(path)!r} is not valid TOML: it is a directory") from None
