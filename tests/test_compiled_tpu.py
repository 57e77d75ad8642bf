"""The deviceless TPU compile (sparse_jax.bench.compiled_tpu, scripts/compile_report.py
--target=v5e): reading the compiler's figures from compiled HLO, and the check itself, which
compiles the default strided and fixed kernels (fwd+bwd, bfloat16) for one TPU v5e on this CPU
and fails for a kernel that Mosaic refuses.

The check needs requirements-tpu-compile.txt's libtpu in a folder of its own: .ci/run installs it
and sets SPARSE_JAX_TPU_TOOLS; elsewhere the check installs it into .tpu_tools first (pip,
once). It is never skipped.
"""

import json
import os
import subprocess
import sys

import pytest

from sparse_jax.bench import compiled_tpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# From the compiled HLO of strided:128 at 16k (B=1, H=8, d=128) and fixed:128:32 at 2k for a
# v5e, the kernels' MLIR bodies cut short: a custom call that is no kernel, two kernels with
# their operands in HBM, one whose outputs XLA keeps in VMEM (S(1)).
HLO = """\
  %custom-call = s32[16384,1]{1,0:T(8,128)S(1)} custom-call(%slice-done, %slice-done.1, %slice-d\
one.2, %slice-done.3), custom_call_target="ConcatBitcast", backend_config={"flag_configs":[],"sc\
oped_memory_configs":[],"used_scoped_memory_configs":[],"aliasing_operands":{"lists":[]}}
  %jvp_sparse_forward_rows_.1 = (f32[1,8,16384,128]{3,2,1,0:T(8,128)}, f32[1,8,16384,1]{3,2,1,0:\
T(8,128)}) custom-call(%copy-done.10, %get-tuple-element.16, %constant.22, %custom-call, %get-tu\
ple-element.14, /*index=5*/%get-tuple-element.12, %copy-done.7, %copy-done.5, %broadcast.2), cus\
tom_call_target="tpu_custom_call", operand_layout_constraints={s32[512]{0}, bf16[1,8,16384,128]{\
3,2,1,0}, s32[16384,1]{1,0}, s32[16384,1]{1,0}, bf16[1,8,16384,128]{3,2,1,0}, bf16[1,8,16384,128\
]{3,2,1,0}, s32[1,16384]{1,0}, s32[1,16384]{1,0}, s32[1,16384]{1,0}}, frontend_attributes={kerne\
l_metadata={}}, metadata={op_name="jit(loss)/jvp(sparse_forward_rows)/pallas_call" stack_frame_i\
d=17}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{"body"\
:"TUzvUgFNTElS...","needs_layout_passes":true,"allow_input_fusion":[],"serialization_format":"1"\
,"output_memory_colors":[],"output_memory_space_colors":[],"input_memory_space_colors":[]},"used\
_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"786432"}],"retry_config":{"ret\
ry_count":"0"},"aliasing_operands":{"lists":[]}}
  %transpose_jvp_sparse_dq_rows__.1 = f32[1,8,16384,128]{3,2,1,0:T(8,128)} custom-call(%copy-don\
e.10, %get-tuple-element.16, %constant.22, %custom-call, %broadcast.16, /*index=5*/%get-tuple-el\
ement.10, %copy.27, %get-tuple-element.14, %get-tuple-element.12, %copy-done.7, /*index=10*/%cop\
y-done.5, %broadcast.2), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[5\
12]{0}, bf16[1,8,16384,128]{3,2,1,0}, s32[16384,1]{1,0}, s32[16384,1]{1,0}, bf16[1,8,16384,128]{\
3,2,1,0}, f32[1,8,16384,1]{3,2,1,0}, f32[1,8,16384,1]{3,2,1,0}, bf16[1,8,16384,128]{3,2,1,0}, bf\
16[1,8,16384,128]{3,2,1,0}, s32[1,16384]{1,0}, s32[1,16384]{1,0}, s32[1,16384]{1,0}}, frontend_a\
ttributes={kernel_metadata={}}, metadata={op_name="jit(loss)/transpose(jvp(sparse_dq_rows))/pall\
as_call" stack_frame_id=5}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"custom\
_call_config":{"body":"TUzvUgFNTElS...","needs_layout_passes":true,"allow_input_fusion":[],"seri\
alization_format":"1","output_memory_colors":[],"output_memory_space_colors":[],"input_memory_sp\
ace_colors":[]},"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"720896"}]\
,"retry_config":{"retry_count":"0"},"aliasing_operands":{"lists":[]}}
  %jvp_sparse_forward_summary_.1 = (f32[1,8,2048,128]{3,2,1,0:T(8,128)S(1)}, f32[1,8,2048,1]{3,2\
,1,0:T(8,128)S(1)}) custom-call(%copy-done.9, %fusion.4, %custom-call.4, %custom-call.5, %bitcas\
t.45, /*index=5*/%bitcast.48, %copy-done.5, %copy-done.6, %jit_loss_.3), custom_call_target="tpu\
_custom_call", operand_layout_constraints={s32[96]{0}, bf16[1,8,2048,128]{3,2,1,0}, s32[2048,1]{\
1,0}, s32[2048,1]{1,0}, bf16[1,8,512,128]{3,2,1,0}, bf16[1,8,512,128]{3,2,1,0}, s32[1,512]{1,0},\
 s32[1,512]{1,0}, s32[1,512]{1,0}}, frontend_attributes={kernel_metadata={}}, metadata={op_name=\
"jit(loss)/jvp(sparse_forward_summary)/pallas_call" stack_frame_id=28}, backend_config={"flag_co\
nfigs":[],"scoped_memory_configs":[],"custom_call_config":{"body":"TUzvUgFNTElS...","needs_layou\
t_passes":true,"allow_input_fusion":[],"serialization_format":"1","output_memory_colors":[],"out\
put_memory_space_colors":[],"input_memory_space_colors":[]},"used_scoped_memory_configs":[{"memo\
ry_space":"1","offset":"0","size":"196608"}],"retry_config":{"retry_count":"0"},"aliasing_operan\
ds":{"lists":[]}}
"""


