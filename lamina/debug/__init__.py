"""Debugging gradients: custom gradient rules and numerical gradient checking."""

from .grad_rule import grad_rule as grad_rule
from .gradcheck import check_gradients as check_gradients
