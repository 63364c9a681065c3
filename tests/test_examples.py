"""The examples, run as a user runs them (end to end, on real data)."""

import argparse
import importlib
import json
import pathlib
import re
import runpy
import shutil
import sys

import jax
import pytest

import lamina as lm

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run_example(name, argv, monkeypatch):
    """Runs `examples/<name>` with `argv`, under JAX's default ("standard") dtype promotion.

    The suite runs with strict promotion to keep lamina itself honest; an example is user code
    that also runs optax's optimisers, which are not strict-clean (adam's bias correction
    raises a float to an int32 power), so it runs as a user would run it.
    """
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    namespace = runpy.run_path(str(EXAMPLES / name), run_name="example")
    with jax.numpy_dtype_promotion("standard"):
        return namespace["main"](argv)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_saved(results, folder, out):
    """The run wrote metrics.json (what `main` returned) and curves.png in `folder`; said so."""
    files = results["files"]
    assert files == {"metrics": folder / "metrics.json", "curves": folder / "curves.png"}
    saved = json.loads(files["metrics"].read_text())
    assert saved["data"] == results["data"] and "--quiet" in saved["command"]
    with open(files["curves"], "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    assert files["curves"].stat().st_size > 10_000  # a drawn figure, not an empty one
    assert f"saved the metrics to {files['metrics']} and the curves to {files['curves']}" in out
    return saved


@pytest.mark.slow
def test_mnist_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = ["--digits", "--epochs", "8", "--quiet", "--out", str(tmp_path)]
    results = run_example("mnist.py", argv, monkeypatch)
    history = results["history"]
    assert len(history) == 8 and results["data"] == "digits (scikit-learn)"
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert results["test"]["test_accuracy"] > 0.9
    out = capsys.readouterr().out
    assert "Results on digits (scikit-learn)" in out and "final test accuracy" in out
    assert "median over the epochs after the first" in out
    saved = check_saved(results, tmp_path, out)
    assert [row["epoch"] for row in saved["history"]] == list(range(1, 9))
    assert saved["history"][-1]["test_accuracy"] == pytest.approx(results["test"]["test_accuracy"])


def test_mnist_example_limit_and_saved_files(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default folder: runs/mnist-<date>-<time> under it
    argv = ["--digits", "--epochs", "1", "--limit", "200", "--quiet"]
    results = run_example("mnist.py", argv, monkeypatch)
    assert results["train_size"] == 200 and results["steps_per_epoch"] == 200 // 64
    out = capsys.readouterr().out
    assert "data: scikit-learn's 8x8 digits (--digits)" in out
    assert "200 of 1,438 training images" in out
    # one epoch: no claim of a median over the epochs after the first
    assert "one epoch, including the compilation" in out and "after the first" not in out
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("mnist-")
    saved = check_saved(results, pathlib.Path("runs") / folder.name, out)
    assert saved["train_size"] == 200 and saved["args"]["limit"] == 200
    assert set(saved["history"][0]) >= {"train_loss", "train_accuracy", "test_accuracy"}


def test_mnist_example_limit_beyond_the_data(monkeypatch, capsys, tmp_path):
    argv = ["--digits", "--epochs", "1", "--limit", "100000", "--batch-size", "512", "--quiet"]
    results = run_example("mnist.py", [*argv, "--out", str(tmp_path)], monkeypatch)
    assert results["train_size"] == 1438
    out = capsys.readouterr().out
    assert "--limit 100,000: digits (scikit-learn) has only 1,438 training images" in out
    with pytest.raises(SystemExit, match=r"error: 10 training images make no full batch of 64"):
        run_example("mnist.py", ["--digits", "--limit", "10", "--out", str(tmp_path)], monkeypatch)
    with pytest.raises(SystemExit):
        run_example("mnist.py", ["--digits", "--limit", "0"], monkeypatch)


def test_examples_say_how_to_get_fashion_mnist(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    common = importlib.import_module("_common")
    monkeypatch.setattr(lm.data, "FASHION_MNIST_DIR", tmp_path / "not-installed")
    data = common.load_data(argparse.Namespace(digits=False, data_dir=None))
    assert data.name == "digits (scikit-learn)"
    out = capsys.readouterr().out
    assert "because Fashion-MNIST is not installed at" in out
    assert "sudo apt-get install dataset-fashion-mnist" in out and "--data-dir" in out


@pytest.mark.slow
@pytest.mark.skipif(
    not lm.data.FASHION_MNIST_DIR.is_dir(),
    reason="needs Debian's dataset-fashion-mnist; .ci/run installs it",
)
def test_mnist_example_on_fashion_mnist_subset(monkeypatch, capsys, tmp_path):
    argv = ["--epochs", "1", "--limit", "6400", "--quiet", "--out", str(tmp_path)]
    results = run_example("mnist.py", argv, monkeypatch)
    assert results["data"] == "Fashion-MNIST" and results["train_size"] == 6400
    assert f"data: Fashion-MNIST, from {lm.data.FASHION_MNIST_DIR}" in capsys.readouterr().out
    assert results["test"]["test_accuracy"] > 0.72  # 100 steps (0.776 here): chance is 0.1


def test_mnist_example_bad_data_dir(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example("mnist.py", ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    with pytest.raises(SystemExit, match=r"error: .*train-images-idx3-ubyte: truncated"):
        run_example("mnist.py", ["--data-dir", str(tmp_path)], monkeypatch)


@pytest.mark.slow
def test_transfer_learning_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = [
        "--digits",
        "--pretrain-steps",
        "400",
        "--steps",
        "200",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    results = run_example("transfer_learning.py", argv, monkeypatch)
    assert results["task_a"] == [0, 1, 2, 3, 4] and results["task_b"] == [5, 6, 7, 8, 9]
    assert results["pretrain"]["test_accuracy"] > 0.95
    variants = results["variants"]
    assert set(variants) == {"scratch", "fine-tune", "slow body", "frozen body"}
    for name, row in variants.items():
        assert row["test_accuracy"] > 0.8, name  # 5 classes: chance is 0.2
    # frozen: only the head trains, and the body is the pretrained one bit for bit
    assert variants["frozen body"]["trainable_params"] < results["total_params"] / 4
    assert variants["fine-tune"]["trainable_params"] == results["total_params"]
    assert results["frozen_body_unchanged"]
    out = capsys.readouterr().out
    assert "bit-identical to the pretrained one" in out
    saved = check_saved(results, tmp_path, out)
    assert (
        saved["variants"]["frozen body"]["test_accuracy"]
        == variants["frozen body"]["test_accuracy"]
    )
    # the curves' data: one row per evaluation (every 100 steps)
    assert [row["step"] for row in saved["variants"]["scratch"]["history"]] == [100, 200]


@pytest.mark.slow
def test_lora_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = [
        "--digits",
        "--pretrain-steps",
        "500",
        "--steps",
        "300",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    results = run_example("lora_finetune.py", argv, monkeypatch)
    assert results["before"]["source"] > 0.9
    # the adapters start as a no-op: the wrapped model is the pretrained one
    assert results["start_target"] == pytest.approx(results["before"]["target"])
    assert results["adapted"]["target"] > results["before"]["target"] + 0.5
    assert results["trainable_params"] < results["total_params"] / 5
    assert results["base_unchanged"]
    # lm.replace + lm.freeze: the adapters are the model's only trainable Parameters
    assert results["trainable_are_adapters"]
    # merged: plain layers (no "base" level), the same predictions
    assert "LoRA" not in results["merged_layer_types"]
    assert results["merged_paths"] == ["bias", "kernel"]
    assert results["merged_params"] == results["pretrained_params"]
    assert results["merged_max_logit_difference"] < 1e-3
    assert results["merged"]["target"] == pytest.approx(results["adapted"]["target"], abs=0.01)
    out = capsys.readouterr().out
    assert "base weights are bit-identical" in out
    saved = check_saved(results, tmp_path, out)
    assert saved["adapted"] == results["adapted"] and saved["rank"] == 4
    assert [row["step"] for row in saved["adapt"]["history"]] == [75, 150, 225, 300]


@pytest.mark.parametrize("name", ["transfer_learning.py", "lora_finetune.py"])
def test_fine_tuning_examples_bad_arguments(name, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example(name, ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit):
        run_example(name, ["--steps", "0"], monkeypatch)


# --- the language-model examples (issue 24) ---------------------------------------------


def example_namespace(name, monkeypatch):
    """The functions of `examples/<name>`, without running it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return runpy.run_path(str(EXAMPLES / name), run_name="example")


def test_generate_example_random_model_is_greedy(monkeypatch, capsys, tmp_path):
    argv = ["--prompt", "Hi", "--max-new-tokens", "8", "--repeats", "1", "--quiet"]
    argv += ["--out", str(tmp_path)]
    example = example_namespace("generate.py", monkeypatch)
    built = []  # the model the example builds, kept to check its tokens (one init, not two)
    random_model = example["random_model"]
    example["load"].__globals__["random_model"] = lambda *a: (
        built.append(random_model(*a)) or built[-1]
    )
    monkeypatch.setattr(sys, "argv", ["generate.py", *argv])
    with jax.numpy_dtype_promotion("standard"):
        results = example["main"](argv)
    assert results["prompt_ids"] == [72, 105]  # the UTF-8 bytes of "Hi"
    assert results["new_tokens"] == 8 and not results["stopped_at_eos"]
    assert results["prefill_seconds"] > 0 and results["tokens_per_second_overall"] > 0
    speed = results["decode_tokens_per_second"]  # None: too fast to time apart (a busy machine)
    out = capsys.readouterr().out
    assert "a random Llama-shaped model over bytes (no --checkpoint)" in out
    assert ("tokens/s decoding" in out) == (speed is not None) and "prefill" in out
    assert "compiling (the first call's time less a later one's)" in out
    assert results["whole_text"] == results["prompt_text"] + results["text"]  # no split char
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["new_ids"] == results["new_ids"] and "--quiet" in saved["command"]
    # greedy: each new token is the argmax of the full (cache-free) forward pass before it
    [(model, variables)] = built
    ids = jax.numpy.asarray([results["prompt_ids"] + results["new_ids"]], dtype="int32")
    with jax.numpy_dtype_promotion("standard"):
        logits, _ = jax.jit(lm.transform(model).apply)(variables, None, ids)
    expected = logits[0, 1:-1].argmax(-1).tolist()
    assert results["new_ids"] == expected


def test_generate_example_matches_transformers(monkeypatch, hf_checkpoint):
    torch = pytest.importorskip("torch")
    folder, hf = hf_checkpoint("llama")
    prompt = [5, 17, 99, 3]
    argv = ["--checkpoint", str(folder), "--prompt-ids", *map(str, prompt)]
    argv += ["--max-new-tokens", "7", "--repeats", "1", "--eos-id", "127", "--quiet"]
    results = run_example("generate.py", argv, monkeypatch)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=7, top_k=None, eos_token_id=127
        )
    assert results["prompt_ids"] + results["new_ids"] == expected[0].tolist()


def test_generate_example_bad_arguments(monkeypatch, tmp_path, hf_checkpoint):
    with pytest.raises(SystemExit, match=r"error: no checkpoint folder at .*--checkpoint"):
        run_example("generate.py", ["--checkpoint", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit, match=r"error: from_pretrained: .* has no config.json"):
        run_example("generate.py", ["--checkpoint", str(tmp_path)], monkeypatch)
    with pytest.raises(SystemExit, match=r"error: prompt token ids \[256\].*vocabulary \[0, 256\)"):
        run_example("generate.py", ["--prompt-ids", "1", "256", "--quiet"], monkeypatch)
    folder, _ = hf_checkpoint("llama")  # no tokenizer.json: byte ids only for the random model
    with pytest.raises(
        SystemExit, match=r"error: .*no tokenizer.json.*tokenizer.model.*--prompt-ids"
    ):
        run_example("generate.py", ["--checkpoint", str(folder), "--prompt", "x"], monkeypatch)
    argv = ["--checkpoint", str(folder), "--prompt-ids", "1", "2", "3", "--max-new-tokens"]
    with pytest.raises(
        SystemExit,
        match=r"error: 3 prompt tokens plus --max-new-tokens 100000 "
        r"exceed .*max_position_embeddings \((\d+)\): use --max-new-tokens \d+ or fewer",
    ):
        run_example("generate.py", [*argv, "100000"], monkeypatch)
    for argv in (
        ["--top-k", "5"],
        ["--max-new-tokens", "0"],
        ["--temperature", "1", "--top-p", "2"],
    ):
        with pytest.raises(SystemExit):
            run_example("generate.py", argv, monkeypatch)


def test_generate_example_decodes_the_continuation_with_the_prompt(monkeypatch):
    """A SentencePiece-style (Metaspace) decoder drops a leading space: the new text is the
    whole output's decoding less the prompt's, not the new ids decoded alone."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "\u2581The": 1, "\u2581cat": 2, "\u2581sat": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = tokenizers.decoders.Metaspace()
    assert tokenizer.decode([3]) == "sat"  # alone, the space is gone
    example = example_namespace("generate.py", monkeypatch)
    assert example["continuation"]([1, 2], [1, 2, 3], tokenizer) == (
        "The cat",
        " sat",
        "The cat sat",
    )
    # bytes (the random model): a character split between the prompt and the continuation
    euro = list("x€".encode())
    assert example["continuation"](euro[:2], euro, None) == ("x\ufffd", "€", "x€")


def test_finetune_llm_example(monkeypatch, capsys, tmp_path):
    argv = ["--steps", "60", "--eval-interval", "30", "--block-size", "32", "--quiet"]
    results = run_example("finetune_llm.py", [*argv, "--out", str(tmp_path)], monkeypatch)
    out = capsys.readouterr().out
    assert "a tiny random Llama over bytes, saved by lamina (no --checkpoint)" in out
    assert "the standard library's" in results["data"]
    # only the adapters train: rank 8 on query (64 -> 4x16) and value (64 -> 2x16), 2 layers
    assert results["adapter_params"] == 2 * (8 * (64 + 64) + 8 * (64 + 32))
    assert [row["step"] for row in results["history"]] == [0, 30, 60]
    # from about ln 256 = 5.5; adapters on a random network learn slowly (5.2 after 50 steps)
    assert results["val_loss"] < results["val_loss_before"] - 0.2
    assert results["base_unchanged"]
    assert results["merged_max_logit_difference"] < 1e-4
    assert results["reloaded_max_logit_difference"] < 1e-4
    assert {"config.json", "model.safetensors"} <= set(results["saved_files"])
    saved = check_saved(results, tmp_path, out)
    assert saved["val_loss"] == results["val_loss"] and saved["rank"] == 8
    if results["transformers_max_logit_difference"] is not None:
        assert results["transformers_max_logit_difference"] < 1e-4


def test_finetune_llm_example_bad_arguments(monkeypatch, capsys, tmp_path, hf_checkpoint):
    """Refused by the command line, before any model is built or loaded."""
    folder, _ = hf_checkpoint("llama")
    limit = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    cases = {
        f"--block-size {limit + 1} exceeds the model's max_position_embeddings \\({limit}\\)": [
            "--checkpoint",
            str(folder),
            "--block-size",
            str(limit + 1),
        ],
        "--block-size 513 exceeds the model's max_position_embeddings \\(512\\)": [
            "--block-size",
            "513",
        ],
        "--data: no text file at .*missing.txt": ["--data", str(tmp_path / "missing.txt")],
    }
    for message, argv in cases.items():
        with pytest.raises(SystemExit, match="2"):
            run_example("finetune_llm.py", [*argv, "--out", str(tmp_path / "run")], monkeypatch)
        assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # nothing written


def character_tokenizer(folder):
    """Writes a tokenizer.json into `folder`: one token per ASCII character, id = its code."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(i): i for i in range(128)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="\x00"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex("."), behavior="isolated"
    )
    tokenizer.decoder = tokenizers.decoders.Fuse()  # decode joins the characters
    tokenizer.save(str(folder / "tokenizer.json"))


def test_finetune_llm_example_on_a_transformers_checkpoint(monkeypatch, tmp_path, hf_checkpoint):
    """A checkpoint made by transformers (Qwen2: q/k/v biases, tied embeddings), with its own
    tokenizer: adapted, merged, saved, and loaded back in PyTorch with the adapted model's
    logits."""
    pytest.importorskip("torch")
    source, _ = hf_checkpoint("qwen2")
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 60)
    argv = ["--data", str(text), "--steps", "40", "--eval-interval", "20", "--block-size", "16"]
    argv += ["--rank", "2", "--quiet", "--out", str(tmp_path / "run")]
    # vocabulary 128 and no tokenizer.json: refused, with the reason
    with pytest.raises(SystemExit, match=r"error: .*no tokenizer.json.*tokenizer.model is not"):
        run_example("finetune_llm.py", ["--checkpoint", str(source), *argv], monkeypatch)
    folder = tmp_path / "qwen2"
    shutil.copytree(source, folder)
    character_tokenizer(folder)
    results = run_example("finetune_llm.py", ["--checkpoint", str(folder), *argv], monkeypatch)
    assert results["model_type"] == "qwen2"
    assert results["train_tokens"] + results["val_tokens"] == len(text.read_text())
    assert results["val_loss"] < results["val_loss_before"]
    assert results["transformers_max_logit_difference"] < 1e-4
    assert results["reloaded_max_logit_difference"] < 1e-4
    assert results["base_unchanged"]
    assert "tokenizer.json" in results["saved_files"]  # carried over from the checkpoint
    # the adapted model generates with the folder's tokenizer (examples/generate.py)
    argv = ["--checkpoint", str(results["saved"]), "--prompt", "To be", "--eos-id", "127"]
    generated = run_example("generate.py", [*argv, "--max-new-tokens", "5", "--quiet"], monkeypatch)
    assert generated["prompt_ids"] == [ord(c) for c in "To be"]
    assert generated["text"] == "".join(chr(i) for i in generated["new_ids"])


@pytest.mark.fast_compile  # small programs compiled once: XLA optimisations cost more
def test_mnist_example_exports_the_trained_network(monkeypatch, capsys, tmp_path):
    import onnxruntime as ort  # the onnx extra (in the dev install)

    argv = ["--digits", "--epochs", "1", "--limit", "200", "--quiet", "--out", str(tmp_path)]
    results = run_example("mnist.py", [*argv, "--export", str(tmp_path / "deploy")], monkeypatch)
    exported = results["exported"]
    paths = {name: tmp_path / "deploy" / f"mnist.{name}" for name in ("stablehlo", "onnx")}
    assert {name: exported[name] for name in paths} == paths
    out = capsys.readouterr().out
    assert f"exported stablehlo: {paths['stablehlo']}\nexported onnx: {paths['onnx']}\n" in out
    assert "max |difference| from apply on 8 test images: stablehlo " in out
    diffs = exported["max_diff"]
    assert set(diffs) == {"stablehlo", "onnx"} and max(diffs.values()) < 1e-4
    saved = json.loads(results["files"]["metrics"].read_text())  # metrics.json records them
    assert saved["exported"] == {**{k: str(v) for k, v in paths.items()}, "max_diff": diffs}
    # loaded as a deployment would (JAX + flatbuffers; ONNX Runtime), at another batch size (any
    # batch runs): apply's logits
    trained = results["trained"]
    images = trained["test_images"][8:15]
    expected, _ = lm.apply(trained["model"])(trained["variables"], None, images, False)
    with open(paths["stablehlo"], "rb") as file:
        artifact = jax.export.deserialize(bytearray(file.read()))
    assert jax.numpy.allclose(artifact.call(images), expected, atol=1e-5)
    assert str((artifact.in_avals, artifact.out_avals)) == (  # as docs/deploying.md says
        "((ShapedArray(float32[b,8,8,1]),), (ShapedArray(float32[b,10]),))"
    )
    session = ort.InferenceSession(str(paths["onnx"]), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": images})
    assert jax.numpy.allclose(logits, expected, atol=1e-5)
    # docs/deploying.md's lines for a service, on these files and the raw pixels: apply's classes
    text = (EXAMPLES.parent / "docs" / "deploying.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    service = {}
    exec(next(block for block in blocks if "def classify_onnx(" in block), service)
    pixels = images[..., 0] * 16  # the 8x8 digits' raw values, 0 to 16
    classes = expected.argmax(axis=-1)
    for name in ("stablehlo", "onnx"):
        assert (service[f"classify_{name}"](str(paths[name]), pixels) == classes).all()


def test_mnist_example_refuses_a_bad_export_folder_before_training(monkeypatch, capsys, tmp_path):
    parse_args = example_namespace("mnist.py", monkeypatch)["parse_args"]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    (tmp_path / "taken" / "mnist.onnx").mkdir(parents=True)
    bad = {
        str(a_file): rf"--export: {re.escape(str(a_file))} is a file, not a folder",
        str(a_file / "sub"): rf"{re.escape(str(a_file))} is a file, so the folder .* cannot be",
        str(tmp_path / "taken"): r"mnist.onnx is a folder: remove it, or give another --export",
    }
    for folder, message in bad.items():
        with pytest.raises(SystemExit, match="2"):
            parse_args(["--digits", "--export", folder])
        assert re.search(message, capsys.readouterr().err)
    # --export without DIR writes in --out: checked the same way
    with pytest.raises(SystemExit, match="2"):
        parse_args(["--digits", "--out", str(a_file), "--export"])
    assert "is a file, not a folder" in capsys.readouterr().err
    # a folder the user cannot write in (root can write anywhere: the check is os.access's)
    with monkeypatch.context() as patch, pytest.raises(SystemExit, match="2"):
        patch.setattr("os.access", lambda path, mode: False)
        parse_args(["--digits", "--export", str(tmp_path / "new" / "deploy")])
    assert f"the folder {tmp_path} is not writable" in capsys.readouterr().err
    # a folder that does not exist yet, under one that does, is fine (export creates it)
    assert parse_args(["--digits", "--export", str(tmp_path / "new")]).export == str(
        tmp_path / "new"
    )
