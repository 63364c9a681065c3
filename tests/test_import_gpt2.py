"""examples/import_gpt2.py: GPT-2 from a `transformers` state dict gives transformers' numbers.

A small randomly initialised ``GPT2LMHeadModel`` (nothing is downloaded): lamina's logits
equal PyTorch's, greedy decoding with lamina's attention cache picks the tokens
``generate(do_sample=False)`` picks, the export back is exact, and the example's command line
reads a checkpoint folder.
"""

import importlib.util
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never download
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import lamina as lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "import_gpt2.py"


def load_example():
    spec = importlib.util.spec_from_file_location("import_gpt2", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_gpt2"] = module
    spec.loader.exec_module(module)
    return module


gpt2 = load_example()


@pytest.fixture(scope="module")
def torch_model():
    """A small GPT-2 with random weights (larger than its initialisation: varied tokens)."""
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=61,
        n_positions=24,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(0, 61, (2, 6)).astype(np.int32)


@pytest.fixture(scope="module")
def converted(torch_model, prompt):
    model = gpt2.GPT2(torch_model.config, decode_batch=prompt.shape[0])
    return model, gpt2.convert(model, torch_model.state_dict())


def test_logits_equal_pytorch(torch_model, prompt, converted):
    model, variables = converted
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(prompt.astype(np.int64))).logits.numpy()
    logits, _ = lm.transform(model).apply(variables, None, jnp.asarray(prompt))
    assert np.abs(expected).max() > 1.0  # logits of a size where errors would show
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_with_the_cache_equals_transformers(torch_model, prompt, converted):
    _, variables = converted
    tokens = gpt2.generate(torch_model.config, variables, prompt, 10)
    reference = gpt2.generate_with_transformers(torch_model, prompt, 10)
    assert tokens.shape == (2, 16) and np.array_equal(tokens[:, :6], prompt)
    assert len(np.unique(tokens[:, 6:])) > 3  # not a degenerate repetition
    np.testing.assert_array_equal(tokens, reference)


def test_generation_refuses_to_pass_n_positions(torch_model, prompt, converted):
    with pytest.raises(ValueError, match="exceed GPT-2's n_positions=24"):
        gpt2.generate(torch_model.config, converted[1], prompt, 19)


def test_export_back_is_exact(torch_model, converted):
    model, variables = converted
    back = lm.to_torch(model, variables, rename=gpt2.RENAME)
    original = torch_model.state_dict()
    assert set(back) == set(original) - {"lm_head.weight"}  # tied: the token embedding
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    fresh = transformers.GPT2LMHeadModel(torch_model.config).eval()
    missing, unexpected = fresh.load_state_dict(back, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    fresh.tie_weights()
    assert torch.equal(fresh.lm_head.weight, original["lm_head.weight"])


def test_an_untied_head_is_refused(torch_model, converted):
    state_dict = dict(torch_model.state_dict())
    state_dict["lm_head.weight"] = state_dict["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from transformer\.wte\.weight"):
        gpt2.convert(converted[0], state_dict)


def save_word_tokenizer(folder):
    """A word-level tokenizer of the model's 61 ids, saved as Hugging Face saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["hello", ",", "my", "name", "is", *(f"w{i}" for i in range(56))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def test_the_example_reads_a_checkpoint_folder_and_its_tokenizer(torch_model, tmp_path, capsys):
    torch_model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path)
    argv = ["--checkpoint", str(tmp_path), "--prompt", "hello, my name is", "--tokens", "5"]
    results = gpt2.main(argv)
    assert results["same"] and results["logits_difference"] < 1e-4
    assert results["tokens"].shape == (1, 10)
    np.testing.assert_array_equal(results["tokens"][0, :5], [0, 1, 2, 3, 4])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("'hello, my name is w")  # the text, decoded
    assert lines[-1].endswith("generated 5 tokens, same as transformers: True")


def test_the_example_without_a_checkpoint(capsys):
    results = gpt2.main(["--tokens", "3"])
    assert results["same"] and results["tokens"].shape == (2, 8)
    assert "same as transformers: True" in capsys.readouterr().out.splitlines()[-1]
