"""Meshes, FSDP sharding and multi-process training.

The pytest process has one CPU device. Runs on 8 devices use a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (and JAX_CPU_ENABLE_ASYNC_DISPATCH=false: many
queued steps on fake CPU devices can deadlock in an all-reduce); the multi-process test starts two
processes of 2 devices each that meet through a coordinator on 127.0.0.1.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import cheap_compile
from sparse_jax import sharding as S
from sparse_jax import train
from sparse_jax.model import transformer as M
from sparse_jax.model.config import model_config
from sparse_jax.run import optim, setup
from test_train import ROOT, get_config, read_metrics

TESTS = os.path.dirname(os.path.abspath(__file__))
# Every run below: the tiny bytes model, a global batch of 16 in 2 micro-batches of 8 (one
# sequence per device on 8 devices), 5 steps, checkpoints at 5 (and 8 after a resume).
RUN = {"batch_size": 16, "optimizer__grad_accum": 2, "optimizer__warmup_steps": 2,
       "total_steps": 5, "eval_every": 5, "log_every": 1, "checkpoint_every": 5}


def run_config(byte_file, **overrides):
    return get_config("bytes", data__path=byte_file, **{**RUN, **overrides})


def losses(workdir, split="train"):
    return {r["step"]: r["bits"] for r in read_metrics(workdir) if r["split"] == split}


def child_env(devices):
    """A child with `devices` CPU devices; it compiles as this process does (`cheap_compile`):
    its cost is compiling tiny programs, and its results are compared with this process's."""
    return cheap_compile({**os.environ, "JAX_PLATFORMS": "cpu",
                          "JAX_CPU_ENABLE_ASYNC_DISPATCH": "false",
                          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})


# ---------------------------------------------------------------------------------------------
# Logical axes and per-device memory (no devices needed).


@pytest.mark.parametrize("name,arg,scan", [("quickstart", None, False),
                                           ("enwik8", "size=paper", False),
                                           ("cifar10", "size=paper", True),
                                           ("cifar10", "size=tiny", False)])
def test_every_parameter_and_optimizer_array_has_logical_axes(name, arg, scan):
    config = get_config(name, arg, model__scan_layers=scan)
    state = optim.abstract_train_state(config)
    specs = S.state_partition_specs(state)
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(state)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    assert len(spec_leaves) == len(leaves)
    matrices = 0
    for (path, x), spec in zip(leaves, spec_leaves):
        assert len(spec) == x.ndim
        name = jax.tree_util.keystr(path)
        if x.ndim == 0:
            assert spec == jax.sharding.PartitionSpec()
        elif "embed" in name:  # token / position tables stay whole
            assert "fsdp" not in spec, name
        elif (x.ndim == 2 + scan and "blocks" in name) or ("head" in name and x.ndim == 2):
            assert "fsdp" in spec, name  # every weight matrix is split
            matrices += 1
    assert matrices >= 3 * 6  # q, k, v, out, ff_in, ff_out of params, mu and nu at least


def test_per_device_memory_shrinks_with_fsdp():
    state = optim.abstract_train_state(get_config("enwik8", "size=paper"))
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert S.per_device_bytes(state, {"data": 8, "fsdp": 1}) == whole
    quarter = S.per_device_bytes(state, {"data": 2, "fsdp": 4})
    # Only the embedding tables, norms and step counts stay whole: under 2% of the model.
    assert whole / 4 < quarter < whole / 4 * 1.02


def test_logical_axes_by_path():
    assert S.logical_axes(("blocks", 3, "ff_in", "kernel"), 2) == ("embed", "mlp")
    assert S.logical_axes(("block_groups", "blocks", 0, "attn", "value", "kernel"), 3) == (
        "layers", "embed", "heads")
    assert S.logical_axes(("opt_state", 0, "mu", "pos_embeds", 1, "embedding"), 2) == (
        "position", "table")
    assert S.logical_axes(("opt", "step"), 0) == ()
    with pytest.raises(ValueError, match="no logical axis names.*mystery/kernel"):
        S.logical_axes(("blocks", 0, "mystery", "kernel"), 2)
    with pytest.raises(ValueError, match="rank 4"):
        S.logical_axes(("blocks", 0, "ff_in", "kernel"), 4)