def test_compiled_hlo_gives_each_mosaic_kernel_and_its_vmem():
    assert compiled_tpu.parse_mosaic_kernels(HLO) == [
        {"name": "sparse_forward_rows", "vmem_bytes": 786432, "output_in_vmem": False,
         "calls": 1, "instructions": ["jvp_sparse_forward_rows_.1"]},
        {"name": "sparse_dq_rows", "vmem_bytes": 720896, "output_in_vmem": False, "calls": 1,
         "instructions": ["transpose_jvp_sparse_dq_rows__.1"]},
        {"name": "sparse_forward_summary", "vmem_bytes": 196608, "output_in_vmem": True,
         "calls": 1, "instructions": ["jvp_sparse_forward_summary_.1"]}]


def test_a_kernel_in_several_computations_is_listed_once_with_its_calls():
    line = HLO.splitlines()[1]
    again = line.replace("%jvp_sparse_forward_rows_.1", "%jvp_sparse_forward_rows_.2")
    kernels = compiled_tpu.parse_mosaic_kernels(line + "\n" + again + "\n")
    assert [(k["name"], k["calls"], k["instructions"]) for k in kernels] == [
        ("sparse_forward_rows", 2, ["jvp_sparse_forward_rows_.1", "jvp_sparse_forward_rows_.2"])]


