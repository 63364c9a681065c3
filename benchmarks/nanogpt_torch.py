"""nanoGPT's Shakespeare run in PyTorch: the reference the char transformer example races.

A re-creation of nanoGPT's GPT (karpathy/nanoGPT ``model.py``: pre-norm blocks, LayerNorm
with biases, `scaled_dot_product_attention` with a causal mask, a 4x GELU MLP, the output
layer tied to the token embedding, GPT-2's initialisation) and of its training loop
(``train.py``: random windows drawn per iteration, AdamW with betas (0.9, 0.99) and weight
decay 0.1 on the matrices, linear warmup then cosine decay to lr / 10, gradients clipped to
norm 1, evaluation of 20 batches of each split every 250 iterations, the loss read every
iteration), with nanoGPT's CPU settings for Shakespeare::

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False
        --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
        --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

Needs PyTorch (``pip install torch==2.13.0`` takes a CPU build); not a lamina dependency.
`benchmarks/char_transformer_wall.py` runs it beside the example::

    python benchmarks/nanogpt_torch.py --data ../shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import math
import time

START = time.perf_counter()

import numpy as np  # noqa: E402  (the clock starts before the imports, as `time` measures)
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.width, self.heads = width, heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2, self.c_fc = nn.LayerNorm(width), nn.Linear(width, 4 * width)
        self.gelu, self.c_proj = nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, layers, heads, width, block_size):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(block_size, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a UTF-8 text file")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    layers, heads, width, block_size, batch_size = 4, 4, 128, 64, 12
    lr, min_lr, warmup, eval_interval, eval_iters = 1e-3, 1e-4, 100, 250, 20
    torch.manual_seed(args.seed)

    with open(args.data, encoding="utf-8") as file:
        text = file.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.uint16)
    split = int(0.9 * len(data))
    parts = {"train": data[:split], "val": data[split:]}

    def get_batch(part):
        ids = parts[part]
        starts = torch.randint(len(ids) - block_size, (batch_size,))

        def window(offset):
            rows = [ids[i + offset : i + offset + block_size].astype(np.int64) for i in starts]
            return torch.stack([torch.from_numpy(row) for row in rows])

        return window(0), window(1)

    model = GPT(len(chars), layers, heads, width, block_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.99),
    )

    def learning_rate(step):
        if step < warmup:
            return lr * (step + 1) / (warmup + 1)
        ratio = (step - warmup) / (args.iters - warmup)
        return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        losses = {
            part: float(np.mean([model(*get_batch(part)).item() for _ in range(eval_iters)]))
            for part in parts
        }
        model.train()
        return losses

    loop_start = time.perf_counter()
    for step in range(args.iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        if step % eval_interval == 0 or step == args.iters:
            losses = estimate_loss()
            print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if step == args.iters:
            break
        inputs, targets = get_batch("train")
        loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT logs every iteration (--log_interval=1)
    end = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads: "
        f"{1000 * (end - loop_start) / args.iters:.1f} ms per iteration (evaluation included), "
        f"{end - START:.1f} s in all"
    )
    print(f"val loss: {losses['val']:.4f}")


if __name__ == "__main__":
    main()
