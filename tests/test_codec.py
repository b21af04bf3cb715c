"""The byte codec: every method restores every payload bit for bit, and never grows it.

Also the Lz4 policy's choice of method: the trial, and its reuse for tensors of a kind.

The oracle is the payload itself: decoded bytes are compared with the original
bytes by ``torch.equal`` on uint8, so NaN payloads, -0.0 and denormals count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from checks import ALL_DTYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from tensorstash.core.policy import Context
from tensorstash.core.stats import StashStats
from tensorstash.tiers._codec import METHODS, Encoded, Stream, choose, decode, encode
from tensorstash.tiers.compress import Compressed, Lz4

DTYPES = [*ALL_DTYPES, torch.complex128]
CHUNKS = [8, 100, 1000, 4096, 512 * 1024]

# Bit patterns of special values, by float format: -0.0, +inf, -inf, NaNs with
# payloads, the smallest denormal, the largest negative denormal.
SPECIAL_BITS = {
    torch.float16: [0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFFFF, 0x0001, 0x83FF],
    torch.bfloat16: [0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0001, 0x807F],
    torch.float32: [
        0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF,
    ],
    torch.float64: [
        0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000001,
        0xFFFFFFFFFFFFFFFF, 0x0000000000000001, 0x800FFFFFFFFFFFFF,
    ],
}  # fmt: skip
COMPONENT = {torch.complex64: torch.float32, torch.complex128: torch.float64}
SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(2)
    yield executor
    executor.shutdown()


# -- helpers ----------------------------------------------------------------------


def as_payload(tensor: Tensor) -> Tensor:
    """The bytes of a tensor as the codec receives them."""
    flat = tensor.contiguous().view(-1)
    return flat.view(torch.uint8)


def roundtrip(payload: Tensor, dtype: torch.dtype, method: str, **options: object) -> Encoded:
    """Encode, decode into a garbage-filled buffer, check the bytes; return the encoding."""
    pool = options.pop("pool", None)
    original = payload.clone()
    encoded = encode(payload, dtype, method, pool=pool, **options)  # type: ignore[arg-type]
    assert torch.equal(payload, original), "encode must not change its input"
    out = torch.full((payload.numel(),), 0xA5, dtype=torch.uint8)
    decode(encoded, out, pool=pool)  # type: ignore[arg-type]
    assert torch.equal(out, original), f"{method} on {dtype}: bytes differ after decode"
    assert encoded.stored_bytes <= encoded.nbytes == payload.numel()
    return encoded


def values_of(dtype: torch.dtype, count: int, style: str, generator: torch.Generator) -> Tensor:
    """``count`` elements: "noise" spans the dtype, "smooth" repeats a few values."""
    if dtype == torch.bool:
        return torch.rand(count, generator=generator) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(count, generator=generator, dtype=torch.float64)
        if style == "smooth":
            base = base.mul(4).round().div(4)
        if dtype.is_complex:
            imag = torch.randn(count, generator=generator, dtype=torch.float64)
            return torch.complex(base, imag).to(dtype)
        return base.to(dtype)
    info = torch.iinfo(dtype)
    low, high = (info.min, info.max) if style == "noise" else (-3, 4)
    low = max(low, info.min)
    return torch.randint(low, high, (count,), generator=generator, dtype=torch.int64).to(dtype)


def with_specials(values: Tensor, fraction: float, generator: torch.Generator) -> Tensor:
    """Overwrite a fraction of float elements with special bit patterns."""
    component = COMPONENT.get(values.dtype, values.dtype)
    if component not in SPECIAL_BITS or values.numel() == 0:
        return values
    parts = values.view(component) if values.dtype.is_complex else values
    bits = parts.view(SIGNED[component.itemsize])
    width = 8 * component.itemsize
    table = [v - (1 << width) if v >= 1 << (width - 1) else v for v in SPECIAL_BITS[component]]
    patterns = torch.tensor(table, dtype=bits.dtype)
    where = torch.rand(bits.numel(), generator=generator) < fraction
    picks = torch.randint(len(table), (bits.numel(),), generator=generator)
    bits[where] = patterns[picks[where]]
    return values


@st.composite
def payloads(draw: st.DrawFn) -> tuple[Tensor, torch.dtype]:
    """A tensor's bytes: any dtype, size, share of zeros and special values."""
    dtype = draw(st.sampled_from(DTYPES))
    count = draw(st.one_of(st.integers(0, 17), st.integers(0, 3000)))
    zeros = draw(st.one_of(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0)))
    specials = draw(st.sampled_from([0.0, 0.0, 0.05, 0.5]))
    style = draw(st.sampled_from(["noise", "smooth"]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    values = values_of(dtype, count, style, generator)
    values[torch.rand(count, generator=generator) < zeros] = 0
    values = with_specials(values, specials, generator)
    payload = as_payload(values)
    # A few trailing bytes short of a whole element, sometimes.
    extra = draw(st.integers(0, dtype.itemsize - 1)) if draw(st.booleans()) else 0
    if extra:
        tail = torch.randint(0, 256, (extra,), generator=generator, dtype=torch.uint8)
        payload = torch.cat([payload, tail])
    return payload, dtype


# -- round trips ------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=payloads(),
    method=st.sampled_from(METHODS),
    chunk_bytes=st.sampled_from(CHUNKS),
    threaded=st.booleans(),
)
def test_codec_roundtrip_is_bitwise(
    pool: ThreadPoolExecutor,
    case: tuple[Tensor, torch.dtype],
    method: str,
    chunk_bytes: int,
    threaded: bool,
) -> None:
    payload, dtype = case
    roundtrip(payload, dtype, method, chunk_bytes=chunk_bytes, pool=pool if threaded else None)


@settings(max_examples=100, deadline=None)
@given(
    data=st.binary(max_size=5000),
    dtype=st.sampled_from(DTYPES),
    method=st.sampled_from(METHODS),
    chunk_bytes=st.sampled_from(CHUNKS),
)
def test_codec_stored_bytes_never_exceed_nbytes(
    data: bytes, dtype: torch.dtype, method: str, chunk_bytes: int
) -> None:
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    encoded = roundtrip(payload.to(torch.uint8), dtype, method, chunk_bytes=chunk_bytes)
    assert encoded.stored_bytes <= len(data)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_codec_empty_payload(method: str, dtype: torch.dtype) -> None:
    encoded = roundtrip(torch.empty(0, dtype=torch.uint8), dtype, method)
    assert encoded.nbytes == 0
    assert encoded.stored_bytes == 0


@pytest.mark.parametrize("method", METHODS)
def test_codec_misaligned_payload_and_out(method: str) -> None:
    values = torch.randn(5000).relu()
    wide = torch.cat([torch.zeros(3, dtype=torch.uint8), as_payload(values)])
    payload = wide[3:]  # storage offset 3: no wider integer view of it exists
    encoded = encode(payload, torch.float32, method, chunk_bytes=1000)
    wide_out = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
    out = wide_out[1:]
    decode(encoded, out)
    assert torch.equal(out, payload)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128, torch.bool])
