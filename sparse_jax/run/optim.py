"""The optimizer and the training state it implies, with nothing of the loop: AdamW with warmup
and cosine decay (`make_optimizer`), the model and optimizer a run creates (`state_builders`)
and the shapes of that state without allocating it (`abstract_train_state`). A leaf module, so
that the cost model (`sparse_jax.run.sizing`) and the trainer (`sparse_jax.train`) both read it
without one importing the other."""

from __future__ import annotations

import jax
import ml_collections
import optax
from flax import nnx

from sparse_jax.model.config import ModelConfig, model_config
from sparse_jax.model.transformer import SparseTransformer


def make_optimizer(config: ml_collections.ConfigDict):
    """(optax transform, learning-rate schedule): clip, then AdamW with warmup + cosine decay."""
    opt = config.optimizer
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, opt.warmup_steps, config.total_steps, end_value=opt.lr * opt.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                        mask=decay_mask)
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw), schedule
    return adamw, schedule


def state_builders(config, cfg: ModelConfig):
    """(create, init, schedule): create() -> (model, optimizer); init() -> the state
    {"params", "opt"} of nnx States; the learning-rate schedule."""
    tx, schedule = make_optimizer(config)

    def create():
        model = SparseTransformer(cfg, rngs=nnx.Rngs(config.seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def init():
        model, optimizer = create()
        return {"params": nnx.state(model), "opt": nnx.state(optimizer)}

    return create, init, schedule


def abstract_train_state(config):
    """Shapes and dtypes ({"params", "opt"} of ShapeDtypeStructs) of the training state of
    `config`, without allocating it."""
    return jax.eval_shape(state_builders(config, model_config(config.model))[1])
