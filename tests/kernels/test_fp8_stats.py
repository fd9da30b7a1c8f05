"""FP8 numerics counters (kernels/fp8_stats.py, the quantisers' STATS path in kernels/fp8.py and
kernels/permute.py) against a plain-torch count of the same quantisation, in Triton's interpreter:
random ragged inputs with planted inf / NaN, huge and tiny values, all-zero groups, empty experts;
and with no buffer the kernels' outputs are bit for bit those with one."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.fp8_stats import (
    ACTIVATIONS,
    AMAX,
    DENSE,
    FIELDS,
    GRADIENTS,
    KINDS,
    NONFINITE,
    SATURATED,
    SATURATION_BOUND,
    TOTAL,
    UNDERFLOW,
    WEIGHTS,
    Fp8Stats,
    stats_reference,
)

# the interpreter computes the planted inf / NaN groups in NumPy, which warns about them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
FP8 = torch.float8_e4m3fn
_FP8 = None  # the interpreted kernels module, for the test-only kernel below


@pytest.fixture
def fp8k(interpreted):
    _, fp8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8")
    return fp8


def _planted(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of spread magnitudes with an inf, a NaN, a row of tiny values beside one huge one (they
    underflow), a row of subnormal-fp32 values, an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(4 * torch.randn(rows, 1, generator=gen))
    x[1, k // 2] = float("inf")
    x[2, 3] = float("nan")
    x[3] = 1e-3 * torch.randn(k, generator=gen)
    x[3, 0] = 1e30
    x[4] = 1e-42
    x[5] = 0.0
    return x


def _read(stats: Fp8Stats, kind: int) -> list:
    row = stats.buffer[kind].tolist()
    return [torch.tensor([row[AMAX]], dtype=torch.int32).view(torch.float32).item(), *row[1:]]


def _assert_counts(got: list, want: list) -> None:
    assert got[1:] == want[1:], (got, want)
    assert got[AMAX] == pytest.approx(want[AMAX], rel=1e-7), (got, want)


def _ungroup(s_MG: torch.Tensor, k: int) -> torch.Tensor:
    return s_MG.repeat_interleave(128, dim=1)[:, :k]


@pytest.mark.parametrize("rows,k", [(37, 200), (6, 128), (16, 72)])
def test_row_counters_match_a_torch_count(fp8k, rows, k):
    x = _planted(rows, k, seed=rows + k)
    stats = Fp8Stats("cpu")
    q, s = fp8k.quantize_rows(x, stats.row(ACTIVATIONS))
    _assert_counts(_read(stats, ACTIVATIONS), stats_reference(x, _ungroup(s, k), q))
    got = _read(stats, ACTIVATIONS)
    assert got[TOTAL] == rows * k and got[NONFINITE] == 2 and got[UNDERFLOW] >= k - 1 + k  # rows 3 and 4
    assert got[SATURATED] == 0 and got[AMAX] <= 448.0 * (1 + 2**-22)  # 448 by construction
    assert stats.buffer[WEIGHTS].eq(0).all() and stats.buffer[GRADIENTS].eq(0).all()
    # a second call adds to the same counters
    fp8k.quantize_rows(x, stats.row(ACTIVATIONS))
    assert _read(stats, ACTIVATIONS)[TOTAL] == 2 * rows * k


def test_clean_tiles_count_the_same_bits_as_element_by_element(interpreted):
    """Finite values take the cheap count (AMAX from the rows' or blocks' amax, underflows and
    non-finite inputs per element position, summed once a program): every counter equal to the torch
    count, AMAX to the bit; a planted inf sends its program's tiles to be counted again element by
    element, with the same counts; so does a rowwise scale that underflowed to 0."""
    _, fp8k, fp8_rowwise = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                       "disagmoe.kernels.fp8_rowwise")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, 300, generator=gen) * torch.exp2(6 * torch.randn(40, 1, generator=gen))
    x[7, :40] = 1e-9  # beside row 7's larger values: these underflow
    for planted in (False, True):
        y = x.clone()
        if planted:
            y[33, 250] = float("inf")
        stats = Fp8Stats("cpu")
        q, s = fp8k.quantize_rows(y, stats.row(ACTIVATIONS))
        want = stats_reference(y, _ungroup(s, 300), q)
        got = _read(stats, ACTIVATIONS)
        assert got == want, (got, want)
        assert got[UNDERFLOW] >= 40 and got[NONFINITE] == int(planted)
    w = x.reshape(3, 40, 100)
    stats = Fp8Stats("cpu")
    q, s = fp8k.quantize_blocks(w, stats.row(WEIGHTS))
    scale = s.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :40, :100]
    assert _read(stats, WEIGHTS) == stats_reference(w, scale, q)
    stats = Fp8Stats("cpu")
    q, s = fp8_rowwise.quantize_rowwise(x, stats.row(ACTIVATIONS))
    assert _read(stats, ACTIVATIONS) == stats_reference(x, s, q)
    # an fp32 row too small for its scale (amax / 448 underflows to 0): x / 0 saturates, counted as such
    tiny = x.clone()
    tiny[5] = 1e-44
    stats = Fp8Stats("cpu")
    q, s = fp8_rowwise.quantize_rowwise(tiny, stats.row(ACTIVATIONS))
    assert s[5].item() == 0.0 and _read(stats, ACTIVATIONS) == stats_reference(tiny, s, q)
    assert _read(stats, ACTIVATIONS)[SATURATED] == 300


def test_the_split_rowwise_quantiser_counts_the_same_bits(interpreted):
    """`fp8_rowwise.quantize_rowwise(split_k=True)` takes (row block, K block) tiles, several programs
    to a row, each taking the row's largest |x / scale| from its whole amax: on finite rows every
    counter is the torch count, AMAX to the bit; an inf, a NaN and an fp32 row whose scale underflowed
    to 0 (in the last row block: one of the four programs never meets them) send the programs that
    meet them to count their tiles again element by element, the same counts."""
    _, _, fp8_rowwise = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                    "disagmoe.kernels.fp8_rowwise")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 300, generator=gen) * torch.exp2(6 * torch.randn(40, 1, generator=gen))
    x[7, :40] = 1e-9  # beside row 7's larger values: these underflow
    planted = x.clone()
    planted[33, 250] = float("inf")
    planted[34, 4] = float("nan")
    planted[37] = 1e-44
    for y in (x, planted):
        stats = Fp8Stats("cpu")
        q, s = fp8_rowwise.quantize_rowwise(y, stats.row(DENSE), split_k=True, block_m=16, block_k=128)
        got = _read(stats, DENSE)
        assert got == stats_reference(y, s, q), got
        assert got[UNDERFLOW] >= 40 and got[NONFINITE] == (2 if y is planted else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89+)")
def test_gpu_planted_non_finite_inputs_are_counted_as_torch_counts_them():
    """On the GPU a max drops a NaN (the interpreter's NumPy max keeps it), so a program whose tiles
    are finite but whose row or column amax is NaN or inf takes the per-position count there, where
    on the CPU it counts its tiles again: the split rowwise quantiser and the token-group quantiser
    with an inf, a NaN and an fp32 row whose scale underflows, each in a row block of its own
    (16 rows a block), give the torch count of their own bytes, AMAX to the bit."""
    from disagmoe.kernels import fp8, fp8_rowwise

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 300, generator=gen) * torch.exp2(6 * torch.randn(64, 1, generator=gen))
    x[3, 250] = float("inf")  # row block 0, the last K block
    x[20, 4] = float("nan")  # row block 1, the first K block: the row's other programs see only its amax
    x[37] = 1e-44  # row block 2
    y = x.cuda()
    stats = Fp8Stats("cuda")
    q, s = fp8_rowwise.quantize_rowwise(y, stats.row(DENSE), split_k=True, block_m=16, block_k=128)
    got = _read(stats, DENSE)
    assert got == stats_reference(x, s.cpu(), q.cpu()), got
    assert got[NONFINITE] == 2 and got[SATURATED] >= 300
    offsets = torch.tensor([0, 20, 20, 64], dtype=torch.int32)  # an empty group, the NaN row opening one
    stats = Fp8Stats("cuda")
    q_KP, s_KC, padded = fp8.quantize_token_groups(y, offsets.cuda(), stats.row(GRADIENTS))
    got = _read(stats, GRADIENTS)
    _assert_counts(got, _token_group_reference(x, offsets, q_KP.cpu(), s_KC.cpu(), padded.cpu()))
    assert got[NONFINITE] == 2 and got[TOTAL] == 64 * 300


@pytest.mark.parametrize("valid", [0, 13, 37, 50])
def test_rows_past_the_valid_count_are_neither_read_nor_counted(fp8k, valid):
    """A worst-case buffer (37 rows) whose rows past `valid_rows` hold inf and NaN (a padding's
    garbage): the counters and the first rows' q and s are those of the data rows alone; a count
    past the buffer is the whole buffer."""
    x = _planted(37, 200, seed=9)
    data = min(valid, 37)
    x[data:] = float("nan")
    x[data::2] = float("inf")
    stats = Fp8Stats("cpu")
    q, s = fp8k.quantize_rows(x, stats.row(GRADIENTS), torch.tensor([valid], dtype=torch.int32))
    want = Fp8Stats("cpu")
    q_want, s_want = fp8k.quantize_rows(x[:data], want.row(GRADIENTS))
    assert stats.buffer.tolist() == want.buffer.tolist()
    assert _read(stats, GRADIENTS)[TOTAL] == data * 200
    assert torch.equal(q[:data].view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s[:data], s_want)


def test_a_valid_count_of_another_kind_is_refused(fp8k):
    with pytest.raises(ValueError, match="valid_rows must be an int32"):
        fp8k.quantize_rows(torch.randn(4, 128), None, torch.tensor([2]))


def test_no_buffer_gives_the_same_bits(fp8k):
    x = _planted(37, 200, seed=3)
    plain = fp8k.quantize_rows(x)
    counted = fp8k.quantize_rows(x, Fp8Stats("cpu").row(GRADIENTS))
    assert torch.equal(plain[0].view(torch.uint8), counted[0].view(torch.uint8)) and torch.equal(plain[1], counted[1])
    w = torch.randn(3, 200, 136)
    plain = fp8k.quantize_blocks(w)
    counted = fp8k.quantize_blocks(w, Fp8Stats("cpu").row(WEIGHTS))
    assert torch.equal(plain[0].view(torch.uint8), counted[0].view(torch.uint8)) and torch.equal(plain[1], counted[1])
    offsets = torch.tensor([5, 5, 30, 37], dtype=torch.int32)
    plain = fp8k.quantize_token_groups(x[:, :72], offsets)
    counted = fp8k.quantize_token_groups(x[:, :72], offsets, Fp8Stats("cpu").row(0))
    assert torch.equal(plain[0].view(torch.uint8), counted[0].view(torch.uint8))
    assert torch.equal(plain[1], counted[1]) and torch.equal(plain[2], counted[2])


def test_block_counters_match_a_torch_count(fp8k):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 200, 136, generator=gen)
    w[1, 150:, 130:] = 1e-20 * torch.randn(50, 6, generator=gen)  # an edge block underflowing beside w[1, 199, 135]
    w[1, 199, 135] = 1.0
    w[2, 7, 9] = float("-inf")
    stats = Fp8Stats("cpu")
    q, s = fp8k.quantize_blocks(w, stats.row(WEIGHTS))
    scale = s.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :200, :136]
    want = stats_reference(w, scale, q)
    _assert_counts(_read(stats, WEIGHTS), want)
    assert want[TOTAL] == w.numel() and want[NONFINITE] == 1 and want[UNDERFLOW] > 0


def _token_group_reference(x: torch.Tensor, offsets: torch.Tensor, q_KP: torch.Tensor, s_KC: torch.Tensor,
                           padded: torch.Tensor) -> list:
    """`stats_reference` of a token-group quantisation: x's rows back from the padded, token-contiguous
    copy, with their chunk's scales."""
    starts, ends = [0, *offsets.tolist()[:-1]], offsets.tolist()
    pstarts = [0, *padded.tolist()[:-1]]
    take = torch.cat([torch.arange(p, p + e - s) for s, e, p in zip(starts, ends, pstarts)]).long()
    q = q_KP.t()[take] if x.shape[0] else q_KP.t()[:0]
    scale = s_KC.t().repeat_interleave(128, dim=0)[take] if x.shape[0] else s_KC.t()[:0]
    return stats_reference(x, scale, q)


@pytest.mark.parametrize("counts,k", [([5, 0, 37, 1], 72), ([0, 0, 130, 0], 40), ([0, 0, 0], 16)])
def test_token_group_counters_count_rows_not_padding(fp8k, counts, k):
    rows = sum(counts)
    x = _planted(max(rows, 6), k, seed=k)[:rows]
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    stats = Fp8Stats("cpu")
    q_KP, s_KC, padded = fp8k.quantize_token_groups(x, offsets, stats.row(GRADIENTS))
    _assert_counts(_read(stats, GRADIENTS), _token_group_reference(x, offsets, q_KP, s_KC, padded))
    assert _read(stats, GRADIENTS)[TOTAL] == rows * k


@pytest.mark.parametrize("seed", range(4))
def test_token_group_counters_of_random_ragged_groups_are_the_torch_count(fp8k, seed):
    """`quantize_token_groups` over random ragged groups (empty ones among them, groups past 128 rows)
    and widths, each program striding over several tiles: finite inputs take the per-position count
    (AMAX from the columns' amax, summed once a program), a planted inf and NaN send their programs'
    tiles to be counted again element by element while the other programs keep the per-position
    count. Either way every counter is the torch count, AMAX to the bit, and q, s are the bytes of
    the launch without counters."""
    gen = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 6, (1,), generator=gen))
    counts = torch.randint(0, 180, (groups,), generator=gen)
    counts[torch.rand(groups, generator=gen) < 0.3] = 0
    counts[0] = 0 if seed == 0 else counts[0]  # a leading empty group
    rows, k = int(counts.sum()), int(torch.randint(1, 70, (1,), generator=gen))
    x = torch.randn(rows, k, generator=gen) * torch.exp2(8 * torch.randn(rows, 1, generator=gen))
    offsets = counts.cumsum(0).to(torch.int32)
    plain = fp8k.quantize_token_groups(x, offsets)
    for planted in (False, True):
        y = x.clone()
        if planted and rows:
            at = torch.randint(0, rows, (2,), generator=gen).tolist()
            y[at[0], int(torch.randint(0, k, (1,), generator=gen))] = float("inf")
            y[at[1], 0] = float("nan")
        stats = Fp8Stats("cpu")
        q_KP, s_KC, padded = fp8k.quantize_token_groups(y, offsets, stats.row(GRADIENTS))
        got = _read(stats, GRADIENTS)
        assert got == _token_group_reference(y, offsets, q_KP, s_KC, padded), (got, counts.tolist(), k)
        assert got[TOTAL] == rows * k and got[NONFINITE] == (2 if planted and rows else 0)
        if not planted:
            assert torch.equal(q_KP.view(torch.uint8), plain[0].view(torch.uint8)) and torch.equal(s_KC, plain[1])