# Splash attention's dq kernel (strided:128 mask at 2k, 512-blocks, v5p), its body cut short:
# its kernel_metadata holds a newline, so the instruction spans three lines of HLO text.
SPLASH_HLO = """\
  %splash_mha_dq_no_residuals.1 = (f32[512,128]{1,0:T(8,128)}, bf16[8,2048,128]{2,1,0:T(8,128)(2\
,1)}) custom-call(%copy-done.9, %copy-done.8, %copy-done.10, %copy-done.3, %copy-done.4, /*index\
=5*/%copy-done.5, %get-tuple-element.1, %broadcast.1, %broadcast_in_dim.1, %copy-done.6), custom\
_call_target="tpu_custom_call", operand_layout_constraints={s8[1,4,4]{2,1,0}, s8[1,4,4]{2,1,0}, s\
8[1,4,4]{2,1,0}, bf16[8,2048,128]{2,1,0}, bf16[8,2048,128]{2,1,0}, bf16[8,2048,128]{2,1,0}, f32[\
8,1,2048]{2,1,0}, bf16[8,2048,128]{2,1,0}, f32[8,1,2048]{2,1,0}, s32[3,512,512]{2,1,0}}, fronten\
d_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q_dq\\": 512, \\"block_kv_dq\\": 512, \\"q_layout\\": 1, \\\
"k_layout\\": 1, \\"v_layout\\": 1}"
}}, metadata={op_name="jit(loss)/transpose(jvp(static_sparsity_splash))/jit(_splash_attention)/s\
plash_mha_dq_no_residuals/splash_mha_dq_no_residuals/pallas_call" stack_frame_id=4}, backend_con\
fig={"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{"body":"TUzvUgFNTElS...",\
"needs_layout_passes":true,"allow_input_fusion":[],"serialization_format":"1","output_memory_col\
ors":[],"output_memory_space_colors":[],"input_memory_space_colors":[]},"used_scoped_memory_conf\
igs":[{"memory_space":"1","offset":"0","size":"1708032"}],"retry_config":{"retry_count":"0"},"al\
iasing_operands":{"lists":[]}}
  %jit__splash_attention_.11 = bf16[8,2048,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%splash_m\
ha_dq_no_residuals.1), index=1
"""


def test_an_instruction_over_several_lines_is_read_whole():
    assert compiled_tpu.parse_mosaic_kernels(SPLASH_HLO) == [
        {"name": "splash_mha_dq_no_residuals", "vmem_bytes": 1708032, "output_in_vmem": False,
         "calls": 1, "instructions": ["splash_mha_dq_no_residuals.1"]}]


# libtpu's static profile (LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR) of
# strided:128 at 2k for a v5p: three of the files it wrote, a Mosaic kernel's, an XLA copy that
# stands for 3 equivalent ones, and one whose op's HLO is nested in it (cut short).
PROFILE = """\
hlo_op_estimate {
  hlo_op_name: "jvp_sparse_forward_rows_.1"
  estimated_cycles: 70658
  num_equivalent_hlos: 1
  dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL
  scalar_inputs: 0
}
hlo_op_estimate {
  hlo_op_name: "copy.45"
  estimated_cycles: 4689
  num_equivalent_hlos: 3
  dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL
  scalar_inputs: 0
}
hlo_op_estimate {
  hlo_op_name: "copy.57"
  estimated_cycles: 0
  num_equivalent_hlos: 2
  dma_instruction_type: DMA_INSTRUCTION_TYPE_REMOTE
  hlo_instruction {
    name: "copy.57"
    opcode: "copy"
    shape {
      element_type: F32
      dimensions: 1
      dimensions: 8
    }
    metadata {
      op_name: "jit(loss)/transpose(jvp())/broadcast_in_dim"
      stack_frame_id: 6
    }
  }
  scalar_inputs: 0
}
"""


def test_the_static_profile_gives_each_ops_cycles():
    assert compiled_tpu.parse_static_profile(PROFILE) == {
        "jvp_sparse_forward_rows_.1": {"cycles": 70658, "equivalent": 1},
        "copy.45": {"cycles": 4689, "equivalent": 3},
        "copy.57": {"cycles": 0, "equivalent": 2}}
    # a field protobuf leaves out (zero) reads as 0
    assert compiled_tpu.parse_static_profile(
        'hlo_op_estimate {\n  hlo_op_name: "x"\n}\n') == {"x": {"cycles": 0, "equivalent": 1}}


