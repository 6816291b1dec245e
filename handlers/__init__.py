"""TorchServe-style handlers: the contract (`base_handler`) and the built-in `llm` handler."""

from pagedserve.handlers.base_handler import BaseHandler, Context, HandlerError
from pagedserve.handlers.llm_handler import LLMHandler, handle_batch

# Handlers shipped with pagedserve, by the name an archive's manifest gives.
BUILTIN_HANDLERS: dict[str, type[BaseHandler]] = {"llm": LLMHandler}

__all__ = ["BUILTIN_HANDLERS", "BaseHandler", "Context", "HandlerError", "LLMHandler", "handle_batch"]
