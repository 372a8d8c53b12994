"""What the ``lowbit`` kernel's ``dense`` variant reads and how it is launched (:mod:`kvweave.kernels.lowbit_dense_triton`
is the kernel; :func:`kvweave.kernels.lowbit_decode.plan_launch` calls these): keys in 2- or 4-bit ``channel-group``
codes (stored after RoPE, or before it and rotated in registers) and 2- or 4-bit values, read as 32-bit words in whole
steps."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvweave.core.environment import env_setting, env_switch
from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.formats import CHANNEL_GROUP, VALUE_TILE
from kvweave.kernels.launch import capability, programmatic
from kvweave.kernels.lowbit_tricks import tiled_pairs, whole_byte_keys, wide_groups

if TYPE_CHECKING:
    from kvweave.kernels import lowbit_dense_triton as jit_dense
else:
    jit_dense: Any = lazy_module("kvweave.kernels.lowbit_dense_triton")

#: the "dense" kernel's step when none is asked for (tokens; it must divide the keys' token group): 64, or 32 at head_dim
#: 64, whose 64-token steps the sm_90 build computes wrong (:data:`NARROW_MAX_BLOCK`)
DENSE_BLOCK = 64

#: the longest step at head_dims under 128: with 64-token steps at head_dim 64 the sm_90 build (Triton 3.x on an H200,
#: 2026-12-02) returned NaN where the interpreter agreed with the twin within 1e-5, while 32-token steps agreed on the
#: GPU too (docs/kernels.md "Codes read as 32-bit words")
NARROW_MAX_BLOCK = 32

#: the GPU build's operand arithmetic (kvweave.kernels.lowbit_dense_triton; tests/test_lowbit_dense.py replays it on the
#: CPU): 2-bit value code ``c`` becomes the byte ``LEVEL_SELECT_MUL * c + LEVEL_SELECT_ADD``, whose two nibbles are the
#: numbers of its level's two bytes among the 8 of the four levels' bfloat16 bits (a byte-permute selector); a 4-bit
#: uniform code at bit 3 of ``UNIFORM4_BASE`` (bfloat16 1.0: ``1 + c / 16``) plus the bfloat16 ``UNIFORM4_OFFSET``
#: (-1.46875) is ``(c - 7.5) / 16``, exactly
LEVEL_SELECT_MUL, LEVEL_SELECT_ADD = 0x22, 0x10
UNIFORM4_BASE, UNIFORM4_OFFSET = 0x3F80, 0xBFBC

#: warps a program the dense kernel's output was checked against its twin with on a GPU (4 is the launch's; 2 matched
#: too; 8 gave attention 0.78 away, H100, 2026-12-05: docs/perf/h100-2026-12-05-plan/kernel-k4v4e77t-b32-warps8.txt)
DENSE_WARPS = (2, 4)
#: registers a thread of the dense kernel may take at head_dims up to 128: 96 lets 5 programs of 4 warps share an SM of an
#: H100/H200 (65,536 registers; Triton 3.6's sm_90 build takes 118 unbounded, 96 with 22 more loop instructions and no
#: stack), 4.5-15% faster than 4 programs at 128 (H200, 2026-12-04, docs/kernels.md "Five programs an SM")
DENSE_MAX_REGISTERS = 96

#: the same with a list of hidden slots (``HID`` > 0), whose checked steps take 123 registers: at 96 they spill 32-40
#: bytes, so 4 programs an SM
DENSE_HIDDEN_REGISTERS = 128

#: where the launch chooses the dense kernel's splits (``programs=None``): a split holds at least this many steps, a row
#: has :data:`DENSE_MIN_SPLITS` to :data:`DENSE_MAX_SPLITS` splits, about :data:`DENSE_WAVES` waves of programs in
#: between, fewer where a row's steps run out first (H200, 2026-12-04, docs/kernels.md "Five programs an SM"; 4 steps
#: a split since the loop-free combine: "The query heads where the model left them, the combine without loops")
DENSE_SPLIT_STEPS = 4
DENSE_MIN_SPLITS = 8
DENSE_MAX_SPLITS = 64
DENSE_WAVES = 3

#: where the rows are many enough that :data:`DENSE_MIN_SPLITS` decides (more than the waves ask for), choose from it
#: to half as many again the splits whose programs fill their last wave best: the time modelled as the waves begun times
#: a program's steps plus :data:`DENSE_PROGRAM_STEPS` (what a program costs besides its steps). H200, 2026-12-04: 1-2%
#: faster at B = 32-64 (6.2 -> 6.98 waves at B = 64, 64K); at B = 8, where the waves decide, the same rule made things
#: 1-2% slower, so it stays out there (docs/kernels.md "A fixed reference for the softmax")
DENSE_WHOLE_WAVES = True
DENSE_PROGRAM_STEPS = 1.0

#: the multiprocessors counted where no GPU is asked (an H200's)
DEFAULT_SMS = 132

#: read 4-bit keys of at least 16 words a token (head_dim >= 128) as eight products, one per code place of a word
#: (:func:`kvweave.kernels.lowbit_step_triton._plane_dots`): no unpacked key tile through shared memory
DENSE_KEY_PLANES = True


#: with key planes, load each step's float16 key scales and zero points a step ahead as int32 words (two channels a
#: word): loaded where they are used, their latency was the largest stall left (Nsight Compute, B = 128 at 64K)
DENSE_PLANE_PREFETCH = True


def key_planes(view: Any) -> bool:
    """Whether the dense kernel reads ``view``'s keys by code places (4-bit keys, 16 or more words a token)."""
    return DENSE_KEY_PLANES and view.inv_freq is None and view.k_bits == 4 and view.exact_k.shape[-1] * 4 // 32 >= 16