def test_cycles_attach_to_kernels_and_sum_per_program(tmp_path):
    for i, text in enumerate(PROFILE.split("hlo_op_estimate {")[1:]):
        (tmp_path / f"op{i}_static_llo_profile.textproto").write_text("hlo_op_estimate {" + text)
    profile = compiled_tpu.read_static_profile(str(tmp_path))
    row = {"kernels": compiled_tpu.parse_mosaic_kernels(HLO)}
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75)
    assert row["kernels"][0]["cycles"] == 70658
    assert row["kernels"][1]["cycles"] is None  # not in the profile: no sum
    assert row["cycles"] is None and row["all_op_cycles"] == 70658 + 3 * 4689
    row = {"kernels": row["kernels"][:1]}
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75)
    assert row["cycles"] == 70658 and row["estimated_us"] == pytest.approx(70658 / 1750)
    row["tile_flops"] = 459e3 / 1.75 * 2e5  # 0.2 M cycles of the v5p's MXUs
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75, peak_tflops=459)
    assert row["mxu_floor_cycles"] == pytest.approx(2e5) and row["bounded_cycles"] == 2e5
    # 0 cycles for a kernel: no estimate (libtpu's for a kernel whose blocks span heads)
    profile["jvp_sparse_forward_rows_.1"]["cycles"] = 0
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75)
    assert row["kernels"][0]["cycles"] is None and row["cycles"] is None


# A scanned model's compiled HLO (libtpu 0.0.48, the paper's step, abridged): the layer loop's
# condition compares the counter with a constant; a kernel runs once in the forward loop and
# once in the backward one (the profile names one of the two, with 2 equivalent ops).
LOOPS = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%wide.region_8.23.clone (wide.arg_tuple.6: (s32[], f32[2,512])) -> pred[] {
  %constant.1870 = s32[]{:T(128)} constant(30), metadata={op_name="jit(train_step)"}
  %wide.arg_tuple.6 = (s32[]{:T(128)}, f32[2,512]{1,0}) parameter(0)
  %get-tuple-element.1303 = s32[]{:T(128)} get-tuple-element(%wide.arg_tuple.6), index=0
  ROOT %lt.97 = pred[]{:T(512)} compare(%get-tuple-element.1303, %constant.1870), directi\
on=LT, metadata={op_name="jit(train_step)/while/cond/lt"}
}

%wide.region_2.22.clone.sunk (wide.param: (s32[], f32[2,512])) -> (s32[], f32[2,512]) {
  %sparse_forward_summary.16 = f32[2,512]{1,0} custom-call(%x), custom_call_target="tpu_cu\
stom_call", metadata={op_name="jit(train_step)/jvp()/while/body/jvp(sparse_forward_summary)/pa\
llas_call"}
  ROOT %tuple.1 = (s32[], f32[2,512]) tuple(%i, %sparse_forward_summary.16)
}

%region_9.cond (arg: (s32[], f32[2,512])) -> pred[] {
  %constant.2 = s32[]{:T(128)} constant(30)
  ROOT %lt.98 = pred[]{:T(512)} compare(%gte.7, %constant.2), direction=LT
}

%region_3.body (param: (s32[], f32[2,512])) -> (s32[], f32[2,512]) {
  %sparse_forward_summary.17 = f32[2,512]{1,0} custom-call(%x), custom_call_target="tpu_cu\
stom_call", metadata={op_name="jit(train_step)/transpose()/while/body/jvp(sparse_forward_summa\
ry)/pallas_call"}
  %fusion.4 = f32[2,512]{1,0} fusion(%sparse_forward_summary.17), kind=kLoop, calls=%fused.4
}

