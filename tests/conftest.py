"""Test configuration: JAX's strict modes, so sloppy dtype and rank handling fails early."""

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile("lamina", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("lamina")


@pytest.fixture
def getkey():
    """Returns a function that hands out fresh keys, one per call."""
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fast_compile: compile with XLA's backend optimisations off (tests/conftest.py)",
    )


@pytest.fixture(autouse=True)
def compile_mode(request):
    """XLA's backend optimisations off (``jax_disable_most_optimizations``) for the tests
    marked ``fast_compile`` (a module: ``pytestmark = pytest.mark.fast_compile``), on for
    the others.

    For modules whose time goes into compiling many small programs (every new shape of an
    eager op, of a ``jax.random`` draw, of a model): LLVM's optimisation passes are most of a
    CPU compile (a third to a half of such a module's time), and a test's tiny arrays do not
    need fast code. The programs compute the same operations (the float rounding may differ
    in the last bits, as between two XLA versions); assertions are unchanged. JAX's caches
    do not key compiled programs by this flag, so they are cleared when it changes: a test
    never runs a program compiled in the other mode (docstring outputs print the last bits).
    """
    fast = request.node.get_closest_marker("fast_compile") is not None
    if jax.config.values["jax_disable_most_optimizations"] != fast:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", fast)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``build(name) -> (folder, torch_model)``: tiny random HF checkpoints (tests/hf_models.py)."""
    pytest.importorskip("transformers")
    from tests.hf_models import hf_folder

    root = tmp_path_factory.mktemp("hf")
    return lambda name: hf_folder(name, root)


@pytest.fixture(scope="session")
def hf_model(hf_checkpoint):
    """``load(name) -> (model, variables, torch_model)``: lamina's reading of a tiny checkpoint
    with its transformers reference, shared by every test of the process (do not change
    them)."""
    from tests.hf_models import hf_loaded

    return lambda name: hf_loaded(name, hf_checkpoint)
