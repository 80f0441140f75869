"""Source fingerprints of the hooks a user wrote, so replay can tell which ones were edited."""

from __future__ import annotations

import hashlib
import inspect
import textwrap

#: Packages whose classes are framework code, not the user's: their methods are not fingerprinted.
FRAMEWORK_PACKAGES = ("lightning", "pytorch_lightning", "torch", "composer", "builtins")


def _is_framework(cls: type) -> bool:
    return cls is object or cls.__module__.split(".")[0] in FRAMEWORK_PACKAGES


def function_fingerprint(func) -> str:
    """A short hash of a function's source (of its bytecode when no source is available)."""
    func = inspect.unwrap(func)
    try:
        text = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        code = getattr(func, "__code__", None)
        text = repr((code.co_code, code.co_consts)) if code is not None else repr(func)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hook_fingerprints(obj: object) -> dict[str, str]:
    """``{method name: fingerprint}`` for every method defined by the user's classes of ``obj``.

    Walks the MRO and keeps the first definition of each name, skipping framework base classes,
    so an override of ``training_step`` is fingerprinted and Lightning's default is not.
    """
    prints: dict[str, str] = {}
    for cls in type(obj).__mro__:
        if _is_framework(cls):
            continue
        for name, member in vars(cls).items():
            if name in prints or (name.startswith("__") and name != "__init__"):
                continue
            func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if inspect.isfunction(func):
                prints[name] = function_fingerprint(func)
    return dict(sorted(prints.items()))
