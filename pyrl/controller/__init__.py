"""pyrl.controller: the single controller. The driver runs the algorithm and calls methods on groups
of Ray workers; @register says how each call's data is split across ranks and gathered back.

    pool = ResourcePool(processes_per_node=[2])
    actors = WorkerGroup(pool, MyWorker)
    out = actors.compute(batch)      # a @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO) method
"""

from pyrl.controller.decorator import Dispatch, Execute, register, register_dispatch_mode
from pyrl.controller.worker import Worker
from pyrl.controller.worker_group import ResourcePool, WorkerError, WorkerGroup, init_ray

__all__ = ["Dispatch", "Execute", "ResourcePool", "Worker", "WorkerError", "WorkerGroup", "init_ray", "register",
           "register_dispatch_mode"]
