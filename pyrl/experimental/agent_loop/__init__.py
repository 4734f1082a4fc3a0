"""verl 0.9.1's agent loops under pyrl: the contract users write their loops against, and pyrl's own
single_turn_agent and tool_agent, registered as users' are (see agent_loop.py)."""

from pyrl.experimental.agent_loop.agent_loop import (
                                                     AgentLoopBase,
                                                     AgentLoopMetrics,
                                                     AgentLoopOutput,
                                                     AgentLoopRunner,
                                                     register,
)
from pyrl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from pyrl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "AgentLoopRunner", "SingleTurnAgentLoop",
           "ToolAgentLoop", "register"]
