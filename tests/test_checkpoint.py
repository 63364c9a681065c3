"""lm.save / lm.load: safetensors round trips, atomic writes, bad files, model checks, shards."""

import errno
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import lamina as lm
from lamina.io import _load, _save
from lamina.io._format import DTYPES


def random_array(dtype, shape, seed=0):
    """Random bits of `dtype` (NaN payloads and all); bool gets 0/1 bytes only."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    count = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(rng.bytes(count), np.uint8).view(dtype).reshape(shape).copy()


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def stray_files(folder):
    return [name for name in os.listdir(folder) if name.endswith(".lamina-tmp")]


class Net(lm.Module):
    def __init__(self, hidden=8, param_dtype=None):
        super().__init__()
        self.layer1 = lm.Dense(4, hidden, param_dtype=param_dtype)
        self.norm = lm.BatchNorm(hidden)
        self.layer2 = lm.Dense(hidden, 2)

    def __call__(self, x, is_training=False):
        return self.layer2(lm.relu(self.norm(self.layer1(x), is_training)))


@pytest.fixture(scope="module")
def net():
    model = Net()
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32)
    _, trained = apply(variables, None, x, is_training=True)  # batch_stats differ from init's
    return model, apply, trained, x


# -- round trips --------------------------------------------------------------------------


def test_the_dtype_table_is_the_packages():
    for code, dtype in DTYPES.items():
        spec = safetensors.TensorSpec(dtype=dtype.name, shape=[1], data_ptr=0, data_len=0)
        assert spec.dtype == code


JAX_DTYPES = [d for d in DTYPES.values() if d.itemsize < 8]  # 64-bit: see the x64 tests


@pytest.mark.parametrize("dtype", JAX_DTYPES, ids=lambda d: d.name)
def test_round_trip_every_dtype_is_bitwise(tmp_path, dtype):
    values = {
        "params": {
            "matrix": jnp.asarray(random_array(dtype, (3, 5))),
            "scalar": jnp.asarray(random_array(dtype, ())),
            "empty": jnp.zeros((0, 2), dtype),
        }
    }
    lm.save(tmp_path / "a.safetensors", values)
    loaded = lm.load(tmp_path / "a.safetensors")
    assert jax.tree.structure(loaded) == jax.tree.structure(values)
    for got, expected in zip(jax.tree.leaves(loaded), jax.tree.leaves(values), strict=True):
        assert isinstance(got, jax.Array)
        assert same_bits(got, expected), (got, expected)


def test_numpy_arrays_and_scalars_save_as_they_are(tmp_path):
    values = {
        "a": np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian
        "t": np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not C-contiguous
        "b": np.float16(1.5),
    }
    lm.save(tmp_path / "a.safetensors", values)
    loaded = lm.load(tmp_path / "a.safetensors")
    assert loaded["a"].dtype == jnp.int32 and (np.asarray(loaded["a"]) == values["a"]).all()
    assert loaded["t"].shape == (3, 2) and (np.asarray(loaded["t"]) == values["t"]).all()
    assert loaded["b"].shape == () and loaded["b"].dtype == jnp.float16 and loaded["b"] == 1.5


def test_empty_dicts_and_empty_variables_round_trip(tmp_path):
    values = {"params": {"w": jnp.ones(2)}, "batch_stats": {}, "cache": {"layer": {}}}
    lm.save(tmp_path / "a.safetensors", values)
    assert jax.tree.structure(lm.load(tmp_path / "a.safetensors")) == jax.tree.structure(values)
    lm.save(tmp_path / "none.safetensors", {})
    assert lm.load(tmp_path / "none.safetensors") == {}


def test_keys_are_the_plans_paths(tmp_path, net):
    model, _, variables, _ = net
    lm.save(tmp_path / "net.safetensors", variables)
    with safetensors.safe_open(tmp_path / "net.safetensors", "np") as file:
        names = set(file.keys())
    assert names == {entry.name for entry in lm._core.graph.Plan(model).variables}
    assert "params/layer1/kernel" in names and "batch_stats/norm/mean" in names


def test_a_nested_model_round_trips_through_its_plan(tmp_path, net):
    model, apply, variables, x = net
    lm.save(tmp_path / "net.safetensors", variables)
    loaded = lm.load(tmp_path / "net.safetensors", model)
    assert jax.tree.structure(loaded) == lm._core.graph.Plan(model).treedef
    for got, expected in zip(jax.tree.leaves(loaded), jax.tree.leaves(variables), strict=True):
        assert same_bits(got, expected)
    np.testing.assert_array_equal(apply(loaded, None, x)[0], apply(variables, None, x)[0])


def test_stacked_and_bfloat16_variables_check_their_stored_layout(tmp_path):
    model = lm.Stack(lm.Dense(3, 3, param_dtype=jnp.bfloat16, dtype=jnp.float32), 4)
    variables = lm.transform(model).init(jax.random.key(1))
    lm.save(tmp_path / "s.safetensors", variables)
    loaded = lm.load(tmp_path / "s.safetensors", model)
    assert loaded["params"]["block"]["kernel"].shape == (4, 3, 3)
    assert same_bits(loaded["params"]["block"]["kernel"], variables["params"]["block"]["kernel"])


def test_metadata_is_stored_in_the_header(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": jnp.ones(2)}, metadata={"step": "7", "by": "me"})
    with safetensors.safe_open(tmp_path / "a.safetensors", "np") as file:
        stored = file.metadata()
    assert {k: v for k, v in stored.items() if not k.startswith("lamina.")} == {
        "step": "7",
        "by": "me",
    }
    assert set(json.loads(stored["lamina.crc32"])) == {"w"}


# -- the safetensors package, both ways ---------------------------------------------------

PACKAGE_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8, jnp.uint32, jnp.bool_]


def test_the_package_reads_what_lm_save_writes(tmp_path):
    values = {
        f"params/{np.dtype(d).name}": jnp.asarray(random_array(d, (2, 3), i))
        for i, d in enumerate(PACKAGE_DTYPES)
    }
    values["params/complex"] = jnp.asarray(random_array(np.complex64, (4,)))
    nested = {"params": {k.split("/")[1]: v for k, v in values.items()}}
    lm.save(tmp_path / "a.safetensors", nested, metadata={"format": "np"})
    read = safetensors.numpy.load_file(tmp_path / "a.safetensors")
    assert set(read) == set(values)
    for name, value in values.items():
        assert same_bits(read[name], value), name


def test_lm_save_writes_the_same_bytes_as_the_package(tmp_path):
    values = {  # mixed element sizes: the order and alignment of the data must agree too
        f"layer{i}/{np.dtype(d).name}": random_array(d, (i + 1, 3), i)
        for i, d in enumerate(DTYPES.values())
    }
    safetensors.numpy.save_file(values, tmp_path / "package.safetensors")
    nested: dict = {}
    for name, value in values.items():
        layer, leaf = name.split("/")
        nested.setdefault(layer, {})[leaf] = value
    lm.save(tmp_path / "lamina.safetensors", nested)
    ours, theirs = (
        split_file((tmp_path / f"{n}.safetensors").read_bytes()) for n in ("lamina", "package")
    )
    assert ours[1] == theirs[1]  # the same data, in the same order
    checksums = ours[0].pop("__metadata__")  # and the same header, but for lamina's checksums
    assert ours[0] == theirs[0] and set(json.loads(checksums["lamina.crc32"])) == set(values)


def split_file(raw):
    """A safetensors file's header (parsed) and data."""
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def test_lm_load_reads_what_the_package_writes(tmp_path):
    values = {
        f"model.{np.dtype(d).name}.weight": random_array(d, (3, 2), i)
        for i, d in enumerate(PACKAGE_DTYPES)
    }
    values["scalar"] = np.array(2.5, np.float32)
    safetensors.numpy.save_file(values, tmp_path / "b.safetensors")
    loaded = lm.load(tmp_path / "b.safetensors")  # names without "/" are top-level entries
    assert set(loaded) == set(values)
    for name, value in values.items():
        assert same_bits(loaded[name], value), name


