"""A PyTorch eager twin of `SparseTransformer` with dense causal attention, for benchmarks only.

What a user would otherwise train on a CPU: the nanoGPT-style loop in PyTorch eager mode (one
`scaled_dot_product_attention` call per layer, `torch.optim.AdamW`). The module mirrors
`model.transformer` for a dense-attention `ModelConfig` exactly: the same embeddings (token plus
the position tables of `pos_emb`), pre-activation blocks (LayerNorm eps 1e-6, tanh GeLU, biases
everywhere), final norm and head, and the same optimizer (global-norm clipping, AdamW with
decay on matrices only, warmup + cosine decay). `load_jax_params` copies a JAX model's weights
in, so a benchmark can check that both compute the same loss before it times them.

Importing this module needs torch (`requirements-bench.txt`); only the twin's runs of
`sparse_jax.bench.training` import it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparse_jax.model import transformer as model_lib
from sparse_jax.model.config import ModelConfig, model_config


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.num_heads
        self.attn_norm = nn.LayerNorm(d, eps=1e-6)
        self.query, self.key = nn.Linear(d, cfg.qk_dim), nn.Linear(d, cfg.qk_dim)
        self.value, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.ff_norm = nn.LayerNorm(d, eps=1e-6)
        self.ff_in, self.ff_out = nn.Linear(d, cfg.ff_dim), nn.Linear(cfg.ff_dim, d)
        self.dropout = cfg.dropout

    def forward(self, h):
        b, n, d = h.shape
        x = self.attn_norm(h)
        split = lambda y: y.view(b, n, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = F.dropout(self.out(a.transpose(1, 2).reshape(b, n, d)), self.dropout, self.training)
        x = self.ff_norm(h + a)
        f = F.dropout(self.ff_out(F.gelu(self.ff_in(x), approximate="tanh")), self.dropout,
                      self.training)
        return h + a + f


class Transformer(nn.Module):
    """`SparseTransformer` with dense causal attention: int64[B, n] -> float32[B, n, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.pattern != "dense" or cfg.scan_layers or cfg.rotary:
            raise ValueError("the PyTorch twin mirrors dense-attention, unscanned models without "
                             "rotary embeddings only")
        self.cfg = cfg
        tables = model_lib.position_tables(cfg)
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeds = nn.ModuleList(nn.Embedding(size, cfg.d_model) for size, _ in tables)
        self.register_buffer("pos_index", torch.as_tensor(np.stack([i for _, i in tables])))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=1e-6)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.token_embed(tokens)
        for table, index in zip(self.pos_embeds, self.pos_index):
            h = h + table(index[:n])[None]
        for block in self.blocks:
            h = block(h)
        return self.head(self.final_norm(h))


def loss_bits(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / math.log(2)


def load_jax_params(module: Transformer, params) -> None:
    """Copies a `SparseTransformer`'s parameters (`nnx.to_pure_dict(nnx.state(model))`) in."""
    def put(tensor, value):
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(np.array(value, np.float32)))

    def linear(mod, p):  # flax kernels are [in, out], torch weights [out, in]
        put(mod.weight, np.asarray(p["kernel"]).T)
        put(mod.bias, p["bias"])

    def norm(mod, p):
        put(mod.weight, p["scale"])
        put(mod.bias, p["bias"])

    put(module.token_embed.weight, params["token_embed"]["embedding"])
    for i, table in enumerate(module.pos_embeds):
        put(table.weight, params["pos_embeds"][i]["embedding"])
    for i, block in enumerate(module.blocks):
        p = params["blocks"][i]
        norm(block.attn_norm, p["attn_norm"])
        norm(block.ff_norm, p["ff_norm"])
        for name in ("query", "key", "value", "out"):
            linear(getattr(block, name), p["attn"][name])
        linear(block.ff_in, p["ff_in"])
        linear(block.ff_out, p["ff_out"])
    norm(module.final_norm, params["final_norm"])
    linear(module.head, params["head"])


def make_optimizer(module: Transformer, opt, total_steps: int):
    """(AdamW, LambdaLR scheduler, clip norm) equal to `sparse_jax.run.optim.make_optimizer`."""
    decay = [p for p in module.parameters() if p.ndim >= 2]
    rest = [p for p in module.parameters() if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                               {"params": rest, "weight_decay": 0.0}],
                              lr=opt.lr, betas=(opt.b1, opt.b2), eps=1e-8)

    def factor(step):  # optax.warmup_cosine_decay_schedule(0, lr, warmup, total, lr * min)
        if step < opt.warmup_steps:
            return step / opt.warmup_steps
        frac = min(1.0, (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, factor), opt.grad_clip


def train_and_evaluate(config, dataset, init_params, compile: bool = False) -> dict:
    """Trains the twin of `config`'s model on `dataset` as `sparse_jax.train` would (the same
    batches, steps, optimizer and initial parameters `init_params`), then scores the valid split
    over at most config.eval_batches batches. Returns timings, losses and valid bits. `compile`:
    the module runs through `torch.compile` (its compilation falls in the first step, which the
    steps/s leave out)."""
    import time

    cfg = model_config(config.model)
    module = Transformer(cfg)
    load_jax_params(module, init_params)
    forward = torch.compile(module) if compile else module
    adamw, schedule, clip = make_optimizer(module, config.optimizer, config.total_steps)
    iterator = dataset.train_batches(config.batch_size)
    losses, window, start = {}, [], time.perf_counter()
    first_step_s = None
    module.train()
    for step in range(1, config.total_steps + 1):
        batch = next(iterator)
        loss = loss_bits(forward(torch.from_numpy(batch["inputs"]).long()),
                         torch.from_numpy(batch["targets"]).long())
        adamw.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        adamw.step()
        schedule.step()
        if step == 1:
            first_step_s = time.perf_counter() - start
        window.append(loss.detach())
        if step % config.log_every == 0 or step == config.total_steps:  # as the trainer logs
            losses[step], window = torch.stack(window).mean().item(), []
    train_s = time.perf_counter() - start
    module.eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i, batch in enumerate(dataset.eval_batches("valid", config.batch_size)):
            if 0 < config.eval_batches <= i:
                break
            logits = forward(torch.from_numpy(batch["inputs"]).long())
            nll = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch["targets"]).long()
                                  .flatten(), reduction="none") / math.log(2)
            mask = torch.from_numpy(batch["mask"]).flatten().float()
            total, count = total + float((nll * mask).sum()), count + float(mask.sum())
    return {"train_s": train_s, "first_step_s": first_step_s,
            "steps_per_s": (config.total_steps - 1) / (train_s - first_step_s),
            "train_bits": losses, "valid_bits": total / max(count, 1.0),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "compiled": compile}
