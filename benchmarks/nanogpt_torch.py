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

Needs PyTorch, not a lamina dependency: ``pip install torch==2.15.0`` (PyPI's Linux wheel is the
CUDA build, which runs on the CPU; ``--index-url https://download.pytorch.org/whl/cpu`` gives the
CPU-only wheel). ``--profile`` runs PyTorch's profiler over 10 training iterations instead of
the run and prints where the time goes, per op and per kind of op.
`benchmarks/char_transformer_wall.py` runs it beside the example::

    python benchmarks/nanogpt_torch.py --data ../shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
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


# --profile: the kinds of op, each an op's name with "aten::" and underscores dropped, lower
# case (autograd's nodes, such as ``NativeLayerNormBackward0``, match as their ops do); an op
# takes the kind of its outermost op that has one (the copies inside the attention are
# attention's), else of its phase (`train_step`'s labels), else "other ops"
KINDS = {
    "matmul": (
        "mm",
        "addmm",
        "bmm",
        "matmul",
        "linear",
        "mmbackward0",
        "addmmbackward0",
        "bmmbackward0",
    ),
    "attention": ("scaleddotproduct*", "*flashattention*"),
    "layer norm": ("*layernorm*",),
    "GELU": ("gelu*",),
    "embedding": ("embedding*", "indexselect*"),
    "cross-entropy": ("crossentropy*", "*logsoftmax*", "nllloss*"),
    "AdamW": ("*adamw*",),
    "copies": ("copy", "clone", "contiguous", "clonebackward0"),
}
PHASE_KINDS = {
    "batch": "drawing the batch",
    "forward": "other ops",
    "backward": "other ops",
    "clip": "gradient clipping",
    "optimizer": "AdamW",
}
BETWEEN_OPS = "between ops (Python)"


def kind_of(name):
    """The kind (`KINDS`) of an op named `name`, or None."""
    name = name.split("evaluate_function: ")[-1].removeprefix("aten::").replace("_", "").lower()
    for kind, patterns in KINDS.items():
        for pattern in patterns:
            core = pattern.strip("*")
            if (
                name == core
                or (pattern.startswith("*") and pattern.endswith("*") and core in name)
                or (pattern.endswith("*") and not pattern.startswith("*") and name.startswith(core))
            ):
                return kind
    return None


def profile(train_step, iters=10, warmup=5):
    """Runs `train_step` `warmup` times, then `iters` times under PyTorch's profiler; prints
    the ops by self time and the self time per kind of op and per phase, in ms per iteration."""
    from torch.profiler import ProfilerActivity, record_function

    for _ in range(warmup):
        train_step()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            train_step(record_function)
        wall = time.perf_counter() - start
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    where = f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    kinds, phases, others = {}, {}, {}
    for event in prof.events():
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if event.name in PHASE_KINDS:
            phases[event.name] = phases.get(event.name, 0.0) + event.cpu_time_total
            kind = BETWEEN_OPS if event.name in ("forward", "backward") else PHASE_KINDS[event.name]
        else:
            found = [k for k in map(kind_of, [event.name, *ancestors]) if k is not None]
            phase = [PHASE_KINDS[a] for a in ancestors if a in PHASE_KINDS]
            kind = found[-1] if found else phase[0] if phase else "other ops"
        kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total
        if kind == "other ops":
            others[event.name] = others.get(event.name, 0.0) + event.self_cpu_time_total
    total = sum(kinds.values())
    print(f"\n{iters} training iterations under the profiler after {warmup} warm-up ({where})")
    print(f"wall time: {1000 * wall / iters:.2f} ms per iteration (with the profiler's overhead)")
    print(
        "phases, ms per iteration: "
        + ", ".join(f"{name} {phases.get(name, 0.0) / 1000 / iters:.2f}" for name in PHASE_KINDS)
    )
    print("self time by kind of op, ms per iteration:")
    for kind, micros in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"  {kind:<22} {micros / 1000 / iters:7.2f}  {100 * micros / total:5.1f}%")
    print(f"  {'total':<22} {total / 1000 / iters:7.2f}")
    top = sorted(others.items(), key=lambda item: -item[1])[:6]
    print("other ops, the largest: " + ", ".join(f"{n} {t / 1000 / iters:.2f}" for n, t in top))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a UTF-8 text file")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile 10 training iterations after 5 warm-up ones, print where the time goes, exit",
    )
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

    def train_step(label=lambda name: contextlib.nullcontext()):
        with label("batch"):
            inputs, targets = get_batch("train")
        with label("forward"):
            loss = model(inputs, targets)
        with label("backward"):
            loss.backward()
        with label("clip"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        with label("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT logs every iteration (--log_interval=1)

    if args.profile:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(warmup)
        profile(train_step)
        return

    loop_start = time.perf_counter()
    eval_seconds = 0.0
    for step in range(args.iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        if step % eval_interval == 0 or step == args.iters:
            tick = time.perf_counter()
            losses = estimate_loss()
            eval_seconds += time.perf_counter() - tick
            print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if step == args.iters:
            break
        train_step()
    end = time.perf_counter()
    loop = end - loop_start
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads: "
        f"{1000 * loop / args.iters:.1f} ms per iteration (evaluation included), "
        f"{1000 * (loop - eval_seconds) / args.iters:.2f} ms per training iteration "
        f"({eval_seconds:.1f} s evaluating), {end - START:.1f} s in all"
    )
    print(f"val loss: {losses['val']:.4f}")


if __name__ == "__main__":
    main()
