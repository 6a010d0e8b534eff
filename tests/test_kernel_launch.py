"""How kernels are launched (kernels/_common.py): the fixed-config mode, compile-only recording,
and the bound on autotune candidates at BERT shapes."""
import pytest
import torch
import triton

from bertfast.kernels import _common
from bertfast.kernels import bias_gelu as BG

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the launch modes under the interpreter")


def _bias_gelu_inputs(n=37, f=300):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, f, generator=g), torch.randn(f, generator=g), torch.randn(n, f, generator=g)


def test_fixed_mode_runs_the_first_candidate_without_tuning(stand_in_tuner, monkeypatch):
    stand_in_tuner()
    monkeypatch.setenv(_common.AUTOTUNE_ENV, "0")
    launched = []
    for tuned in (BG._fwd_tuned, BG._bwd_tuned):
        monkeypatch.setattr(tuned, "run", lambda *a, **k: pytest.fail("the autotuner ran in fixed mode"))
    original = type(BG._fwd_tuned.fn).run  # the interpreter's function class, shared by both kernels

    def spy(self, *args, **kwargs):
        if self.fn.__name__.startswith("_bias_gelu"):  # not the backward's column_sums launch
            launched.append({k: kwargs[k] for k in ("BLOCK_N", "BLOCK_F", "num_warps", "enable_fp_fusion")
                             if k in kwargs})
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(BG._fwd_tuned.fn), "run", spy)
    x, bias, dy = _bias_gelu_inputs()
    y = BG.bias_gelu_fwd(x, bias)
    dx, dbias = BG.bias_gelu_bwd(dy, x, bias)
    z = (x + bias).requires_grad_(True)
    want = torch.nn.functional.gelu(z)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    (gz,) = torch.autograd.grad(want, z, dy)
    torch.testing.assert_close(dx, gz, atol=2e-6, rtol=1e-5)
    first = _common.candidates(BG._fwd_tuned, (x, bias, y, 37, 300, 300, 64), {"APPROX_TANH": False})[0]
    assert launched[0] == {**first.kwargs, "num_warps": first.num_warps, **_common.COMPILE_OPTIONS}
    assert len(launched) == 2


def test_a_pinned_candidate_is_the_config_launched(stand_in_tuner):
    """pinned_candidate (tests/ops/test_candidates.py checks every candidate with it): the named kernel
    launches candidate i of its pruned list (its last past the end), untimed, the other kernels their
    first; it lists each kernel's candidates; after the block launches take the autotuner again."""
    stand_in_tuner(BG._fwd_tuned, BG._bwd_tuned)
    launched = []
    original = type(BG._fwd_tuned.fn).run

    def spy(self, *args, **kwargs):
        if self.fn.__name__.startswith("_bias_gelu"):
            launched.append((self.fn.__name__, {k: kwargs[k] for k in ("BLOCK_N", "BLOCK_F", "num_warps")}))
        return original(self, *args, **kwargs)
    x, bias, dy = _bias_gelu_inputs()
    configs = _common.candidates(BG._fwd_tuned, (x, bias, x, 37, 300, 300, 64), {"APPROX_TANH": False})
    first_bwd = _common.candidates(BG._bwd_tuned, (dy, x, bias, x, x, 37, 300, 300, 300, 16, 64),
                                   {"APPROX_TANH": False})[0]
    assert len(configs) > 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(BG._fwd_tuned.fn), "run", spy)
        for tuned in (BG._fwd_tuned, BG._bwd_tuned):
            mp.setattr(tuned, "run", lambda *a, **k: pytest.fail("the autotuner ran under a pin"))
        for i in range(len(configs) + 1):
            launched.clear()
            with _common.pinned_candidate("_bias_gelu_fwd_kernel", i) as listed:
                BG.bias_gelu_fwd(x, bias)
                BG.bias_gelu_bwd(dy, x, bias)
            pinned = configs[min(i, len(configs) - 1)]
            assert launched[0] == ("_bias_gelu_fwd_kernel", {**pinned.kwargs, "num_warps": pinned.num_warps})
            assert launched[1] == ("_bias_gelu_bwd_kernel", {**first_bwd.kwargs, "num_warps": first_bwd.num_warps})
            assert listed["_bias_gelu_fwd_kernel"] == [_common.config_text(c) for c in configs]
            assert set(listed) == {"_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel"}
    assert not _common._PINNED and "_bias_gelu_fwd_kernel" not in _common.tuned_configs()
    BG.bias_gelu_fwd(x, bias)  # no pin: the autotuner chooses
    assert "_bias_gelu_fwd_kernel" in _common.tuned_configs()


