"""The kernels the performance model reads: each compiled for sm_90 offline at BERT's shapes, its
first autotune candidate (the config ``BERTFAST_AUTOTUNE=0`` runs) or every candidate (record's
``candidates``), with the work of one launch.

Launches are recorded as the compile report records them (gpucheck.compile_report.bert_launches
inside ``compile_only``: nothing runs), then compiled by Triton with the offline driver; the cubin
is disassembled (sass.disassemble) and ptxas's report gives the registers. ``WORK`` says, per
kernel, what an element is and how a launch's work divides into main-loop iterations and programs.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import math
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from bertfast import registry
from bertfast.perfmodel.hardware import Gpu
from bertfast.perfmodel.model import Work
from bertfast.perfmodel.sass import Function, disassemble, parse

HEAD_DIM = 64
ROWS_PER_GROUP = 32  # bias_gelu's backward on a GPU: 2 x MAX_ROWS_PER_TILE rows per program (kernels/bias_gelu.py)


@dataclass
class Setting:
    """One benchmark shape: the model, its sequence length and batch, bf16 activations with fp32
    parameters (autocast), and the dropout probability."""

    model: str = "bert-large"
    seq: int = 512
    batch: int = 32
    dropout: float = 0.1

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    def label(self) -> str:
        return f"{self.model} seq {self.seq} batch {self.batch} bf16 p={self.dropout:g}"

    def as_report_setting(self):
        return (self.model, self.seq, self.batch, "bf16", "fp32", self.dropout)


@dataclass
class Launch:
    op: str
    kernel: str
    meta: Dict[str, object]     # constexprs and the first candidate's block sizes, num_warps
    grid: Tuple[int, ...]
    args: tuple
    compile: Callable[[], object]
    names: Tuple[str, ...]      # the kernel's parameter name of each argument
    tuned: bool = False         # meta holds the config a GPU run's autotuner chose, not the first candidate
    call: int = 0               # which recorded call it is (record(candidates=...): one launch per candidate)
    candidates: int = 1         # how many candidates were recorded for that call

    def unused_names(self) -> List[str]:
        """The parameters CONDITIONAL_ARGS says this launch's flags leave untouched."""
        return [name for name, flag in CONDITIONAL_ARGS.get(self.kernel, {}).items() if not _flag(self.meta, flag)]

    def used_args(self) -> List[object]:
        """The arguments the kernel touches: not the stand-ins passed for unused_names."""
        unused = set(self.unused_names())
        return [a for a, name in zip(self.args, self.names) if name not in unused]


def _flag(meta: Dict[str, object], flag: str) -> bool:
    """A constexpr flag's value in a launch's meta; "!NAME": NAME unset; "NAME>N": the constexpr NAME above N."""
    if ">" in flag:
        name, least = flag.split(">")
        return int(meta.get(name, 0)) > int(least)
    return not meta.get(flag[1:]) if flag.startswith("!") else bool(meta.get(flag))


# A kernel's pointer arguments that it reads or writes only when a constexpr flag is set ("!FLAG": unset). Otherwise its
# launcher passes another argument in their place (a pointer Triton needs, no bytes of its own): counted,
# such a stand-in made the LayerNorm forward's traffic look 25% larger than it is.
_ATTENTION_ARGS = {"CU_SEQLENS": "IS_VARLEN", "KEY_MASK": "HAS_KEY_MASK", "SEED": "HAS_DROPOUT",
                   "KEEP": "HAS_DROPOUT"}