def test_bad_meshes_are_clear_errors():
    assert S.mesh_shape(8, -1, 4) == {"data": 2, "fsdp": 4, "seq": 1}
    assert S.mesh_shape(8, -1, 2, 2) == {"data": 2, "fsdp": 2, "seq": 2}
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        S.mesh_shape(8, -1, 3)
    with pytest.raises(ValueError, match="mesh.fsdp=2 x mesh.seq=3 does not divide the 8"):
        S.mesh_shape(8, -1, 2, 3)
    with pytest.raises(ValueError, match="mesh.seq must be a positive integer"):
        S.mesh_shape(8, -1, 1, 0)
    with pytest.raises(ValueError, match="must equal the 8 devices"):
        S.mesh_shape(8, 4, 4)
    with pytest.raises(ValueError, match="positive integer"):
        S.mesh_shape(8, -1, 0)
    state = optim.abstract_train_state(get_config("bytes", data__path="unused"))  # d_model = 64
    with pytest.raises(ValueError, match="cannot be split over mesh axis 'fsdp' of size 3"):
        S.per_device_bytes(state, {"data": 1, "fsdp": 3})


def test_distributed_start_up_needs_size_and_rank(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert S.initialize_distributed() is False  # one process: nothing to join
    with pytest.raises(ValueError, match="--num_processes and --process_id"):
        S.initialize_distributed("127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        S.initialize_distributed("127.0.0.1:1234", 2, 2)
    for address in ("garbage", "127.0.0.1", "127.0.0.1:port", ":1234", "host:70000"):
        with pytest.raises(ValueError, match=f"--coordinator_address='{address}' must be "
                                             "HOST:PORT"):
            S.initialize_distributed(address, 2, 0)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "garbage")  # named as the variable
    with pytest.raises(ValueError, match=r"\$JAX_COORDINATOR_ADDRESS='garbage' must be HOST:PORT"):
        S.initialize_distributed()


@pytest.mark.slow  # starts other processes
def test_cpu_devices_one_per_core_unless_xla_flags_say_otherwise():
    code = ("from sparse_jax import sharding as S; import sys; "
            "got = S.set_cpu_devices(int(sys.argv[1])); import jax; "
            "print(got, len(jax.devices()), S.set_cpu_devices(1))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = lambda count, env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, str(count)], capture_output=True, text=True, timeout=120,
        env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, check=True).stdout.split()
    assert run(3, env) == ["3", "3", "None"]  # after JAX started: left alone
    assert run(-1, env) == [str(S.cpu_cores())] * 2 + ["None"]
    forced = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=5"}
    assert run(3, forced) == ["None", "5", "None"]
    with pytest.raises(ValueError, match="cpu_devices"):
        S.set_cpu_devices(0)


@pytest.mark.slow  # starts other processes
def test_describe_reports_per_device_memory():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "describe.py"),
         f"--config={os.path.join(ROOT, 'configs', 'enwik8.py')}", "--devices=8",
         "--config.mesh.fsdp=4", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    per_device = info["per_device"]
    assert per_device["mesh"] == {"data": 2, "fsdp": 4, "seq": 1}
    float32_bytes, fsdp = 4, 4
    assert per_device["params_bytes"] == pytest.approx(info["params"] * float32_bytes / fsdp,
                                                       rel=0.02)
    assert per_device["optimizer_bytes"] == pytest.approx(2 * per_device["params_bytes"],
                                                          rel=0.01)


# ---------------------------------------------------------------------------------------------
# 8 simulated devices and 2 processes against 1 device.