def test_codec_roundtrip_large_segments(method: str, dtype: torch.dtype) -> None:
    # Segments of the default 512 KiB hold several of the pieces torch works
    # on at once; an odd count leaves a short last segment and piece.
    generator = torch.Generator().manual_seed(0)
    values = values_of(dtype, 300_001, "smooth", generator)
    values[torch.rand(300_001, generator=generator) < 0.5] = 0
    roundtrip(as_payload(values), dtype, method)


@pytest.mark.parametrize("method", METHODS)
def test_codec_decodes_twice(method: str) -> None:
    payload = as_payload(torch.randn(3000).relu().half())
    encoded = encode(payload, torch.float16, method, chunk_bytes=1024)
    for _ in range(2):
        out = torch.empty_like(payload)
        decode(encoded, out)
        assert torch.equal(out, payload)


def test_codec_zeros_keeps_negative_zero_and_nan_payloads() -> None:
    bits = torch.tensor([0, -(2**31), 0, 0x7FC00001, 0, -1, 1, 0], dtype=torch.int32)
    encoded = roundtrip(as_payload(bits.view(torch.float32)), torch.float32, "zeros")
    assert encoded.method == "zeros"


def test_codec_bits_every_byte_pattern() -> None:
    patterns = torch.arange(256).unsqueeze(1).bitwise_right_shift(torch.arange(8)).bitwise_and(1)
    flags = patterns.to(torch.bool).view(-1)
    encoded = roundtrip(as_payload(flags), torch.bool, "bits")
    assert encoded.method == "bits"
    assert encoded.stored_bytes <= 256


