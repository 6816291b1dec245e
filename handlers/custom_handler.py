"""Custom handlers: a handler class shipped as Python code inside an archive.

The server runs one only when the operator allows custom handlers (the archive is refused
otherwise, see pagedserve.engine.model.archive_manifest.resolve_handler). The manifest's `handler` names
the file and optionally the class: `my_handler.py`, `my_handler`, `my_handler:MyHandler`.
Without a class name the module must define exactly one concrete `BaseHandler` subclass.

On the server a custom handler wraps the engine workers for `/predictions`: its `preprocess`
turns each raw request (`{"body": bytes, "headers": {...}}`) into a `ParsedBody` (or a
`HandlerError`), the server generates with its workers, and its `postprocess` turns each
finished `RequestOutput` into the JSON reply. Subclassing `handlers.LLMHandler` and overriding
one of the two is the usual way. TorchServe's function entry point (`handle(data, context)`)
cannot wrap the workers and is refused with a clear message.

The module is imported with the archive's folder on sys.path, so files shipped next to it
(`--extra-files`) can be imported at its top level.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path

from pagedserve.handlers.base_handler import BaseHandler


class CustomHandlerError(ValueError):
    """A custom handler that cannot be loaded; the message says why."""


def load_custom_handler(path: Path, handler_spec: str) -> BaseHandler:
    """Import the handler file at `path` and instantiate the handler class `handler_spec` names."""
    _, _, entry = handler_spec.partition(":")
    module = _import(path)
    if entry:
        found = getattr(module, entry, None)
        if found is None:
            raise CustomHandlerError(f"handler {handler_spec!r}: {path.name} defines no {entry!r}")
    else:
        found = _only_handler_class(module, path)
    if not (inspect.isclass(found) and issubclass(found, BaseHandler)):
        raise CustomHandlerError(
            f"handler {handler_spec!r} is not a handler class: the server runs classes derived "
            "from handlers.BaseHandler (usually handlers.LLMHandler), whose preprocess and "
            "postprocess wrap its engine workers; a function entry point such as TorchServe's "
            "handle(data, context) is not supported"
        )
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise CustomHandlerError(
            f"handler {handler_spec!r}: {found.__name__} leaves {missing} "
            "abstract; subclass handlers.LLMHandler to inherit them"
        )
    try:
        return found()
    except Exception as exc:  # their code: refuse the archive and say why
        raise CustomHandlerError(
            f"handler {handler_spec!r}: {found.__name__}() failed: {type(exc).__name__}: {exc}"
        ) from exc


def _import(path: Path):
    # One module name per file path: two archives' my_handler.py never share a module.
    name = "pagedserve_custom_handler_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CustomHandlerError(f"cannot import the handler file {path.name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up there
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # their code: refuse the archive and say why
        sys.modules.pop(name, None)
        raise CustomHandlerError(f"the handler file {path.name} failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(folder)
    return module


def _only_handler_class(module, path: Path) -> type:
    classes = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, BaseHandler)
        and obj.__module__ == module.__name__
        and not inspect.isabstract(obj)
    ]
    if len(classes) == 1:
        return classes[0]
    if not classes:
        raise CustomHandlerError(
            f"{path.name} defines no handler class (a subclass of handlers.LLMHandler or "
            "handlers.BaseHandler); a function entry point such as TorchServe's "
            "handle(data, context) is not supported by the server"
        )
    names = ", ".join(sorted(c.__name__ for c in classes))
    raise CustomHandlerError(
        f"{path.name} defines several handler classes ({names}); name one "
        f"in the manifest, e.g. {path.stem}:{classes[0].__name__}"
    )
