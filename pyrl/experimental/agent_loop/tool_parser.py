"""verl 0.9.1's `verl.experimental.agent_loop.tool_parser` module path, for pyrl's parsers
(pyrl/workers/rollout/tool_parser.py)."""

from pyrl.workers.rollout.tool_parser import FunctionCall, ToolParser

__all__ = ["FunctionCall", "ToolParser"]
