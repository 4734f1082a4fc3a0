"""verl 0.9.1's rollout tracing decorator (verl.utils.rollout_trace), under its path. pyrl has no trace backend
(weave, mlflow): `actor_rollout_ref.rollout.trace.backend` is refused at start, and the decorator calls the agent
loop's method as verl's does when no backend is configured."""

from __future__ import annotations

import functools


def rollout_trace_op(func):
    @functools.wraps(func)
    async def call(self, *args, **kwargs):
        return await func(self, *args, **kwargs)

    return call
