"""pyrl.tools.schemas and pyrl.tools.function_tool against verl 0.9.1's behaviour: the schema inferred from a
typed, Google-docstring function, the decorator and registry, loading a function_tool_path file, and how a
function's return value becomes (ToolResponse, reward, metrics)."""

import asyncio
from typing import Literal, Optional

import pytest
from pydantic import ValidationError

from pyrl.tools import function_tool as ft
from pyrl.tools.function_tool import FunctionTool, function_tool, get_function_tool, normalize_function_tool_return
from pyrl.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolSchema,
    ToolResponse,
)


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch):
    """Each test registers into its own empty registry (the module's globals are looked up at call time)."""
    monkeypatch.setattr(ft, "FUNCTION_TOOL_REGISTRY", {})
    monkeypatch.setattr(ft, "_LOADED_FUNCTION_TOOL_PATHS", {})


def get_weather(city: str, days: int, unit: Literal["celsius", "fahrenheit"] = "celsius",
                detail: Optional[float] = None, window: int | float = 1) -> str:
    """Get the weather forecast for a city.

    Args:
        city: The city's name.
        days: How many days ahead.
        unit: The temperature unit.
        detail: How detailed, from 0 to 1.
        window: Hours per forecast step.
    """
    return f"{city}: sunny for {days} days ({unit})"


WEATHER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "days": {"type": "integer", "description": "How many days ahead."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit."},
                "detail": {"type": "number", "description": "How detailed, from 0 to 1."},
                "window": {"type": ["integer", "number"], "description": "Hours per forecast step."},
            },
            "required": ["city", "days"],
        },
    },
}


def test_schema_from_type_hints_and_docstring_equals_the_hand_written_one():
    function_tool(get_weather)
    tool = get_function_tool("get_weather")
    assert tool.tool_schema == OpenAIFunctionToolSchema.model_validate(WEATHER_SCHEMA)
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == WEATHER_SCHEMA
    assert tool.name == "get_weather" and tool.fn is get_weather and not tool.is_async


def test_decorator_forms_rename_and_explicit_schema():
    @function_tool("forecast")
    def weather(city: str) -> str:
        """Forecast.

        Args:
            city: The city.
        """
        return city

    @function_tool(schema=WEATHER_SCHEMA)
    def anything(**kwargs):  # an explicit schema skips inference, so even **kwargs is accepted
        return kwargs

    assert get_function_tool("forecast").tool_schema.function.name == "forecast"
    assert get_function_tool("anything").tool_schema.function.name == "get_weather"  # the schema as given
    assert weather("Paris") == "Paris"  # the decorator returns the function itself


def test_registry_refuses_a_second_function_under_a_taken_name_and_unknown_names():
    function_tool(get_weather)
    function_tool(get_weather)  # the same function again is fine (a module imported twice)

    def get_weather_2(city: str) -> str:
        """Other.

        Args:
            city: The city.
        """
        return city

    with pytest.raises(ValueError, match="already registered"):
        function_tool("get_weather")(get_weather_2)
    with pytest.raises(KeyError, match="not registered"):
        get_function_tool("nope")


def test_variadic_and_undocumented_functions_are_refused():
    def search(query: str, *args) -> str:
        """Search.

        Args:
            query: The query.
        """
        return query

    with pytest.raises(ValueError, match="variadic"):
        function_tool(search)

    def no_doc(x: int) -> int:
        return x

    with pytest.raises(Exception, match="docstring"):
        function_tool(no_doc)


def test_call_runs_sync_functions_in_a_thread_and_awaits_async_ones():
    @function_tool
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: First.
            b: Second.
        """
        return a + b

    @function_tool
    async def sub(a: int, b: int) -> int:
        """Subtract.

        Args:
            a: First.
            b: Second.
        """
        return a - b

    assert get_function_tool("sub").is_async
    assert asyncio.run(get_function_tool("add").call({"a": 2, "b": 3})) == 5
    assert asyncio.run(get_function_tool("sub").call({"a": 2, "b": 3})) == -1


def test_normalize_function_tool_return():
    response = ToolResponse(text="x")
    assert normalize_function_tool_return(response) == (response, 0.0, {})
    assert normalize_function_tool_return("hi") == (ToolResponse(text="hi"), 0.0, {})
    assert normalize_function_tool_return({"a": "é"}) == (ToolResponse(text='{"a": "é"}'), 0.0, {})
    assert normalize_function_tool_return(42) == (ToolResponse(text="42"), 0.0, {})
    assert normalize_function_tool_return(None) == (ToolResponse(text="None"), 0.0, {})
    assert normalize_function_tool_return(("ok",)) == (ToolResponse(text="ok"), 0.0, {})
    assert normalize_function_tool_return(("ok", 0)) == (ToolResponse(text="ok"), 0.0, {})
    assert normalize_function_tool_return(("ok", None, None)) == (ToolResponse(text="ok"), 0.0, {})
    assert normalize_function_tool_return(({"v": 1}, 0.5, {"n": 2})) == (ToolResponse(text='{"v": 1}'), 0.5, {"n": 2})
    for bad in [(), ("a", 1.0, {}, "extra")]:
        with pytest.raises(TypeError, match="length"):
            normalize_function_tool_return(bad)


def test_load_function_tools_from_path(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text('''
from pyrl.tools.function_tool import function_tool


@function_tool
def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: The text.
    """
    return len(text.split())


@function_tool("shout")
async def upper(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()
''')
    tools = ft.load_function_tools_from_path(str(path))
    assert [t.name for t in tools] == ["shout", "word_count"]
    assert all(isinstance(t, FunctionTool) for t in tools)
    assert asyncio.run(tools[1].call({"text": "a b c"})) == 3
    assert ft.load_function_tools_from_path(str(path)) is tools  # a second load does not run the file again
    with pytest.raises(FileNotFoundError, match="function_tool_path"):
        ft.load_function_tools_from_path(str(tmp_path / "missing.py"))


def test_parsed_arguments_decode_or_flag_an_error():
    good, error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name="f", arguments='{"x": [1, 2]}'))
    assert (good.name, good.arguments, error) == ("f", {"x": [1, 2]}, False)
    for raw in ['{"x": 1', "[1, 2]", '"text"', ""]:
        call, error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
            OpenAIFunctionParsedSchema(name="f", arguments=raw))
        assert call.arguments == {} and error, raw


def test_tool_response():
    assert ToolResponse().is_empty() and not ToolResponse(text="a").is_empty()
    assert ToolResponse(text="a").is_text_only() and not ToolResponse(text="a", image=[object()]).is_text_only()
    with pytest.raises(ValidationError, match="expected a list"):
        ToolResponse(image=object())
