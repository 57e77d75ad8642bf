"""A quick run of the random-kill harness (`tests/kill_harness.py`): a training run and a data
load, each killed at random instants and restarted, end where an uninterrupted one ends. The
long run (50 kills and more) is manual: `python tests/kill_harness.py --kills=50`."""

import numpy as np
import pytest

import kill_harness


@pytest.mark.slow  # starts other processes
def test_training_killed_at_random_instants_ends_bit_exact(tmp_path):
    result = kill_harness.training(4, np.random.default_rng(1), str(tmp_path), log=lambda s: None)
    assert result["problems"] == []
    assert result["kills"] == 4 and result["starts"] >= 5


@pytest.mark.slow
def test_data_cache_killed_at_random_instants_loads_whole(tmp_path):
    result = kill_harness.data_cache(4, np.random.default_rng(2), str(tmp_path), log=lambda s: None)
    assert result["problems"] == [] and result["kills"] >= 1