ENTRY %main.5 (p: f32[2,512]) -> f32[] {
  %while.55 = (s32[], f32[2,512]) while(%tuple.208), condition=%wide.region_8.23.clone, body=%\
wide.region_2.22.clone.sunk, metadata={op_name="jit(train_step)/jvp()/while"}
  %while.56 = (s32[], f32[2,512]) while(%tuple.209), condition=%region_9.cond, body=%region_3\
.body
  ROOT %reduce.1 = f32[] reduce(%gte.8, %c), dimensions={0,1}, to_apply=%add
}
"""


def test_a_scanned_layers_ops_count_once_a_layer():
    trips = compiled_tpu.loop_trips(LOOPS)
    assert trips["sparse_forward_summary.16"] == trips["sparse_forward_summary.17"] == 30
    assert trips["fusion.4"] == trips["lt.97"] == 30 and "reduce.1" not in trips
    row = {"kernels": compiled_tpu.parse_mosaic_kernels(LOOPS)}
    assert row["kernels"][0]["instructions"] == ["sparse_forward_summary.16",
                                                 "sparse_forward_summary.17"]
    profile = {"sparse_forward_summary.16": {"cycles": 1000, "equivalent": 2},
               "fusion.4": {"cycles": 10, "equivalent": 1},
               "reduce.1": {"cycles": 7, "equivalent": 1}}
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75, trips=trips)
    assert row["cycles"] == 2 * 30 * 1000 and row["all_op_cycles"] == 60000 + 300 + 7
    # a loop whose count the condition does not give: no sums rather than a wrong one
    unknown = LOOPS.replace("constant(30)\n  ROOT %lt.98", "parameter(1)\n  ROOT %lt.98")
    trips = compiled_tpu.loop_trips(unknown)
    assert trips["fusion.4"] is None and trips["sparse_forward_summary.16"] == 30
    row = {"kernels": compiled_tpu.parse_mosaic_kernels(LOOPS)}
    compiled_tpu.attach_cycles(row, profile, clock_ghz=1.75, trips=trips)
    assert row["cycles"] is None and row["all_op_cycles"] is None


def test_ours_and_splash_are_set_side_by_side():
    rows = [{"name": "attention 16k strided:128@pallas", "cycles": 2.8e6},
            {"name": "attention 16k strided:128@pallas:256x256", "cycles": 1.4e6,
             "all_op_cycles": 2.0e6},
            {"name": "splash 16k strided:128 b512", "cycles": 7.0e6, "all_op_cycles": 7.2e6},
            {"name": "splash 16k strided:128 b1024", "cycles": 8.0e6},
            {"name": "splash 16k dense b512", "cycles": 7.7e6},
            {"name": "attention 16k fixed:128:32@pallas fwd", "cycles": 1.0e6},
            {"name": "splash 16k fixed:128:32 b512", "cycles": 3.0e6},
            {"name": "splash 16k fixed:128:32 b512 fwd", "error": "x"}]
    assert compiled_tpu.beside_splash(rows) == [
        {"length": "16k", "mask": "strided:128", "forward": False,
         "ours": "attention 16k strided:128@pallas:256x256", "ours_cycles": 1.4e6,
         "splash": "splash 16k strided:128 b512", "splash_cycles": 7.0e6, "ratio": 5.0,
         "all_op_ratio": 3.6}]
    # at 64k the heads differ (the profiler's limits): per head, 8 M over 8 heads against 4 M
    rows = [{"name": "attention 64k fixed:128:32@pallas", "cycles": 8.0e6,
             "all_op_cycles": 16.0e6, "bounded_cycles": 8.0e6},
            {"name": "splash 64k fixed:128:32 b512 h1", "cycles": 4.0e6, "all_op_cycles": 4.0e6,
             "bounded_cycles": 6.0e6}]
    pair, = compiled_tpu.beside_splash(rows)
    assert (pair["ratio"], pair["all_op_ratio"], pair["bounded_ratio"]) == (4.0, 2.0, 6.0)
    text = compiled_tpu.markdown([], "v5p", ["# t"])
    assert "time at 1.75 GHz" in text
    assert "no static cycles" in compiled_tpu.markdown([], "v5e", ["# t"])


def test_problems_name_failures_missing_kernels_and_overflows():
    rows = [{"name": "a@pallas", "target": "v5e", "kernels": [{"name": "k"}], "fits": True},
            {"name": "b@pallas", "target": "v5e", "error": "RESOURCE_EXHAUSTED: E1001"},
            {"name": "c@pallas", "target": "v5e", "kernels": [], "fits": True},
            {"name": "d@pallas", "target": "v5e", "kernels": [{"name": "k"}], "fits": False,
             "planned_gib": 17.5}]
    assert compiled_tpu.problems(rows) == [
        "b@pallas: RESOURCE_EXHAUSTED: E1001",
        "c@pallas: no Mosaic kernel in the compiled program",
        "d@pallas: plans 17.50 GiB, more than the chip's 16 GiB"]


def test_programs_and_selection_refuse_unknown_names():
    assert [p["name"] for p in compiled_tpu.select(["ci"])] == [
        "attention 8k strided:128@pallas", "attention 8k fixed:128:32@pallas"]
    assert [p["name"] for p in compiled_tpu.select(["splash 16k strided:128 b512"])] == [
        "splash 16k strided:128 b512"]
    with pytest.raises(ValueError, match="'attention99k' is no program or group"):
        compiled_tpu.select(["attention99k"])


def test_missing_tools_are_one_line_with_the_install_command(tmp_path):
    with pytest.raises(ValueError, match=r"lacks libtpu: install it with `pip install --no-deps "
                                         r"--target .* -r requirements-tpu-compile.txt`"):
        compiled_tpu.check_tools(str(tmp_path))
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", "--target=v5e",
                           f"--tools={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "lacks libtpu" in proc.stderr


def _pallas_calls(jaxpr, out):
    """(kernel name, cost estimate) of every pallas_call in ``jaxpr``, nested ones too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append((eqn.params["name"], eqn.params["cost_estimate"]))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                _pallas_calls(inner, out)
    return out


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_every_kernel_tells_xla_its_work_from_the_block_lists(backend):
    import jax
    import jax.numpy as jnp

    from sparse_jax.attention import blocks as kernel
    from sparse_jax.attention import fused
    from sparse_jax.attention.spec import PatternSpec

    spec, n, heads, d = PatternSpec("strided", stride=16), 256, 2, 32
    sizes = kernel.BlockSizes(16, 16)
    x = jax.ShapeDtypeStruct((1, heads, n, d), jnp.float32)

    def loss(q, k, v):
        return fused.sequence_attention(spec, q, k, v, sizes=sizes, backend=backend,
                                         interpret=True).sum()

    calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr, [])
    assert sorted(name for name, _ in calls) == sorted(
        f"sparse_{p}_{t}" for p in ("forward", "dq", "dkv") for t in ("rows", "columns"))
    # per scored (query, key) pair of the visited tiles: q·k and p·v forward; q·k, do·v and
    # ds·k for dq; q·k, do·v, dsᵀ·q and pᵀ·do for dk and dv; one exponential each pass
    scored = heads * fused.sparsity(spec, n, sizes)["scored"]
    for kind, per_pair in (("forward", 4 * d), ("dq", 6 * d), ("dkv", 8 * d)):
        work = [c for name, c in calls if name.startswith(f"sparse_{kind}_")]
        assert sum(c.flops for c in work) == per_pair * scored
        assert sum(c.transcendentals for c in work) == scored
        # at least each of its inputs read once, outputs written once
        assert all(c.bytes_accessed > 0 for c in work)
    assert sum(c.bytes_accessed for _, c in calls) > 12 * heads * n * d * 4


