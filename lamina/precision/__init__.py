"""Mixed precision: policies (param, compute, output dtypes) per module, and loss scaling."""

from .loss_scale import DynamicLossScale as DynamicLossScale
from .loss_scale import all_finite as all_finite
from .policy import Policy as Policy
from .policy import with_policy as with_policy
