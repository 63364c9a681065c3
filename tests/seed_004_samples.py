"""The code samples of the Metoryx article, verbatim, in the article's order.

The article is the seed `../shared/seeds/004_a6172f56ed72f6a5.txt`.

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
    (
        "mnist",
        '''
import itertools

import jax
import jax.random as jr
import metoryx as mx
import optax

import tensorflow as tf
import tensorflow_datasets as tfds


# ハイパーパラメータ
random_seed = 42
num_epochs = 10
batch_size = 64

# MNIST のメタデータ
num_images = 60000
num_steps_per_epoch = num_images // batch_size

# Tensorflow の乱数シードを設定
tf.random.set_seed(random_seed)


# MNIST データセットを読み込むための関数
def get_dataset(num_epochs, batch_size, split):
    ds = tfds.load("mnist", split=split)
    ds = ds.map(
        lambda item: {
            "image": tf.cast(item["image"], tf.float32) / 255.0,
            "label": item["label"],
        }
    )
    ds = ds.repeat(num_epochs)
    if split == "train":
        ds = ds.shuffle(1024)
    ds = ds.batch(batch_size, drop_remainder=(split == "train"))
    ds = ds.prefetch(1)
    return ds


# モデルの定義
class ConvNet(mx.Module):
    """A simple CNN for MNIST classification."""

    def __init__(self):
        super().__init__()
        self.conv1 = mx.Conv(1, 32, kernel_size=(3, 3), strides=(1, 1), padding="SAME")
        self.conv2 = mx.Conv(32, 64, kernel_size=(3, 3), strides=(1, 1), padding="SAME")
        self.fc1 = mx.Dense(7 * 7 * 64, 128)
        self.fc2 = mx.Dense(128, 10)

    def __call__(self, x, is_training):
        x = self.conv1(
            x
        )  # Input shape is expected to be (batch, height, width, channels)
        x = mx.relu(x)
        x = mx.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = self.conv2(x)
        x = mx.relu(x)
        x = mx.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # Flatten
        x = mx.dropout(x, rate=0.5, is_training=is_training)
        x = self.fc1(x)
        x = mx.relu(x)
        return self.fc2(x)


# モデルのインスタンス化と Module Transformation の実行
net = ConvNet()
init, apply = mx.transform(net)


# 学習ステップと評価ステップの定義
# JIT コンパイルを適用して高速化
@jax.jit
def train_step(rng, params, state, opt_state, batch):
    def loss_fn(params):
        variables = {"params": params, **state}
        logits, new_state = apply(variables, rng, batch["image"], is_training=True)
        new_state.pop("params")

        # ロスと精度の計算
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]
        ).mean()
        accuracy = (logits.argmax(axis=-1) == batch["label"]).mean()
        log_dict = {"loss": loss, "accuracy": accuracy}

        return loss, (new_state, log_dict)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (new_state, log_dict)), grads = grad_fn(params)

    # パラメータの更新
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_state, new_opt_state, log_dict


@jax.jit
def eval_step(params, state, batch):
    variables = {"params": params, **state}
    logits, _ = apply(variables, None, batch["image"], is_training=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    accuracy = (logits.argmax(axis=-1) == batch["label"]).mean()
    return {"loss": loss, "accuracy": accuracy}


# 初期化と学習の準備
rng = jr.PRNGKey(42)  # Set random seed
rng, init_rng = jr.split(rng)
variables = init(init_rng)

# パラメータと状態を分離
state = variables
params = state.pop("params")

# Optimizer の設定
optimizer = optax.sgd(learning_rate=0.01, momentum=0.9)
opt_state = optimizer.init(params)

# 学習の実行
train_ds = get_dataset(num_epochs, batch_size, split="train")
train_iter = iter(train_ds.as_numpy_iterator())
for epoch in range(num_epochs):
    # AverageMeter は、メトリクスの平均を計算するユーティリティクラス
    meter = mx.utils.AverageMeter()
    for batch in itertools.islice(train_iter, num_steps_per_epoch):
        rng, rng_apply = jr.split(rng)
        params, state, opt_state, metrics = train_step(
            rng_apply, params, state, opt_state, batch
        )
        meter.update(metrics, n=len(batch["image"]))
    print(meter.compute())

# テストの実行
test_ds = get_dataset(1, batch_size, split="test")
meter = mx.utils.AverageMeter()
for batch in test_ds.as_numpy_iterator():
    metrics = eval_step(params, state, batch)
    meter.update(metrics, n=len(batch["image"]))
print("Test:", meter.compute())
''',
    ),
]
