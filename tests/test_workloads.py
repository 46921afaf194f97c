"""Analytic workloads: exact byte and FLOP counts, profile structure, errors, JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap_ds.attention_rates import AttentionShape
from slackswap_ds.errors import InvalidFileError, ProfileError, UnknownNameError
from slackswap_ds.hardware import load_hardware
from slackswap_ds.step_profile import StepProfile
from slackswap_ds.workloads import (
    PRESETS,
    ModelSpec,
    Parallel,
    build_costs,
    layer_activation_bytes,
    layer_forward_flops,
    load_workload_file,
    preset_spec,
    transformer_profile,
    workload,
    workload_names,
    workloads_dir,
)

HW = load_hardware("a100-80g-pcie4")


@pytest.fixture(scope="module")
def profiles() -> dict[str, StepProfile]:
    return {name: workload(name, HW) for name in workload_names()}


def korthikanti(s: int, b: int, h: int, a: int) -> int:
    """Bytes one GPT/BERT layer saves (16-bit, 1-byte masks): s·b·h·(34 + 5·a·s/h)."""
    return 34 * s * b * h + 5 * a * s * s * b


def small_spec(**kw) -> ModelSpec:
    base = dict(name="tiny", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, ffn_kind="gelu",
                norm="layernorm", norm_placement="pre", dropout=0.1, vocab=100, seq=16, micro_batch=2,
                dtype_bytes=2, flash=False, source="test")
    base.update(kw)
    return ModelSpec(**base)


def layer_bytes_in_profile(p: StepProfile, layer: int) -> int:
    return sum(a.bytes for a in p.activations if p.region_of(a) == f"layers.{layer}")


# ---- presets -----------------------------------------------------------------------------------
def test_presets_exist_and_cite_sources():
    assert {"bert-large", "gpt2-xl", "llama-7b", "llama-70b"} <= set(workload_names())
    assert workload_names() == sorted(PRESETS)
    for spec in PRESETS.values():
        assert len(spec.source) > 80, spec.name
    assert "DeepLearningExamples" in PRESETS["bert-large"].source
    assert "llm.c" in PRESETS["gpt2-xl"].source
    assert "llm-foundry" in PRESETS["llama-7b"].source
    l70 = PRESETS["llama-70b"]
    assert (l70.layers, l70.hidden, l70.heads, l70.kv_heads, l70.ffn) == (80, 8192, 64, 8, 28672)


def test_every_preset_file_spells_out_every_field():
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    files = sorted(workloads_dir().glob("*.json"))
    assert [p.stem for p in files] == workload_names()
    for path in files:
        data = json.loads(path.read_text())
        assert set(data) == fields | {"format"}, path.name
        assert load_workload_file(path) == PRESETS[path.stem]


def _preset_folder(tmp_path, monkeypatch, **changes):
    """A copy of the gpt2-xl preset file in a folder of its own, with `changes` (None drops a field)."""
    data = json.loads((workloads_dir() / "gpt2-xl.json").read_text())
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not None}
    (tmp_path / "gpt2-xl.json").write_text(json.dumps(data))
    monkeypatch.setenv("SLACKSWAP_WORKLOADS_DIR", str(tmp_path))
    return tmp_path / "gpt2-xl.json"


def test_presets_come_from_the_workloads_folder(tmp_path, monkeypatch):
    _preset_folder(tmp_path, monkeypatch, seq=256)
    assert workload_names() == ["gpt2-xl"]
    assert preset_spec("gpt2-xl").seq == 256
    monkeypatch.delenv("SLACKSWAP_WORKLOADS_DIR")
    assert preset_spec("gpt2-xl").seq == 1024


@pytest.mark.parametrize("changes, message", [
    ({"heads": 24}, "hidden (1600) must be divisible by heads (24)"),
    ({"layers": None, "colour": "red"}, "missing field(s) ['layers']"),
    ({"colour": "red"}, "unknown field(s) ['colour']"),
    ({"name": "gpt2"}, "\"name\" is 'gpt2'"),
    ({"format": "slackswap.hardware/1"}, "expected a JSON object with \"format\": \"slackswap.workload/1\""),
    ({"dropout": "0.1"}, "dropout must be a probability"),
])
def test_a_malformed_preset_file_is_named(tmp_path, monkeypatch, changes, message):
    path = _preset_folder(tmp_path, monkeypatch, **changes)
    with pytest.raises(InvalidFileError) as e:
        workload_names()
    assert str(path) in str(e.value) and message in str(e.value)


def test_a_preset_file_that_is_not_json_is_named(tmp_path, monkeypatch):
    path = _preset_folder(tmp_path, monkeypatch)
    path.write_text("{ not json")
    with pytest.raises(InvalidFileError, match="is not valid JSON") as e:
        preset_spec("gpt2-xl")
    assert str(path) in str(e.value)


def test_a_missing_presets_folder_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SLACKSWAP_WORKLOADS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(InvalidFileError, match="SLACKSWAP_WORKLOADS_DIR"):
        workload_names()


# ---- exact saved bytes -------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [("gpt2-xl", 2_988_441_600), ("bert-large", 620_756_992)])
def test_preset_layer_bytes_match_korthikanti(profiles, name, expected):
    spec = PRESETS[name]
    assert korthikanti(spec.seq, spec.micro_batch, spec.hidden, spec.heads) == expected
    assert layer_activation_bytes(spec) == expected
    p = profiles[name]
    assert all(layer_bytes_in_profile(p, l) == expected for l in range(spec.layers))


@pytest.mark.parametrize("overrides", [dict(seq=2048, micro_batch=4), dict(seq=128, micro_batch=1)])
def test_overridden_shapes_match_korthikanti(overrides):
    for name in ("gpt2-xl", "bert-large"):
        spec = dataclasses.replace(PRESETS[name], **overrides)
        assert layer_activation_bytes(spec) == korthikanti(spec.seq, spec.micro_batch, spec.hidden, spec.heads)


@settings(max_examples=40, deadline=None)
@given(
    s=st.integers(1, 64), b=st.integers(1, 4), a=st.integers(1, 8), d=st.integers(1, 16),
    placement=st.sampled_from(["pre", "post"]),
)
def test_korthikanti_exact_on_random_shapes(s, b, a, d, placement):
    h = a * d
    spec = small_spec(seq=s, micro_batch=b, heads=a, kv_heads=a, hidden=h, ffn=4 * h, norm_placement=placement)
    assert layer_activation_bytes(spec) == korthikanti(s, b, h, a)
    assert layer_forward_flops(spec) == 24 * b * s * h * h + 4 * b * s * s * h
    p = transformer_profile(spec, HW)
    assert layer_bytes_in_profile(p, 0) == layer_bytes_in_profile(p, 1) == korthikanti(s, b, h, a)


def test_flash_removes_exactly_the_s2_terms():
    spec = PRESETS["gpt2-xl"]
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    flash = dataclasses.replace(spec, flash=True)
    # 34·s·b·h plus the fp32 log-sum-exp 4·b·a·s; the 5·a·s²·b attention-core bytes are gone
    assert layer_activation_bytes(flash) == 34 * s * b * h + 4 * b * a * s == 892_928_000
    assert layer_activation_bytes(spec) - layer_activation_bytes(flash) == 5 * a * s * s * b - 4 * b * a * s
    # the same FLOPs as the unfused core without a causal mask; with one, the fused kernel skips blocks
    assert layer_forward_flops(dataclasses.replace(flash, causal=False)) == layer_forward_flops(spec)
    assert layer_forward_flops(flash) < layer_forward_flops(spec)


def test_a_fused_causal_attention_op_does_half_the_full_work_plus_half_the_diagonal_blocks():
    # toy: s = 512 in blocks of 128 -> n = 4 blocks a side; 10 of the 16 blocks are at or below the
    # diagonal: half of the work (8 blocks) plus half of the 4 diagonal blocks
    s, b, a, d = 512, 2, 4, 64
    spec = small_spec(seq=s, micro_batch=b, heads=a, kv_heads=a, hidden=a * d, ffn=4 * a * d)
    full_spec = dataclasses.replace(spec, flash=True, causal=False)
    causal_spec = dataclasses.replace(full_spec, causal=True)

    def flash_op(sp):
        return next(c for c in build_costs(sp, Parallel(), layers=[0], embed=False, head=False).costs
                    if c.key.endswith("flash_attn"))

    full, causal = flash_op(full_spec), flash_op(causal_spec)
    assert full.gemms == (4.0 * b * s * s * a * d,)  # QK^T and P.V over the whole s x s
    assert causal.gemms[0] == full.gemms[0] * 10 / 16 == full.gemms[0] / 2 + full.gemms[0] * 4 / 2 / 16
    assert causal.bwd_gemms[0] == full.bwd_gemms[0] * 10 / 16
    # the unfused core materialises every score: a causal mask saves it nothing
    unfused = dataclasses.replace(spec, flash=False, causal=True)
    assert layer_forward_flops(unfused) == layer_forward_flops(dataclasses.replace(unfused, causal=False))


def test_no_dropout_means_no_dropout_ops_or_masks():
    spec = dataclasses.replace(PRESETS["gpt2-xl"], dropout=0.0)
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    # 34·sbh less the two 1-byte residual-dropout masks; 5·as²b less the mask (1) and dropout out (2)
    assert layer_activation_bytes(spec) == 32 * s * b * h + 2 * a * s * s * b
    p = transformer_profile(spec, HW)
    assert not [o.key for o in p.ops if "dropout" in o.key]
    assert not [a.key for a in p.activations if "dropout" in a.key or "mask" in a.key]
    # without attention dropout the softmax output is read by softmax's and by P·V's backward
    sm = p.by_key["layers.0.attn:softmax.out"]
    assert [p.ops[u].key for u in sm.users] == ["layers.0.attn:3:softmax", "layers.0.attn:4:av"]


def llama_layer_bytes(spec: ModelSpec) -> int:
    b, s, h, a, f = spec.micro_batch, spec.seq, spec.hidden, spec.heads, spec.ffn
    n, nkv, nf = b * s * h, b * s * spec.kv_heads * spec.head_dim, b * s * f
    # x, norm1.out, q, attn.out, norm2.in, norm2.out | k, v | gate, up, silu, product | 2 rstd | lse
    return 2 * 6 * n + 2 * 2 * nkv + 2 * 4 * nf + 2 * 4 * b * s + 4 * b * a * s


@pytest.mark.parametrize("name, expected", [("llama-7b", 1_889_107_968), ("llama-70b", 5_440_143_360)])
def test_llama_layer_bytes_exact(name, expected):
    spec = PRESETS[name]
    assert llama_layer_bytes(spec) == expected == layer_activation_bytes(spec)


def test_gqa_shrinks_k_and_v(profiles):
    p = profiles["llama-70b"]
    spec = PRESETS["llama-70b"]
    q, k, v = (p.by_key[f"layers.5.attn:{t}"] for t in "qkv")
    assert q.bytes == 2 * spec.micro_batch * spec.seq * spec.hidden
    assert k.bytes == v.bytes == q.bytes * spec.kv_heads // spec.heads


def test_fp32_activations_double_all_but_masks_and_fp32_stats():
    spec = PRESETS["gpt2-xl"]
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    fp32 = dataclasses.replace(spec, dtype_bytes=4)
    masks = 2 * s * b * h + a * s * s * b  # two residual-dropout masks + attention-dropout mask
    assert layer_activation_bytes(fp32) == 2 * (korthikanti(s, b, h, a) - masks) + masks


def test_head_and_embed_tensors(profiles):
    spec = PRESETS["gpt2-xl"]
    p = profiles["gpt2-xl"]
    b, s, h, V = spec.micro_batch, spec.seq, spec.hidden, spec.vocab
    assert p.by_key["head:ce.logprobs"].bytes == 4 * b * s * V
    assert p.by_key["head:norm.in"].bytes == p.by_key["head:norm.out"].bytes == 2 * b * s * h
    assert not p.by_key["head:norm.in"].recomputable
    mask = p.by_key["embed:dropout.mask"]
    assert mask.bytes == b * s * h and mask.recomputable and mask.deps == ()


# ---- FLOPs and times ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2-xl", "bert-large"])
def test_layer_forward_flops_match_korthikanti(name):
    spec = PRESETS[name]
    b, s, h = spec.micro_batch, spec.seq, spec.hidden
    assert spec.ffn == 4 * h and spec.kv_heads == spec.heads
    assert layer_forward_flops(spec) == 24 * b * s * h * h + 4 * b * s * s * h


def test_swiglu_gqa_flops():
    spec = PRESETS["llama-70b"]
    b, s, h, f, kv, d = spec.micro_batch, spec.seq, spec.hidden, spec.ffn, spec.kv_heads, spec.head_dim
    linear = 2 * b * s * h * (h + 2 * kv * d) + 2 * b * s * h * h + 3 * 2 * b * s * h * f
    assert spec.flash and spec.causal  # the fused causal core: blocks of 128 at and below the diagonal
    n = s // 128
    assert layer_forward_flops(spec) == linear + 4 * b * s * s * h * (n + 1) / (2 * n)


def test_matmul_backward_is_twice_forward_when_compute_bound(profiles):
    spec = PRESETS["gpt2-xl"]
    b, s, h, V = spec.micro_batch, spec.seq, spec.hidden, spec.vocab
    ops = {o.key: o for o in profiles["gpt2-xl"].ops}
    t = b * s  # tokens: (batch, m, n, k) of Y = X W, of the input gradient and of the weight gradient
    shapes = {
        "layers.7.attn:1:qkv": (t, 3 * h, h),
        "layers.7.attn:6:proj": (t, h, h),
        "layers.7.mlp:1:fc1": (t, 4 * h, h),
        "layers.7.mlp:3:fc2": (t, h, 4 * h),
        "head:1:lm_head": (t, V, h),
    }
    for key, (m, n, k) in shapes.items():
        op, f = ops[key], 2.0 * m * n * k
        # compute-bound, at the measured rate of a GEMM of its size and shape; backward: the input
        # gradient (m x n by n x k) and the weight gradient (k x m by m x n), the same FLOPs
        launch = HW.kernel_overhead_s  # each GEMM is one kernel
        assert op.fwd_s == pytest.approx(HW.gemm_s(f, (1, m, n, k)) + launch, rel=1e-12), key
        assert op.bwd_s == pytest.approx(HW.gemm_s(f, (1, m, k, n)) + HW.gemm_s(f, (1, k, n, m)) + 2 * launch,
                                         rel=1e-12), key
        assert op.fwd_s == pytest.approx(f / HW.gemm_rate(f), rel=0.25), key  # the shape moves it a little


def test_flash_backward_is_2_5x_forward(profiles):
    spec = PRESETS["llama-7b"]
    b, s, h = spec.micro_batch, spec.seq, spec.hidden
    op = next(o for o in profiles["llama-7b"].ops if o.key == "layers.0.attn:3:flash_attn")
    n = s // 128
    f = 4 * b * s * s * h * (n + 1) / (2 * n)  # causal: the blocks at and below the diagonal
    launch = HW.kernel_overhead_s
    assert spec.attention_kernel == "fa2" and (s, h // spec.heads) == (2048, 128)
    # FlashAttention-2, causal, head dim 128, seq 2k on A100: 155 TFLOP/s in the benchmark's count (half the
    # full s x s work for a causal kernel: the diagonal blocks' extra work is inside the measured rate)
    counted = 4 * b * s * s * h / 2
    assert op.fwd_s == pytest.approx(counted / 155e12 + launch, rel=1e-12)
    assert op.bwd_s == pytest.approx(2.5 * counted / 155e12 + launch, rel=1e-12)  # one kernel of 2.5x the FLOPs
    assert HW.attention_s(f, AttentionShape("fa2", 128, s, True, (n + 1) / (2 * n))) > HW.gemm_s(f)


def test_softmax_is_hbm_bound_with_explicit_bytes(profiles):
    spec = PRESETS["gpt2-xl"]
    N = spec.micro_batch * spec.heads * spec.seq**2
    op = next(o for o in profiles["gpt2-xl"].ops if o.key == "layers.0.attn:3:softmax")
    # at the measured speed of a memory-bound kernel (STREAM Copy), plus each kernel's fixed cost
    assert HW.elementwise_bps == 1.61e12
    assert op.fwd_s == pytest.approx(2 * N * 2 / HW.elementwise_bps + HW.kernel_overhead_s, rel=1e-12)  # read x, write y
    assert op.bwd_s == pytest.approx(3 * N * 2 / HW.elementwise_bps + HW.kernel_overhead_s, rel=1e-12)  # read y, dy; write dx


# ---- structure ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, count", [("gpt2-xl", 1 + 48 * 15 + 3), ("bert-large", 2 + 24 * 15 + 3),
                                         ("llama-7b", 32 * 15 + 4), ("llama-70b", 80 * 15 + 4)])
def test_activation_counts(profiles, name, count):
    assert len(profiles[name].activations) == count


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_identical_layers_have_identical_activation_classes(profiles, name):
    p = profiles[name]
    per_layer: dict[str, list] = defaultdict(list)
    for a in p.activations:
        r = p.region_of(a)
        if r.startswith("layers."):
            per_layer[r].append((a.layer_class, a.bytes, len(a.users), len(a.producers)))
    assert len(per_layer) == PRESETS[name].layers
    first = per_layer["layers.0"]
    assert all(v == first for v in per_layer.values())
    ops_per_layer: dict[str, list] = defaultdict(list)
    for o in p.ops:
        if o.region.startswith("layers."):
            ops_per_layer[o.region].append((re.sub(r"^layers\.\d+\.", "", o.key), o.fwd_s, o.bwd_s))
    assert all(v == ops_per_layer["layers.0"] for v in ops_per_layer.values())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_regions_keys_and_recomputability(profiles, name):
    p = profiles[name]
    spec = PRESETS[name]
    assert p.regions == ("embed", *(f"layers.{l}" for l in range(spec.layers)), "head")
    for o in p.ops:
        assert re.fullmatch(r"(embed|head|layers\.\d+\.(attn|mlp)):\d+:[a-z0-9_]+", o.key), o.key
        assert o.key.split(":")[0].startswith(o.region)
    for a in p.activations:
        region = p.region_of(a)
        assert a.key.startswith(region + (":" if region in ("embed", "head") else ".")), a.key
        if a.key.endswith(":x") or a.key == "head:norm.in":  # region inputs
            assert not a.recomputable, a.key
        else:
            assert a.recomputable, a.key
        assert all(p.ops[pr].region == region for pr in a.producers)


def test_one_tensor_two_users(profiles):
    p = profiles["llama-7b"]
    norm_out = p.by_key["layers.2.mlp:rmsnorm2.out"]
    assert [p.ops[u].key for u in norm_out.users] == ["layers.2.mlp:1:gate", "layers.2.mlp:3:up"]
    out = p.by_key["layers.2.attn:attn.out"]
    assert [p.ops[u].key for u in out.users] == ["layers.2.attn:3:flash_attn", "layers.2.attn:4:proj"]


def test_bert_is_post_ln(profiles):
    p = profiles["bert-large"]
    keys = [o.key for o in p.ops if o.region == "layers.0"]
    assert keys[0] == "layers.0.attn:0:qkv" and keys[-1] == "layers.0.mlp:4:ln2"
    x = p.by_key["layers.0.attn:x"]
    assert [p.ops[u].key for u in x.users] == ["layers.0.attn:0:qkv"]


def test_meta_and_override_name():
    p = workload("gpt2-xl", "a100-80g-pcie4", seq=2048, micro_batch=4)
    meta = dict(p.meta)
    assert meta["source"] == "analytic" and meta["hardware"] == HW.name
    assert meta["model.seq"] == "2048" and meta["model.micro_batch"] == "4"
    assert p.name == "gpt2-xl[micro_batch=4,seq=2048]"
    assert workload("gpt2-xl", HW).name == "gpt2-xl"


# ---- errors ------------------------------------------------------------------------------------
def test_unknown_workload_lists_valid_names():
    with pytest.raises(UnknownNameError) as e:
        workload("gpt5", HW)
    assert isinstance(e.value, KeyError)
    for name in workload_names():
        assert name in str(e.value)


def test_unknown_override_names_valid_fields():
    with pytest.raises(ProfileError, match="sequence_length.*valid fields.*micro_batch"):
        workload("gpt2-xl", HW, sequence_length=2048)


@pytest.mark.parametrize("bad, match", [
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(hidden=65), "divisible by heads"),
    (dict(seq=0), "seq must be a positive integer"),
    (dict(micro_batch=2.0), "micro_batch must be a positive integer"),
    (dict(ffn_kind="relu"), "ffn_kind"),
    (dict(norm_placement="sandwich"), "norm_placement"),
    (dict(dropout=1.0), "dropout"),
    (dict(dtype_bytes=3), "dtype_bytes"),
])
def test_invalid_specs_raise_profile_error(bad, match):
    with pytest.raises(ProfileError, match=match):
        small_spec(**bad)


def test_overrides_are_validated():
    with pytest.raises(ProfileError, match="multiple of kv_heads"):
        workload("bert-large", HW, kv_heads=3)


# ---- JSON --------------------------------------------------------------------------------------
def test_json_round_trip_and_stable_digest(profiles, tmp_path):
    p = profiles["bert-large"]
    back = StepProfile.from_json(json.loads(json.dumps(p.to_json())))
    assert back == p and back.digest == p.digest
    assert workload("bert-large", HW).digest == p.digest
    path = tmp_path / "bert.json"
    p.save(path)
    assert StepProfile.load(path) == p
    assert workload("bert-large", HW, seq=256).digest != p.digest


def test_core_does_not_import_torch():
    code = "import sys, slackswap_ds.workloads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- tensor and sequence parallelism, mixture of experts -------------------------------------------
from slackswap_ds.hardware import Curve  # noqa: E402
from slackswap_ds.workloads import Parallel  # noqa: E402

_22B = ModelSpec(name="22b", layers=2, hidden=6144, heads=64, kv_heads=64, ffn=4 * 6144, ffn_kind="gelu",
                 norm="layernorm", norm_placement="pre", dropout=0.1, vocab=51200, seq=2048, micro_batch=4,
                 dtype_bytes=2, flash=False, source="Korthikanti et al. 2022, Table 3")


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_bytes_with_tensor_and_sequence_parallelism_are_korthikantis(t, sp):
    if sp and t == 1:
        return
    s, b, h, a = _22B.seq, _22B.micro_batch, _22B.hidden, _22B.heads
    # Korthikanti et al. eq. 2 and 3: s·b·h·(10 + 24/t + 5·a·s/(h·t)) with TP, s·b·h/t·(34 + 5·a·s/h) with TP + SP
    want = (34 * s * b * h + 5 * a * s * s * b) // t if sp else 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t
    assert layer_activation_bytes(_22B, Parallel(t, sp)) == want


def test_tensor_parallelism_splits_the_matmul_flops():
    assert layer_forward_flops(_22B, Parallel(8)) * 8 == pytest.approx(layer_forward_flops(_22B), rel=1e-12)


def test_an_uncut_profile_is_the_same_profile():
    assert transformer_profile(_22B, HW, Parallel()).digest == transformer_profile(_22B, HW).digest


def test_collectives_per_layer_follow_megatron():
    def comm_ops(par):
        p = transformer_profile(_22B, HW, par)
        return [o.key.split(":")[-1] for o in p.ops if o.region == "layers.0"
                and o.key.split(":")[-1] in ("tp_in", "tp_out", "all_gather", "reduce_scatter")]

    assert comm_ops(Parallel()) == []
    assert comm_ops(Parallel(8)) == ["tp_in", "tp_out", "tp_in", "tp_out"]
    assert comm_ops(Parallel(8, True)) == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]


def _toy_board(busbw=1e9):
    """Whole-number rates: a GEMM runs at 1 TFLOP/s, HBM at 1 GB/s, collectives at `busbw`."""
    return dataclasses.replace(HW, name="toy-board", gemm_flops=Curve(((1.0, 1e12),)), hbm_bps=1e9,
                               allreduce_busbw=Curve(((1.0, busbw),)), flash_attention_flops=None)


def test_a_tiny_tensor_parallel_all_reduce_has_exact_event_times():
    from slackswap_ds.plan import Plan, lower
    from slackswap_ds.simulator import simulate

    spec = dataclasses.replace(_22B, layers=1, hidden=64, heads=4, kv_heads=4, ffn=256, seq=8, micro_batch=2,
                               vocab=128, dropout=0.0)
    hw = _toy_board()
    p = transformer_profile(spec, hw, Parallel(2))
    plan = Plan.build(p, {a.key: "keep" for a in p.activations}, budget_bytes=0, hardware_digest=hw.digest,
                      planner="keep-all")
    res = simulate(lower(p, plan), hw)
    ev = {(e.kind, e.name): e for e in res.events}
    keys = [o.key for o in p.ops]
    tp_out = "layers.0.attn:7:tp_out"
    i = keys.index(tp_out)
    nbytes = 2 * 8 * 64 * 2  # the attention block's full output: b·s·h 16-bit values
    ar_s = nbytes * 2 * (2 - 1) / 2 / 1e9  # nccl-tests: all-reduce moves 2(n-1)/n of the buffer at busbw
    e = ev["fwd", tp_out]
    assert e.start == pytest.approx(sum(o.fwd_s for o in p.ops[:i]), abs=1e-15)
    launch = hw.kernel_overhead_s  # (an NCCL kernel like any other)
    assert e.end - e.start == pytest.approx(ar_s + launch, rel=1e-12)
    b = ev["bwd", "layers.0.attn:1:tp_in"]  # the block input's all-reduce runs in backward only
    assert b.end - b.start == pytest.approx(ar_s + launch, rel=1e-12) and ev["fwd", "layers.0.attn:1:tp_in"].end == \
        ev["fwd", "layers.0.attn:1:tp_in"].start


def test_tensor_parallelism_refuses_a_cut_the_model_does_not_allow():
    with pytest.raises(ProfileError, match=r"heads \(25\) must be divisible by tp \(2\)"):
        workload("gpt2-xl", HW, Parallel(2))
    with pytest.raises(ProfileError, match="needs tp > 1"):
        Parallel(1, True)
    with pytest.raises(ProfileError, match="no allreduce_busbw curve"):
        workload("llama-7b", "gh200", Parallel(2))


def test_gqa_key_value_heads_are_replicated_when_fewer_than_the_cut():
    spec = PRESETS["llama-70b"]  # 8 KV heads
    p16 = transformer_profile(dataclasses.replace(spec, layers=1), HW, Parallel(16))
    k = p16.by_key["layers.0.attn:k"].bytes
    assert k == spec.micro_batch * spec.seq * 1 * spec.head_dim * 2  # one KV head per rank


def test_mixture_of_experts_bytes_and_flops_scale_with_experts_per_token():
    base = dataclasses.replace(PRESETS["llama-7b"], layers=1, micro_batch=1, seq=256, experts=8)
    one, two = (dataclasses.replace(base, experts_per_token=k) for k in (1, 2))
    b, s, h, f, B = 1, 256, base.hidden, base.ffn, 2
    # per extra routed copy of every token: its dispatched input (h) and expert output (h), the gate,
    # up, silu and product tensors (4 f), and its fp32 routing weight
    assert layer_activation_bytes(two) - layer_activation_bytes(one) == b * s * ((2 * h + 4 * f) * B + 4)
    expert_flops = 3 * 2 * b * s * h * f  # gate, up, down per routed copy
    assert layer_forward_flops(two) - layer_forward_flops(one) == pytest.approx(expert_flops, rel=1e-12)
    with pytest.raises(ProfileError, match="experts_per_token"):
        dataclasses.replace(base, experts_per_token=9)


def test_a_fused_loss_reads_the_logits_once_and_saves_their_16_bit_gradient():
    """llm.c's fused_classifier: one kernel per micro-step reads each logit and writes its gradient
    over it; nothing is left for a backward kernel, and the saved tensor is the 16-bit dlogits."""
    spec = small_spec(dropout=0.0)
    fused = dataclasses.replace(spec, fused_loss=True)
    logits = spec.micro_batch * spec.seq * spec.vocab
    plain_p, fused_p = transformer_profile(spec, HW), transformer_profile(fused, HW)
    assert plain_p.by_key["head:ce.logprobs"].bytes == 4 * logits
    assert fused_p.by_key["head:ce.dlogits"].bytes == 2 * logits and "head:ce.logprobs" not in fused_p.by_key
    op = next(o for o in fused_p.ops if o.key == "head:2:cross_entropy")
    assert op.fwd_s == pytest.approx(HW.elementwise_s(4 * logits) + HW.kernel_overhead_s) and op.bwd_s == 0.0
    with pytest.raises(ProfileError, match="fused_loss must be True or False"):
        dataclasses.replace(spec, fused_loss=1)