def _eight_device_child(byte_file, workdir):
    """Runs in a subprocess with 8 devices (see test_eight_devices_...)."""
    assert jax.device_count() == 8
    # Parameters and optimizer state are really split in the data x fsdp layout.
    config = run_config(byte_file, mesh__fsdp=4)
    cfg = model_config(config.model)
    mesh = setup.make_mesh(config)
    jitted = train.make_jitted(config, cfg, mesh)
    state = jitted.init()
    kernel = state["params"]["blocks"][0]["ff_in"]["kernel"][...]
    mu = state["opt"]["opt_state"][1][0]["mu"]["blocks"][0]["ff_in"]["kernel"][...]
    for x in (kernel, mu):
        assert x.sharding.spec == jax.sharding.PartitionSpec("fsdp", None), x.sharding
        assert x.addressable_shards[0].data.shape == (x.shape[0] // 4, x.shape[1])
    batch = {"inputs": jnp.zeros((16, cfg.seq_len), jnp.int32)}
    batch["targets"] = batch["inputs"]
    batch = jax.device_put(batch, jitted.batch_sharding)
    rng = jax.device_put(jax.random.key(0),
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    state, _ = jitted.train_step(state, batch, rng)
    kernel = state["params"]["blocks"][0]["ff_in"]["kernel"][...]
    assert kernel.addressable_shards[0].data.shape == (kernel.shape[0] // 4, kernel.shape[1])
    # The runs the parent compares with its 1-device runs.
    train.train(run_config(byte_file), os.path.join(workdir, "data8"))
    train.train(run_config(byte_file, mesh__fsdp=4), os.path.join(workdir, "fsdp4"))
    train.train(run_config(byte_file, mesh__fsdp=4, total_steps=8),
                os.path.join(workdir, "one_then_eight"))
    # Evaluation of a run trained with fsdp restores its parameters split the same way.
    from sparse_jax import evaluate

    result = evaluate.evaluate(os.path.join(workdir, "fsdp4"), "valid", 5, progress=False,
                               write=False)
    assert result["devices"] == 8
    print("CHILD OK", json.dumps({"eval_bits": result["bits"]}))


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory, byte_file):
    """A 1-device run: 5 steps (checkpoint at 5, copied to `one_then_eight` and `one_at_5`),
    then to 8."""
    root = tmp_path_factory.mktemp("sharding")
    train.train(run_config(byte_file), str(root / "one"))
    shutil.copytree(root / "one", root / "one_then_eight")
    shutil.copytree(root / "one", root / "one_at_5")
    train.train(run_config(byte_file, total_steps=8), str(root / "one"))
    return root


@pytest.mark.slow  # starts other processes
def test_eight_devices_match_one_device_and_checkpoints_move_between_them(one_device_run,
                                                                           byte_file):
    root = one_device_run
    code = ("import test_sharding as t; "
            f"t._eight_device_child({byte_file!r}, {str(root)!r})")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(8), cwd=TESTS,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "CHILD OK" in out.stdout, out.stdout + out.stderr[-5000:]
    child = json.loads(out.stdout.split("CHILD OK", 1)[1])
    from sparse_jax import evaluate

    on_one = evaluate.evaluate(str(root / "fsdp4"), "valid", 5, progress=False, write=False)
    assert child["eval_bits"] == pytest.approx(on_one["bits"], abs=1e-5)
    one = losses(root / "one")
    assert sorted(one) == list(range(1, 9))
    for layout in ("data8", "fsdp4"):  # same global batch, 8 devices: same losses
        got = losses(root / layout)
        assert sorted(got) == [1, 2, 3, 4, 5]
        for step in got:
            assert got[step] == pytest.approx(one[step], abs=1e-5), (layout, step)
        assert losses(root / layout, "valid")[5] == pytest.approx(
            losses(root / "one", "valid")[5], abs=1e-5)
    # Saved on 1 device, resumed on 8 (fsdp); saved on 8 (fsdp), resumed on 1.
    train.train(run_config(byte_file, total_steps=8), str(root / "fsdp4"))
    for workdir in ("one_then_eight", "fsdp4"):
        got = losses(root / workdir)
        for step in (6, 7, 8):
            assert got[step] == pytest.approx(one[step], abs=1e-5), (workdir, step)


def _seq_gradients(pattern, seq, attention="xla", fsdp=1):
    """The loss and gradients of the tiny bytes model with `pattern` at its initial
    parameters, on a random batch of 8, on a mesh of `fsdp` x `seq` devices (data takes the
    rest of the 8); the 5-step comparison is scripts/context_parallel.py --model_steps."""
    import numpy as np
    from flax import nnx

    config = run_config("unused", model__pattern=pattern, model__attention=attention,
                        mesh__seq=seq, mesh__fsdp=fsdp, batch_size=8, optimizer__grad_accum=1)
    cfg = model_config(config.model)
    mesh = setup.make_mesh(config)
    jitted = train.make_jitted(config, cfg, mesh)
    params = jitted.init()["params"]
    tokens = np.random.default_rng(0).integers(0, 256, (8, cfg.seq_len + 1), np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                           jitted.batch_sharding)
    model_def = nnx.graphdef(nnx.eval_shape(lambda: M.SparseTransformer(cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def loss_and_grads(params, batch):
        def loss(params):
            logits = nnx.merge(model_def, params)(
                batch["inputs"], activation_sharding=jitted.batch_sharding)
            return M.loss_bits(logits, batch["targets"])
        return jax.value_and_grad(loss)(params)

    return loss_and_grads(params, batch)


def _seq_child(byte_file, workdir):
    """Runs in a subprocess with 8 devices (see test_sequences_split_over_devices_...)."""
    import shutil

    import numpy as np

    from sparse_jax import evaluate

    assert jax.device_count() == 8
    differences = {}
    # (pattern, implementation, fsdp, seq): the CPU kernels inside the split beside FSDP
    for pattern, attention, fsdp, seq in (("strided", "xla", 1, 8), ("fixed", "xla", 1, 8),
                                          ("dense", "xla", 1, 8), ("strided", "native", 2, 4)):
        (l1, g1), (l8, g8) = (_seq_gradients(pattern, 1),
                              _seq_gradients(pattern, seq, attention, fsdp))
        g1, g8 = ({jax.tree_util.keystr(k): np.asarray(v) for k, v in
                   jax.tree_util.tree_leaves_with_path(g)} for g in (g1, g8))
        # each array's largest difference over its largest entry, but the key bias's: it has
        # no gradient (a softmax ignores a score added to every key), only rounding noise
        differences[f"{pattern}@{attention} fsdp={fsdp} seq={seq}"] = {
            "loss": abs(float(l1) - float(l8)) / float(l1),
            "grads": max(float(np.abs(g1[k] - g8[k]).max() / np.abs(g1[k]).max())
                         for k in g1 if "['key']['bias']" not in k)}
    # Saved on 1 device (seq=1), resumed with each sequence split over 2 (data over 4): a real
    # run (train.train: data, checkpoints, validation), then evaluated split the same way.
    resumed = os.path.join(workdir, "then_seq2")
    shutil.copytree(os.path.join(workdir, "one_at_5"), resumed)
    train.train(run_config(byte_file, mesh__seq=2, total_steps=8), resumed)
    result = evaluate.evaluate(resumed, "valid", 5, progress=False, write=False)
    assert result["devices"] == 8
    print("CHILD OK", json.dumps({"differences": differences, "eval_bits": result["bits"]}))


@pytest.mark.slow  # starts other processes
def test_sequences_split_over_devices_match_one_device(one_device_run, byte_file, capsys):
    """mesh.seq: each sequence's positions over 8 devices (context parallelism) computes the
    loss and gradients of one device (unsplit), within 1e-5 relative, for strided, fixed and
    dense, and strided with the fused CPU kernels inside the split over 4 beside fsdp=2; a
    checkpoint of 1 device resumes with seq=2 as the 1-device run went on (losses,
    validation), and the run evaluates split as on one device; sampling reads it on one
    device."""
    root = one_device_run
    code = f"import test_sharding as t; t._seq_child({byte_file!r}, {str(root)!r})"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(8), cwd=TESTS,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "CHILD OK" in out.stdout, out.stdout + out.stderr[-5000:]
    child = json.loads(out.stdout.split("CHILD OK", 1)[1])
    for pattern, diffs in child["differences"].items():
        for what, d in diffs.items():
            assert d < 1e-5, (pattern, what, d)
    one = losses(root / "one")
    got = losses(root / "then_seq2")
    for step in (6, 7, 8):
        assert got[step] == pytest.approx(one[step], rel=1e-5), step
    assert losses(root / "then_seq2", "valid")[8] == pytest.approx(
        losses(root / "one", "valid")[8], rel=1e-5)
    from sparse_jax import evaluate

    on_one = evaluate.evaluate(str(root / "then_seq2"), "valid", 5, progress=False, write=False)
    assert child["eval_bits"] == pytest.approx(on_one["bits"], rel=1e-5)
    # Sampling reads it on one device, and says so.
    from sparse_jax import sample

    result = sample.sample(str(root / "then_seq2"), num_samples=1, length=8,
                           output=str(root / "sample.txt"))
    assert len(result["samples"][0]) == 1 + 8  # the default prompt "\n" and 8 new bytes
    assert "Sampling on one device" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # starts other processes
def test_two_processes_match_one_process(one_device_run, byte_file, tmp_path):
    """2 processes x 2 CPU devices, one coordinator on 127.0.0.1: each process reads its half
    of every global batch; losses and the checkpoint equal the 1-device run's."""
    workdir = tmp_path / "two"
    address = f"127.0.0.1:{_free_port()}"
    args = [f"--config.{k.replace('__', '.')}={v}" for k, v in RUN.items()]
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'bytes.py')}:size=tiny",
         f"--workdir={workdir}", f"--config.data.path={byte_file}", *args,
         f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"],
        env=child_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(outputs)[-6000:]
    assert "mesh {'data': 4, 'fsdp': 1}" in outputs[0]
    assert "Starting" not in outputs[1]  # only process 0 logs
    one = losses(one_device_run / "one")
    got = losses(workdir)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        assert got[step] == pytest.approx(one[step], abs=1e-5), step
    # The checkpoint both processes wrote resumes on 1 device, as the 1-device run went on.
    train.train(run_config(byte_file, total_steps=8), str(workdir))
    got = losses(workdir)
    for step in (6, 7, 8):
        assert got[step] == pytest.approx(one[step], abs=1e-5), step