_ATTENTION_BWD_ARGS = {"CU_SEQLENS": "IS_VARLEN", "KEY_MASK": "HAS_KEY_MASK", "KEEP": "HAS_DROPOUT", "DB": "HAS_DB"}
CONDITIONAL_ARGS: Dict[str, Dict[str, str]] = {
    "_attention_fwd_kernel": _ATTENTION_ARGS,
    "_attention_bwd_fused_kernel": _ATTENTION_BWD_ARGS,
    "_attention_bwd_dkdv_kernel": _ATTENTION_BWD_ARGS,
    "_attention_bwd_dkdv_atomic_dq_kernel": _ATTENTION_BWD_ARGS,
    "_attention_bwd_dq_store_kernel": {"DB": "HAS_DB"},
    "_attention_bwd_dq_kernel": {**_ATTENTION_BWD_ARGS, "DELTA_OUT": "REFINE_DELTA"},
    "_attention_bwd_delta_kernel": {"CU_SEQLENS": "IS_VARLEN"},
    "_bias_dropout_residual_layernorm_fwd_kernel": {"BIAS": "HAS_BIAS", "RES": "HAS_RES", "PRE": "STORE_PRE",
                                                    "KEEP": "STORE_KEEP", "SEED": "HAS_DROPOUT"},
    "_bias_dropout_residual_layernorm_bwd_kernel": {"DRES": "HAS_RES", "DBIAS_PART": "HAS_BIAS",
                                                    "SEED": "HAS_DROPOUT"},
    "_embeddings_fwd_kernel": {"KEEP": "STORE_KEEP", "SEED": "HAS_DROPOUT"},
    "_embeddings_bwd_kernel": {"SEED": "HAS_DROPOUT"},
    "_embeddings_bwd_pos_kernel": {"DTT": "TT_SORTED", "DTT_PART": "!TT_SORTED", "SEED": "HAS_DROPOUT"},
    "_table_rows_kernel": {"DTT": "TT_SORTED"},
    "_gemm_bias_gelu_kernel": {"BIAS": "!BACKWARD", "Z": "HAS_Z", "DBIAS_PART": "BACKWARD"},
    "_logits_stats_kernel": {"BIAS": "HAS_BIAS", "LABEL_OK": "CHECK_LABELS"},
    "_mlm_logits_gemm_kernel": {"BIAS": "HAS_BIAS"},
    "_softmax_dw_gemm_kernel": {"DB": "HAS_DB"},
    "_softmax_dx_gemm_kernel": {"PART": "SPLIT>1", "COUNTS": "SPLIT>1"},
}


# The helper files a kernel's code calls into beside its own file and the row ops' kernels/_rows.py
# (report.compare: a change there is a change of the kernel's source since a GPU run)
SHARED_SOURCES: Dict[str, Tuple[str, ...]] = {
    "_gemm_bias_gelu_kernel": ("kernels/_gemm.py",),
    "_mlm_logits_gemm_kernel": ("kernels/_gemm.py",),
    "_softmax_dx_gemm_kernel": ("kernels/_gemm.py",),
    "_softmax_dw_gemm_kernel": ("kernels/_gemm.py",),
}


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _bytes(launch: Launch, keep: Callable[[object], bool] = lambda a: True) -> int:
    """The bytes of the tensors ``launch`` touches (each argument once), those ``keep`` accepts."""
    return sum(a.numel() * a.element_size() for a in launch.used_args() if hasattr(a, "numel") and keep(a))


def _tile(meta: Dict[str, object], *names: str) -> int:
    return int(math.prod(int(meta[n]) for n in names))


