"""Debugging gradients: custom gradient rules and numerical gradient checking.

A room beside the core. `grad_rule.py` writes a gradient together with its forward pass
(`grad_rule`, on `jax.custom_vjp`; it reads nothing of lamina's). `gradcheck.py` checks a
transformed model's autodiff gradients against finite differences, variable by variable
(`check_gradients`): it reads the variables dict through the core's layout functions,
`gradcheck_problem.py` builds the function it differentiates and `finite_differences.py`
compares the derivatives. It imports only the core.
"""

from .grad_rule import grad_rule as grad_rule
from .gradcheck import check_gradients as check_gradients