def test_excluded_candidates_are_left_out_in_every_mode(stand_in_tuner, monkeypatch):
    """BERTFAST_EXCLUDE_CANDIDATES ('kernel:config; ...', configs as config_text writes them): the fixed
    mode then runs the first candidate left, the autotuner times only those left, a pin never reaches an
    excluded one; excluding them all, or a malformed entry, is a clear error; bertfast info and the
    bench's results name them."""
    from bertfast import info
    from types import SimpleNamespace

    from bertfast.bench.cli import _autotune_mode
    stand_in_tuner(BG._fwd_tuned)
    x, bias, _ = _bias_gelu_inputs()
    args, consts = (x, bias, x, 37, 300, 300, 64), {"APPROX_TANH": False}
    listed = _common.candidates(BG._fwd_tuned, args, consts)
    first, second = (_common.config_text(c) for c in listed[:2])
    monkeypatch.setenv(_common.EXCLUDE_ENV, f" _bias_gelu_fwd_kernel:{first}  ; _other_kernel:BLOCK_M=1 num_warps=4")
    left = _common.candidates(BG._fwd_tuned, args, consts)
    assert [_common.config_text(c) for c in left] == [_common.config_text(c) for c in listed[1:]]
    launched = []
    original = type(BG._fwd_tuned.fn).run

    def spy(self, *a, **kwargs):
        launched.append({k: kwargs[k] for k in ("BLOCK_N", "BLOCK_F", "num_warps")})
        return original(self, *a, **kwargs)
    monkeypatch.setattr(type(BG._fwd_tuned.fn), "run", spy)
    monkeypatch.setenv(_common.AUTOTUNE_ENV, "0")
    BG.bias_gelu_fwd(x, bias)
    assert launched[-1] == {**listed[1].kwargs, "num_warps": listed[1].num_warps}  # the first left
    monkeypatch.setenv(_common.AUTOTUNE_ENV, "1")
    launched.clear()
    BG.bias_gelu_fwd(x, bias)  # tuned: over the candidates left (here one: launched untimed)
    assert launched and all(c == {**listed[1].kwargs, "num_warps": listed[1].num_warps} for c in launched)
    assert _common.tuned_configs()["_bias_gelu_fwd_kernel"][0]["config"] == second
    with _common.pinned_candidate("_bias_gelu_fwd_kernel", 0) as pinned:
        BG.bias_gelu_fwd(x, bias)
    assert first not in pinned["_bias_gelu_fwd_kernel"]
    line = info._autotune_line()
    assert f"autotune candidates excluded (BERTFAST_EXCLUDE_CANDIDATES): _bias_gelu_fwd_kernel: {first}; " in line
    gpu = SimpleNamespace(is_cuda=True, triton_interpret=False)  # the bench's results on a GPU
    assert _autotune_mode(gpu).endswith(f"candidates; {_common.excluded_summary()}")
    assert "_other_kernel: BLOCK_M=1 num_warps=4" in _autotune_mode(gpu)
    everything = "; ".join(f"_bias_gelu_fwd_kernel:{_common.config_text(c)}" for c in listed)
    monkeypatch.setenv(_common.EXCLUDE_ENV, everything)
    with pytest.raises(RuntimeError, match="_bias_gelu_fwd_kernel: BERTFAST_EXCLUDE_CANDIDATES excludes every"):
        _common.candidates(BG._fwd_tuned, args, consts)
    monkeypatch.setenv(_common.EXCLUDE_ENV, f"BLOCK_N=1 {second}")
    with pytest.raises(ValueError, match="expected 'kernel:config' entries separated by ';'"):
        _common.candidates(BG._fwd_tuned, args, consts)
    assert "BERTFAST_EXCLUDE_CANDIDATES: expected" in info._autotune_line()
    monkeypatch.delenv(_common.EXCLUDE_ENV)
    assert _common.excluded_summary() == "" and len(_common.candidates(BG._fwd_tuned, args, consts)) == len(listed)


def test_every_launch_pins_fp_contraction(stand_in_tuner, monkeypatch):
    """Tuned, fixed and plain launches pass enable_fp_fusion=True: triton 3.10 turns its default off."""
    assert _common.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    stand_in_tuner(BG._fwd_tuned, BG._bwd_tuned)
    seen = []
    original = type(BG._fwd_tuned.fn).run

    def spy(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs.get("enable_fp_fusion")))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(BG._fwd_tuned.fn), "run", spy)
    x, bias, dy = _bias_gelu_inputs()
    for fixed in ("1", "0"):  # autotuned (each candidate timed, then the best), then the first candidate
        monkeypatch.setenv(_common.AUTOTUNE_ENV, fixed)
        BG.bias_gelu_bwd(dy, x, bias)  # the tuned kernel, then the plain column_sums kernel
    names = {name for name, _ in seen}
    assert any(n.startswith("_bias_gelu") for n in names) and len(names) >= 2, names
    assert all(flag is True for _, flag in seen), seen


