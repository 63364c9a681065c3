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


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``build(name) -> (folder, torch_model)``: tiny random HF checkpoints (tests/hf_models.py)."""
    pytest.importorskip("transformers")
    from tests.hf_models import hf_folder

    root = tmp_path_factory.mktemp("hf")
    return lambda name: hf_folder(name, root)
