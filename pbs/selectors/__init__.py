"""Registered selectors; importing this package registers the built-in ones."""

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
