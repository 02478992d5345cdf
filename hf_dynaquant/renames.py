"""Names changed by issue 17 (one name per concept), still accepted for one more release.

The quantization knobs (a :class:`~hf_dynaquant.QuantConfig`) are ``config`` everywhere (was
``quant=``, ``base=``), the configuration cube (a :class:`~hf_dynaquant.SearchSpace`) is
``search_space`` (was ``space=``), the batches quality is measured on are ``eval_data`` (was
``data=``), and the pruning criterion is ``prune_by`` (was ``metric``, a name kept for quality
metrics only). An old name still works, with a :class:`FutureWarning` that says the new one; giving
both is an :class:`~hf_dynaquant.errors.InvalidSettingError`. Everything goes through
:func:`take_renamed`, so every renamed argument, dictionary key and CLI flag behaves alike.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

from .errors import InvalidSettingError

__all__ = ["take_renamed", "renamed_keywords", "renamed_attribute"]

T = TypeVar("T")


def _keyword(name: str) -> str:
    return f"{name}="


def take_renamed(
    given: MutableMapping[str, Any],
    renames: Mapping[str, str],
    where: str,
    *,
    spell: Callable[[str], str] = _keyword,
    stacklevel: int = 3,
) -> None:
    """Move the value of every old name in ``given`` (keyword arguments, an options dict, parsed
    CLI flags) to its new name (``renames``: old -> new), with a :class:`FutureWarning` saying the
    new name; both given is an :class:`InvalidSettingError`. ``where`` names the function or
    command in the messages, ``spell`` how a name is written there (``config=``, ``--prune-by``)."""
    for old, new in renames.items():
        if old not in given:
            continue
        if new in given:
            raise InvalidSettingError(
                f"{where}: {spell(new)} and {spell(old)} (its old name) were both given; pass {spell(new)} only"
            )
        warnings.warn(
            f"{where}: {spell(old)} is deprecated and will be removed in the next release; use {spell(new)}",
            FutureWarning,
            stacklevel=stacklevel,
        )
        given[new] = given.pop(old)


def renamed_keywords(**renames: str) -> Callable[[T], T]:
    """Decorator of a function or a class (its ``__init__``, e.g. a dataclass's) whose keyword
    arguments were renamed (``old="new"``): the old keywords still work, see :func:`take_renamed`."""

    def decorate(target: T) -> T:
        func: Callable[..., Any] = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]
        where = target.__qualname__

        @functools.wraps(func)
        def accepting_old_names(*args: Any, **kwargs: Any) -> Any:
            take_renamed(kwargs, renames, where)
            return func(*args, **kwargs)

        if isinstance(target, type):
            target.__init__ = accepting_old_names  # type: ignore[misc]
            return target
        return accepting_old_names  # type: ignore[return-value]

    return decorate


def renamed_attribute(old: str, new: str) -> property:
    """A read-only class attribute ``old`` that reads ``new``, with a :class:`FutureWarning`."""

    def read(self: Any) -> Any:
        warnings.warn(
            f"{type(self).__name__}.{old} is deprecated and will be removed in the next release; use .{new}",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return property(read, doc=f"Deprecated name of ``{new}``.")
