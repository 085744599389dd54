"""Registered selectors; importing this package registers the built-in ones.

Every module of the package is imported (a new selector file registers itself with no line here);
the names below are the public classes.
"""

import importlib as _importlib
import pkgutil as _pkgutil


from pbs.selectors.antidiagonal import AntidiagonalSelector
from pbs.selectors.budget import BudgetSelector
from pbs.selectors.head_choice import HeadChoiceSelector
from pbs.selectors.mean_pool import MeanPoolSelector
from pbs.selectors.oracle import OracleSelector
from pbs.selectors.pooled_query import PooledQuerySelector
from pbs.selectors.sampled_rows import SampledRowsSelector
from pbs.selectors.union import UnionSelector
from pbs.selectors.vertical_slash import VerticalSlashSelector

__all__ = ["AntidiagonalSelector", "BudgetSelector", "HeadChoiceSelector", "MeanPoolSelector", "OracleSelector", "PooledQuerySelector",
           "SampledRowsSelector", "UnionSelector",
           "VerticalSlashSelector"]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