def _tools():
    """The tools folder ($SPARSE_JAX_TPU_TOOLS, else the repository's default), installed
    there first if absent, as .ci/run does: the check always runs; an incomplete folder fails
    it."""
    tools = os.environ.get(compiled_tpu.TOOLS_ENV) or os.path.join(REPO, compiled_tpu.DEFAULT_TOOLS)
    compiled_tpu.install_tools(tools, compiled_tpu.REQUIREMENTS)
    compiled_tpu.check_tools(tools)
    return tools


@pytest.mark.slow
def test_default_kernels_compile_for_a_tpu_v5e(tmp_path):
    tools = _tools()
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", f"--tools={tools}",
                           "--target=v5e", "--programs=ci", "--check",
                           f"--output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        rows = json.load(f)["rows"]
    assert [r["name"] for r in rows] == [p["name"] for p in compiled_tpu.select(["ci"])]
    for row in rows:  # libtpu from the tools folder; forward, dq and dkv per term, in Mosaic
        assert row["libtpu"].startswith(os.path.abspath(tools)), row["libtpu"]
        assert row["fits"] and len(row["kernels"]) == 6, row["name"]
        # the strided terms run the band kernels (the default band128x16); fixed's summary the
        # listed tiles
        band = "strided" in row["name"]
        assert {k["name"].rsplit("_", 1)[0] for k in row["kernels"]} == (
            {"sparse_band_forward", "sparse_band_dq", "sparse_band_dkv"} if band else
            {"sparse_forward", "sparse_dq", "sparse_dkv", "sparse_band_forward", "sparse_band_dq",
             "sparse_band_dkv"})
        # scratch and double-buffered tiles or windows, well within a v5e's VMEM (the band
        # kernels have no scratch, and XLA may keep a small kernel's operands whole in VMEM,
        # which leaves it no scoped VMEM of its own)
        assert all(k["vmem_bytes"] <= 16 * 2**20 for k in row["kernels"])
        assert max(k["vmem_bytes"] for k in row["kernels"]) >= 1024 * 1024
    assert "| attention 8k strided:128@pallas | sparse_band_dkv_columns |" in (
        tmp_path / "results.md").read_text()
    # XLA's cost analysis counts the kernels' work (their pl.CostEstimate): at least their
    # matrix products over the visited tiles, 2304 flops per scored pair and head at d = 128
    from sparse_jax.attention import blocks as kernel
    from sparse_jax.attention import fused
    from sparse_jax.bench.attention import parse_pattern

    for row, program in zip(rows, compiled_tpu.select(["ci"])):
        spec = parse_pattern(program["pattern"], program["seq_len"])[0]
        scored = fused.sparsity(spec, program["seq_len"],
                                 kernel.BlockSizes.for_backend("mosaic"))["scored"]
        assert row["flops"] >= 2304 * program["heads"] * scored, row["name"]


