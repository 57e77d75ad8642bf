"""Rows and batches on the host (NumPy): the byte splits and evaluation windows of a byte stream
(the paper's minimum-context protocol), the rows of pictures, and the training iterators, pure
functions of (seed, step) whose state a checkpoint holds (``data.datasets`` explains the
batches and the iterators' contract).
"""

from typing import NamedTuple

import numpy as np

from sparse_jax.data.sources import SPLITS

# ---------------------------------------------------------------------------------------------
# Rows of a byte stream and of images.


def split_bytes(data: np.ndarray, fractions=(0.9, 0.05, 0.05)) -> dict[str, np.ndarray]:
    """Contiguous train/valid/test slices (views) in this order; sizes round(cumsum(f) * n)."""
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split_fractions must be 3 non-negative numbers summing to 1, got "
                         f"{fractions}")
    cuts = [0, *(int(round(c * len(data))) for c in np.cumsum(fractions)[:2]), len(data)]
    return {name: data[a:b] for name, a, b in zip(SPLITS, cuts[:-1], cuts[1:])}


class EvalWindows(NamedTuple):
    """Evaluation windows over a byte split of n bytes, with window length L.

    Window w has inputs data[s:s+L] and targets data[s+1:s+L+1] (s = starts[w], zero-padded past
    the end); it scores positions j with score_from[w] <= j < score_to[w]. Together the windows
    score every target data[t], 1 <= t < n, exactly once (data[0] is only context).
    """

    starts: np.ndarray  # int64 [W]
    score_from: np.ndarray  # int64 [W]
    score_to: np.ndarray  # int64 [W]; < L only in a final partial window


def eval_windows(data: np.ndarray, seq_len: int, min_context: int | None = None) -> EvalWindows:
    """Non-overlapping windows (min_context None or 0), or windows with stride seq_len - m that
    score only positions j >= m (so each scored byte sees m + 1 or more bytes before it), except
    the first window, which scores everything; the paper's Table 3 protocol."""
    m = min_context or 0
    if not 0 <= m < seq_len:
        raise ValueError(f"min_context must be in [0, seq_len={seq_len}), got {min_context}")
    num_targets, stride = len(data) - 1, seq_len - m
    count = 0 if num_targets <= 0 else 1 + max(0, -(-(num_targets - seq_len) // stride))
    starts = np.arange(count, dtype=np.int64) * stride
    score_from = np.where(starts == 0, 0, m).astype(np.int64)
    score_to = np.minimum(seq_len, num_targets - starts)
    return EvalWindows(starts, score_from, score_to)


def read_windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Inputs data[s:s+L] and targets data[s+1:s+L+1] for each start, zero-padded past the end."""
    rows = np.zeros((len(starts), seq_len + 1), np.int32)
    for i, s in enumerate(starts):
        chunk = data[s:s + seq_len + 1]
        rows[i, :len(chunk)] = chunk
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def image_rows(images: np.ndarray) -> dict[str, np.ndarray]:
    """Targets: the images; inputs: the images shifted right by one, 0 in front."""
    targets = images.astype(np.int32)
    inputs = np.concatenate([np.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)
    return {"inputs": inputs, "targets": targets}


# ---------------------------------------------------------------------------------------------
# Training iterators.


class Stage(NamedTuple):
    """A context stage of a training run: the steps before `until` (those not in an earlier
    stage) read `batch_size` windows of `seq_len`. `config.context_stages` spells them in this
    order; `sparse_jax.train` appends the full context until total_steps."""

    until: int
    seq_len: int
    batch_size: int


class StepIterator:
    """An iterator whose batch at step k is `self.batch_at(k)`: its state is (seed, step)."""

    def __init__(self, seed: int, step: int = 0):
        self.seed, self.step = int(seed), int(step)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def get_state(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


class ByteWindows(StepIterator):
    """Training windows at uniformly random offsets of one contiguous (memory-mapped) array.

    Step k's global batch of batch_size x process_count windows is drawn from
    default_rng([seed, k]) and this process reads its slice, so the global batch does not
    depend on how many processes share it."""

    def __init__(self, data, seq_len, batch_size, seed=0, process_index=0, process_count=1):
        super().__init__(seed)
        if len(data) <= seq_len:
            raise ValueError(f"{len(data)} bytes cannot hold a window of {seq_len} + 1")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.process_index, self.global_batch = process_index, batch_size * process_count

    def starts_at(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.data) - self.seq_len, size=self.global_batch)
        first = self.process_index * self.batch_size
        return starts[first:first + self.batch_size]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return read_windows(self.data, self.starts_at(step), self.seq_len)


class StagedBatches(StepIterator):
    """Context stages: step k's batch comes from the first stage whose `until` exceeds k,
    else from `last` (the full context). Every iterator draws step k's batch from its own
    (seed, k), so the state stays (seed, step) and a resume lands in the right stage."""

    def __init__(self, stages: list[tuple[int, StepIterator]], last: StepIterator):
        """`stages`: (until, the iterator of the steps before until), in step order."""
        super().__init__(last.seed)
        self.stages, self.last = stages, last

    def iterator_at(self, step: int) -> StepIterator:
        return next((it for until, it in self.stages if step < until), self.last)

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return self.iterator_at(step).batch_at(step)

    def set_state(self, state: dict[str, int]) -> None:
        super().set_state(state)
        for it in (*(it for _, it in self.stages), self.last):
            it.seed = self.seed


class ImageBatches(StepIterator):
    """Epochs of shuffled images (each a permutation from default_rng([seed, epoch])), read in
    global batches of batch_size x process_count of which this process takes its slice; the
    last partial global batch of an epoch is dropped."""

    def __init__(self, source, batch_size, seed=0, process_index=0, process_count=1):
        super().__init__(seed)
        self.source, self.batch_size = source, batch_size
        self.process_index, self.global_batch = process_index, batch_size * process_count
        self.steps_per_epoch = len(source) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(source)} images are fewer than one global batch of "
                             f"{self.global_batch}")

    def indices_at(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
        first = i * self.global_batch + self.process_index * self.batch_size
        return perm[first:first + self.batch_size]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return image_rows(self.source.images(self.indices_at(step)))
