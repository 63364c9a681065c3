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


def test_example_inputs_add_calls_and_flops():
    import pickle

    model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    plain = lm.summary(model)
    assert plain.calls == [] and plain.flops is None and plain.grad_flops is None
    s = lm.summary(model, jnp.ones((3, 4)), backward=True)
    assert [row.name for row in s.rows] == [row.name for row in plain.rows]
    assert s.totals == plain.totals
    first = 2 * 3 * 4 * 8 + 3 * 8  # x @ kernel, + bias
    # backward: two more products (dx, dkernel), and dbias sums 3 rows into 8 (16 adds)
    first_grad = first + 2 * (2 * 3 * 4 * 8) + 2 * 8
    assert s.calls[1] == lm.model_summary.CallRow(
        "layers_0", "Dense", 1, ((3, 8),), first, first_grad
    )
    assert s.flops == sum(row.flops for row in s.calls[1:]) + 3 * 8 == 342  # with the relu
    assert s.grad_flops > sum(row.grad_flops for row in s.calls[1:])
    text = str(s)
    assert text.startswith(str(plain) + "\n\n")  # the variables' table as without inputs
    lines = text.splitlines()
    assert lines[-8].split() == ["module", "type", "calls", "output", "FLOPs", "forward+backward"]
    assert lines[-5].split() == ["layers_0", "Dense", "1", "(3,", "8)", "216", "616"]
    assert lines[-2:] == ["forward FLOPs: 342 (XLA's cost analysis)", "forward+backward FLOPs: 986"]
    again = pickle.loads(pickle.dumps(s))
    assert again.calls == s.calls and str(again) == text


def test_html_is_an_escaped_table():
    import html.parser

    class Cells(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.cells, self.tags = [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)

        def handle_data(self, data):
            self.cells.append(data)

    plain = Cells()
    plain.feed(lm.summary(Net())._repr_html_())
    assert set(plain.tags) <= {"div", "p", "b", "table", "thead", "tbody", "tr", "th", "td"}
    assert {"<root>", "encoder", "blocks/0", "count", "counters", "269,322 (923.5 KB)"} <= {
        cell.split("params: ")[-1] for cell in plain.cells
    }
    model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    text = lm.summary(model, jnp.ones((3, 4)))._repr_html_()
    assert "<td>&lt;root&gt;</td>" in text and "<root>" not in text
    parsed = Cells()
    parsed.feed(text)
    calls = parsed.cells[parsed.cells.index("FLOPs") + 1 :]
    root = ["<root>", "Sequential", "1", "(3, 2)", "342"]
    assert calls[:10] == [*root, "layers_0", "Dense", "1", "(3, 8)", "216"]
    assert "forward FLOPs: 342 (XLA's cost analysis)" in parsed.cells


def test_a_summary_pickled_before_it_had_calls_still_prints():
    # A Summary pickled by a lamina without FLOPs holds no calls, flops or grad_flops: the
    # class's defaults stand in for them.
    import pickle

    model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    new = lm.summary(model)
    old = lm.model_summary.Summary.__new__(lm.model_summary.Summary)
    old.__dict__.update(
        {k: v for k, v in vars(new).items() if k not in ("calls", "flops", "grad_flops")}
    )
    again = pickle.loads(pickle.dumps(old))
    assert "calls" not in vars(again)
    assert str(again) == str(new) and again._repr_html_() == new._repr_html_()
    assert (tuple(again.calls), again.flops, again.grad_flops) == ((), None, None)
