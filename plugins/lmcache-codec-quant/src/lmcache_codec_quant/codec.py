"""Group-quantization KV codecs: ``int8``, ``int4`` (asymmetric) and ``fp8`` (e4m3).

The tensor is cut, in memory order, into groups of ``group_size`` elements; each group
gets its own parameters. On vLLM's CPU KV cache a chunk is ``[layers, blocks, heads,
block_size, 2*head_size]`` and, inside each block and head, K is stored *transposed*
(``[head_size, block_size]``: one row per channel) followed by V (``[block_size,
head_size]``: one row per token). With a group size dividing both the block size and the
head size (the default 32 does: vLLM's CPU block size is a multiple of 32), a K group is
one channel over a run of tokens and a V group is one token over a run of channels: the
per-channel keys / per-token values grouping of KIVI (Liu et al., 2024), which keeps the
outlier channels of K from spoiling the scale of the other channels.

``int8`` / ``int4``: ``q = round((x - min) / scale)`` with ``scale = (max - min) /
(2**bits - 1)``; ``min`` and ``scale`` are float16 (float32 for a chunk whose range does
not fit float16), the scale rounded up so no value clips. Error bound per element:
``scale / 2`` plus the float16 rounding of ``min`` (``|min| * 2**-11``) plus the rounding
to the output dtype. ``fp8``: ``x / s`` stored as float8 e4m3 with ``s = amax / 448`` per
group (bfloat16, rounded up); relative error at most ``2**-4``, absolute at most
``s * 2**-10`` near zero.

Decoding reads the parameters and codes from the stream (copied once into a scratch
buffer only when the stream is read-only) and writes into per-thread scratch tensors
reused across calls, then into the caller's tensor.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from lmcache_core.codecs import (
    FRAME_BYTES,
    CodecError,
    Scratch,
    read_frame,
    write_frame,
)

__all__ = ["Fp8Codec", "Int4Codec", "Int8Codec"]

_TAG = b"QGRP"
_VERSION = 1
_HEAD = struct.Struct("<IBBH")  # group size, mode, flags, reserved
_MODES = {"int8": 1, "int4": 2, "fp8": 3}
_F32_PARAMS = 1  # flag: parameters stored as float32
_FP8_MAX = 448.0


def _check_group(group_size: int, even: bool) -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or not 2 <= group_size <= 4096
    ):
        raise ValueError(f"group_size must be an integer 2-4096, not {group_size!r}")
    if even and group_size % 2:
        raise ValueError(f"group_size must be even for int4, not {group_size}")
    return group_size


class _GroupCodec:
    name = ""
    lossless = False
    mode = ""

    def __init__(self, group_size: int = 32) -> None:
        self.group_size = _check_group(group_size, self.mode == "int4")
        self._scratch = Scratch()

    def options(self) -> dict[str, Any]:
        """The options recorded with every object."""
        return {"group_size": self.group_size}

    # ------------------------------------------------------------------ helpers
    def _groups(self, tensor: torch.Tensor) -> tuple[int, int]:
        n = tensor.numel()
        return n, -(-n // self.group_size)

    def _padded_f32(self, tensor: torch.Tensor, slot: str) -> tuple[torch.Tensor, int, int]:
        """The tensor as float32 ``[groups, group_size]`` in scratch, the tail padded with
        its last value (so padding never widens a group's range)."""
        if not torch.is_floating_point(tensor):
            raise CodecError(f"{self.name} encodes floating-point KV, not {tensor.dtype}")
        n, ng = self._groups(tensor)
        g = self.group_size
        buf = self._scratch.get(slot, ng * g, torch.float32)
        flat = tensor.contiguous().view(-1)
        buf[:n].copy_(flat)
        if ng * g > n:
            buf[n:].fill_(float(flat[-1]))
        if not bool(torch.isfinite(buf[:n]).all()):
            raise CodecError(f"{self.name} cannot encode non-finite KV values")
        return buf.view(ng, g), n, ng

    def _stream(self, nbytes: int) -> torch.Tensor:
        return self._scratch.get("enc", FRAME_BYTES + nbytes)

    def _body(self, buf: Any, out: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        frame = read_frame(buf, _TAG, (_VERSION,), out)
        body = frame.body
        if len(body) < _HEAD.size:
            raise CodecError("quantized stream is truncated")
        group, mode, flags, _ = _HEAD.unpack_from(body, 0)
        if mode != _MODES[self.mode] or group != self.group_size:
            raise CodecError(
                f"stream was encoded by another quantization (mode {mode}, group {group}); "
                f"this codec is {self.name} with group_size {self.group_size}"
            )
        if body.readonly:  # torch cannot view read-only memory: one copy into scratch
            tmp = self._scratch.get("in", len(body))
            tmp.numpy()[:] = body
            data = tmp
        else:
            data = (
                torch.frombuffer(body, dtype=torch.uint8)
                if len(body)
                else torch.empty(0, dtype=torch.uint8)
            )
        return data[_HEAD.size :], flags, out.numel()

    @staticmethod
    def _finish(out: torch.Tensor, values: torch.Tensor, n: int) -> None:
        out.view(-1).copy_(values.view(-1)[:n])

    def encode(self, tensor: torch.Tensor) -> memoryview:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode_into(self, buf: Any, out: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError


class _IntCodec(_GroupCodec):
    bits = 8

    def encode(self, tensor: torch.Tensor) -> memoryview:
        """Quantize ``tensor``; the view is valid until this thread's next call."""
        if tensor.numel() == 0:
            out = self._stream(_HEAD.size)
            _HEAD.pack_into(out.numpy().data, FRAME_BYTES, self.group_size, _MODES[self.mode], 0, 0)
            n = write_frame(out.numpy(), _TAG, _VERSION, tensor.dtype, 0, _HEAD.size)
            return out.numpy().data[:n]
        v, n, ng = self._padded_f32(tensor, "x")
        levels = (1 << self.bits) - 1
        mn, mx = torch.aminmax(v, dim=1)
        flags = 0
        pdtype = torch.float16
        if float(mx.abs().max()) > 60000.0 or float(mn.abs().max()) > 60000.0:
            pdtype, flags = torch.float32, _F32_PARAMS
        mn_p = mn.to(pdtype)
        mn32 = mn_p.float()
        scale = (mx - mn32).clamp_min(0) / levels
        scale_p = scale.to(pdtype)
        low = scale_p.float() < scale
        if bool(low.any()):
            scale_p = torch.where(
                low, torch.nextafter(scale_p, torch.full_like(scale_p, float("inf"))), scale_p
            )
        scale_p = torch.where(scale_p > 0, scale_p, torch.ones_like(scale_p))
        sc32 = scale_p.float()
        q = v.sub(mn32[:, None]).div_(sc32[:, None]).round_().clamp_(0, levels).to(torch.uint8)
        if self.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        psize = 4 if flags else 2
        nbytes = _HEAD.size + 2 * ng * psize + q.numel()
        stream = self._stream(nbytes)
        body = stream[FRAME_BYTES:]
        body.numpy()[: _HEAD.size] = memoryview(
            _HEAD.pack(self.group_size, _MODES[self.mode], flags, 0)
        )
        off = _HEAD.size
        body[off : off + ng * psize].view(pdtype).copy_(mn_p)
        off += ng * psize
        body[off : off + ng * psize].view(pdtype).copy_(scale_p)
        off += ng * psize
        body[off : off + q.numel()].copy_(q.reshape(-1))
        total = write_frame(stream.numpy(), _TAG, _VERSION, tensor.dtype, n, nbytes, flags)
        return stream.numpy().data[:total]

    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Dequantize ``buf`` into ``out``; :class:`CodecError` if it cannot."""
        data, flags, n = self._body(buf, out)
        if n == 0:
            if len(data):
                raise CodecError("stream has data for an empty tensor")
            return
        g = self.group_size
        ng = -(-n // g)
        psize = 4 if flags & _F32_PARAMS else 2
        pdtype = torch.float32 if flags & _F32_PARAMS else torch.float16
        qbytes = ng * g if self.bits == 8 else ng * g // 2
        if len(data) != 2 * ng * psize + qbytes:
            raise CodecError(
                f"{self.name} stream has {len(data)} bytes of data, expected {2 * ng * psize + qbytes}"
            )
        mn = self._scratch.get("mn", ng, torch.float32)
        sc = self._scratch.get("sc", ng, torch.float32)
        mn.copy_(data[: ng * psize].view(pdtype))
        sc.copy_(data[ng * psize : 2 * ng * psize].view(pdtype))
        q = data[2 * ng * psize :]
        if self.bits == 4:
            packed = q.view(ng, g // 2)
            unpacked = self._scratch.get("q4", ng * g).view(ng, g)
            torch.bitwise_and(packed, 15, out=unpacked[:, 0::2])
            torch.bitwise_right_shift(packed, 4, out=unpacked[:, 1::2])
            q = unpacked
        q = q.view(ng, g)
        direct = out.dtype == torch.float32 and ng * g == n
        vals = (
            out.view(ng, g) if direct else self._scratch.get("y", ng * g, torch.float32).view(ng, g)
        )
        vals.copy_(q)  # converts in its loop; the in-place ops below allocate nothing
        vals.mul_(sc[:, None]).add_(mn[:, None])
        if not direct:
            self._finish(out, vals, n)


class Int8Codec(_IntCodec):
    """``int8``: 8-bit asymmetric group quantization (about 1.06 bytes per element with
    the default group of 32, float16 parameters)."""

    name = "int8"
    mode = "int8"
    bits = 8


class Int4Codec(_IntCodec):
    """``int4``: 4-bit asymmetric group quantization, two codes per byte."""

    name = "int4"
    mode = "int4"
    bits = 4


class Fp8Codec(_GroupCodec):
    """``fp8``: float8 e4m3 with one bfloat16 scale per group (needs a torch with
    ``torch.float8_e4m3fn``, 2.1 and later)."""

    name = "fp8"
    mode = "fp8"

    def __init__(self, group_size: int = 32) -> None:
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("fp8 needs a torch build with torch.float8_e4m3fn")
        super().__init__(group_size)

    def encode(self, tensor: torch.Tensor) -> memoryview:
        """Quantize ``tensor`` to e4m3; the view is valid until this thread's next call."""
        n, ng = self._groups(tensor)
        g = self.group_size
        nbytes = _HEAD.size + 2 * ng + ng * g
        stream = self._stream(nbytes)
        body = stream[FRAME_BYTES:]
        body.numpy()[: _HEAD.size] = memoryview(_HEAD.pack(g, _MODES["fp8"], 0, 0))
        if n:
            v, n, ng = self._padded_f32(tensor, "x")
            amax = v.abs().amax(dim=1)
            s = (amax / _FP8_MAX).to(torch.bfloat16)
            low = s.float() * _FP8_MAX < amax
            if bool(low.any()):
                s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
            s = torch.where(s > 0, s, torch.ones_like(s))
            off = _HEAD.size
            body[off : off + 2 * ng].view(torch.bfloat16).copy_(s)
            off += 2 * ng
            q = v.div(s.float()[:, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            body[off : off + ng * g].copy_(q.view(torch.uint8).reshape(-1))
        total = write_frame(stream.numpy(), _TAG, _VERSION, tensor.dtype, n, nbytes)
        return stream.numpy().data[:total]

    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Dequantize ``buf`` into ``out``; :class:`CodecError` if it cannot."""
        data, _flags, n = self._body(buf, out)
        g = self.group_size
        ng = -(-n // g)
        if len(data) != 2 * ng + ng * g:
            raise CodecError(
                f"fp8 stream has {len(data)} bytes of data, expected {2 * ng + ng * g}"
            )
        if n == 0:
            return
        sc = self._scratch.get("sc", ng, torch.float32)
        sc.copy_(data[: 2 * ng].view(torch.bfloat16))
        q = data[2 * ng :].view(torch.float8_e4m3fn).view(ng, g)
        if out.dtype == torch.float32 and ng * g == n:
            vals = out.view(ng, g)
        else:
            vals = self._scratch.get("y", ng * g, torch.float32).view(ng, g)
        vals.copy_(q)
        vals.mul_(sc[:, None])
        if vals.data_ptr() != out.data_ptr():
            self._finish(out, vals, n)