def test_tuned_configs_report_what_the_autotuner_chose_under_the_key_recorded_offline(stand_in_tuner):
    """tuned_configs() lists each autotuned kernel's choice per tuning key, as a GPU run writes it for
    the perf model (bertfast/bench/profile.py): the key Triton's autotuner used equals the one
    compile_only records offline for the same arguments, and the config is one of the candidates."""
    from bertfast.kernels import attention, bias_dropout_residual_layernorm  # noqa: F401  (their tuners)
    assert {"_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel", "_attention_fwd_kernel",
            "_bias_dropout_residual_layernorm_fwd_kernel"} <= {_common.jit_function(t).__name__
                                                               for t in _common._TUNERS}
    stand_in_tuner(BG._fwd_tuned, BG._bwd_tuned)
    assert "_bias_gelu_fwd_kernel" not in _common.tuned_configs()  # nothing tuned yet
    x, bias, _ = _bias_gelu_inputs()
    y = BG.bias_gelu_fwd(x, bias)
    chosen = _common.tuned_configs()["_bias_gelu_fwd_kernel"]
    args, consts = (x, bias, y, 37, 300, 300, 64), {"APPROX_TANH": False}
    offline = _common.key_values(_common._tuning_key(BG._fwd_tuned, args, consts))
    assert [tuple(c["key"]) for c in chosen] == [offline]
    assert chosen[0]["config"] in {_common.config_text(c) for c in _common.candidates(BG._fwd_tuned, args, consts)}
    assert "BLOCK_F=" in chosen[0]["config"] and "num_warps=" in chosen[0]["config"]


def test_autotune_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(_common.AUTOTUNE_ENV, "yes")
    with pytest.raises(ValueError, match="BERTFAST_AUTOTUNE: expected 0 or 1, got 'yes'"):
        _common.autotune_enabled()


def test_compile_only_records_candidates_and_runs_nothing(monkeypatch):
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(type(BG._fwd_tuned.fn), "run", lambda *a, **k: pytest.fail("a kernel ran"))
    seen = []
    x, bias, _ = _bias_gelu_inputs(64, 3072)
    with _common.compile_only(lambda fn, grid, args, consts, configs, key: seen.append((fn.__name__, configs, key))):
        BG.bias_gelu_fwd(x, bias)
    assert [name for name, _, _ in seen] == ["_bias_gelu_fwd_kernel"]
    args, consts = (x, bias, x, 64, 3072, 3072, 64), {"APPROX_TANH": False}
    want = _common.candidates(BG._fwd_tuned, args, consts)
    assert [str(c) for c in seen[0][1]] == [str(c) for c in want] and len(want) > 1
    assert seen[0][2] == _common._tuning_key(BG._fwd_tuned, args, consts) and "3072" in str(seen[0][2])


def test_candidates_per_tuning_key_are_bounded_at_bert_shapes(monkeypatch):
    """What the autotuner tries per key (its list pruned for the shape) stays small: tuning costs a
    compile and a timing per candidate on a GPU that is lent for minutes."""
    from bertfast.gpucheck.compile_report import record_launches

    monkeypatch.setattr(_common, "interpreting", lambda: False)
    launches = record_launches(fast=False)
    kernels = {launch.fn.__name__ for launch in launches}
    assert {"_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
            "_attention_bwd_fused_kernel", "_bias_gelu_fwd_kernel",
            "_bias_gelu_bwd_kernel", "_bias_dropout_residual_layernorm_fwd_kernel",
            "_bias_dropout_residual_layernorm_bwd_kernel", "_embeddings_fwd_kernel", "_embeddings_bwd_kernel",
            "_embeddings_bwd_pos_kernel", "_mlm_head_loss_fwd_kernel", "_gemm_bias_gelu_kernel"} <= kernels
    for launch in launches:
        assert 1 <= len(launch.configs) <= _common.MAX_CANDIDATES, (launch.fn.__name__, launch.case,
                                                                      [str(c) for c in launch.configs])


