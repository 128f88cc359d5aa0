"""Consumers built from the configuration: a built-in, else an entry point
of the ``replicator.consumers`` group, else a dotted path."""

import importlib
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from twisted.logger import Logger

from ..config import ConfigError, ConsumerConfig
from . import jsonl_options
from . import log as log_consumer
from .base import Consumer

log = Logger(namespace="replicator.consumers")

#: Entry point group third-party consumers register under.
ENTRY_POINT_GROUP = "replicator.consumers"

BUILTINS: dict[str, Callable[[ConsumerConfig, str, str, Any], Consumer]] = {
    "jsonl": jsonl_options.build,
    "log": log_consumer.build,
}
CONSUMER_METHODS = ("positions", "on_facts", "on_position", "close")


def _from_entry_point(name: str, where: str) -> Any:
    """The object entry point ``name`` names, or None if there is none."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        return None
    try:
        return matches[0].load()
    except Exception as e:
        raise ConfigError(f"{where}.type", f"entry point {name!r} ({matches[0].value}) cannot be "
                                           f"loaded: {type(e).__name__}: {e}") from None


def _from_dotted_path(path: str) -> tuple[Any, str | None]:
    """``(object, None)`` for ``package.module:Name`` or ``package.module.Name``;
    ``(None, reason)`` if that cannot be imported."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        return None, "not a dotted path package.module:Class"
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        return None, str(e)
    except Exception as e:
        return None, f"importing {module_name} raised {type(e).__name__}: {e}"
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return None, f"{module_name} has no attribute {attr!r}"
    return obj, None


def _build_external(config: ConsumerConfig, where: str) -> Consumer:
    name = config.type
    factory = _from_entry_point(name, where)
    if factory is None:
        factory, reason = _from_dotted_path(name)
        if factory is None:
            raise ConfigError(f"{where}.type", f"unknown consumer {name!r} (not built in, no "
                                               f"entry point, not importable: {reason})")
    if not callable(factory):
        raise ConfigError(f"{where}.type", f"{name!r} is not a class")
    try:
        # (a duck-typed consumer: the methods are checked below)
        consumer: Consumer = factory(streams=config.streams, **config.options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(where, f"cannot create {name}: {e}") from None
    except Exception as e:
        raise ConfigError(where, f"cannot create {name}: {type(e).__name__}: {e}") from None
    missing = [m for m in CONSUMER_METHODS if not callable(getattr(consumer, m, None))]
    if missing:
        raise ConfigError(f"{where}.type",
                          f"{name!r} made a {type(consumer).__name__}, which is not a consumer "
                          f"(no {', '.join(missing)})")
    if getattr(consumer, "streams", None) is None and (
            config.streams is not None or not hasattr(consumer, "streams")):
        consumer.streams = config.streams  # the reader filters by this attribute
    return consumer


def build_consumer(config: ConsumerConfig, base_dir: str, reactor: Any, where: str) -> Consumer:
    """One consumer from its config (see :func:`load_consumers`); a mistake
    is a ConfigError naming ``where`` or a key below it."""
    builtin = BUILTINS.get(config.type)
    if builtin is not None:
        return builtin(config, base_dir, where, reactor)
    return _build_external(config, where)


def check_consumers(configs: Sequence[ConsumerConfig], key: str = "consumers") -> None:
    """The options of the built-in consumers checked as :func:`load_consumers`
    checks them, without opening or creating anything (``replicator check``:
    the running daemon holds the files); ConfigError naming the key."""
    for i, config in enumerate(configs):
        where = f"{key}[{i}]"
        if config.type == "jsonl":
            jsonl_options.options_of(config, ".", where)
        elif config.type == "log":
            log_consumer.options_of(config, where)


def load_consumers(configs: Sequence[ConsumerConfig], base_dir: str, reactor: Any,
                   key: str = "consumers") -> list[Consumer]:
    """Consumers from their configs, in order.

    ``type`` is a built-in (``jsonl``: options ``path`` (relative to
    ``base_dir``), ``fsync``, ``flush_interval``, ``rotate_size``,
    ``rotate_age``, ``rotate_keep``, ``rotate_names``; ``log``: option
    ``level``),
    else an entry point of the ``replicator.consumers`` group, else a dotted
    path ``package.module:Class``; such a class is called with ``streams=``
    and the options as keyword arguments.  Every mistake is a ConfigError
    naming ``<key>[i]`` or a key below it; consumers already built are closed
    then.
    """
    built: list[Consumer] = []
    try:
        for i, config in enumerate(configs):
            built.append(build_consumer(config, base_dir, reactor, f"{key}[{i}]"))
    except BaseException:
        for consumer in built:
            try:
                consumer.close()
            except Exception:
                log.failure("closing consumer {c} failed", c=consumer)
        raise
    return built
