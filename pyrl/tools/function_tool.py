"""Plain Python functions as tools (verl 0.9.1's `verl.tools.function_tool`).

A stateless tool needs no BaseTool subclass: decorate a typed function with a Google-style docstring with
`@function_tool` and name its file in the rollout's `multi_turn.function_tool_path`; the OpenAI schema is
inferred from the signature and docstring (transformers' get_json_schema), the function lands in
FUNCTION_TOOL_REGISTRY, and the agent loop calls it with the model's arguments (sync functions in a thread)
and turns what it returns into (ToolResponse, reward, metrics) with normalize_function_tool_return.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from pyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from pyrl.usercode import load_file

logger = logging.getLogger(__name__)

FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}
# a file loaded twice (the dataset and every agent-loop worker load it) registers its tools once
_LOADED_FUNCTION_TOOL_PATHS: dict[str, list[FunctionTool]] = {}


@dataclass
class FunctionTool:
    """A registered function: what the agent loop needs of a tool (name, tool_schema) and how to call it."""

    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        """Calls the function with the model's arguments as keywords. A sync function runs in a daemon thread of
        its own, so that it stalls neither the other trajectories' event loop nor, when it hangs past the agent
        loop's deadline (a thread cannot be killed), a shared pool that later calls would wait on."""
        if self.is_async:
            return await self.fn(**parameters)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result=None, error=None):
            if not done.done():  # the caller may have given up (timed out) already
                done.set_exception(error) if error is not None else done.set_result(result)

        def run():
            try:
                outcome = (self.fn(**parameters), None)
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting caller
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:  # the loop is gone (abandoned by a deadline): nobody waits for this answer
                pass

        threading.Thread(target=run, name=f"tool-{self.name}", daemon=True).start()
        return await done


def function_tool(name: str | Callable | None = None, *, schema: OpenAIFunctionToolSchema | dict | None = None):
    """Registers a function as a tool; returns the function unchanged.

    `@function_tool` names the tool after the function, `@function_tool("other_name")` renames it. The schema
    is inferred from the type hints and the docstring (a summary and an `Args:` entry per parameter; transformers
    raises at decoration time when one is missing) unless `schema` (an OpenAIFunctionToolSchema or its dict)
    is given. Registering a different function under a taken name raises ValueError.
    """

    def make_decorator(tool_name_override: str | None):
        def decorator(fn: Callable):
            tool_name = tool_name_override or fn.__name__
            if isinstance(schema, OpenAIFunctionToolSchema):
                built_schema = schema
            elif isinstance(schema, dict):
                built_schema = OpenAIFunctionToolSchema.model_validate(schema)
            else:
                built_schema = _build_schema_from_fn(fn, tool_name)
            existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"function tool '{tool_name}' is already registered to "
                                 f"{existing.fn.__module__}.{existing.fn.__qualname__}; refusing to overwrite it "
                                 f"with {fn.__module__}.{fn.__qualname__}")
            FUNCTION_TOOL_REGISTRY[tool_name] = FunctionTool(name=tool_name, fn=fn, tool_schema=built_schema,
                                                             is_async=inspect.iscoroutinefunction(fn))
            return fn

        return decorator

    if callable(name) and schema is None:  # bare @function_tool: `name` is the decorated function
        return make_decorator(None)(name)
    return make_decorator(name)


def get_function_tool(name: str) -> FunctionTool:
    """The registered function tool `name`; KeyError when absent."""
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(f"function tool '{name}' is not registered (registered: {sorted(FUNCTION_TOOL_REGISTRY)}); "
                       f"name its file in the rollout's multi_turn.function_tool_path")
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Runs the Python file at `path` (once per process) and returns the function tools it registered."""
    abs_path = os.path.abspath(path)
    if abs_path in _LOADED_FUNCTION_TOOL_PATHS:
        return _LOADED_FUNCTION_TOOL_PATHS[abs_path]
    before = set(FUNCTION_TOOL_REGISTRY)
    load_file(path, "function_tool_path")  # the file's @function_tool decorators register its tools

    new_names = sorted(set(FUNCTION_TOOL_REGISTRY) - before)
    if not new_names:
        logger.warning("function_tool_path %s registered no tools; is @function_tool applied?", path)
    tools = [FUNCTION_TOOL_REGISTRY[name] for name in new_names]
    _LOADED_FUNCTION_TOOL_PATHS[abs_path] = tools
    return tools


def _build_schema_from_fn(fn: Callable, tool_name: str) -> OpenAIFunctionToolSchema:
    """The OpenAI schema of `fn` from its signature and Google-style docstring (transformers' get_json_schema)."""
    variadic = [name for name, p in inspect.signature(fn).parameters.items()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool '{tool_name}' ({fn.__module__}.{fn.__qualname__}): variadic parameter(s) "
                         f"{variadic} cannot be expressed in an OpenAI tool schema; expected named parameters")
    from transformers.utils import get_json_schema  # lazy: importing pyrl.tools should not load transformers

    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return OpenAIFunctionToolSchema.model_validate(raw)


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function tool's return value as (ToolResponse, reward, metrics).

    ToolResponse as is; str as its text; dict as its JSON; a tuple (response,), (response, reward) or
    (response, reward, metrics) with the response coerced the same way (a None reward is 0.0, None metrics
    {}); anything else as str(ret). Tuples of another length raise TypeError: they are authoring bugs, not
    answers to show the model.
    """
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"@function_tool return tuple: expected length 1, 2 or 3 ((response,), (response, "
                            f"reward) or (response, reward, metrics)), got length {len(ret)}: {ret!r}")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _coerce_response(ret[0]), reward, metrics
    return _coerce_response(ret), 0.0, {}


def _coerce_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))
