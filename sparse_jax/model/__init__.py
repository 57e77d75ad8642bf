"""The paper's model in Flax NNX: ``layers`` (sparse self-attention and the residual block, each
with a cached ``decode_step``), ``transformer`` (``ModelConfig``, ``SparseTransformer``, the loss)
and ``decode`` (cached sampling of any length). The names below are the public surface."""

from sparse_jax.model.config import DTYPES, PATTERNS, ModelConfig, model_config
from sparse_jax.model.decode import generate, windows
from sparse_jax.model.layers import Block, SparseSelfAttention
from sparse_jax.model.transformer import SparseTransformer, loss_bits, position_tables, token_bits

__all__ = ["DTYPES", "PATTERNS", "Block", "ModelConfig", "SparseSelfAttention",
           "SparseTransformer", "generate", "loss_bits", "model_config", "position_tables",
           "token_bits", "windows"]