@pytest.mark.slow
def test_one_sequence_over_four_chips_compiles_with_the_kernels_and_collectives():
    # context parallelism for a v5e slice of 4 chips (2 x 2): each chip's program runs the
    # Mosaic kernels on its shard, the columns' all-to-all and the halo's collective-permute
    tools = _tools()
    program = {**compiled_tpu._context("strided:128@pallas", 8192, 4, 1), "group": "test"}
    row = compiled_tpu.compile_program(program, "v5e", tools, cycles=False)
    assert "error" not in row, row["error"]
    assert {k["name"] for k in row["kernels"]} >= {"sparse_band_forward_rows",
                                                   "sparse_band_dkv_columns"}
    assert {"all-to-all", "collective-permute"} <= set(row["collectives"])
    # one chip's plan: a quarter of the sequence's q, k, v (bfloat16) and their gradients
    assert row["memory"]["argument"] == 3 * 8192 // 4 * 128 * 2


def _program(options, **extra):
    return {"name": f"attention strided:128@pallas:{options}", "group": "test",
            "kind": "attention", "pattern": f"strided:128@pallas:{options}", "seq_len": 2048,
            **compiled_tpu.ATTENTION_SHAPE, **extra}


@pytest.mark.slow
def test_the_check_fails_for_a_kernel_mosaic_refuses():
    tools = _tools()
    # 64 x 64 tiles: the project refuses them for a TPU (BlockSizes.check_backend) ...
    refused = compiled_tpu.compile_program(_program("64x64"), "v5e", tools)
    assert "Mosaic (a TPU) needs multiples of 128" in refused["error"]
    # ... and so does Mosaic itself, past that rule: a key tile's last dimension, 64, is no
    # multiple of the 128 lanes
    mosaic = compiled_tpu.compile_program(_program("64x64", unchecked_tiles=True), "v5e", tools)
    assert "divisible by 8 and 128" in mosaic["error"], mosaic["error"]
    assert len(compiled_tpu.problems([refused, mosaic])) == 2
