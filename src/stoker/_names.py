"""Suggestions for a misspelled name (``did you mean``), for the option groups and the Loader.

The nearest names come from :func:`difflib.get_close_matches` (Ratcliff/Obershelp similarity,
the same suggestion Python's own ``NameError`` and argparse make).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice nearest ``name`` (similarity >= 0.6), else ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def suggest_fields(cls: type) -> type:
    """Class decorator for a dataclass: a keyword that is not one of its fields raises TypeError
    ``"<Class>() got an unexpected keyword argument 'x' (did you mean 'y'?)"`` (Python's own
    message, with the nearest field), before the dataclass's ``__init__`` runs. Returns ``cls``."""
    init = vars(cls)["__init__"]  # the dataclass's own
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for k in kwargs:
            if k not in names:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {k!r}{did_you_mean(k, names)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
