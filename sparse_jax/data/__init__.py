"""Where a run's bytes and pictures come from and how they are batched: ``sources`` (enwik8, byte
files, CIFAR-10 through TFDS, the generated stream; the cache-and-vouch machinery), ``images``
(folders of pictures), ``datasets`` (``DataConfig``, byte and picture datasets, batch
iterators), ``baselines`` (what compressors and PNG/WebP pay, copy distances) and
``code_corpus`` (the larger code corpus, built from pinned sources). The names below are the
public surface."""

from sparse_jax.data.batches import Stage
from sparse_jax.data.datasets import DataConfig, Dataset, data_config, make_dataset, prepare

__all__ = ["DataConfig", "Dataset", "Stage", "data_config", "make_dataset", "prepare"]
