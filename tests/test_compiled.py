"""The deviceless GPU compile (sparse_jax.bench.compiled, scripts/compile_report.py): reading the
compiler's figures, the occupancy rules, and the check itself, which compiles the default
strided and fixed kernels, a chained variant and the fixed pattern's gathered kernels for an H100
(sm_90a) on this CPU and fails for a kernel that spills or cannot compile.

The check needs requirements-gpu-compile.txt's packages in a folder of their own: .ci/run
installs them and sets SPARSE_JAX_GPU_TOOLS; elsewhere the check installs them into .gpu_tools
first (pip, ~0.6 GB, once). It is never skipped.
"""

import os
import subprocess
import sys

import pytest

from sparse_jax.bench import compiled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = compiled.TARGETS["h100"]

PTXAS_LOG = """\
I1127 21:52:43.564469    5965 subprocess_compilation.cc:349] ptxas warning : Registers are \
spilled to local memory in function 'sparse_dkv_columns', 132 bytes spill stores, 156 bytes \
spill loads
ptxas info    : Compiling entry function 'sparse_dkv_columns' for 'sm_90a'
ptxas info    : Function properties for sparse_dkv_columns
    128 bytes stack frame, 132 bytes spill stores, 156 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 128 bytes cumulative stack size
ptxas info    : Compile time = 154.519 ms
I1127 21:52:43.60 4078 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'sparse_dq_rows' for 'sm_90a'
ptxas info    : Function properties for sparse_dq_rows
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""

THUNKS = """\
005: kCustomKernel [source       | next=006 (1) ] wrapped_transpose grid: [16384, 1, 1] \
threads: [128, 1, 1]  shared_memory: 0 bytes
006: kCustomKernel [prev=005 (1) | next=011 (5) ] sparse_forward_rows grid: [256, 1, 8] \
threads: [128, 1, 1]  shared_memory: 42496 bytes
"""

HLO = """\
HloModule jit_f, entry_computation_layout={(bf16[4,8]{1,0})->f32[4,8]{1,0}}

%fused_computation (param_0: bf16[4,8]) -> f32[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  ROOT %convert = f32[4,8]{1,0} convert(%param_0)
}

