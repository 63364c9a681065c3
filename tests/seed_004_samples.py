"""The code samples of seed 004 (the Metoryx article), verbatim, in the article's order.

Each entry is ``(title, code)``. `tests/test_seed_examples.py` runs them with
``import lamina as mx`` in place of ``import metoryx as mx`` and checks that every one is
word for word in the seed (when the seed file is at hand). The MNIST program is run by
`tests/test_mnist_seed.py`.
"""

SAMPLES = [
    (
        "usage",
        """
import jax
import jax.numpy as jnp
import jax.random as jr
import metoryx as mx

#
# 定義フェイズ (オブジェクト指向)
#
class Mlp(mx.Module):
    def __init__(self, in_size, hidden_size, out_size):
        super().__init__()
        self.layer1 = mx.Dense(in_size, hidden_size)
        self.layer2 = mx.Dense(hidden_size, out_size)

    def __call__(self, x):
        x = self.layer1(x)
        x = mx.relu(x)
        return self.layer2(x)

model = Mlp(784, 256, 10)

#
# 定義フェイズから実行フェイズへの移行
#
init, apply = mx.transform(model)

#
# 実行フェイズ (関数型プログラミング)
#
variables = init(jr.PRNGKey(0))
outputs, new_variables = apply(variables, jr.PRNGKey(1), jnp.ones((1, 784)))
""",
    ),
    (
        "init",
        """
variables = init(jr.PRNGKey(0))
""",
    ),
    (
        "apply",
        """
outputs, new_variables = apply(variables, jr.PRNGKey(1), jnp.ones((1, 784)))
""",
    ),
    (
        "grad",
        """
# 第一引数に対して勾配を計算
def loss_fn(params, model_state, inputs, targets):
    variables = {'params': params, **model_state}  # 'params' とその他のコレクションをまとめる
    outputs, new_state = apply(variables, jr.PRNGKey(1), inputs)
    loss = ...
    return loss, new_state

variables = init(jr.PRNGKey(0))

# パラメータと状態を分離
model_state = variables
params = model_state.pop("params")

# パラメータに対する勾配を計算
grads, new_state = jax.grad(loss_fn, has_aux=True)(params, model_state, inputs, targets)
""",
    ),
    (
        "definition",
        """
import metoryx as mx


class Mlp(mx.Module):
    def __init__(self, in_size, hidden_size, out_size):
        super().__init__()
        self.layer1 = mx.Dense(in_size, hidden_size)
        self.layer2 = mx.Dense(hidden_size, out_size)

    def __call__(self, x):
        x = self.layer1(x)
        x = mx.relu(x)
        return self.layer2(x)

# インスタンス化
model = Mlp(784, 256, 10)
""",
    ),
    (
        "list",
        """
class MlpList(mx.Module):
    def __init__(self, in_size, hidden_sizes, out_size):
        super().__init__()
        self.layers = [mx.Dense(in_size, hidden_sizes[0])]
        for i in range(1, len(hidden_sizes)):
            self.layers.append(mx.Dense(hidden_sizes[i-1], hidden_sizes[i]))
        self.layers.append(mx.Dense(hidden_sizes[-1], out_size))

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = mx.relu(layer(x))
        return self.layers[-1](x)
""",
    ),
    (
        "replace_layer",
        """
model = Mlp(784, 256, 10)
model.layer2 = mx.Dense(256, 20)  # 出力層を置き換え
""",
    ),
    (
        "assign_value",
        """
model = Mlp(784, 256, 10)
model.layer1.kernel.value = jnp.zeros((784, 256))  # layer1 のカーネルの初期値をゼロに割り当て
""",
    ),
    (
        "transfer",
        """
model = Mlp(784, 256, 10)

# ダミーの事前学習済みパラメータを用意
pretrained_variables = {
    'params': {
        'layer1': {
            'kernel': jnp.ones((784, 256)),
            'bias': jnp.ones((256,)),
        },
        'layer2': {
            'kernel': jnp.ones((256, 10)),
            'bias': jnp.ones((10,)),
        },
    },
}

# 事前学習済みパラメータを割り当て
model = mx.assign_variables(model, pretrained_variables)
model.layer2 = mx.Dense(256, 2)  # 出力層の次元数を変更し、ランダムに初期化
""",
    ),
    (
        "transform",
        """
model = Mlp(784, 256, 10)
init, apply = mx.transform(model)
""",
    ),
    (
        "to_callable",
        """
def to_callable(model):
    return model.forward  # 例えば forward メソッドを使用したい場合

init, apply = mx.transform(model, to_callable=to_callable)
""",
    ),
    (
        "my_layer",
        """
class MyLayer(mx.Module):
    def __init__(self, in_size, out_size):
        super().__init__()
        self.param = mx.Parameter((in_size, out_size), mx.initializers.lecun_normal())  # パラメータ
        self.state = mx.State("some_states", (out_size,), mx.initializers.zeros(), mutable=True)  # 状態
""",
    ),
    (
        "parameter_value",
        """
p = mx.Parameter((10, 10), mx.initializers.zeros())
p.value = jnp.ones((10, 10))  # 初期値を割り当てる
""",
    ),
    (
        "state_update",
        """
class MyLayer(mx.Module):
    def __init__(self, in_size, out_size):
        super().__init__()
        self.state = mx.State("some_states", (out_size,), mx.initializers.zeros(), mutable=True)
    def __call__(self, x):
        self.state.value = self.state.value + jnp.sum(x, axis=0)  # 状態を更新
        return x + self.state.value
""",
    ),
    (
        "add_noise",
        """
class AddNoise(mx.Module):
    def __call__(self, x):
        rng = mx.next_rng_key()  # Metoryx が供給する PRNG キーを取得
        z = jr.normal(rng, x.shape)
        return x + z

model = AddNoise()
init, apply = mx.transform(model)
variables = init(jr.PRNGKey(0))

# 第 2 引数に PRNG キーを渡す
outputs, new_variables = apply(variables, jr.PRNGKey(1), jnp.ones((10, 10)))
""",
    ),
    (
        "no_rng",
        """
outputs, new_variables = apply(variables, None, jnp.ones((10, 10)))
""",
    ),
    (
        "rng_dict",
        """
# 第 2 引数に辞書形式で複数の PRNG キーを渡す
rngs = {"dropout": jr.PRNGKey(0), "noise": jr.PRNGKey(1)}
outputs, new_variables = apply(variables, rngs, jnp.ones((10, 10)))
""",
    ),
    (
        "named_noise",
        """
class AddNoise(mx.Module):
    def __call__(self, x):
        rng = mx.next_rng_key("noise")  # noise という名前のキーを取得
        z = jr.normal(rng, x.shape)
        return x + z
""",
    ),
    (
        "prng_keys",
        """
rngs = mx.PRNGKeys(jr.PRNGKey(42), dropout=jr.PRNGKey(0), noise=jr.PRNGKey(1))
outputs, new_variables = apply(variables, rngs, jnp.ones((10, 10)))
""",
    ),
    (
        "next_rng_key_names",
        """
mx.next_rng_key("noise")  # noise という名前のキーを使用
mx.next_rng_key()         # デフォルトのキーを使用
mx.next_rng_key("foo")    # foo という名前のキーがないので、デフォルトのキーを使用
""",
    ),
]