def test_lm_load_reads_a_pytorch_state_dict_saved_by_safetensors_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)
    save_file(layer.state_dict(), tmp_path / "torch.safetensors")
    loaded = lm.load(tmp_path / "torch.safetensors")
    assert loaded["weight"].dtype == jnp.bfloat16
    expected = layer.weight.detach().view(torch.int16).numpy()
    assert np.asarray(loaded["weight"]).view(np.int16).tobytes() == expected.tobytes()


# -- bad input never writes ---------------------------------------------------------------


def _deleted():
    array = jnp.ones(3)
    array.delete()
    return array


BAD_INPUTS = {  # name: (variables, what the message says)
    "non-str key": (lambda: {"params": {1: jnp.ones(2)}}, r"key 1 \(int\) in params"),
    "slash": (lambda: {"params": {"a/b": jnp.ones(2)}}, r"key 'a/b' in params"),
    "empty key": (lambda: {"params": {"": jnp.ones(2)}}, r"key '' in params"),
    "set": (lambda: {"params": {"layers": {1.0}}}, r"params/layers: set \{1.0\} is not an array"),
    "float": (lambda: {"params": {"scale": 1.0}}, r"params/scale: float 1.0 is not an array"),
    "abstract": (
        lambda: {"params": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}},
        r"params/w: a ShapeDtypeStruct \(shape \(2,\), float32\) describes an array without "
        r"holding one",
    ),
    "masked": (
        lambda: {"w": np.ma.array([1.0, 2.0], mask=[0, 1], dtype=np.float32)},
        r"w: a NumPy masked array, whose mask the file cannot keep",
    ),
    "complex128": (lambda: {"w": np.ones(2, np.complex128)}, r"w: dtype complex128 .*complex64"),
    "int4": (lambda: {"w": jnp.ones(2, jnp.int4)}, r"w: dtype int4 has no safetensors type"),
    "key array": (lambda: {"rng": jax.random.key(0)}, r"rng: a typed PRNG key.*key_data"),
    "deleted": (lambda: {"w": _deleted()}, r"w: a deleted array"),
    "reserved": (lambda: {"__metadata__": jnp.ones(2)}, r"'__metadata__'.*reserves"),
    "bare array": (lambda: jnp.ones(2), r"must be a pytree of arrays .*got ArrayImpl"),
    "none": (lambda: None, r"must be a pytree of arrays .*got NoneType"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_an_error_and_leaves_the_old_file(tmp_path, name):
    make, match = BAD_INPUTS[name]
    path = tmp_path / "a.safetensors"
    lm.save(path, {"params": {"w": jnp.arange(3.0)}})
    before = path.read_bytes()
    with pytest.raises(lm.VariablesError, match=match):
        lm.save(path, make())
    assert path.read_bytes() == before and stray_files(tmp_path) == []


def test_every_bad_leaf_is_listed_at_once(tmp_path):
    with pytest.raises(lm.VariablesError, match=r"(?s)params/a: float.*params/b: dtype int4"):
        lm.save(tmp_path / "a.safetensors", {"params": {"a": 1.0, "b": jnp.ones(2, jnp.int4)}})
    assert os.listdir(tmp_path) == []


def test_a_traced_array_is_an_error(tmp_path):
    def inside(x):
        lm.save(tmp_path / "a.safetensors", {"w": x})
        return x

    with pytest.raises(lm.VariablesError, match=r"w: a traced value .*jax.jit"):
        jax.jit(inside)(jnp.ones(2))


@pytest.mark.parametrize(
    "metadata, error, match",
    [
        ({"step": 3}, TypeError, r"metadata must map str to str, got 'step': 3"),
        ("step=3", TypeError, r"metadata must be a dict"),
        ({"lamina.mine": "x"}, ValueError, r"'lamina.mine' starts with 'lamina.'"),
    ],
)
def test_bad_metadata_is_an_error(tmp_path, metadata, error, match):
    with pytest.raises(error, match=match):
        lm.save(tmp_path / "a.safetensors", {"w": jnp.ones(2)}, metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_a_header_too_long_for_readers_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_save, "MAX_HEADER_BYTES", 64)  # in truth 100 MB of names and shapes
    with pytest.raises(lm.VariablesError, match=r"header .* 2 arrays.*over the 64"):
        lm.save(tmp_path / "a.safetensors", {"params": {"w": jnp.ones(2), "b": jnp.ones(2)}})
    assert os.listdir(tmp_path) == []


def test_bad_paths_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"folder .*missing does not exist"):
        lm.save(tmp_path / "missing" / "a.safetensors", {"w": jnp.ones(2)})
    with pytest.raises(IsADirectoryError, match=r"is a folder"):
        lm.save(tmp_path, {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike, got int"):
        lm.save(3, {"w": jnp.ones(2)})


# -- atomicity ----------------------------------------------------------------------------

_KILLED_WRITER = r"""
import sys, time
import numpy as np
import lamina as lm
from lamina.io import _load, _save

write, written = _save._write_tensor, []


def write_then_stall(*args):
    write(*args)
    written.append(args)
    if len(written) == 3:  # three of eight tensors are in the temporary file
        print("writing", flush=True)
        time.sleep(120)


_save._write_tensor = write_then_stall
lm.save(sys.argv[1], {"params": {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(8)}})
"""


def test_a_writer_killed_midway_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "model.safetensors"
    old = {"params": {"w": jnp.arange(5.0)}}
    lm.save(path, old)
    before = path.read_bytes()
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        strays = stray_files(tmp_path)
        assert len(strays) == 1 and (tmp_path / strays[0]).stat().st_size > 8 * 2**20
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert path.read_bytes() == before  # the real name never saw a byte of the new file
    assert same_bits(lm.load(path)["params"]["w"], old["params"]["w"])
    lm.save(path, {"params": {"w": jnp.ones(2)}})  # the next save removes the dead one's file
    assert stray_files(tmp_path) == []
    assert lm.load(path)["params"]["w"].shape == (2,)


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    path = tmp_path / "model.safetensors"
    live = tmp_path / ".model.safetensors.0123456789abcdef.lamina-tmp"
    dead = tmp_path / ".model.safetensors.fedcba9876543210.lamina-tmp"
    other_live = tmp_path / ".step_2.safetensors.0123456789abcdef.lamina-tmp"
    other_dead = tmp_path / ".step_1.safetensors.fedcba9876543210.lamina-tmp"
    not_ours = tmp_path / ".notes.txt.swp"
    for stray in (live, dead, other_live, other_dead, not_ours):
        stray.write_bytes(b"partial")
    with open(live, "rb+") as held, open(other_live, "rb+") as other_held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a save in progress holds it
        fcntl.flock(other_held.fileno(), fcntl.LOCK_EX)
        lm.save(path, {"w": jnp.ones(2)})
        assert live.exists() and other_live.exists() and not_ours.exists()
    assert not dead.exists() and not other_dead.exists()  # any save cleans its folder


def test_a_save_removes_the_strays_of_other_checkpoints_in_its_folder(tmp_path):
    path = tmp_path / "step_1.safetensors"
    lm.save(path, {"w": jnp.arange(3.0)})
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert len(stray_files(tmp_path)) == 1
    lm.save(tmp_path / "step_2.safetensors", {"w": jnp.ones(2)})  # another name, same folder
    assert stray_files(tmp_path) == []
    assert lm.load(path)["w"].shape == (3,)


def test_an_error_while_writing_removes_the_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    lm.save(path, {"w": jnp.arange(3.0)})
    before = path.read_bytes()

    def fail(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_save, "_write_tensor", fail)
    with pytest.raises(
        lm.CheckpointError, match=r"could not write .*model\.safetensors .*EIO|Input"
    ):
        lm.save(path, {"w": jnp.ones(4)})
    assert path.read_bytes() == before and stray_files(tmp_path) == []


def test_the_file_gets_ordinary_permissions(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": jnp.ones(2)})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


# -- bad files ----------------------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    lm.save(path, {"params": {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4, jnp.int8)}})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(header, data):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _corruptions(raw, header, data):
    overlapping = json.loads(json.dumps(header))
    overlapping["params/b"]["data_offsets"] = [20, 24]
    outside = json.loads(json.dumps(header))
    outside["params/a"]["data_offsets"] = [0, 4000]
    return {
        "truncated": raw[:-5],
        "truncated header": raw[:20],
        "empty": b"",
        "huge header length": struct.pack("<Q", 2**40) + raw[8:],
        "header past the end": struct.pack("<Q", len(raw)) + raw[8:],
        "bad json": raw[:8] + b"[" * (len(raw) - 8 - len(data)) + data,
        "overlapping offsets": _with_header(overlapping, data),
        "offsets out of range": _with_header(outside, data),
        "text": b"step,loss\n1,0.5\n" * 10,
        "pickle": pickle.dumps({"params": {"a": [1.0, 2.0]}}),
        "npz": b"PK\x03\x04" + bytes(200),
    }


CORRUPTIONS = list(_corruptions(b"", {"params/a": {}, "params/b": {}}, b""))


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_broken_file_is_an_error_naming_it(tmp_path, good_file, corruption):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(_corruptions(*good_file)[corruption])
    with pytest.raises(lm.CheckpointError, match=r"broken\.safetensors is not a readable"):
        lm.load(path)


def test_a_file_replaced_while_it_is_opened_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    lm.save(path, {"w": jnp.ones(4, jnp.float32)})
    safe_open = safetensors.safe_open

    def replaced_first(*args, **kwargs):  # another process saves between open and validation
        lm.save(path, {"w": jnp.ones(4, jnp.int32)})
        return safe_open(*args, **kwargs)

    monkeypatch.setattr(_load.safetensors, "safe_open", replaced_first)
    with pytest.raises(lm.CheckpointError, match=r"a\.safetensors changed while it was being"):
        lm.load(path)


def test_a_missing_file_or_a_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nothing\.safetensors"):
        lm.load(tmp_path / "nothing.safetensors")
    with pytest.raises(IsADirectoryError, match=r"is a folder"):
        lm.load(tmp_path)


def test_names_that_are_not_a_tree_are_an_error(tmp_path):
    safetensors.numpy.save_file(
        {"a": np.ones(2, np.float32), "a/b": np.ones(2, np.float32)}, tmp_path / "t.safetensors"
    )
    with pytest.raises(lm.CheckpointError, match=r"t\.safetensors: a is a tensor and also"):
        lm.load(tmp_path / "t.safetensors")
    safetensors.numpy.save_file({"a//b": np.ones(2, np.float32)}, tmp_path / "e.safetensors")
    with pytest.raises(lm.CheckpointError, match=r"'a//b' has an empty part"):
        lm.load(tmp_path / "e.safetensors")


def test_64_bit_arrays_need_x64(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": np.ones(2, np.float64), "n": np.ones(2, np.int64)})
    with pytest.raises(lm.CheckpointError, match=r"(?s)64-bit arrays.*n \(int64\), w \(float64"):
        lm.load(tmp_path / "a.safetensors")


# -- checked against a model --------------------------------------------------------------


class Changed(lm.Module):
    """Net after edits: wider, stored in bfloat16, LayerNorm for BatchNorm, one more layer."""

    def __init__(self):
        super().__init__()
        self.layer1 = lm.Dense(4, 16, param_dtype=jnp.bfloat16, dtype=jnp.float32)
        self.norm = lm.LayerNorm(8)
        self.layer2 = lm.Dense(8, 2)
        self.extra = lm.Dense(2, 2)


def test_every_mismatch_with_the_model_is_listed_in_one_error(tmp_path, net):
    _, _, variables, _ = net
    lm.save(tmp_path / "net.safetensors", variables)
    with pytest.raises(lm.VariablesError) as error:
        lm.load(tmp_path / "net.safetensors", Changed())
    message = str(error.value)
    assert "net.safetensors got variables that do not match Changed" in message
    assert "missing (2): params/extra/bias, params/extra/kernel" in message
    assert "unexpected (2): batch_stats/norm/mean, batch_stats/norm/var" in message
    assert "wrong shape (2): params/layer1/bias: expected (16,), got (8,)" in message
    assert "params/layer1/kernel: expected (4, 16), got (4, 8)" in message
    assert "wrong dtype (2): params/layer1/bias: expected bfloat16, got float32" in message
    assert "lm.assign_variables" in message


def test_a_model_check_happens_before_any_data_is_read(tmp_path, net, monkeypatch):
    _, _, variables, _ = net
    lm.save(tmp_path / "net.safetensors", variables)
    monkeypatch.setattr(_load, "read_array", lambda *a: pytest.fail("data was read"))
    with pytest.raises(lm.VariablesError, match="wrong shape"):
        lm.load(tmp_path / "net.safetensors", Net(hidden=16))


def test_load_wants_a_module(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"expected an lm\.Module, got dict"):
        lm.load(tmp_path / "a.safetensors", {"w": 1})


# -- shardings ----------------------------------------------------------------------------


def test_one_sharding_for_all_arrays(tmp_path, net):
    model, _, variables, _ = net
    lm.save(tmp_path / "net.safetensors", variables)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded = lm.load(tmp_path / "net.safetensors", model, shardings=device)
    assert all(leaf.sharding == device for leaf in jax.tree.leaves(loaded))


def test_shardings_that_do_not_match_the_variables_are_an_error(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"params": {"w": jnp.ones(2), "b": jnp.ones(2)}})
    mesh = jax.make_mesh((1,), ("model",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    spec = jax.sharding.PartitionSpec("model")
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)no sharding for \(1\): params/b.*no such variable \(1\): params/v"
        r".*not a jax.sharding.Sharding \(1\): params/w: P\('model',?\)",
    ):
        lm.load(tmp_path / "a.safetensors", shardings={"params": {"w": spec, "v": named}})
    too_long = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    with pytest.raises(lm.VariablesError, match=r"sharding for params/b does not fit .*\(2,\)"):
        lm.load(tmp_path / "a.safetensors", shardings=too_long)


_SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
from collections import Counter
import jax, jax.numpy as jnp, numpy as np
import safetensors.numpy
import lamina as lm
from jax.sharding import NamedSharding, PartitionSpec as P
from lamina.io import _load, _save, tensors

path = sys.argv[1]
auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagates shardings through apply
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
assert len(jax.devices()) == 8


class Model(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(8, 16, param_dtype=jnp.bfloat16, dtype=jnp.float32)
        self.norm = lm.BatchNorm(16)

    def __call__(self, x):
        return self.norm(self.dense(x), False)


specs = {
    "params": {
        "dense": {"kernel": P("data", "model"), "bias": P("model")},
        "norm": {"scale": P("model"), "bias": P()},
    },
    "batch_stats": {"norm": {"mean": P(("data", "model")), "var": P()}},
}
shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
model = Model()
init, apply = lm.transform(model)
variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
assert variables["params"]["dense"]["kernel"].sharding == shardings["params"]["dense"]["kernel"]
expected = jax.device_get(variables)

written = []
blocks = _save._host_blocks
def recording_blocks(array):
    for index, block in blocks(array):
        written.append((array.shape, block.shape))
        yield index, block
_save._host_blocks = recording_blocks
lm.save(path, variables)
mapped_bytes = open(path, "rb").read()
_save.reserve = lambda fd, size: False  # a file system without fallocate: ordinary writes
lm.save(path, variables)
assert open(path, "rb").read() == mapped_bytes  # strided shards written run by run, the same
written = written[: len(written) // 2]
kernel_blocks = [b for shape, b in written if shape == (8, 16)]
assert kernel_blocks == [(4, 4)] * 8, kernel_blocks  # one block per distinct shard
assert Counter(b for shape, b in written if shape == (16,)) == {(4,): 8, (2,): 8, (16,): 2}
package = safetensors.numpy.load_file(path)
assert np.array_equal(package["params/dense/kernel"], expected["params"]["dense"]["kernel"])

reads = []
read_block = tensors.read_block
def recording_read(source, index):
    block = read_block(source, index)
    reads.append((source.shape, block.shape))
    return block
tensors.read_block = recording_read
loaded = lm.load(path, model, shardings=shardings)
for got, want, sharding in zip(
    jax.tree.leaves(loaded), jax.tree.leaves(expected), jax.tree.leaves(shardings), strict=True
):
    assert got.sharding == sharding, (got.sharding, sharding)
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), want)
# every device read its own block: the kernel in quarters of its rows' halves, the mean in
# eighths; only the replicated arrays (P()) were read whole (once: JAX reuses equal blocks)
assert set(reads) == {((8, 16), (4, 4)), ((16,), (4,)), ((16,), (2,)), ((16,), (16,))}, reads
assert len([r for r in reads if r[0] == (8, 16)]) == 8

lm.save(path, {"odd": np.ones(6, np.float32)})
try:
    lm.load(path, shardings={"odd": NamedSharding(mesh, P("model"))})
    raise AssertionError("an indivisible sharding was accepted")
except lm.VariablesError as error:
    assert "the sharding for odd does not fit its shape (6,)" in str(error), error
x = jnp.ones((2, 8))
assert np.array_equal(apply(loaded, None, x)[0], apply(variables, None, x)[0])

# 64-bit types keep every bit once JAX holds them
jax.config.update("jax_enable_x64", True)
wide = {
    "f64": np.frombuffer(np.random.default_rng(0).bytes(48), np.float64),
    "i64": np.array([-(2**62), 3], np.int64),
    "u64": np.array([2**64 - 1], np.uint64),
}
lm.save(path, wide)
back = lm.load(path)
for name, value in wide.items():
    assert back[name].dtype == value.dtype and np.asarray(back[name]).tobytes() == value.tobytes()
print("ok")
"""


def test_sharded_variables_save_and_load_one_block_per_device(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SHARDED), str(tmp_path / "sharded.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-4000:]


# -- faults while writing -----------------------------------------------------------------

_LIMITED_WRITER = r"""
import resource, signal, sys
import numpy as np
import lamina as lm
from lamina.io import _save

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit is then EFBIG, as in Python itself
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
if sys.argv[2] == "unreserved":
    _save.reserve = lambda fd, size: False  # ordinary writes hit the limit midway
try:
    lm.save(sys.argv[1], {"w": np.ones(2**19, np.float32)})  # 2 MiB
except lm.CheckpointError as error:
    print(error)
"""


@pytest.mark.parametrize("mode", ["reserved", "unreserved"])
def test_a_file_size_limit_is_a_checkpoint_error_naming_the_file(tmp_path, mode):
    path = tmp_path / "model.safetensors"
    lm.save(path, {"w": jnp.arange(3.0)})
    before = path.read_bytes()
    result = subprocess.run(
        [sys.executable, "-c", _LIMITED_WRITER, str(path), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"lm.save could not write {path} (2097" in result.stdout
    assert "File too large" in result.stdout and "ulimit -f" in result.stdout
    assert path.read_bytes() == before and stray_files(tmp_path) == []


def test_a_full_disk_is_a_checkpoint_error_before_anything_is_written(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    lm.save(path, {"w": jnp.arange(3.0)})
    before = path.read_bytes()

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(
        lm.CheckpointError,
        match=r"could not write .*model\.safetensors \(4\d\d\d bytes needed, \d+ free on its "
        r"file system\): No space left on device\. The file at .* is as it was .*Free space",
    ):
        lm.save(path, {"w": jnp.ones(1000)})
    assert path.read_bytes() == before and stray_files(tmp_path) == []


_FULL_DISK = r"""
import sys
import numpy as np
import lamina as lm
try:
    lm.save(sys.argv[1], {"w": np.ones(2**20, np.float32)})  # 4 MiB on a 1 MiB disk
except lm.CheckpointError as error:
    print(error)
"""


def test_a_disk_that_fills_during_a_save_is_an_error_not_a_crash(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr[-200:]!r}")
    try:
        path = disk / "model.safetensors"
        lm.save(path, {"w": jnp.arange(3.0)})
        before = path.read_bytes()
        result = subprocess.run(
            [sys.executable, "-c", _FULL_DISK, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (result.returncode, result.stderr[-3000:])  # not SIGBUS
        assert "4194" in result.stdout and "No space left on device" in result.stdout
        assert path.read_bytes() == before and stray_files(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_writes_without_a_reservation_give_the_same_file(tmp_path, monkeypatch):
    values = {"a": random_array(np.float32, (5, 7)), "b": random_array(jnp.bfloat16, (3,), 1)}
    values["c"] = np.arange(4, dtype=">i4")  # big-endian in, little-endian in the file
    lm.save(tmp_path / "mapped.safetensors", values)
    monkeypatch.setattr(_save, "reserve", lambda fd, size: False)
    lm.save(tmp_path / "written.safetensors", values)
    mapped = (tmp_path / "mapped.safetensors").read_bytes()
    assert (tmp_path / "written.safetensors").read_bytes() == mapped


def test_runs_of_a_strided_shard_cover_it_in_file_order():
    tensor = np.arange(4 * 6 * 5).reshape(4, 6, 5)
    index = (slice(2, 4), slice(0, 3), slice(None))  # rows 2-3, columns 0-2: one run per row
    runs = list(_save._runs(tensor.shape, index, tensor[index]))
    assert [(at, run.shape) for at, run in runs] == [(60, (3, 5)), (90, (3, 5))]
    flat = tensor.reshape(-1)
    for at, run in runs:
        np.testing.assert_array_equal(flat[at : at + run.size], run.reshape(-1))
    assert [at for at, _ in _save._runs((4, 6), (slice(1, 3),), tensor[0, :2])] == [6]


# -- corrupted data -----------------------------------------------------------------------


def flipped(raw, position, bit=0):
    data = bytearray(raw)
    data[position] ^= 1 << bit
    return bytes(data)


def test_every_single_byte_flip_in_the_data_is_an_error_naming_the_array(tmp_path):
    values = {"params": {"a": random_array(np.float32, (16, 8)), "b": random_array(np.int8, (40,))}}
    path = tmp_path / "a.safetensors"
    lm.save(path, values)
    raw = path.read_bytes()
    header, data = split_file(raw)
    start = len(raw) - len(data)
    rng = np.random.default_rng(0)
    for name in ("params/a", "params/b"):
        begin, end = header[name]["data_offsets"]
        for position in rng.integers(begin, end, 25):
            path.write_bytes(flipped(raw, start + int(position), int(rng.integers(8))))
            with pytest.raises(
                lm.CheckpointError,
                match=rf"a\.safetensors is corrupted: the data of 1 array\(s\) does not match "
                rf"the checksum .*: {name}\. .*verify=False",
            ):
                lm.load(path)
    # verify=False reads the damaged bytes as they are
    path.write_bytes(flipped(raw, start + header["params/b"]["data_offsets"][0], 0))
    damaged = lm.load(path, verify=False)["params"]["b"]
    assert int(damaged[0]) == int(values["params"]["b"][0]) ^ 1


def test_a_header_followed_by_zeros_is_an_error(tmp_path):
    path = tmp_path / "a.safetensors"
    lm.save(path, {"w": random_array(np.float32, (64,)), "n": np.arange(5, dtype=np.int32)})
    raw = path.read_bytes()
    _, data = split_file(raw)
    path.write_bytes(raw[: len(raw) - len(data)] + bytes(len(data)))
    with pytest.raises(lm.CheckpointError, match=r"2 array\(s\) does not match.*: n, w"):
        lm.load(path)


def test_a_header_edit_that_reinterprets_the_bytes_is_an_error(tmp_path):
    path = tmp_path / "a.safetensors"
    lm.save(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    raw = path.read_bytes()
    for old, new in [(b'"F32"', b'"I32"'), (b"[2,3]", b"[3,2]")]:
        assert raw.count(old) == 1
        path.write_bytes(raw.replace(old, new))
        with pytest.raises(lm.CheckpointError, match=r"does not match the checksum.*: w"):
            lm.load(path)


@pytest.mark.parametrize(
    "entry, match",
    [
        ('{"w": "zz"}', r"not 8 hex digits for w"),
        ('{"v": "00000000"}', r"names differ in v, w"),
        ("[1]", r"not a JSON object"),
        ("{", r"Expecting"),
    ],
)
def test_a_damaged_checksum_entry_is_an_error(tmp_path, entry, match):
    path = tmp_path / "a.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path, {"lamina.crc32": entry})
    with pytest.raises(
        lm.CheckpointError, match=rf"checksum entry 'lamina.crc32' is damaged .*{match}"
    ):
        lm.load(path)
    assert lm.load(path, verify=False)["w"].shape == (2,)


def test_files_without_checksums_still_load(tmp_path):
    values = {"params": {"w": random_array(np.float32, (3, 2))}}
    path = tmp_path / "old.safetensors"
    lm.save(path, values)
    header, data = split_file(path.read_bytes())
    del header["__metadata__"]  # as the version before checksums wrote it
    path.write_bytes(_with_header(header, data))
    assert same_bits(lm.load(path)["params"]["w"], values["params"]["w"])


@pytest.mark.parametrize("damaged", [b"lamina.crc33", b"lamina.CRC32"])
def test_a_damaged_checksum_key_is_an_error(tmp_path, damaged):
    path = tmp_path / "a.safetensors"
    lm.save(path, {"w": np.arange(4, dtype=np.float32), "e": {}})
    raw = path.read_bytes()
    assert raw.count(b"lamina.crc32") == 1
    raw = bytearray(raw.replace(b"lamina.crc32", damaged))
    raw[-1] ^= 1  # and the data: without the key's check this would load silently
    path.write_bytes(bytes(raw))
    with pytest.raises(
        lm.CheckpointError,
        match=r"lamina's metadata \(lamina\.\S+, lamina\.empty_dicts\) but no checksum entry "
        r"'lamina.crc32'.*verify=False",
    ):
        lm.load(path)
    assert lm.load(path, verify=False)["w"].shape == (4,)


def test_files_of_other_writers_load_unchecked(tmp_path):
    path = tmp_path / "a.safetensors"
    w = np.arange(3, dtype=np.float32)
    safetensors.numpy.save_file({"w": w}, path, {"format": "np", "other.crc32": "x"})
    np.testing.assert_array_equal(np.asarray(lm.load(path)["w"]), w)


def test_verify_must_be_a_bool(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"verify"):
        lm.load(tmp_path / "a.safetensors", verify="no")


# -- any pytree, restored into a structure ------------------------------------------------


def test_a_training_state_round_trips_exactly_into_its_structure(tmp_path, net):
    optax = pytest.importorskip("optax")
    model, apply, variables, x = net
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = optimizer.init(variables["params"])
    grads = jax.tree.map(jnp.ones_like, variables["params"])
    with jax.numpy_dtype_promotion("standard"):  # Adam's bias correction: float ** int32
        _, opt_state = optimizer.update(grads, opt_state, variables["params"])  # count 1
    state = {
        "variables": variables,
        "opt": opt_state,
        "step": jnp.asarray(7),
        "data": [np.int32(5)],
    }
    path = tmp_path / "state.safetensors"
    lm.save(path, state)
    with safetensors.safe_open(path, "np") as file:
        assert "opt/1/0/mu/layer1/kernel" in set(file.keys())  # adamw's ScaleByAdamState.mu
    for like in (state, jax.eval_shape(lambda: state)):
        restored = lm.load(path, like=like)
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        assert type(restored["opt"][1][0]) is type(opt_state[1][0])  # named tuples, not dicts
        for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
            assert isinstance(got, jax.Array) and same_bits(got, expected)
    # training goes on from the restored state as from the original
    with jax.numpy_dtype_promotion("standard"):
        _, again = optimizer.update(grads, restored["opt"], restored["variables"]["params"])
        _, expected = optimizer.update(grads, opt_state, variables["params"])
    for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(expected), strict=True):
        assert same_bits(got, want)
    # without a structure the file reads as nested dicts, indices and fields as keys
    plain = lm.load(path)
    assert same_bits(plain["opt"]["1"]["0"]["count"], opt_state[1][0].count)
    assert plain["data"]["0"].dtype == jnp.int32 and plain["opt"]["0"] == {}  # an EmptyState


def test_a_structure_that_does_not_match_the_file_is_one_error(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"step": jnp.asarray(3), "opt": (jnp.ones(2), jnp.ones(3))})
    like = {"step": jnp.asarray(0.0), "opt": (jnp.ones(4),), "extra": jnp.ones(1)}
    with pytest.raises(lm.VariablesError) as error:
        lm.load(tmp_path / "a.safetensors", like=like)
    message = str(error.value)
    assert "a.safetensors got arrays that do not match like=" in message
    assert "missing (1): extra" in message and "unexpected (1): opt/1" in message
    assert "wrong shape (1): opt/0: expected (4,), got (2,)" in message
    assert "wrong dtype (1): step: expected float32, got int32" in message


def test_bad_like_and_model_arguments_are_errors(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"step": jnp.asarray(3)})
    with pytest.raises(lm.VariablesError, match=r"step: int 3 has no shape and dtype"):
        lm.load(tmp_path / "a.safetensors", like={"step": 3})
    with pytest.raises(lm.VariablesError, match=r"the top level: a single array has no name"):
        lm.load(tmp_path / "a.safetensors", like=jnp.asarray(0))
    with pytest.raises(TypeError, match=r"a model or like=, not both"):
        lm.load(tmp_path / "a.safetensors", lm.Dense(2, 2), like={"step": jnp.asarray(0)})
    with pytest.raises(TypeError, match=r"expected an lm\.Module, got dict; .*pass it as like="):
        lm.load(tmp_path / "a.safetensors", {"step": jnp.asarray(0)})


def test_like_places_arrays_on_its_leaves_shardings(tmp_path):
    lm.save(tmp_path / "a.safetensors", {"w": jnp.arange(4.0)})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=device)}
    restored = lm.load(tmp_path / "a.safetensors", like=like)
    assert restored["w"].sharding == device
    np.testing.assert_array_equal(restored["w"], np.arange(4.0))


# -- what is not a regular file -----------------------------------------------------------

_READ_FIFO = r"""
import sys
import lamina as lm
try:
    lm.load(sys.argv[1])
except lm.CheckpointError as error:
    print(error)
"""


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this system")
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    result = subprocess.run(  # a subprocess, so that a regression cannot hang the suite
        [sys.executable, "-c", _READ_FIFO, str(fifo)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipe.safetensors is a named pipe (FIFO), not a regular file" in result.stdout


def test_a_device_is_refused(tmp_path):
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    with pytest.raises(lm.CheckpointError, match=r"/dev/null is a character device, not a regular"):
        lm.load("/dev/null")
