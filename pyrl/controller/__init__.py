"""pyrl.controller: the single controller. The driver runs the algorithm and calls methods on groups
of Ray workers; @register says how each call's data is split across ranks and gathered back.

    pool = ResourcePool(processes_per_node=[2])
    actors = WorkerGroup(pool, MyWorker)
    out = actors.compute(batch)      # a @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO) method
"""

from pyrl.controller.decorator import Dispatch, Execute, register, register_dispatch_mode
from pyrl.controller.worker import Worker

_NEED_RAY = ("ResourcePool", "WorkerError", "WorkerGroup", "init_ray")


def __getattr__(name):
    # the groups need Ray; a worker class alone does not, so a worker runs in a process without Ray installed
    # (a single-process reference, a GPU machine with torch only)
    if name in _NEED_RAY:
        from pyrl.controller import worker_group  # lazy: ray is loaded only when a group is asked for

        return getattr(worker_group, name)
    raise AttributeError(f"module 'pyrl.controller' has no attribute {name!r}")


__all__ = ["Dispatch", "Execute", "ResourcePool", "Worker", "WorkerError", "WorkerGroup", "init_ray", "register",
           "register_dispatch_mode"]