#: the head_dims whose build tests/test_lowbit_gpu.py checks on a GPU: the only ones "auto" gives the dense kernel (256
#: since 2026-12-06: docs/kernels.md "head_dim 256 on the GPU")
GPU_CHECKED_DIMS = (64, 128, 256)

#: the narrowest head_dim the dense kernel reads keys stored before RoPE at: at head_dim 64 its sm_90 build (Triton 3.6,
#: H100, 2026-12-06) was 4.4% of the output's scale off the twin (3% allowed) where the interpreter agreed to 1e-5, while
#: head_dim 128 matched at real sizes (docs/kernels.md "Keys before RoPE in the dense kernel")
ROPE_MIN_DIM = 128

#: registers a thread of the dense kernel may take over keys stored before RoPE, at any batch: their rotation's tiles
#: spilled at 96 (and 2 registers' worth at 128, sm_90 build)
DENSE_ROPE_REGISTERS = 128

#: the rotary pairs the dense kernel rotates at a time over keys stored before RoPE (``ROPE_PAIRS``), where set:
#: KVWEAVE_ROPE_PAIRS (8, 16, 32 or 64) for every head_dim; 0 (unset): :data:`DENSE_ROPE_PAIRS_NARROW` at head_dims up
#: to 128, :data:`DENSE_ROPE_PAIRS_WIDE` above (:func:`rope_pairs`)
DENSE_ROPE_PAIRS = env_setting("KVWEAVE_ROPE_PAIRS", 0, (0, 8, 16, 32, 64))
#: at head_dim 128, halves (32 pairs): Triton 3.6's sm_90 build takes 8% fewer loop instructions than quarters (16,
#: the query's rows read a part at a time) at 128 registers, neither spilling, and was 2.5-5.5% faster at B = 8 and 32,
#: within 1% at B = 1 (H100, 2026-12-07, both in one lease; docs/kernels.md "Keys before RoPE in the dense kernel")
DENSE_ROPE_PAIRS_NARROW = 32
#: at head_dim 256, 32 pairs spill 32 bytes a thread at 128 registers against 8 for 16 (Triton 3.6, sm_90): not timed,
#: so 16 stay there
DENSE_ROPE_PAIRS_WIDE = 16