def test_row_tile_pruner_prefers_tiles_of_few_warps_where_they_give_the_allowed_count():
    """The LayerNorm backward's pruner (max_warps=8): at H = 1024 its 16-warp tile leaves (fp32 tiles
    spilled there with triton 3.6, at 128 registers a thread); at H = 8192 only 16 warps give 16 per
    thread, so it stays."""
    from bertfast.kernels._rows import BWD_PER_THREAD, MAX_ROWS_PER_TILE, row_config_pruner, row_tile_configs
    configs = row_tile_configs(MAX_ROWS_PER_TILE)

    def shapes(pruner, block_h):
        return [(c.kwargs["BLOCK_M"], c.num_warps) for c in pruner(configs, {"n_bucket": 1 << 14}, BLOCK_H=block_h)]
    assert shapes(row_config_pruner(BWD_PER_THREAD), 1024) == [(1, 4), (2, 8), (4, 16)]
    assert shapes(row_config_pruner(BWD_PER_THREAD, max_warps=8), 1024) == [(1, 4), (2, 8)]
    assert shapes(row_config_pruner(BWD_PER_THREAD, max_warps=8), 8192) == [(1, 16)]


def test_the_layernorm_backward_pipelines_its_loads_within_its_shared_memory(monkeypatch):
    """Its loop's loads run through Triton's pipeline (STAGES - 1 tiles of dy and pre_norm in shared
    memory): BWD_STAGES at BERT's rows, fewer for wide fp32 rows, never more than BWD_STAGE_BYTES a
    program for the largest tile a pruned candidate takes, and never fewer than 2 (no pipeline)."""
    from bertfast.kernels import bias_dropout_residual_layernorm as LN
    from bertfast.kernels._rows import BWD_PER_THREAD, MAX_ROWS_PER_TILE, row_config_pruner, row_tile_configs
    configs = row_tile_configs(MAX_ROWS_PER_TILE)
    for block_h in (16, 128, 1024, 2048, 4096, 8192):
        tiles = [c.kwargs["BLOCK_M"] * block_h for c in row_config_pruner(BWD_PER_THREAD, LN.BWD_MAX_WARPS)(
            configs, {"n_bucket": 1 << 14}, BLOCK_H=block_h)]
        for element_bytes in (4, 6, 8):  # bf16 dy and pre_norm, bf16 and fp32, fp32
            stages = LN.bwd_stages(block_h, element_bytes)
            assert 2 <= stages <= LN.BWD_STAGES
            assert (stages - 1) * max(tiles) * element_bytes <= LN.BWD_STAGE_BYTES or stages == 2, (block_h, stages)
    assert LN.bwd_stages(1024, 4) == LN.BWD_STAGES == 5  # BERT-large in bf16: four 4 KB rows ahead
    assert LN.bwd_stages(8192, 8) == 2
    # the launcher passes it
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    seen = []
    dy = torch.randn(64, 1024, dtype=torch.bfloat16)
    with _common.compile_only(lambda fn, grid, args, consts, configs, key: seen.append((fn.__name__, consts))):
        LN.bias_dropout_residual_layernorm_bwd(dy, dy, torch.zeros(64), torch.ones(64), torch.ones(1024), 0.0, None,
                                               True, True)
    assert [consts["STAGES"] for name, consts in seen if name == "_bias_dropout_residual_layernorm_bwd_kernel"] == [5]


