"""The codec contract: tests every KV codec's test module subclasses.

Subclass :class:`CodecContract`, set ``name`` (the registered codec name) and
``options``, and for a lossy codec implement :meth:`CodecContract.error_bound`, an
elementwise bound of ``|decoded - original|`` for a float32 copy of the input. The suite
checks: round trips over dtypes and odd sizes (bit-exact for a lossless codec, within the
bound otherwise), that damaged, truncated, foreign or mismatched streams raise
:class:`~lmcache_core.codecs.CodecError`, that decoding allocates nothing output-sized
(torch's allocations through the profiler, Python's through ``tracemalloc``), that the
options are JSON and recreate an equivalent codec, and concurrent use from threads.
"""

from __future__ import annotations

import json
import threading
import tracemalloc
from typing import Any, ClassVar

import pytest
import torch

from ..codecs import CodecError, KVCodec
from ..plugins.codec_registry import get_codec_registry

__all__ = ["CodecContract", "kv_like"]

#: Shapes the round trips use: odd 1-D/3-D sizes, an empty tensor, vLLM CPU chunks.
SHAPES: list[tuple[int, ...]] = [
    (1,),
    (7,),
    (1001,),
    (3, 5, 7),
    (0,),
    (2, 1, 2, 32, 16),
    (3, 2, 2, 32, 130),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kv_like(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    """A KV-like tensor: per-channel offsets and scales (some outlier channels), a slow
    drift over tokens and noise; deterministic for ``seed``."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    last = shape[-1]
    rows = n // last
    chan = torch.randn(1, last, generator=g) * 2
    scale = torch.rand(1, last, generator=g) + 0.2
    scale[0, :: max(1, last // 5)] *= 6  # outlier channels
    drift = torch.cumsum(torch.randn(rows, 1, generator=g) * 0.05, dim=0)
    x = chan + drift + torch.randn(rows, last, generator=g) * scale
    return x.reshape(shape).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def _out_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound of rounding float32 values near ``x`` to ``dtype`` (half an ulp, and then some)."""
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    return x.abs() * eps + torch.finfo(dtype).tiny


class CodecContract:
    """Tests every codec passes (see the module docstring)."""

    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    #: Set by a codec whose library cannot decompress into a caller buffer: its decode
    #: may allocate output-sized buffers (at most twice the output) per call.
    allocates_output: ClassVar[bool] = False

    @pytest.fixture
    def codec(self) -> KVCodec:
        return get_codec_registry().create(self.name, self.options)

    def error_bound(self, codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound of the decode error for float32 ``x`` (lossy codecs)."""
        raise NotImplementedError

    def encoded(self, codec: KVCodec, x: torch.Tensor) -> bytes:
        return bytes(codec.encode(x))

    # ------------------------------------------------------------------ round trips
    def test_registered_flag_matches(self, codec: KVCodec) -> None:
        spec = get_codec_registry().get(self.name)
        assert codec.name == self.name
        assert codec.lossless is spec.lossless
        assert isinstance(codec, KVCodec)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_round_trip(self, codec: KVCodec, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        x = kv_like(shape, dtype, seed=len(shape) * 31 + sum(shape))
        buf = self.encoded(codec, x)
        out = torch.full_like(x, 12345.0)
        codec.decode_into(buf, out)
        if codec.lossless:
            assert _same_bits(out, x)
            return
        err = (out.float() - x.float()).abs()
        bound = self.error_bound(codec, x.float()) + _out_rounding(x.float(), dtype)
        worst = (err - bound).max().item() if err.numel() else 0.0
        assert worst <= 0, f"error exceeds the bound by {worst} ({shape}, {dtype})"

    def test_special_values(self, codec: KVCodec) -> None:
        """A lossless codec keeps -0, infinities, NaN and subnormals bit for bit; a lossy
        one refuses non-finite values (a store that is not made, never wrong KV)."""
        x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.0])
        for dtype in DTYPES:
            y = x.to(dtype)
            if codec.lossless:
                out = torch.empty_like(y)
                codec.decode_into(self.encoded(codec, y), out)
                assert _same_bits(out, y)
            else:
                with pytest.raises(CodecError):
                    codec.encode(y)

    def test_encoded_smaller_than_raw_on_kv(self, codec: KVCodec) -> None:
        x = kv_like((2, 2, 2, 32, 128), torch.float32)
        assert len(codec.encode(x)) < x.nbytes

    # ------------------------------------------------------------------ damage
    def test_truncated_raises(self, codec: KVCodec) -> None:
        x = kv_like((2, 1, 2, 32, 16))
        buf = self.encoded(codec, x)
        out = torch.empty_like(x)
        for n in sorted({0, 1, 10, 39, 40, 41, len(buf) // 2, len(buf) - 1}):
            with pytest.raises(CodecError):
                codec.decode_into(buf[:n], out)
        with pytest.raises(CodecError):
            codec.decode_into(buf + b"\0", out)

    def test_corrupted_raises(self, codec: KVCodec) -> None:
        x = kv_like((2, 1, 2, 32, 16))
        buf = self.encoded(codec, x)
        out = torch.empty_like(x)
        for pos in sorted({0, 4, 9, 12, 20, 38, 40, len(buf) // 2, len(buf) - 1}):
            bad = bytearray(buf)
            bad[pos] ^= 0x5A
            with pytest.raises(CodecError):
                codec.decode_into(bytes(bad), out)
        with pytest.raises(CodecError):
            codec.decode_into(bytes(len(buf)), out)

    def test_mismatched_output_raises(self, codec: KVCodec) -> None:
        x = kv_like((2, 1, 2, 32, 16))
        buf = self.encoded(codec, x)
        with pytest.raises(CodecError):
            codec.decode_into(buf, torch.empty(x.numel() + 1))
        other = torch.float16 if x.dtype != torch.float16 else torch.float32
        with pytest.raises(CodecError):
            codec.decode_into(buf, torch.empty(x.shape, dtype=other))
        with pytest.raises(CodecError):
            codec.decode_into(buf, torch.empty(x.numel() * 2, dtype=x.dtype)[::2])

    def test_foreign_stream_raises(self, codec: KVCodec) -> None:
        x = kv_like((2, 1, 2, 32, 16))
        out = torch.empty_like(x)
        for name in get_codec_registry().names():
            if name == self.name:
                continue
            other = get_codec_registry().create(name)
            with pytest.raises(CodecError):
                codec.decode_into(bytes(other.encode(x)), out)

    # ------------------------------------------------------------------ memory
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_decode_allocates_nothing_output_sized(
        self, codec: KVCodec, dtype: torch.dtype
    ) -> None:
        from torch.profiler import ProfilerActivity, profile

        x = kv_like((4, 2, 2, 32, 128), dtype)
        buf = self.encoded(codec, x)
        out = torch.empty_like(x)
        codec.decode_into(buf, out)  # warm-up: scratch buffers reach their size
        codec.decode_into(buf, out)
        tracemalloc.start()
        try:
            codec.decode_into(buf, out)
            _, py_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            codec.decode_into(buf, out)
        torch_bytes = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
        limit = x.nbytes // 8 + (2 * x.nbytes if self.allocates_output else 0)
        assert torch_bytes < limit, (
            f"decode allocated {torch_bytes} bytes in torch (output {x.nbytes})"
        )
        assert py_peak < limit, f"decode allocated {py_peak} bytes in Python (output {x.nbytes})"

    # ------------------------------------------------------------------ options, threads
    def test_options_are_json_and_recreate(self, codec: KVCodec) -> None:
        opts = codec.options()
        assert json.loads(json.dumps(opts)) == opts
        again = get_codec_registry().create(self.name, opts)
        assert again.options() == opts
        x = kv_like((2, 1, 2, 32, 16))
        out = torch.empty_like(x)
        again.decode_into(self.encoded(codec, x), out)
        out2 = torch.empty_like(x)
        codec.decode_into(self.encoded(codec, x), out2)
        assert _same_bits(out, out2)

    def test_bad_option_is_a_clear_error(self) -> None:
        with pytest.raises(ValueError, match="no option"):
            get_codec_registry().create(self.name, {**self.options, "no_such_option": 1})

    def test_threads(self, codec: KVCodec) -> None:
        inputs = [kv_like((2, 2, 2, 32, 64), torch.bfloat16, seed=s) for s in range(4)]
        expected = []
        for x in inputs:
            out = torch.empty_like(x)
            codec.decode_into(self.encoded(codec, x), out)
            expected.append(out)
        errors: list[str] = []

        def work(i: int) -> None:
            for _ in range(5):
                x = inputs[i]
                buf = bytes(codec.encode(x))
                out = torch.empty_like(x)
                codec.decode_into(buf, out)
                if not _same_bits(out, expected[i]):
                    errors.append(f"thread {i}: different result")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