def rope_pairs(dim: int) -> int:
    """The rotary pairs the dense kernel rotates at a time over keys stored before RoPE at head_dim ``dim``."""
    pairs = DENSE_ROPE_PAIRS or (DENSE_ROPE_PAIRS_NARROW if dim <= 128 else DENSE_ROPE_PAIRS_WIDE)
    return min(pairs, dim // 2)

#: whether "auto" gives the dense kernel keys stored before RoPE (rotated in registers, ``ROPE``): its GPU build matched
#: the twin (tests/test_dense_rope.py, tests/test_lowbit_gpu.py; H100, 2026-12-06, docs/perf/gpu-2026-12-06-vq), so on;
#: 0 gives them back to the "wide" kernel, which read them before. KVWEAVE_DENSE_ROPE (0 or 1) sets it
ROPE_GPU_CHECKED = bool(env_setting("KVWEAVE_DENSE_ROPE", 1, (0, 1)))


def rope_registers(view: Any) -> int | None:
    """The registers the dense kernel's launch gives a thread over ``view`` whatever the batch (keys before RoPE:
    :data:`DENSE_ROPE_REGISTERS`), or None where the batch decides."""
    return DENSE_ROPE_REGISTERS if view.inv_freq is not None else None


def gpu_unchecked(view: Any) -> str | None:
    """Why the default launch does not give ``view`` to the dense kernel although it reads it (its GPU build for that
    head_dim, or for keys before RoPE, not checked on a GPU), or None."""
    if view.exact_k.shape[-1] not in GPU_CHECKED_DIMS:
        return f"it is built and checked on a GPU at head_dims {GPU_CHECKED_DIMS}"
    if view.inv_freq is not None and not ROPE_GPU_CHECKED:
        return "its build for keys stored before RoPE is not yet checked on a GPU (variant 'dense' asks for it anyway)"
    return None


def auto_dense(view: Any) -> bool:
    """Whether the default launch ("auto", no step asked for) gives ``view`` to the dense kernel."""
    return dense_refusal(view) is None and gpu_unchecked(view) is None


def dense_block(view: Any) -> int:
    """The dense kernel's step for ``view`` when none is asked for."""
    return DENSE_BLOCK if view.exact_k.shape[-1] >= 128 else NARROW_MAX_BLOCK


def dense_refusal(view: Any, block: int | None = None) -> str | None:
    """Why the "dense" kernel cannot read ``view`` (a :class:`kvweave.kernels.lowbit_decode.LowbitView`) in steps of
    ``block`` tokens (None: :func:`dense_block`), or None where it can."""
    block = dense_block(view) if block is None else block
    dim = view.exact_k.shape[-1]
    if not whole_byte_keys(view):
        return "it reads 2- or 4-bit channel-group keys (not channel-alloc widths or 3-bit codes)"
    if view.v_bits not in (2, 4):
        return f"it reads 2- or 4-bit values, got {view.v_bits}-bit"
    if not wide_groups(view) or (view.v_group * view.v_bits) % 32 or (dim * view.k_bits) % 32:
        return (f"it reads values in at most 4 channel groups of at least 16 channels in whole 32-bit words (groups of "
                f"{view.v_group} channels at head_dim {dim})")
    if block < 16 or block & (block - 1) or view.k_group % block or view.tokens % block:
        return (f"its steps ({block} tokens) must be a power of two of at least 16 that divides the keys' token group "
                f"({view.k_group}) and the packed tokens ({view.tokens})")
    if view.v_tiled and (view.v_bits not in (2, 4) or view.v_group != 64 or block != 64):
        return (f"it reads values stored in tiles of 64 tokens as 2- or 4-bit codes in groups of 64 channels in steps of 64 "
                f"tokens, got {view.v_bits}-bit codes in groups of {view.v_group} in steps of {block}")
    if view.inv_freq is not None and dim < ROPE_MIN_DIM:
        return (f"it reads keys stored before RoPE at head_dims of at least {ROPE_MIN_DIM} (its GPU build at head_dim "
                f"{dim} was not checked to match), got {dim}")
    if dim < 128 and block > NARROW_MAX_BLOCK:
        return (f"at head_dim {dim} its steps must be at most {NARROW_MAX_BLOCK} tokens (the GPU build of longer ones "
                f"computes wrong), got {block}")
    return None


def tiles_refusal(view: Any, variant: str, block: int | None) -> str:
    """Why kernel ``variant`` (not "dense") cannot read ``view``'s values stored in tiles, and what to use instead."""
    why = dense_refusal(view, block) or gpu_unchecked(view)
    fix = f"the 'dense' kernel cannot read this storage: {why}; use" if why else "use variant 'dense' (or 'auto'),"
    return (f"the lowbit '{variant}' kernel reads values token by token, and these are stored in tiles of {VALUE_TILE} "
            f"tokens (token_tiles), which only the 'dense' kernel reads; {fix} backend 'torch' or values without token_tiles")


def tiles_build_refusal(key_format: str, key_bits: int, dim: int, values_group: int, keys_group: int) -> str | None:
    """Why a pipeline storing values in tiles cannot decode on a GPU (the dense kernel, the only one that reads them,
    cannot take its keys, groups or head_dim), or None."""
    keys = key_format == CHANNEL_GROUP and key_bits in (2, 4)
    if keys and dim >= 128 and min(values_group, dim) == 64 and keys_group % VALUE_TILE == 0:
        return None
    return (f"values stored in tiles of {VALUE_TILE} tokens (token_tiles) are read on a GPU by the 'dense' kernel only, "
            f"which takes 2- or 4-bit {CHANNEL_GROUP} keys (stored before or after RoPE) in groups of a multiple of "
            f"{VALUE_TILE} tokens, value groups of 64 channels and head_dim >= 128; here keys {key_format} at "
            f"{key_bits} bits, keys group {keys_group}, values group {min(values_group, dim)}, head_dim {dim}")


def level_word(levels: list[float]) -> int:
    """Four value levels' bfloat16 bits in one 64-bit word, code 0's in the lowest 16 bits, as a signed int64: the
    byte-permute table the dense kernel reads from the bfloat16 levels (``_level_table``), as the tests replay it."""
    bits = torch.tensor(levels, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    word = sum(int(b) << (16 * k) for k, b in enumerate(bits.tolist()))
    return word - (1 << 64) if word >= 1 << 63 else word


#: give each real query row two of the tile's columns where the tile has twice the rows (Llama-3-8B's 4 query heads a KV
#: head in the 8 columns a Hopper warpgroup product takes at least): the softmax then works on the real rows alone and
#: one tile of probabilities serves two value groups (kvweave.kernels.lowbit_dense_triton._steps)
DENSE_PAIR_ROWS = True


#: the first Triton whose sm_90 build of the dense kernel makes warpgroup products of operands in registers (before it,
#: Ampere ``mma.sync`` ones: Triton 3.6, what torch 2.11 installs, and 3.7)
WARPGROUP_TRITON = (3, 8)


def ampere_products(device: Any) -> bool:
    """Whether the dense kernel's tensor-core products build as Ampere ``mma.sync`` ones for ``device``: a GPU before
    Hopper, or a Triton before :data:`WARPGROUP_TRITON`; for a CPU tensor (benchmarks/kernel_sass.py builds for
    sm_90) the Triton alone decides. There the tiled values' operands go behind an instruction the compiler does not
    look past (``ASM`` = 2, :func:`kvweave.kernels.lowbit_tile_triton._operand`)."""
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < WARPGROUP_TRITON:
        return True
    return device.type == "cuda" and capability(device)[0] < 9


#: registers a thread of the dense kernel may take at head_dims over 128: unbounded, Triton 3.6 built head_dim 256 at
#: 199-252 (two programs an SM); at 128 (four, a few bytes spilled) it was 1.18-1.33x faster in every cell timed (H100,
#: 2026-12-06: docs/kernels.md "head_dim 256 on the GPU")
DENSE_WIDE_REGISTERS = 128
#: KVWEAVE_DENSE_REGISTERS: every dense launch's registers a thread instead of the rules' (0), to time a build against
#: its spills: Triton 3.9's sm_90 build spills at 128 (docs/kernels.md "What Triton 3.9 builds")
DENSE_REGISTERS = env_setting("KVWEAVE_DENSE_REGISTERS", 0, (0, 96, 128, 168, 192, 255))


def dense_registers(dim: int, hidden: bool) -> int | None:
    """The registers a thread of the dense kernel may take at head_dim ``dim`` (None: the compiler's choice)."""
    if DENSE_REGISTERS or dim > 128:
        return DENSE_REGISTERS or DENSE_WIDE_REGISTERS
    return DENSE_HIDDEN_REGISTERS if hidden else DENSE_MAX_REGISTERS


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: Any) -> int:
    """The streaming multiprocessors of ``device`` (:data:`DEFAULT_SMS` for a CPU tensor's)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def dense_slots(sms: int, dim: int, hidden: bool, num_warps: int = 4, registers: int | None = None) -> int:
    """The dense kernel's programs ``sms`` SMs hold at once, one wave, by ``registers`` (or :func:`dense_registers`)."""
    registers = registers or dense_registers(dim, hidden) or 128
    return sms * max(1, 65536 // (registers * 32 * num_warps))


#: where the dense kernel's programs are one wave even at :data:`DENSE_AHEAD_REGISTERS` registers a thread (a batch of
#: one row at Llama-3-8B's shape) and its values are in tiles of at most two channel groups (of the widths
#: :data:`DENSE_AHEAD_BITS`), take those registers and load each step's value tiles' words a step before the step that
#: reads them: with about 4 programs an SM the registers cost no program, and a program's next values are in flight
#: while it computes (H100, 2026-12-05: 4-7% off a call of the 8x class at B = 1; the key words loaded so cost 10-25%,
#: so they are not; docs/kernels.md "Codes a step ahead, 128 registers, the combine in slices"; on and off in turn,
#: 2026-12-06: 7% off at B = 1, the same at B = 8, "The dense kernel's rule timed on and off"); KVWEAVE_DENSE_AHEAD=0
#: turns it off (to time both)
DENSE_AHEAD_WAVE = env_switch("KVWEAVE_DENSE_AHEAD")
#: the registers a thread the rule's launch takes (4 programs of 4 warps an SM; 168 for 3 an SM with the token loop
#: unrolled by two was slower at every length, H100, 2026-12-07: docs/kernels.md "Two steps an iteration at one row")
DENSE_AHEAD_REGISTERS = 128
#: the value codes' widths the rule takes: those it was timed on (2-bit, the 8x class; 4-bit, the ~5x class: 4-11% off
#: a call at B = 1 on an H100, 2026-12-06)
DENSE_AHEAD_BITS = (2, 4)


def dense_ahead(view: Any, programs: int, sms: int, dim: int, hidden: bool, num_warps: int,
                trick: dict) -> tuple[int, bool]:
    """The dense kernel's ``AHEAD`` (1: key words a step ahead, 2: value tiles' words, 3: both) and whether it takes
    :data:`DENSE_AHEAD_REGISTERS` registers: the launch's rule (:data:`DENSE_AHEAD_WAVE`: the values' words, at 128
    registers) for ``programs``, else the ``trick`` settings asked for (``KAHEAD``, ``VAHEAD``, ``R128``)."""
    fits = programs <= dense_slots(sms, dim, hidden, num_warps, DENSE_AHEAD_REGISTERS)
    timed = tiled_pairs(view) and view.v_bits in DENSE_AHEAD_BITS and dense_registers(dim, hidden) is not None
    if DENSE_AHEAD_WAVE and timed and fits:
        return 2, True
    return int(trick.get("KAHEAD", False)) + 2 * int(trick.get("VAHEAD", False)), trick.get("R128", False)


#: launch the combine early (:func:`kvweave.kernels.launch.programmatic`) where the dense kernel's programs fit in one
#: wave: there the SMs have room for the combine's programs beside the packed pass's, and B = 1 gained 7-11% (H100,
#: 2026-12-05; docs/kernels.md "The combine launched before the packed pass ends") ...
EARLY_COMBINE_WAVES = 1
#: ... or where the rows (batch x KV heads) are at most this many, whatever the waves: at B = 8 (64 rows, three waves)
#: the 8x class's call was 2-4% shorter with it in two leases and the ~5x class's the same, at B = 32 (256 rows) 1-2%
#: longer in one of the two (H100, every call past the L2 cache, 2026-12-07: docs/kernels.md "The combine launched
#: early past one wave at few rows")
EARLY_COMBINE_ROWS = 64


def dense_splits(rows: int, steps: int, sms: int, dim: int, hidden: bool, num_warps: int = 4,
                 registers: int | None = None) -> int:
    """The splits of each of ``rows`` rows' ``steps`` steps that the dense kernel runs in where the launch chooses: about
    :data:`DENSE_WAVES` waves of the programs ``sms`` multiprocessors hold at once (their registers:
    ``registers``, or :func:`dense_registers`), :data:`DENSE_MIN_SPLITS` to :data:`DENSE_MAX_SPLITS`, at most one per
    :data:`DENSE_SPLIT_STEPS` steps; where the fewest splits decide, the last wave as full as a few more allow
    (:data:`DENSE_WHOLE_WAVES`). One wave of few long programs leaves SMs idle at its end; many short ones pay each
    program's loads before its steps and a longer combine (a batch of one row took 16% longer in 165 splits than in
    66)."""
    slots = dense_slots(sms, dim, hidden, num_warps, registers)
    wanted = max(DENSE_MIN_SPLITS, min(DENSE_MAX_SPLITS, -(-DENSE_WAVES * slots // max(1, rows))))
    most = max(1, steps // DENSE_SPLIT_STEPS)
    if not DENSE_WHOLE_WAVES or wanted >= most or wanted > DENSE_MIN_SPLITS:
        return max(1, min(most, wanted))
    low, high = wanted, min(DENSE_MAX_SPLITS, most, 3 * wanted // 2)

    def modelled(splits: int) -> float:
        return -(-rows * splits // slots) * (steps / splits + DENSE_PROGRAM_STEPS)

    return min(range(low, max(low, high) + 1), key=lambda splits: (modelled(splits), splits))


#: 4-bit uniform values in tiles, read as their operand bits ``1 + code / 16`` with ``(7.5 + 16) / 16`` times each
#: slot's weights taken off the output once at the end (``LEVELS`` = 3), where each operand register took a paired add
DENSE_OFFSET_OUT = True


#: the dense kernel's probabilities against a fixed reference instead of a running maximum: the program's first step's
#: largest logit, no reduction across the warps nor rescaling in the steps; a program whose logits rose more than
#: :data:`DENSE_FIXED_LIMIT` above it (base 2) runs again against the largest it saw (docs/kernels.md "A fixed
#: reference for the softmax")
DENSE_FIXED_MAX = True
DENSE_FIXED_LIMIT = 64.0


def offset_out(constants: dict) -> bool:
    """Whether the dense kernel reads 4-bit uniform values as ``1 + code / 16`` and takes the offset off the output once
    (values in tiles, two value groups or fewer, each query row in two columns: the weights' tile serves both groups)."""
    return (DENSE_OFFSET_OUT and constants["VBITS"] == 4 and constants["LEVELS"] == 1 and constants["VTILE"]
            and constants["PAD"] == 2 and constants["D"] // constants["VGROUP"] <= 2)


def query_pad(group: int, rows: int) -> int:
    """The tile columns each real query row takes in the dense kernel: 2 where the ``rows`` of the tile are twice the
    ``group`` query heads of a KV head rounded up to a power of two, else 1."""
    real = 1 << (group - 1).bit_length()
    return 2 if DENSE_PAIR_ROWS and rows == 2 * real else 1


def dense_launch(view: Any, args: tuple, constants: dict, kind: int, l0: float, l1: float, group: int,
                 trick: dict | None = None, tail: tuple[int, int] | None = None) -> tuple:
    """The "dense" kernel's launch (kernel, grid, arguments, constants) from the arguments and constants
    :func:`kvweave.kernels.lowbit_decode.plan_launch` made for the others: the codes as 32-bit words (the same bytes),
    no rotary or channel-width arguments; ``group``: the query heads of a KV head (``PAD``: :func:`query_pad`);
    ``trick``: :func:`kvweave.kernels.lowbit_tricks.parse_tricks`'s constants (its launch settings: :func:`dense_ahead`);
    ``tail``: (how many of each row's splits are long, the short ones' length in tokens) where they differ
    (:func:`dense_tail`), else None."""
    if constants["num_warps"] not in DENSE_WARPS:
        raise ValueError(f"the lowbit 'dense' kernel runs with {' or '.join(map(str, DENSE_WARPS))} warps a program, got "
                         f"{constants['num_warps']} (at 8 its output was 0.78 away from the torch twin on an H100)")
    (padded, _, k_zero, k_scale, k_oi, k_ov, _, _, v_scale, v_max, v_levels, freq, start, positions, hidden, m, l, acc,
     tokens, heads, splits, split_len, first, rope_scale, scaling) = args
    table16 = view.v_levels16 if view.v_levels16 is not None else view.v_levels.to(torch.bfloat16)
    if table16.data_ptr() % 4:  # the kernel reads the 2-bit levels' table as two int32 words (_level_table)
        table16 = table16.clone()
    words = (view.k_codes.contiguous().view(torch.int32), view.v_codes.contiguous().view(torch.int32))
    dense_args = (padded, words[0], k_zero, k_scale, k_oi, k_ov, words[1], v_scale, v_max, v_levels, table16, start,
                  positions, hidden, freq, m, l, acc, tokens, heads, splits, split_len, *(tail or (splits, split_len)),
                  first, scaling, l0, l1, rope_scale, m)  # the trace's placeholder (kvweave.kernels.timeline: the last argument)
    keep = ("D", "G", "KBITS", "KGROUP", "KO", "VBITS", "VGROUP", "HAS_START", "BLOCK", "LOWP", "VLOG", "VST", "HAS_POS",
            "HID", "ROPE", "num_warps")
    asm = (2 if ampere_products(padded.device) else 1) if constants["APPROX"] else 0
    dense_constants = {name: constants[name] for name in keep} | {"LEVELS": kind, "ASM": asm,
                                                                  "KPLANES": key_planes(view), "VTILE": view.v_tiled}
    dense_constants["PAD"] = query_pad(group, constants["G"])
    dense_constants["QG"] = group
    dense_constants["TRACE"] = 0  # a recorded launch passes a trace for the last argument and 1 (Launch.run)
    dense_constants["ROPE_PAIRS"] = rope_pairs(constants["D"])
    dense_constants["FIX"], dense_constants["FIX_LIMIT"] = DENSE_FIXED_MAX, DENSE_FIXED_LIMIT
    programs = m.shape[0] * splits  # the combine starts before the last programs end where they are one wave
    sms, hid = multiprocessors(padded.device), constants["HID"] > 0
    registers = dense_registers(constants["D"], hid)
    dense_constants["AHEAD"], wide = dense_ahead(view, programs, sms, constants["D"], hid, constants["num_warps"],
                                                 trick or {})
    if wide:
        registers = DENSE_AHEAD_REGISTERS if registers is None else max(registers, DENSE_AHEAD_REGISTERS)
    if (rope := rope_registers(view)) is not None:
        registers = rope if registers is None else max(registers, rope)
    dense_constants["PDL"] = programmatic(padded.device) and (m.shape[0] <= EARLY_COMBINE_ROWS or programs <= (
        EARLY_COMBINE_WAVES * dense_slots(sms, constants["D"], hid, constants["num_warps"], registers)))
    if asm:  # a GPU build: the steps ahead whose codes are asked of the L2 cache (the l2aheadN tricks; AHEAD // 4;
        # slower at every shape timed: docs/kernels.md "Codes asked of the L2 cache ahead")
        dense_constants["AHEAD"] += 4 * (trick or {}).get("L2AHEAD", 0)
    if offset_out(dense_constants):  # 4-bit uniform levels as 1 + code / 16, the offset taken off at the end
        dense_constants["LEVELS"] = 3
    dense_constants["KPF"] = (dense_constants["KPLANES"] and DENSE_PLANE_PREFETCH and k_scale.dtype == torch.float16
                              and k_zero.dtype == torch.float16)
    if registers is not None:  # unbounded, the steps that check hidden slots took 155: 3 programs an SM (15% slower)
        dense_constants["maxnreg"] = registers
    return jit_dense._lowbit_dense_kernel, (m.shape[0], splits), dense_args, dense_constants