ENTRY %main (p0: bf16[4,8]) -> f32[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %k = (f32[4,8]{1,0}, f32[4,1]{1,0}) custom-call(%p0), custom_call_target="__gpu$xla.gpu.triton"
  %gte = f32[4,8]{1,0} get-tuple-element(%k), index=0
  ROOT %fusion = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation
}
"""


def test_ptxas_log_gives_registers_and_spills_per_kernel():
    figures = compiled.parse_ptxas(PTXAS_LOG)
    assert figures["sparse_dkv_columns"] == {"arch": "sm_90a", "stack": 128, "spill_stores": 132,
                                             "spill_loads": 156, "registers": 255}
    assert figures["sparse_dq_rows"]["registers"] == 168
    assert figures["sparse_dq_rows"]["spill_stores"] == 0


def test_thunk_sequence_gives_grid_threads_and_shared_memory():
    assert compiled.parse_thunks(THUNKS) == [
        {"name": "wrapped_transpose", "grid": [16384, 1, 1], "threads": 128, "shared_memory": 0},
        {"name": "sparse_forward_rows", "grid": [256, 1, 8], "threads": 128,
         "shared_memory": 42496}]


@pytest.mark.parametrize("registers, smem, blocks, share, bound", [
    (164, 42496, 3, 0.1875, "registers"),  # the default forward kernel on an H100
    (231, 58624, 2, 0.125, "registers"),  # its dkv
    (32, 42496, 5, 0.3125, "shared memory"),
    (24, 0, 16, 1.0, "threads"),
])
def test_occupancy_follows_the_cuda_calculator(registers, smem, blocks, share, bound):
    got = compiled.occupancy(H100, registers, 128, smem)
    assert (got["blocks_per_sm"], got["occupancy"], got["bound"]) == (blocks, share, bound)


def test_xla_kernel_bytes_counts_fusions_not_pallas_calls():
    # The fusion reads bf16[4,8] (64 B) and writes f32[4,8] (128 B); the Triton call is apart.
    assert compiled.xla_kernel_bytes(HLO) == {"kernels": 1, "bytes": 192}


def test_problems_name_failures_and_spills():
    rows = [{"name": "a", "kernels": [{"name": "sparse_dkv_rows", "spill_bytes": 0}]},
            {"name": "b", "kernels": [{"name": "sparse_dkv_rows", "spill_bytes": 712,
                                       "registers": 255}]},
            {"name": "c", "error": "RESOURCE_EXHAUSTED: Shared memory size limit exceeded"}]
    assert compiled.problems(rows) == [
        "b: sparse_dkv_rows spills 712 bytes (255 registers)",
        "c: RESOURCE_EXHAUSTED: Shared memory size limit exceeded"]


def test_rank_puts_spills_last_and_then_bytes_per_resident_warp():
    def row(name, spill, occupancy, gb):
        return {"name": name, "max_spill_bytes": spill, "hbm_gb": gb,
                "kernels": [{"occupancy": occupancy}, {"occupancy": 0.5}]}
    rows = [row("attention 16k strided:128@pallas:a", 424, 0.0625, 1.39),
            row("attention 16k strided:128@pallas", 0, 0.125, 1.44),
            row("attention 16k strided:128@pallas:b", 0, 0.25, 1.37),
            row("attention 16k fixed:128:32@pallas", 0, 0.125, 4.47),
            {"name": "attention 16k dense@cudnn", "kernels": []}]
    assert [r["name"][14:] for r in compiled.rank(rows)] == [
        "fixed:128:32@pallas", "strided:128@pallas:b", "strided:128@pallas",
        "strided:128@pallas:a"]


def test_programs_cover_the_report_and_selection_refuses_unknown_names():
    names = [p["name"] for p in compiled.programs()]
    assert set(compiled.CI_PROGRAMS) <= set(names)
    assert "step paper 16k dense (cuDNN)" in names and "study long sparse" in names
    assert [p["name"] for p in compiled.select(["ci"])] == list(compiled.CI_PROGRAMS)
    with pytest.raises(ValueError, match="'attention99k' is no program or group"):
        compiled.select(["attention99k"])


def test_missing_tools_are_one_line_with_the_install_command(tmp_path):
    with pytest.raises(ValueError, match=r"lacks jax-cuda12-plugin, nvidia-cuda-nvcc-cu12: "
                                         r"install them with `pip install --no-deps --target"):
        compiled.check_tools(str(tmp_path))
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", f"--tools={tmp_path}",
                           "--programs=ci"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "lacks jax-cuda12-plugin" in proc.stderr


def test_tools_are_installed_whole_or_not_at_all(tmp_path):
    """A folder that exists is left alone; a pip that fails (here: a requirement that is no
    file) is one line, and no folder, half-installed or temporary, is left."""
    kept = tmp_path / "kept"
    kept.mkdir()
    compiled.install_tools(str(kept), "no-such-requirements.txt")  # exists: pip never runs
    assert os.listdir(kept) == []
    bad = tmp_path / "reqs.txt"
    bad.write_text("./no/such/package\n")
    with pytest.raises(ValueError, match=r"^could not install .*reqs.txt into .*tools: ") as e:
        compiled.install_tools(str(tmp_path / "tools"), str(bad))
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["kept", "reqs.txt"]


def _tools():
    """The tools folder ($SPARSE_JAX_GPU_TOOLS, else the repository's default), installed
    there first if absent, as .ci/run does: the check always runs; an incomplete folder fails
    it."""
    tools = os.environ.get(compiled.TOOLS_ENV) or os.path.join(REPO, compiled.DEFAULT_TOOLS)
    compiled.install_tools(tools, compiled.REQUIREMENTS)
    compiled.check_tools(tools)
    return tools


@pytest.mark.slow
def test_default_kernels_compile_for_an_h100_without_spills(tmp_path):
    tools = _tools()
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", f"--tools={tools}",
                           "--programs=ci", "--check", f"--output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    with open(tmp_path / "results.json") as f:
        rows = json.load(f)["rows"]
    assert [r["name"] for r in rows] == list(compiled.CI_PROGRAMS)
    for row in rows:  # onepass and gathered: four kernels; onepass: one XLA kernel (the loss's)
        onepass = compiled.ONEPASS in row["name"]  # atomic: dq's zeros and cast too
        kernels = 4 if onepass or "gathered" in row["name"] else 6
        kernels -= "gathered" in row["name"] and "atomic" in row["name"]  # no dq kernel
        assert row["fits"] and len(row["kernels"]) == kernels, row["name"]
        if onepass:
            assert row["xla_kernel_bytes"]["kernels"] == (3 if "atomic" in row["name"] else 1)
            assert all(k["programs"] == 132 * k["blocks_per_sm"] for k in row["kernels"])
        for k in row["kernels"]:  # every Triton kernel: figures read, no spill
            assert k["registers"] > 0 and k["spill_bytes"] == 0 and 0 < k["occupancy"] <= 1
            assert k["tiles_mean"] >= 1 and k["hbm_bytes"] > 0
    # fwd+bwd must move at least q, k, v, o, do and the gradients once
    assert min(r["hbm_gb"] for r in rows) * 1e9 > compiled.least_bytes(16384)
    assert "| attention 16k strided:128@pallas | sparse_dkv_rows |" in (
        tmp_path / "results.md").read_text()


def _program(options, n=2048):
    return {"name": f"attention strided:128@pallas:{options}", "group": "test",
            "kind": "attention", "pattern": f"strided:128@pallas:{options}", "seq_len": n,
            **compiled.ATTENTION_SHAPE}


@pytest.mark.slow
def test_the_check_fails_for_a_kernel_that_spills_or_cannot_compile():
    tools = _tools()
    spills = compiled.compile_program(_program("chained:h2"), "h100", tools)
    assert "error" not in spills
    assert any("sparse_dkv" in p and "spills" in p for p in compiled.problems([spills]))
    too_big = compiled.compile_program(_program("128x256"), "h100", tools)  # 263,680 B
    assert "Shared memory size limit exceeded" in too_big["error"]
    assert compiled.problems([too_big])


@pytest.mark.slow
def test_a_cudnn_row_without_cudnn_falls_back_to_xla_and_says_so(tmp_path):
    """The report's promise (its docs and --help): without cuDNN in the tools, a dense@cudnn
    program compiles XLA's unfused attention and its row says it fell back (it once failed:
    "RuntimeError: cuDNN not found")."""
    tools = _tools()
    if os.path.isdir(os.path.join(tools, "nvidia", "cudnn")):  # a folder without cuDNN: links
        bare = tmp_path / "tools"
        bare.mkdir()
        for name in os.listdir(tools):
            if name != "nvidia":
                os.symlink(os.path.join(tools, name), bare / name)
        (bare / "nvidia").mkdir()
        for name in os.listdir(os.path.join(tools, "nvidia")):
            if name != "cudnn":
                os.symlink(os.path.join(tools, "nvidia", name), bare / "nvidia" / name)
        tools = str(bare)
    program = next(p for p in compiled.select(["all"]) if p.get("pattern") == "dense@cudnn"
                   and p["seq_len"] == 8192)
    row = compiled.compile_program(program, "h100", tools)
    assert "error" not in row, row.get("error")
    assert row["note"].startswith("fell back") and "dense@xla" in row["note"]
    assert row["planned_gb"] > 0


def test_tile_work_counts_every_batch_row():
    """A batch of sequences: the list-walking kernels run more programs of the same walks; the
    one-pass kernels' persistent grid keeps its programs and each walks more items. Either way
    the tiles and bytes grow with the batch (the compile of the preset's B=16 attention read
    them as B=1's before)."""
    from sparse_jax.attention.spec import PatternSpec
    from sparse_jax.bench import compiled_work
    from sparse_jax.bench.attention import parse_pattern

    spec = PatternSpec("strided", stride=64)
    for options in ("chained", "onepass:s1", "onepass:s1:atomic"):
        sizes = parse_pattern(f"strided:64@pallas:{options}", 4096)[2]
        one, many = (compiled_work.tile_work(spec, 4096, sizes, 8, 64, batch=b) for b in (1, 16))
        assert one.keys() == many.keys()
        for name, k in one.items():
            m = many[name]
            assert m["hbm_bytes"] == pytest.approx(16 * k["hbm_bytes"], rel=1e-6), name
            total, total_many = (w["tiles_mean"] * w["programs"] for w in (k, m))
            assert total_many == pytest.approx(16 * total), name
            if "onepass" in options:  # one program a resident slot, more items each
                assert m["programs"] == k["programs"] and m["items"] == 16 * k["items"], name
            else:
                assert m["programs"] == 16 * k["programs"], name
