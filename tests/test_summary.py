import jax.numpy as jnp

import lamina as lm


class Net(lm.Module):
    def __init__(self):
        super().__init__()
        self.encoder = lm.Dense(784, 256)
        self.decoder = self.encoder  # tied: counted once
        self.blocks = [lm.Dense(256, 256, dtype=jnp.bfloat16), lm.Dense(256, 10)]
        self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)


def test_counts_bytes_and_totals():
    s = lm.summary(Net())
    assert s.num_params == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert s.totals["counters"] == (1, 4)
    params_bytes = (784 * 256 + 256 + 256 * 10 + 10) * 4 + (256 * 256 + 256) * 2
    assert s.totals["params"] == (s.num_params, params_bytes)
    assert [row.module_path for row in s.rows] == [
        "encoder",
        "encoder",
        "blocks/0",
        "blocks/0",
        "blocks/1",
        "blocks/1",
        "<root>",
    ]
    assert s.rows[2].dtype == "bfloat16" and s.rows[2].shape == (256, 256)
    assert s.modules[0] == ("<root>", "Net") and len(s.modules) == 4


def test_table_text():
    text = str(lm.summary(Net()))
    lines = text.splitlines()
    assert lines[0] == "Net: 4 modules, 7 variables"
    assert any(line.startswith("encoder   Dense  kernel") for line in lines)
    assert "count (counters)" in text
    assert lines[-2] == "params: 269,322 (923.5 KB)"
    assert lines[-1] == "counters: 1 (4 B)"
    assert repr(lm.summary(Net())) == text


def test_model_without_variables():
    class Empty(lm.Module):
        pass

    s = lm.summary(Empty())
    assert s.num_params == 0 and str(s).endswith("no variables")
