"""The dispatch layer: which backend runs a call, which planners plan for it, and how selectors
made of selectors are composed on the GPU.

* `pbs.backends.registry`: the backend and planner registries, and `resolve_backend`, the one
  place a backend is chosen (at plan time; the `Plan` records it and `pbs.run` obeys);
* `pbs.backends.eligibility`: one reasons function per kernel, used by every caller;
* `pbs.backends.builtin`: the ``hopper``, ``triton``, ``reference`` and ``flex`` backends;
* `pbs.backends.planners` and `pbs.backends.composition`: the ``triton`` planners of the
  permuters and selectors that have GPU kernels;
* `pbs.backends.ragged_planners`: the ``ragged`` planners of padded batches (the capturable
  varlen path), per sequence with the lengths on the device;
* `pbs.backends.probe`: the dense policy's density probe and gated dense kernel.

It sits above the components (`pbs.permuters`, `pbs.selectors`) and the kernels, below planning.
"""

from pbs.backends import builtin, composition, planners, ragged_planners  # noqa: F401 - registration
from pbs.backends.eligibility import planning_family
from pbs.backends.registry import (
    AttentionBackend,
    AttentionCall,
    CallSpec,
    check_backend_name,
    get_backend,
    list_backends,
    planner_for,
    register_backend,
    register_planner,
    resolve_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionCall",
    "CallSpec",
    "check_backend_name",
    "get_backend",
    "list_backends",
    "planner_for",
    "planning_family",
    "register_backend",
    "register_planner",
    "resolve_backend",
]
