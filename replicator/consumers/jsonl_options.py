"""The options of a ``jsonl`` consumer (``consumers[]`` entries of type
``jsonl``): checked into the keyword arguments of a
:class:`.jsonl.JsonlConsumer`, a mistake one :class:`ConfigError` naming
the key; and the consumer built from them.
"""

import os
import re
from collections.abc import Mapping
from typing import Any

from ..config import (
    ConfigError,
    ConsumerConfig,
    get_bool,
    get_int,
    get_number,
    get_path,
    get_str,
    no_unknown,
)
from . import jsonl_files
from .base import STARTS, Consumer
from .jsonl import JsonlConsumer, JsonlError

_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _rotate_size(options: Mapping[str, Any], where: str) -> int | None:
    """``rotate_size``: bytes, as an integer or ``"100M"`` (K, M, G: powers
    of 1024); at least 1 KiB."""
    value = options.get("rotate_size")
    if value is None:
        return None
    m = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif m is not None:
        size = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    else:
        raise ConfigError(f"{where}.rotate_size",
                          f"{value!r} is not a size (bytes, or e.g. \"100M\", \"1G\")")
    if not 1024 <= size <= 1 << 50:
        raise ConfigError(f"{where}.rotate_size", f"must be from 1K to 1P bytes, got {size}")
    return size


def _rotate_age(options: Mapping[str, Any], where: str) -> float | None:
    """``rotate_age``: seconds, as a number or ``"12h"`` (s, m, h, d); at
    least one second."""
    value = options.get("rotate_age")
    if value is None:
        return None
    m = _AGE.fullmatch(value.strip()) if isinstance(value, str) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        age = float(value)
    elif m is not None:
        age = float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]
    else:
        raise ConfigError(f"{where}.rotate_age",
                          f"{value!r} is not an age (seconds, or e.g. \"12h\", \"7d\")")
    if not 1 <= age <= 366 * 86400 * 10:
        raise ConfigError(f"{where}.rotate_age", f"must be from 1 second to 10 years, "
                                                 f"got {value!r}")
    return age


def options_of(config: ConsumerConfig, base_dir: str, where: str) -> dict[str, Any]:
    """The keyword arguments of a :class:`JsonlConsumer` from its config
    (options ``path``, relative to ``base_dir``; ``fsync``;
    ``flush_interval``; ``rotate_size``, ``rotate_age``, ``rotate_keep``,
    ``rotate_names``), the path included; a mistake is a ConfigError naming
    the key.  Pure: ``replicator check`` runs it without opening anything."""
    options = config.options
    no_unknown(options, ("path", "fsync", "flush_interval", "rotate_size", "rotate_age",
                         "rotate_keep", "rotate_names", "start"), where)
    path = get_path(options, "path", where)
    rotate_names = get_str(options, "rotate_names", where, "number")
    if rotate_names not in jsonl_files.NAMES:
        raise ConfigError(f"{where}.rotate_names", f"{rotate_names!r} is not one of "
                                                   f"{', '.join(jsonl_files.NAMES)}")
    return dict(
        path=os.path.join(base_dir, path),  # an absolute path stays as it is
        fsync=get_bool(options, "fsync", where, True),
        flush_interval=get_number(options, "flush_interval", where, 0.05, minimum=0,
                                  maximum=60),
        rotate_size=_rotate_size(options, where),
        rotate_age=_rotate_age(options, where),
        rotate_keep=get_int(options, "rotate_keep", where, 7, minimum=1, maximum=100000),
        rotate_names=rotate_names,
        start=start_of(options, where))


def start_of(options: Mapping[str, Any], where: str) -> str:
    """A built-in consumer's ``start`` option (default ``beginning``)."""
    start: str = get_str(options, "start", where, "beginning")
    if start not in STARTS:
        raise ConfigError(f"{where}.start", f"{start!r} is not one of {', '.join(STARTS)}")
    return start


def build(config: ConsumerConfig, base_dir: str, where: str, reactor: Any) -> Consumer:
    """A :class:`JsonlConsumer` from its config (:func:`options_of`)."""
    kwargs = options_of(config, base_dir, where)
    path = kwargs.pop("path")
    try:
        return JsonlConsumer(path, reactor, streams=config.streams, **kwargs)
    except JsonlError as e:
        raise ConfigError(f"{where}.path", str(e)) from None
    except OSError as e:
        raise ConfigError(f"{where}.path",
                          f"cannot open {e.filename or path}: {e.strerror or e}") from None
