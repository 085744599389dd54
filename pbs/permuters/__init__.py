"""Registered permuters; importing this package registers the built-in ones.

Every module of the package is imported (a new permuter file registers itself with no line here);
the names below are the public classes.
"""

import importlib as _importlib
import pkgutil as _pkgutil


from pbs.permuters.avg_query import AvgQueryPermuter
from pbs.permuters.greedy import GreedyPermuter
from pbs.permuters.identity import IdentityPermuter
from pbs.permuters.key_aware_query import KeyAwareQueryPermuter
from pbs.permuters.last_block import LastBlockPermuter
from pbs.permuters.none import NoPermuter
from pbs.permuters.random import RandomPermuter
from pbs.permuters.random_query import RandomQueryPermuter

__all__ = [
    "AvgQueryPermuter",
    "GreedyPermuter",
    "IdentityPermuter",
    "KeyAwareQueryPermuter",
    "LastBlockPermuter",
    "NoPermuter",
    "RandomPermuter",
    "RandomQueryPermuter",
]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