def test_codec_bits_on_bytes_other_than_0_1_falls_back_to_lz4() -> None:
    payload = torch.tensor([0, 1, 2, 1] * 100, dtype=torch.uint8)
    assert roundtrip(payload, torch.bool, "bits").method == "lz4"


def test_codec_shuffle_on_one_byte_elements_is_lz4() -> None:
    payload = torch.tensor([1, 2, 3, 4] * 100, dtype=torch.uint8)
    assert roundtrip(payload, torch.int8, "shuffle").method == "lz4"


def test_codec_incompressible_zeros_is_stored_raw() -> None:
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(1, 256, (100_000,), generator=generator, dtype=torch.uint8)
    # 10% zeros at random: the bitmap (1/8 of the bytes) costs more than they save.
    noise[torch.rand(100_000, generator=generator) < 0.1] = 0
    encoded = roundtrip(noise, torch.uint8, "zeros")
    assert encoded.method == "raw"


@pytest.mark.parametrize("acceleration", [1, 8, 64])
def test_codec_acceleration(acceleration: int) -> None:
    payload = as_payload(torch.randn(100_000).relu())
    roundtrip(payload, torch.float32, "lz4", acceleration=acceleration)


# -- sizes ------------------------------------------------------------------------


def test_codec_zeros_beats_lz4_on_relu_outputs() -> None:
    payload = as_payload(torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)).relu())
    zeros = roundtrip(payload, torch.float32, "zeros")
    lz4 = roundtrip(payload, torch.float32, "lz4")
    assert zeros.method == "zeros"
    assert zeros.stored_bytes < lz4.stored_bytes


def test_codec_bits_packs_random_bools_7x() -> None:
    flags = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) < 0.5
    encoded = roundtrip(as_payload(flags), torch.bool, "bits")
    assert encoded.nbytes >= 7 * encoded.stored_bytes


# -- choose -----------------------------------------------------------------------


def test_choose_bits_for_bools() -> None:
    flags = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) < 0.5
    assert choose(as_payload(flags), torch.bool) == "bits"


def test_choose_zeros_for_mostly_zero_floats() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1 << 20, generator=generator)
    values[torch.rand(1 << 20, generator=generator) < 0.9] = 0
    assert choose(as_payload(values), torch.float32) == "zeros"


def test_choose_raw_for_noise() -> None:
    noise = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    assert choose(noise, torch.uint8) == "raw"


def test_choose_compresses_dropout_mask() -> None:
    keep = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) < 0.9
    payload = as_payload(keep.float() / 0.9)
    method = choose(payload, torch.float32)
    assert method != "raw"
    assert roundtrip(payload, torch.float32, method).stored_bytes * 5 < payload.numel()


@pytest.mark.parametrize("count", [0, 1, 3, 1000])
def test_choose_small_payloads(count: int) -> None:
    payload = as_payload(torch.zeros(count))
    method = choose(payload, torch.float32)
    assert method in METHODS
    roundtrip(payload, torch.float32, method)


# -- threads ----------------------------------------------------------------------


def test_codec_busy_pool_does_not_block() -> None:
    executor = ThreadPoolExecutor(1)
    release = threading.Event()
    executor.submit(release.wait)  # the only worker is busy until the end
    try:
        payload = as_payload(torch.randn(100_000).relu())
        roundtrip(payload, torch.float32, "zeros", chunk_bytes=4096, pool=executor)
    finally:
        release.set()
        executor.shutdown()


def test_codec_runs_on_a_worker_of_its_own_pool() -> None:
    executor = ThreadPoolExecutor(1)
    payload = as_payload(torch.randn(100_000))
    try:
        job = executor.submit(
            roundtrip, payload, torch.float32, "shuffle", chunk_bytes=4096, pool=executor
        )
        job.result(timeout=60)
    finally:
        executor.shutdown()