@pytest.mark.parametrize("counts,k", [([5, 0, 37, 1], 72), ([0, 0, 130, 0], 200)])
def test_the_one_pass_quantiser_counts_both_quantisations(fp8k, counts, k):
    """`quantize_rows_and_token_groups` adds into its row what `quantize_rows` and
    `quantize_token_groups` add into theirs (so a step records what it did with two passes): x's
    elements twice, as rows and as token groups (the padding never), the planted inf and NaN
    twice, each quantisation's underflowing values; and with no row it gives the same bits."""
    rows = sum(counts)
    x = _planted(rows, k, seed=k + 1)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    one, two = Fp8Stats("cpu"), Fp8Stats("cpu")
    counted = fp8k.quantize_rows_and_token_groups(x, offsets, one.row(GRADIENTS))
    fp8k.quantize_rows(x, two.row(GRADIENTS))
    fp8k.quantize_token_groups(x, offsets, two.row(GRADIENTS))
    assert one.buffer.tolist() == two.buffer.tolist()
    got = _read(one, GRADIENTS)
    assert got[TOTAL] == 2 * rows * k and got[NONFINITE] == 4 and got[UNDERFLOW] > 0
    plain = fp8k.quantize_rows_and_token_groups(x, offsets)
    for got_part, plain_part in zip(counted, plain, strict=True):
        for g, p in zip(got_part, plain_part, strict=True):
            assert torch.equal(g.contiguous().view(torch.uint8), p.contiguous().view(torch.uint8))