def test_the_layernorm_forward_offers_row_groups_first_pipelined_within_their_shared_memory(monkeypatch):
    """Its candidates: the first FWD_GROUP_CANDIDATES row tiles as row groups (ROW_GROUPS programs an SM of
    FWD_GROUP_WARPS warps in all, their loads through Triton's pipeline: STAGES - 1 tiles of x and the
    residual within FWD_STAGE_BYTES a program, at least 2 stages), then the first FWD_TILE_CANDIDATES as
    one tile a program (STAGES 1: no loop); the grid holds ROW_GROUPS programs an SM, or one a tile."""
    from bertfast.kernels import bias_dropout_residual_layernorm as LN
    from bertfast.kernels._rows import MAX_ROWS_PER_TILE, block_h_for
    tuned = LN._fwd_tuned
    for h, dtype, has_res in ((1024, torch.bfloat16, True), (768, torch.bfloat16, True), (1024, torch.float32, True),
                              (8192, torch.float32, True), (1024, torch.bfloat16, False), (128, torch.float32, True)):
        x = torch.empty(16384, h, dtype=dtype, device="meta")
        configs = tuned.early_config_prune(tuned.configs, {"X": x, "n_bucket": 1 << 14}, HAS_RES=has_res,
                                           BLOCK_H=block_h_for(h))
        groups = [c for c in configs if c.kwargs["ROW_GROUPS"]]
        single = configs[len(groups):]
        assert configs[:len(groups)] == groups and 1 <= len(groups) <= LN.FWD_GROUP_CANDIDATES, h
        assert 1 <= len(single) <= LN.FWD_TILE_CANDIDATES and not any(c.kwargs["ROW_GROUPS"] for c in single)
        assert all(c.kwargs["STAGES"] == 1 for c in single)
        for c in groups:
            assert c.kwargs["BLOCK_M"] <= MAX_ROWS_PER_TILE
            assert c.kwargs["ROW_GROUPS"] == max(1, LN.FWD_GROUP_WARPS // c.num_warps)
            tile = c.kwargs["BLOCK_M"] * block_h_for(h) * dtype.itemsize * (2 if has_res else 1)
            assert 2 <= c.kwargs["STAGES"] <= LN.FWD_STAGES
            assert (c.kwargs["STAGES"] - 1) * tile <= LN.FWD_STAGE_BYTES or c.kwargs["STAGES"] == 2, (h, dtype)
    # BERT-large in bf16: eight programs of a row and two warps an SM, three 4 KB rows ahead
    x = torch.empty(16384, 1024, dtype=torch.bfloat16, device="meta")
    first = tuned.early_config_prune(tuned.configs, {"X": x, "n_bucket": 1 << 14}, HAS_RES=True, BLOCK_H=1024)[0]
    assert (first.kwargs["BLOCK_M"], first.num_warps) == (1, 2)
    assert (first.kwargs["ROW_GROUPS"], first.kwargs["STAGES"]) == (8, 4)
    monkeypatch.setattr(LN, "resident_programs", lambda device, per_sm: per_sm * 132)
    grid = LN.fwd_grid(16384, torch.device("cuda"))
    assert grid({"BLOCK_M": 1, "ROW_GROUPS": 8}) == (1056,) and grid({"BLOCK_M": 2, "ROW_GROUPS": 0}) == (8192,)
    assert LN.fwd_grid(100, torch.device("cuda"))({"BLOCK_M": 1, "ROW_GROUPS": 8}) == (100,)  # at most a tile each


def test_the_ffn_gemms_default_holds_two_programs_an_sm_in_each_direction():
    """The fixed mode's config (the pruned list's first) of the GEMM with the GELU epilogue: forward the
    list's first (128 x 128, 8 warps, 110 registers), backward _GEMM_BWD_DEFAULT (64 x 128, 4 warps: the
    first takes 161 registers there, one program an SM); the other candidates keep their order."""
    configs = BG._gemm_configs()

    def tiles(backward):
        return [BG._gemm_shape(c) for c in BG._prune_gemm(configs, {"N": 4096, "K": 1024}, BACKWARD=backward)]
    forward, backward = tiles(False), tiles(True)
    assert forward[0] == (128, 128, 64, 3, 8) and backward[0] == BG._GEMM_BWD_DEFAULT
    assert backward[1:] == [t for t in forward if t != BG._GEMM_BWD_DEFAULT] and sorted(backward) == sorted(forward)
    # what launch() and the compile report read: the autotuned kernel's own pruned list
    shape = {"N": 4096, "K": 1024}
    tuned = _common.candidates(BG._gemm_tuned, [shape.get(name) for name in BG._gemm_tuned.arg_names],
                               {"BACKWARD": True})
    assert BG._gemm_shape(tuned[0]) == BG._GEMM_BWD_DEFAULT == (64, 128, 64, 4, 4)


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """The launchers' grids and buckets use kernels._common's (plain ints: triton 3.9's are constexpr
    functions costing ~2 us a host call); they must give Triton's answers."""
    for n in list(range(-3, 1100)) + [2**16 - 1, 2**16, 2**16 + 1, 10**9]:
        assert _common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert _common.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_every_recorded_launch_has_a_launch_key(monkeypatch):
    """launch() remembers each autotuned kernel's kwargs by _launch_key: every launch of the compile
    report's BERT settings gives a hashable key, and two launches that Triton's autotuner keys apart
    are apart in it too."""
    from bertfast.gpucheck.compile_report import record_launches

    monkeypatch.setattr(_common, "interpreting", lambda: False)
    tuners = {id(_common.jit_function(t)): t for t in _common._TUNERS}
    keys = {}
    for launch in record_launches(fast=True):
        tuner = tuners.get(id(launch.fn))
        if tuner is None:
            continue  # a plain kernel: launched as it is
        key = _common._launch_key(tuner, launch.args, launch.consts, True)
        hash(key)
        keys.setdefault(key, set()).add(_common._tuning_key(tuner, launch.args, launch.consts))
    assert keys and all(len(tuning) == 1 for tuning in keys.values())