def _attention(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    from bertfast.gpucheck.compile_report import MODELS
    heads = MODELS[setting.model][0] // HEAD_DIM
    scores = setting.batch * heads * setting.seq ** 2
    tile = _tile(launch.meta, "BLOCK_M", "BLOCK_N")
    stages, programs = int(launch.meta.get("num_stages", 2)), _numel(launch.grid)
    if launch.meta.get("PERSISTENT"):
        # the one-pass backward's loop over whole (sequence, head) pairs, a program per SM (the grid
        # recorded on CPU tensors has the interpreter's 3)
        tile, stages = _tile(launch.meta, "BLOCK_N", "BLOCK_N"), int(launch.meta["ITEM_STAGES"])
        programs = min(int(scores // tile), gpu.sms)
    # Triton pipelines the key (query) blocks' loads over num_stages: num_stages - 1 are in flight.
    return Work(scores / tile, tile, programs, int(launch.meta["num_warps"]), _bytes(launch),
                loads_ahead=max(1, stages - 1))


def _attention_atomic_dq(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """_attention, with the fp32 dQ accumulator counted twice: its atomics read it and write it back
    (their L2 traffic, every key block's adds, is not priced: a GPU run will say)."""
    work = _attention(setting, launch, gpu)
    acc = launch.args[launch.names.index("DQ_ACC")]
    work.hbm_bytes += acc.numel() * acc.element_size()
    return work


def _no_loop(*tile_names: str) -> Callable[[Setting, Launch, Gpu], Work]:
    """A kernel whose program handles one tile: as many iterations as programs."""
    def work(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
        programs = _numel(launch.grid)
        return Work(programs, _tile(launch.meta, *tile_names), programs, int(launch.meta.get("num_warps", 4)),
                    _bytes(launch))
    return work


def _row_loop(rows_tile: str, cols_tile: str, programs: Callable[[Setting, Launch, Gpu], int]):
    """A kernel whose programs walk the [rows_tile, cols_tile] tiles of its first argument, [rows, cols]
    (a tile wider than the row counted whole: BERT-base's 768 columns take a tile of 1,024), programs
    as on a GPU."""
    def work(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
        rows, cols = launch.args[0].shape
        tile_rows, tile_cols = int(launch.meta[rows_tile]), int(launch.meta[cols_tile])
        return Work(math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols), tile_rows * tile_cols,
                    programs(setting, launch, gpu), int(launch.meta.get("num_warps", 4)),
                    _bytes(launch, lambda a: a.dim() == 0 or a.shape[0] != 0))
    return work


def _row_groups(op: str) -> Callable[[Setting, Launch, Gpu], int]:
    """The programs of ``op``'s row_groups launch on ``gpu`` (the recorded grid is the CPU's three),
    at the BWD_PROGRAMS_PER_SM of kernels/<op>.py."""
    def programs(setting: Setting, launch: Launch, gpu: Gpu) -> int:
        from bertfast.kernels._rows import row_group_shape
        per_sm = importlib.import_module(f"bertfast.kernels.{op}").BWD_PROGRAMS_PER_SM
        return row_group_shape(launch.args[0].shape[0], per_sm * gpu.sms)[0]
    return programs


def _gelu_groups(setting: Setting, launch: Launch, gpu: Gpu) -> int:
    n, f = launch.args[0].shape
    return math.ceil(n / ROWS_PER_GROUP) * math.ceil(f / int(launch.meta["BLOCK_F"]))


def _gelu_bwd(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """Row tiles in groups of 32 rows; each program's [BLOCK_F] fp32 partial is written, and read back."""
    work = _row_loop("BLOCK_N", "BLOCK_F", programs=_gelu_groups)(setting, launch, gpu)
    work.overhead_bytes = work.programs * 2 * int(launch.meta["BLOCK_F"]) * 4
    return work


def _gathered_bytes(setting: Setting, launch: Launch) -> int:
    """The table rows a launch's tokens gather, each distinct row read from DRAM once
    (bertfast.bench.flops.gathered_rows: at most the tokens, at most the table)."""
    from bertfast.bench.flops import gathered_rows
    tables = [launch.args[launch.names.index(name)] for name in ("WORD", "POS", "TT")]
    return sum(gathered_rows(setting.tokens, t.shape[0]) * t.shape[1] * t.element_size() for t in tables)


def _logits_stats(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """_no_loop's, its bytes with W's rows at the labels (one a row at most, each distinct row once:
    gathered_rows) where the launch's arguments would count the whole decoder weight."""
    from bertfast.bench.flops import gathered_rows
    weight = launch.args[launch.names.index("W")]
    work = _no_loop("BLOCK_R")(setting, launch, gpu)
    rows = launch.args[launch.names.index("LABELS")].shape[0]
    work.hbm_bytes = (_bytes(launch, lambda a: a is not weight)
                      + gathered_rows(rows, weight.shape[0]) * weight.shape[1] * weight.element_size())
    return work


def _embeddings_fwd(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    # Reads the ids and the gathered table rows (fp32 parameters), writes the bf16 output and the
    # statistics; not the tables.
    programs = _numel(launch.grid)
    hidden = launch.args[3].shape[1]
    moved = setting.tokens * (hidden * 2 + 3 * 8 + 2 * 4) + _gathered_bytes(setting, launch)
    return Work(programs, _tile(launch.meta, "BLOCK_M", "BLOCK_H"), programs, int(launch.meta["num_warps"]), moved)


def _embeddings_walk(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """A walk over sorted entries (the backward's by word, and its by position), a chunk a program: each
    entry reads its key, its token index, the token's ids, statistics and dy row, and the rows its token
    gathers (_gathered_bytes: the word rows the walk by position gathers again come from DRAM, the word
    table being larger than L2), to compute dh; the walk by word writes each token's two LayerNorm scalars,
    the walk by position reads them. The table rows a walk completes are priced with _table_rows (which
    writes the rest); the partial sums (the runs cut by the chunks' edges, and the walk by position's
    LayerNorm and token-type partials) written and read back, as overhead."""
    arg = dict(zip(launch.names, launch.args))
    dy, keys = arg["DY"], arg["KEYS"]
    tokens, hidden = dy.shape
    chunk = int(launch.meta["CHUNK"])
    if launch.kernel == "_embeddings_bwd_kernel":
        entries, chunks, partials = tokens, math.ceil(tokens / chunk), 0
    else:
        entries, chunks = keys.numel() - tokens, math.ceil(keys.numel() / chunk) - tokens // chunk
        partials = sum(arg[name].numel() for name in ("DW_PART", "DB_PART", "DTT_PART")
                       if name not in launch.unused_names())
    per_entry = (hidden * dy.element_size() + 3 * arg["IDS"].element_size() + keys.element_size()
                 + arg["ORDER"].element_size() + 4 * 4)  # mean, rstd, a, c
    moved = (entries * per_entry + entries // tokens * _gathered_bytes(setting, launch)
             + hidden * arg["W"].element_size() + 8)
    tile = _tile(launch.meta, "BLOCK_M", "BLOCK_H")
    return Work(entries * int(launch.meta["BLOCK_H"]) / tile, tile, _numel(launch.grid), int(launch.meta["num_warps"]),
                moved, overhead_bytes=2 * (chunks * 2 * hidden + partials) * 4,
                loads_ahead=max(1, int(launch.meta["STAGES"]) - 1))


def _table_rows(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """ROWS x BLOCK_H of the stacked tables a program: each table row written once by the two passes
    together (zeros, or the sum of its chunks' partials), the bounds read. Its loop, over a row's
    chunks, runs only in the few programs whose rows cross chunks (the positions', [MASK]'s): not
    priced, so iterations 0 and the body once per program."""
    rows = launch.args[1].numel() - 1
    programs = _numel(launch.grid)
    unused = set(launch.unused_names())
    tables = sum(a.numel() * a.element_size() for a, name in zip(launch.args, launch.names)
                 if name in ("DWORD", "DPOS", "DTT") and name not in unused)
    return Work(0, _tile(launch.meta, "ROWS", "BLOCK_H"), programs, int(launch.meta["num_warps"]),
                tables + 8 * (rows + 1))


def _partial_bytes_per_program(launch: Launch, sets: int) -> int:
    """The fp32 [H] partial sums a row-group program writes (and column_sums reads back): ``sets`` of them."""
    return 2 * sets * launch.args[0].shape[1] * 4


def _ln_fwd(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """One tile a program, or (ROW_GROUPS) a loop over row tiles by ROW_GROUPS programs an SM of the GPU
    (the recorded grid is the CPU's three) in blocks of whole tiles, those holding rows counted
    (row_group_shape at BLOCK_M, as the kernel splits them), its loads STAGES - 1 tiles ahead (Triton's
    pipeline)."""
    from bertfast.kernels._rows import row_group_shape
    per_sm = int(launch.meta.get("ROW_GROUPS") or 0)
    if not per_sm:
        return _no_loop("BLOCK_M", "BLOCK_H")(setting, launch, gpu)
    programs = row_group_shape(launch.args[0].shape[0], per_sm * gpu.sms, int(launch.meta["BLOCK_M"]))[0]
    work = _row_loop("BLOCK_M", "BLOCK_H", programs=lambda *_: programs)(setting, launch, gpu)
    work.loads_ahead = max(1, int(launch.meta["STAGES"]) - 1)
    return work


def _ln_bwd(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """A row-group loop whose partials are priced at the GPU's G (the recorded ones are the CPU's),
    its loads STAGES - 1 tiles ahead (Triton's pipeline)."""
    work = _row_loop("BLOCK_M", "BLOCK_H", programs=_row_groups("bias_dropout_residual_layernorm"))(
        setting, launch, gpu)
    has_bias = launch.meta.get("HAS_BIAS") in (True, 1)
    work.overhead_bytes = work.programs * _partial_bytes_per_program(launch, 3 if has_bias else 2)
    work.loads_ahead = max(1, int(launch.meta["STAGES"]) - 1)
    return work


def _gemm_over(k_of: Callable[[Launch], int]) -> Callable[[Setting, Launch, Gpu], Work]:
    """A GEMM reducing over ``k_of(launch)`` per program: an iteration is one BLOCK_K step of a BLOCK_M x
    BLOCK_N tile (its elements the tile's multiply-adds); its operands and outputs each counted once (L2
    serves the re-reads of a group's rows and columns); its loads num_stages - 1 steps ahead."""
    def work(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
        meta = launch.meta
        programs = _numel(launch.grid)
        steps = math.ceil(k_of(launch) / int(meta["BLOCK_K"]))
        return Work(programs * steps, _tile(meta, "BLOCK_M", "BLOCK_N", "BLOCK_K"), programs,
                    int(meta["num_warps"]), _bytes(launch), loads_ahead=max(1, int(meta.get("num_stages", 2)) - 1))
    return work


def _arg(launch: Launch, name: str) -> int:
    return int(launch.args[launch.names.index(name)])


# A GEMM of A [M, K] (the first argument) and B
_gemm = _gemm_over(lambda launch: launch.args[0].shape[1])


def _softmax_dx(setting: Setting, launch: Launch, gpu: Gpu) -> Work:
    """The fused MLM decoder's input gradient: a GEMM over its split of the vocabulary; split, its partials
    written (PART, counted once as an argument) and read back by each tile's last split."""
    work = _gemm_over(lambda l: _arg(l, "tiles_per_split") * int(l.meta["TILE_N"]))(setting, launch, gpu)
    if int(launch.meta["SPLIT"]) > 1:
        work.overhead_bytes = launch.args[launch.names.index("PART")].numel() * 4
    return work


# kernel -> how a launch's work is counted; the kernels not listed are not modelled yet (the MLM loss,
# LAMB): the step budget prices their work by its bytes, or not at all
WORK: Dict[str, Callable[[Setting, Launch, Gpu], Work]] = {
    "_attention_fwd_kernel": _attention,
    "_attention_bwd_dq_kernel": _attention,
    "_attention_bwd_dkdv_kernel": _attention,
    "_attention_bwd_dkdv_atomic_dq_kernel": _attention_atomic_dq,
    "_attention_bwd_dq_store_kernel": _no_loop("BLOCK_T", "BLOCK_D"),
    "_attention_bwd_delta_kernel": _no_loop("BLOCK_M", "BLOCK_D"),
    "_attention_bwd_fused_kernel": _attention,
    "_bias_gelu_fwd_kernel": _no_loop("BLOCK_N", "BLOCK_F"),
    "_bias_gelu_bwd_kernel": _gelu_bwd,
    "_bias_dropout_residual_layernorm_fwd_kernel": _ln_fwd,
    "_bias_dropout_residual_layernorm_bwd_kernel": _ln_bwd,
    "_embeddings_fwd_kernel": _embeddings_fwd,
    "_embeddings_bwd_kernel": _embeddings_walk,
    "_embeddings_bwd_pos_kernel": _embeddings_walk,
    "_table_rows_kernel": _table_rows,
    "_gemm_bias_gelu_kernel": _gemm,
    "_mlm_logits_gemm_kernel": _gemm,
    "_logits_stats_kernel": _logits_stats,
    # the fused MLM decoder's backward GEMMs: the input gradient's over its split of the vocabulary, the weight
    # gradient's over the rows
    "_softmax_dx_gemm_kernel": _softmax_dx,
    "_softmax_dw_gemm_kernel": _gemm_over(lambda l: _arg(l, "M")),
}


def _sequence_tiles(kernel: str, meta: Dict[str, object], length: int) -> Tuple[int, int]:
    """(programs with work, main-loop iterations) of one attention kernel for one head of one sequence
    of ``length`` tokens. Each loop runs to the sequence's end, so a tile the sequence fills in part
    costs a whole one; the persistent one-pass backward walks every query block of its key tile (all
    of the batch's longest sequence), whatever the sequence's length."""
    queries = -(-length // int(meta.get("BLOCK_M", 1)))
    keys = -(-length // int(meta.get("BLOCK_N", 1)))
    if kernel == "_attention_bwd_fused_kernel":
        return (1, 1) if meta.get("PERSISTENT") else (1, queries)  # its key tile holds every key
    if kernel == "_attention_bwd_delta_kernel":
        return queries, queries
    if kernel == "_attention_bwd_dkdv_kernel":
        return keys, keys * queries
    if kernel in ("_attention_fwd_kernel", "_attention_bwd_dq_kernel"):
        return queries, queries * keys
    raise KeyError(f"perf-model: no tiles per sequence for {kernel}")


def at_lengths(work: Work, launch: Launch, setting: Setting, lengths: Sequence[int], gpu: Gpu) -> Work:
    """``work``, the attention ``launch``'s at ``setting`` (full sequences), for a batch of sequences of
    ``lengths`` padded to setting.seq instead, the same kernel, blocks and tokens' bytes: its
    iterations and programs those the lengths' tiles give (a program of no tile returns at once)."""
    full_programs, full_iterations = _sequence_tiles(launch.kernel, launch.meta, setting.seq)
    tiles = [_sequence_tiles(launch.kernel, launch.meta, n) for n in lengths]
    per_head = work.iterations / (setting.batch * full_iterations)
    iterations = per_head * sum(i for _, i in tiles)
    if launch.meta.get("PERSISTENT"):
        programs = min(int(per_head * len(lengths)), gpu.sms)  # a program an SM over (sequence, head) items
    else:
        programs = int(round(work.programs / (setting.batch * full_programs) * sum(p for p, _ in tiles)))
    return replace(work, iterations=iterations, programs=programs)


def priced_ops() -> Tuple[str, ...]:
    """The ops whose kernels the model predicts one by one: bertfast.registry's attention and row ops
    (the MLM head is priced as its GEMMs, the optimizers per parameter byte: bertfast.perfmodel.step)."""
    return registry.names(registry.ATTENTION, registry.ROW)


def record(setting: Setting, ops: Optional[Sequence[str]] = None,
           tuned: Optional[Dict[str, Dict[Tuple, str]]] = None, dq_mode: str = "deterministic",
           candidates: Sequence[str] = ()) -> List[Launch]:
    """Every kernel launch of ``ops`` (default: priced_ops()) at ``setting`` (varlen attention, head dim 64, its
    backward in ``dq_mode``, BERTFAST_ATTENTION_DQ's): the first candidate, or the config ``tuned`` (kernel ->
    tuning key -> config_text, a GPU run's autotuner's choices) names for the launch's key when it is still
    among the candidates; for the ops and kernels named in ``candidates`` (without such a choice), one launch
    per candidate, their ``call`` shared."""
    from bertfast.gpucheck.compile_report import bert_launches

    launches: List[Launch] = []
    for case, call in bert_launches([setting.as_report_setting()], (HEAD_DIM,), ops or priced_ops(),
                                    padded_attention=False, dq_modes=(dq_mode,)):
        _record_into(launches, case.split(" ", 1)[0], call, tuned, candidates)
    return launches


def record_call(op: str, call: Callable[[], None]) -> List[Launch]:
    """Every launch ``call`` makes (``op``'s launchers at shapes of the caller's own), one per candidate."""
    launches: List[Launch] = []
    _record_into(launches, op, call, None, (op,))
    return launches


def _record_into(launches: List[Launch], op: str, call: Callable[[], None],
                 tuned: Optional[Dict[str, Dict[Tuple, str]]], candidates: Sequence[str]) -> None:
    """``call``'s launches appended to ``launches`` as record describes them."""
    from bertfast.kernels._common import COMPILE_OPTIONS, compile_only, config_text, key_values

    def keep(fn, grid, args, consts, configs, key):
        ran = (tuned or {}).get(fn.__name__, {}).get(key_values(key)) if key is not None else None
        chosen = next((c for c in configs if c is not None and config_text(c) == ran), None)
        every = op in candidates or fn.__name__ in candidates
        tried = [chosen] if chosen is not None else configs if every else configs[:1]
        call_index = launches[-1].call + 1 if launches else 0
        for config in tried:
            meta = dict(consts)
            if config is not None:
                meta.update(config.all_kwargs())
            shape = grid(meta) if callable(grid) else grid
            def compile_it(fn=fn, args=tuple(args), meta=meta):
                return fn.warmup(*args, grid=(1,), **meta, **COMPILE_OPTIONS)
            launches.append(Launch(op, fn.__name__, meta, tuple(int(g) for g in shape), tuple(args), compile_it,
                                   tuple(fn.arg_names[:len(args)]), chosen is not None, call_index, len(tried)))
    with compile_only(keep):
        call()


@dataclass
class Compiled:
    launch: Launch
    function: Function
    registers: Optional[int]
    shared_bytes: int
    spills: Optional[int] = None  # ptxas's spill stores + loads (bytes); None: no report


def compile_launch(launch: Launch) -> Compiled:
    """sm_90 SASS, registers and shared memory of one launch's config (offline driver set)."""
    from bertfast.gpucheck.compile_report import parse_ptxas
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = launch.compile()
    functions = parse(disassemble(kernel.asm["cubin"]))
    function = functions.get(launch.kernel) or next(iter(functions.values()))
    report = parse_ptxas(log.getvalue()).get(launch.kernel, {})
    spills = report["spill_stores"] + report["spill_loads"] if "spill_stores" in report else None
    return Compiled(launch, function, report.get("registers"), int(getattr(kernel.metadata, "shared", 0)), spills)


@contextlib.contextmanager
def offline_triton():
    """Triton compiling for sm_90 without a GPU, into a fresh cache (so ptxas reports every kernel).
    It replaces Triton's driver for the rest of the process: run it in a process of its own (the
    command does; tests run the command)."""
    from bertfast.gpucheck.compile_report import _prepare_offline_triton
    with tempfile.TemporaryDirectory() as cache:
        _prepare_offline_triton(cache)
        yield