def test_codec_shut_down_pool_still_works() -> None:
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    roundtrip(
        as_payload(torch.randn(10_000)), torch.float32, "lz4", chunk_bytes=4096, pool=executor
    )


# -- errors -----------------------------------------------------------------------


def test_encode_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="unknown method 'gzip'"):
        encode(torch.zeros(8, dtype=torch.uint8), torch.uint8, "gzip")


@pytest.mark.parametrize(
    "payload",
    [torch.zeros(8), torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)[::2]],
    ids=["float", "2-d", "strided"],
)
def test_encode_rejects_bad_payloads(payload: Tensor) -> None:
    with pytest.raises(ValueError, match="1-D contiguous uint8 CPU tensor"):
        encode(payload, torch.uint8, "lz4")


@pytest.mark.parametrize("options", [{"chunk_bytes": 0}, {"acceleration": 0}])
def test_encode_rejects_bad_settings(options: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be an int"):
        encode(torch.zeros(8, dtype=torch.uint8), torch.uint8, "lz4", **options)


def test_decode_rejects_wrong_out_size() -> None:
    encoded = encode(torch.zeros(8, dtype=torch.uint8), torch.uint8, "lz4")
    with pytest.raises(ValueError, match="out holds 7 bytes"):
        decode(encoded, torch.empty(7, dtype=torch.uint8))


def test_decode_reports_corrupted_blocks() -> None:
    good = encode(torch.zeros(4096, dtype=torch.uint8), torch.uint8, "lz4")
    (stream,) = good.parts
    assert isinstance(stream, Stream)
    bad = Encoded("lz4", 4096, (Stream(1, stream.segment, stream.sizes, (b"\xff\x00",)),))
    with pytest.raises(ValueError, match="corrupted"):
        decode(bad, torch.empty(4096, dtype=torch.uint8))


def test_choose_leaves_bf16_activations_raw() -> None:
    # A shuffle gets about 1.2x on them, too little for its cost on 2-byte elements.
    generator = torch.Generator().manual_seed(0)
    values = torch.nn.functional.gelu(torch.randn(1 << 20, generator=generator)).bfloat16()
    assert choose(as_payload(values), torch.bfloat16) == "raw"


def test_choose_shuffles_float32_that_gains_enough() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(512, 2048, generator=generator).log_softmax(-1)
    assert choose(as_payload(values), torch.float32) == "shuffle"


@pytest.mark.parametrize("method", ["lz4", "shuffle", "zeros"])
def test_codec_keeps_the_callers_torch_threads(method: str) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        payload = as_payload(torch.randn(100_000).relu())
        roundtrip(payload, torch.float32, method)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# -- the Lz4 policy's trial -------------------------------------------------------


def packed_method(policy: Lz4, tensor: Tensor, ctx: Context) -> str:
    packed = policy.pack(tensor, ctx)
    assert isinstance(packed, Compressed)
    restored = policy.unpack(packed, ctx)
    assert isinstance(restored, Tensor) and torch.equal(restored, tensor)
    return packed.encoded(ctx).method


def test_lz4_reuses_the_trial_for_tensors_of_the_same_kind() -> None:
    ctx, policy = Context(StashStats()), Lz4()
    relu = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).relu()
    assert packed_method(policy, relu, ctx) == "zeros"
    # Alone, a constant tensor is plain lz4's (the cheaper of two near ties);
    # of the same kind as the first, it reuses "zeros".
    assert packed_method(policy, torch.ones(256, 1024), ctx) == "zeros"
    assert packed_method(Lz4(), torch.ones(256, 1024), Context(StashStats())) == "lz4"
    assert packed_method(policy, torch.ones(1024, 256), ctx) == "lz4"


def test_lz4_reused_method_that_does_not_pay_keeps_bytes_in_place() -> None:
    ctx, policy = Context(StashStats()), Lz4()
    relu = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).relu()
    assert packed_method(policy, relu, ctx) == "zeros"
    dense = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)).abs() + 1
    packed = policy.pack(dense, ctx)
    assert isinstance(packed, Compressed)
    (part,) = packed.encoded(ctx).parts
    assert isinstance(part, Tensor) and part.data_ptr() == dense.data_ptr()