def test_the_permutes_counters_are_the_row_quantisers_of_the_tokens(interpreted):
    """quantize_then_permute counts what quantize_rows of the tokens counts (each token once, not once
    per pair), planted inf and NaN included."""
    _, fp8, permute = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.permute")
    gen = torch.Generator().manual_seed(7)
    x = _planted(24, 200, seed=7)
    topk = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(24)])
    topk[topk == 3] = 4  # expert 3 empty
    by_permute, by_rows = Fp8Stats("cpu"), Fp8Stats("cpu")
    _, dest = permute.pair_destinations(topk, 5)
    permute.quantize_then_permute(x, dest, by_permute.row(ACTIVATIONS))
    fp8.quantize_rows(x, by_rows.row(ACTIVATIONS))
    assert torch.equal(by_permute.buffer, by_rows.buffer)
    assert _read(by_permute, ACTIVATIONS)[NONFINITE] == 2  # the two planted tokens, each counted once


def test_swiglu_epilogue_counts_its_output(fp8k):
    counts, k, ffn = [5, 0, 37, 1], 200, 136
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(sum(counts), k, generator=gen)
    b = torch.randn(len(counts), k, 2 * ffn, generator=gen) / k**0.5
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    from disagmoe.kernels.tile_configs import TileConfig

    tiles = TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1)
    stats = Fp8Stats("cpu")
    plain = fp8k.fp8_swiglu_gemm(qa, sa, offsets, qb, sb, tiles)
    q, s = fp8k.fp8_swiglu_gemm(qa, sa, offsets, qb, sb, tiles, stats=stats.row(ACTIVATIONS))
    assert torch.equal(plain[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(plain[1], s)
    act, _ = fp8k.fp8_swiglu_reference(qa, sa, offsets, qb, sb)  # equal sums to fp32 rounding
    got, want = _read(stats, ACTIVATIONS), stats_reference(act, _ungroup(s, ffn), q)
    assert got[TOTAL] == want[TOTAL] == sum(counts) * ffn and got[NONFINITE] == got[SATURATED] == 0
    assert abs(got[UNDERFLOW] - want[UNDERFLOW]) <= 2 and got[AMAX] == pytest.approx(448.0, rel=1e-6)


def test_forced_scales_saturate_and_underflow(fp8k):
    """The counting itself (`fp8._record_stats`) under scales the quantisers never choose: a scale
    below the group's amax / 448 clips (saturates) what lies past SATURATION_BOUND, one far above
    it flushes small values to zero."""
    import triton
    import triton.language as tl

    global _FP8
    _FP8 = fp8k  # the interpreter resolves a kernel's names in its module's globals, not in closures

    @triton.jit
    def forced(x_ptr, s_ptr, stats_ptr, M, BLOCK_M: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, 128)
        ok = (rows < M)[:, None] & (cols < 128)[None, :]
        x = tl.load(x_ptr + rows[:, None] * 128 + cols[None, :], mask=ok, other=0.0)
        scale = tl.load(s_ptr + rows, mask=rows < M, other=1.0)
        scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        _FP8._record_stats(stats_ptr, x, scaled, _FP8._round_to_e4m3(scaled), ok)

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20, 128, generator=gen) * 100.0
    x[0, :4] = torch.tensor([5000.0, -1e6, 464.0, 465.0])
    x[1, 0] = float("nan")
    scale = torch.exp2(torch.randint(-8, 12, (20,), generator=gen).float())
    scale[0] = 1.0
    stats = Fp8Stats("cpu")
    forced[(triton.cdiv(20, 16),)](x, scale, stats.row(GRADIENTS), 20, BLOCK_M=16)
    q = (x / scale[:, None]).clamp(-448, 448).to(FP8)
    want = stats_reference(x, scale[:, None], q)
    got = _read(stats, GRADIENTS)
    _assert_counts(got, want)
    assert got[SATURATED] > 3 and got[UNDERFLOW] > 0 and got[NONFINITE] == 1
    assert got[AMAX] > SATURATION_BOUND  # the amax before the clamp, not 448


def test_fields_of_a_step_record():
    stats = Fp8Stats("cpu")
    bits = torch.tensor([448.0, 3.5], dtype=torch.float32).view(torch.int32).tolist()
    stats.buffer[ACTIVATIONS] = torch.tensor([bits[0], 0, 10, 1000, 0])
    stats.buffer[GRADIENTS] = torch.tensor([bits[1], 2, 30, 3000, 1])
    fields = Fp8Stats.fields(stats.buffer.flatten().tolist())
    assert fields["fp8_amax"] == 448.0
    assert fields["fp8_saturated_share"] == 2 / 4000 and fields["fp8_underflow_share"] == 40 / 4000
    assert fields["fp8_nonfinite"] == ["gradients"]
    assert fields["fp8_by_kind"]["weights"] == {"amax": 0.0, "saturated_share": 0.0, "underflow_share": 0.0,
                                                "elements": 0, "nonfinite": 0}
    assert fields["fp8_by_kind"]["gradients"]["saturated_share"] == 2 / 3000
    stats.reset()
    assert Fp8Stats.fields(stats.buffer.flatten().tolist())["fp8_nonfinite"] == []
    assert stats.buffer.shape == (len(KINDS), FIELDS)


def test_a_wrong_stats_buffer_is_refused(fp8k):
    with pytest.raises(ValueError, match="one int64 row of 5 counters"):
        fp8k.quantize_rows(torch.randn(4, 128), torch.zeros(5, dtype=torch.float32))


@pytest.mark.slow  # the whole FP8 FFN in the interpreter: ~4 s
@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad"])
def test_the_expert_ffn_counts_every_quantisation_by_kind(interpreted, backward):
    """One FP8 expert FFN forward and backward with an empty expert: the weight copies count as
    weights, x and the SwiGLU output as activations (rows forward; with the FP8 weight gradients
    token copies backward too), dy and dh13 as gradients (rows, and with the FP8 weight gradients
    token copies); nothing saturates, nothing is non-finite."""
    _, _, fp8_ffn = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn")
    counts, hidden, ffn = [9, 0, 20], 128, 128
    rows = sum(counts)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    w13 = (torch.randn(3, hidden, 2 * ffn, generator=gen) / hidden**0.5).requires_grad_()
    w2 = (torch.randn(3, ffn, hidden, generator=gen) / ffn**0.5).requires_grad_()
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    stats = Fp8Stats("cpu")
    y = fp8_ffn.expert_ffn_fp8(x, offsets, w13, w2, stats=stats, backward=backward)
    assert stats.buffer[GRADIENTS].eq(0).all()
    y.square().sum().backward()
    totals = stats.buffer[:, TOTAL].tolist()
    copies = 2 if backward == "fp8" else 1  # rows, and token groups for the FP8 weight gradients
    assert totals[WEIGHTS] == w13.numel() + w2.numel()
    assert totals[ACTIVATIONS] == copies * (rows * hidden + rows * ffn)
    assert totals[GRADIENTS] == copies * (rows * hidden + rows * 2 * ffn)
    assert stats.buffer[:, SATURATED].eq(0).all() and stats.buffer[:, NONFINITE].eq(0).all()
    fields = Fp8Stats.fields(stats.buffer.flatten().tolist())
    assert fields["fp8_amax"] == pytest.approx(448.0, rel=1e-6) and fields["fp8_nonfinite"] == []
    plain = fp8_ffn.expert_ffn_fp8(x.detach(), offsets, w13.detach(), w2.detach())
    assert torch.equal(plain, y.detach())  # counting changes no output


# --- the counters of several ranks, reduced in the step's all-ranks sum (distributed modes) ------

def _rank_buffer(gen: torch.Generator, nonfinite: bool = False) -> torch.Tensor:
    """A rank's step buffer: amax bits of random positive floats, counts up to 2^40."""
    buffer = torch.randint(0, 1 << 40, (len(KINDS), FIELDS), generator=gen, dtype=torch.int64)
    amax = torch.rand(len(KINDS), generator=gen) * 500
    buffer[:, AMAX] = amax.view(torch.int32).long()
    buffer[:, NONFINITE] = 0
    if nonfinite:
        buffer[GRADIENTS, NONFINITE] = 1
    return buffer


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_ranks_counters_reduce_to_summed_counts_and_the_largest_amax(world):
    """Every rank packs its buffer (an attention rank without one packs zeros); the words summed in
    any order unpack to each count summed over ranks and each kind's amax the max over ranks,
    exactly (float64 holds the integers), so every rank reads the same buffer."""
    from disagmoe.kernels.fp8_stats import pack_for_sum, sum_words, unpack_sum

    gen = torch.Generator().manual_seed(world)
    buffers = [None] + [_rank_buffer(gen) for _ in range(world - 1)]  # rank 0: attention only
    shares = [pack_for_sum(b, rank, world, "cpu") for rank, b in enumerate(buffers)]
    assert all(s.shape == (sum_words(world),) and s.dtype == torch.float64 for s in shares)
    held = torch.stack([b for b in buffers if b is not None])
    want = held.sum(0)
    want[:, AMAX] = held[:, :, AMAX].amax(0)
    in_order = unpack_sum(torch.stack(shares).sum(0), world)
    assert torch.equal(in_order, want)
    reversed_order = torch.zeros(sum_words(world), dtype=torch.float64)
    for share in reversed(shares):
        reversed_order += share
    assert torch.equal(unpack_sum(reversed_order, world), want)
    fields = Fp8Stats.fields(in_order.flatten().tolist())
    bits = int(held[:, :, AMAX].max())
    assert fields["fp8_amax"] == torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def test_one_ranks_non_finite_scale_skips_the_update_on_every_rank():
    """The skip flag comes from the reduced buffer, which every rank holds alike: one rank's inf
    gives every rank's flag 1.0; with none every flag is 0.0."""
    from disagmoe.kernels.fp8_stats import pack_for_sum, reduced_nonfinite_flag, unpack_sum

    world = 3
    gen = torch.Generator().manual_seed(0)
    for bad in (None, 0, 2):
        buffers = [_rank_buffer(gen, nonfinite=rank == bad) for rank in range(world)]
        own = [Fp8Stats("cpu") for _ in range(world)]
        for stats, buffer in zip(own, buffers, strict=True):
            stats.buffer.copy_(buffer)
        summed = torch.stack([pack_for_sum(b, r, world) for r, b in enumerate(buffers)]).sum(0)
        flags = [reduced_nonfinite_flag(unpack_sum(summed.clone(), world)).item() for _ in range(world)]
        assert flags == [0.0 if bad is None else 1.0] * world
        # a rank's own flag alone would disagree: only the bad rank would skip
        assert [s.nonfinite_flag().item() for s in own] == [float(r == bad) for r in range(world)]


def test_packing_refuses_a_rank_outside_the_world_and_a_wrong_width():
    from disagmoe.kernels.fp8_stats import pack_for_sum, sum_words, unpack_sum

    with pytest.raises(ValueError, match="rank 3 is not one of 3 ranks"):
        pack_for_sum(None, 3, 3)
    with pytest.raises(ValueError, match=f"expected {sum_words(2)} summed words for 2 ranks"):
        unpack_sum(torch.zeros(sum_words(3), dtype=torch.float64), 2)


def test_a_counting_launch_keeps_each_program_under_its_packed_counts():
    """`fp8.counted_programs`: the persistent count, or enough programs that none counts more than
    2^16 - 1 chunks (units handed out whole: a unit's chunks all go to one program)."""
    import triton

    from disagmoe.kernels import fp8

    base = fp8._persistent_programs(torch.device("cpu"))
    assert fp8.counted_programs(torch.device("cpu"), 100, 4) == base
    for units, chunks in [(10**6, 1), (81919, 4), (3 * 10**5, 7)]:
        programs = fp8.counted_programs(torch.device("cpu"), units, chunks)
        assert triton.cdiv(units, programs) * chunks <= 65535, (units, chunks, programs)


@pytest.mark.parametrize("rows,k", [(512, 256), (300_000, 1024)])
def test_the_one_pass_launch_keeps_each_program_under_its_packed_counts(monkeypatch, rows, k):
    """`fp8.quantize_rows_and_token_groups`' launch: one program an SM (the CPU's handful), or enough that none
    quantises more than 255 tiles (each row position of a half counts up to 2 x 128 underflows a tile in 16
    bits); its programs stride over all the tiles. (The kernel is not run: its launch is recorded.)"""
    import triton

    from disagmoe.kernels import fp8

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args))

    monkeypatch.setattr(fp8, "_quantize_rows_and_token_groups_kernel", Recorder())
    offsets = torch.tensor([rows // 3, rows // 2, rows], dtype=torch.int32)
    fp8.quantize_rows_and_token_groups(torch.empty(rows, k, dtype=torch.bfloat16), offsets, Fp8Stats("cpu").row(0))
    ((grid, args),) = launches
    chunks, tiles = args[12], args[13]
    assert tiles == chunks * triton.cdiv(k, 128) and chunks == fp8.padded_capacity(rows, 3) // 128
    assert grid == (max(4, triton.cdiv(tiles, 255)),) and triton.cdiv(tiles, grid[0]) <= 255, (grid, tiles)
