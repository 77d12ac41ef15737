"""The ``cachegen`` codec: token groups, deltas against an anchor, bits by layer depth,
entropy coding. The design is described in this distribution's README.

Tensor view. A vLLM CPU chunk ``[L, B, H, N, 2D]`` (layers, blocks, KV heads, block
size, K|V content, K stored transposed inside each block and head) is read as
``X[kv, layer, channel, token]`` with ``channel = head * D + d`` and ``token = block * N
+ n``. Any other tensor is read as one layer of rows over its last dimension (``[1, 1,
rows, last]``), so the codec accepts every float tensor, with CacheGen's structure only
where the layout is known.

Per chunk: tokens are cut into groups of ``group_tokens``; the first token of a group is
its anchor, stored with 8-bit asymmetric quantization per channel; every other token is
stored as its delta from the *decoded* anchor, quantized symmetrically per channel with
``bits[band]`` bits, where the layer's depth band (first, middle, last third of the layers)
picks the entry of ``bits``. Anchor and delta codes are then entropy-coded (``zstd`` or a
``range`` coder, per K/V tensor and layer). Error bound per element: the delta step / 2
(``max|delta| / (2**bits - 2)`` of its channel) plus the rounding to the output dtype;
anchors: their step / 2.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmcache_core.codecs import (
    FRAME_BYTES,
    CodecError,
    Scratch,
    read_frame,
    write_frame,
)

from .entropy import ENTROPY_CODERS, decode_symbols, encode_symbols

__all__ = ["CacheGenCodec"]

_TAG = b"CGEN"
_VERSION = 1
# kv, layers, rows, tokens, group, coder, vllm layout flag, reserved
_HEAD = struct.Struct("<BBHIIIBBH")
_VLLM_CPU = 1


def _bands(layers: int, bits: Sequence[int]) -> list[int]:
    """Bits of each layer: layer ``l`` uses ``bits[l * len(bits) // layers]``."""
    return [bits[(i * len(bits)) // layers] for i in range(layers)]


class CacheGenCodec:
    """CacheGen-style KV compression (codec name ``cachegen``, lossy).

    Options: ``bits`` (delta bits per depth band, shallow to deep, 2-8 each; default
    ``[8, 7, 6]``), ``group_tokens`` (tokens per group, the first one the anchor; 2-256;
    default 16), ``entropy`` (``zstd`` or ``range``), ``level`` (zstd's level).
    """

    name = "cachegen"
    lossless = False

    def __init__(
        self,
        bits: Sequence[int] = (8, 7, 6),
        group_tokens: int = 16,
        entropy: str = "zstd",
        level: int = 3,
    ) -> None:
        bits = list(bits) if not isinstance(bits, str | bytes) else []
        if (
            not bits
            or len(bits) > 8
            or any(isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 8 for b in bits)
        ):
            raise ValueError(
                f"bits must be a list of 1-8 integers 2-8 (shallow to deep layers), not {bits!r}"
            )
        if (
            isinstance(group_tokens, bool)
            or not isinstance(group_tokens, int)
            or not 2 <= group_tokens <= 256
        ):
            raise ValueError(f"group_tokens must be an integer 2-256, not {group_tokens!r}")
        if entropy not in ENTROPY_CODERS:
            raise ValueError(f"entropy must be one of {', '.join(ENTROPY_CODERS)}, not {entropy!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"level must be an integer 1-22, not {level!r}")
        self.bits = bits
        self.group_tokens = group_tokens
        self.entropy = entropy
        self.level = level
        self._scratch = Scratch()

    def options(self) -> dict[str, Any]:
        """The options recorded with every object (``level`` changes only the bytes'
        size, not what decodes: it is left out so levels share a namespace)."""
        return {"bits": list(self.bits), "entropy": self.entropy, "group_tokens": self.group_tokens}

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _geometry(shape: Sequence[int]) -> tuple[int, int, int, int, int]:
        """``(kv, layers, rows, tokens, flag)`` of a tensor of ``shape``."""
        if len(shape) == 5 and shape[4] % 2 == 0 and shape[4] > 0:
            L, B, H, N, C = (int(s) for s in shape)
            return 2, L, H * (C // 2), B * N, _VLLM_CPU
        n = 1
        for s in shape:
            n *= int(s)
        last = int(shape[-1]) if len(shape) else 1
        return 1, 1, (n // last) if last else 0, last, 0

    @staticmethod
    def _kv_views(t: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``t`` (a vLLM CPU chunk) as ``[L, H, D, B, N]`` for K and for V."""
        L, B, H, N, C = t.shape
        D = C // 2
        flat = t.view(L, B, H, N * C)
        k = flat[..., : N * D].view(L, B, H, D, N).permute(0, 2, 3, 1, 4)
        v = flat[..., N * D :].view(L, B, H, N, D).permute(0, 2, 4, 1, 3)
        return [k, v]

    def _gather(
        self, tensor: torch.Tensor, kv: int, L: int, R: int, T: int, Tp: int, flag: int
    ) -> torch.Tensor:
        x = self._scratch.get("x", kv * L * R * Tp, torch.float32).view(kv, L, R, Tp)
        if flag == _VLLM_CPU:
            _, B, H, N, C = tensor.shape
            for i, view in enumerate(self._kv_views(tensor)):
                x[i, :, :, :T].view(L, H, C // 2, B, N).copy_(view)
        else:
            x[0, 0, :, :T].copy_(tensor.reshape(R, T))
        if Tp > T:
            x[..., T:].copy_(x[..., T - 1 : T].expand(kv, L, R, Tp - T))
        return x

    def _scatter(
        self, x: torch.Tensor, out: torch.Tensor, L: int, R: int, T: int, flag: int
    ) -> None:
        if flag == _VLLM_CPU:
            _, B, H, N, C = out.shape
            for i, view in enumerate(self._kv_views(out)):
                view.copy_(x[i, :, :, :T].view(L, H, C // 2, B, N))
        else:
            out.view(R, T).copy_(x[0, 0, :, :T])

    # ------------------------------------------------------------------ encode
    def encode(self, tensor: torch.Tensor) -> memoryview:
        """Compress ``tensor``; the view is valid until this thread's next call."""
        if not torch.is_floating_point(tensor):
            raise CodecError(f"cachegen encodes floating-point KV, not {tensor.dtype}")
        tensor = tensor.contiguous()
        kv, L, R, T, flag = self._geometry(tuple(tensor.shape))
        g = self.group_tokens
        ng = -(-T // g) if T else 0
        Tp = ng * g
        coder = ENTROPY_CODERS.index(self.entropy)
        head = _HEAD.pack(kv, L, 0, R, T, g, coder, flag, 0)
        layer_bits = _bands(L, self.bits)
        nparams = 3 * kv * L * R
        if tensor.numel() == 0:
            return self._finish(tensor, head, layer_bits, torch.empty(0), b"")
        x = self._gather(tensor, kv, L, R, T, Tp, flag)
        if not bool(torch.isfinite(x).all()):
            raise CodecError("cachegen cannot encode non-finite KV values")
        xg = x.view(kv, L, R, ng, g)
        anchors = xg[..., 0]
        params = torch.empty(3, kv, L, R, dtype=torch.float32)
        a_min, a_max = anchors.amin(dim=-1), anchors.amax(dim=-1)
        a_scale = ((a_max - a_min) / 255.0).clamp_min(torch.finfo(torch.float32).tiny)
        qa = anchors.sub(a_min[..., None]).div_(a_scale[..., None]).round_().clamp_(0, 255)
        a_hat = qa * a_scale[..., None] + a_min[..., None]
        deltas = xg[..., 1:] - a_hat[..., None]
        m = torch.tensor([(1 << b - 1) - 1 for b in layer_bits], dtype=torch.float32).view(1, L, 1)
        d_scale = (deltas.abs().amax(dim=(-1, -2)) / m).clamp_min(torch.finfo(torch.float32).tiny)
        qd = deltas.div_(d_scale[..., None, None]).round_().add_(m[..., None, None])
        qd = qd.clamp_(torch.zeros(()), (2 * m)[..., None, None])
        params[0], params[1], params[2] = a_min, a_scale, d_scale
        nsym = kv * L * R * ng * g
        symbols = self._scratch.get("sym", nsym)
        sym_a = symbols[: kv * L * R * ng].view(kv, L, R, ng)
        sym_d = symbols[kv * L * R * ng :].view(kv, L, R, ng, g - 1)
        sym_a.copy_(qa)
        sym_d.copy_(qd)
        payload = encode_symbols(
            symbols.numpy(), self._contexts(kv, L, R, ng, g, layer_bits), self.entropy, self.level
        )
        assert params.numel() == nparams
        return self._finish(tensor, head, layer_bits, params, payload)

    @staticmethod
    def _contexts(
        kv: int, L: int, R: int, ng: int, g: int, layer_bits: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """``(start, stop, alphabet)`` of each entropy context: anchors then deltas of
        each (kv, layer)."""
        ctx: list[tuple[int, int, int]] = []
        na = R * ng
        for i in range(kv * L):
            ctx.append((i * na, (i + 1) * na, 256))
        base = kv * L * na
        nd = R * ng * (g - 1)
        for i in range(kv * L):
            ctx.append(
                (base + i * nd, base + (i + 1) * nd, 2 * ((1 << layer_bits[i % L] - 1) - 1) + 1)
            )
        return ctx

    def _finish(
        self,
        tensor: torch.Tensor,
        head: bytes,
        layer_bits: Sequence[int],
        params: torch.Tensor,
        payload: bytes,
    ) -> memoryview:
        bits_block = bytes(layer_bits) + b"\0" * (-len(layer_bits) % 8)
        pbytes = params.numel() * 4
        nbytes = len(head) + len(bits_block) + pbytes + len(payload)
        stream = self._scratch.get("enc", FRAME_BYTES + nbytes).numpy()
        pos = FRAME_BYTES
        for part in (head, bits_block):
            stream[pos : pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
            pos += len(part)
        if pbytes:
            stream[pos : pos + pbytes] = params.reshape(-1).view(torch.uint8).numpy()
            pos += pbytes
        stream[pos : pos + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        total = write_frame(stream, _TAG, _VERSION, tensor.dtype, tensor.numel(), nbytes)
        return memoryview(stream)[:total]

    # ------------------------------------------------------------------ decode
    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Decode ``buf`` into ``out``; :class:`CodecError` if it cannot."""
        frame = read_frame(buf, _TAG, (_VERSION,), out)
        body = frame.body
        if len(body) < _HEAD.size:
            raise CodecError("cachegen stream is truncated")
        kv, L, _, R, T, g, coder, flag, _ = _HEAD.unpack_from(body, 0)
        if (kv, L, R, T, flag) != self._geometry(tuple(out.shape)):
            raise CodecError("cachegen stream was encoded for a tensor of another shape")
        if (
            coder >= len(ENTROPY_CODERS)
            or ENTROPY_CODERS[coder] != self.entropy
            or g != self.group_tokens
        ):
            raise CodecError("cachegen stream was encoded with other options than this codec's")
        pos = _HEAD.size
        layer_bits = list(body[pos : pos + L])
        pos += L + (-L % 8)
        if layer_bits != _bands(L, self.bits):
            raise CodecError("cachegen stream was encoded with other bits than this codec's")
        if out.numel() == 0:
            if pos != len(body):
                raise CodecError("stream has data for an empty tensor")
            return
        ng = -(-T // g)
        Tp = ng * g
        pbytes = 3 * kv * L * R * 4
        if pos + pbytes > len(body):
            raise CodecError("cachegen stream is truncated")
        params = self._scratch.get("params", 3 * kv * L * R, torch.float32)
        params.view(torch.uint8).numpy()[:] = body[pos : pos + pbytes]
        pos += pbytes
        params = params.view(3, kv, L, R)
        nsym = kv * L * R * ng * g
        symbols = self._scratch.get("sym", nsym)
        decode_symbols(
            body[pos:], symbols.numpy(), self._contexts(kv, L, R, ng, g, layer_bits), self.entropy
        )
        sym_a = symbols[: kv * L * R * ng].view(kv, L, R, ng)
        sym_d = symbols[kv * L * R * ng :].view(kv, L, R, ng, g - 1)
        x = self._scratch.get("x", kv * L * R * Tp, torch.float32).view(kv, L, R, ng, g)
        m = self._scratch.get("m", L, torch.float32)
        for i, b in enumerate(layer_bits):
            m[i] = (1 << b - 1) - 1
        # copy_ converts the codes in its loop; in-place ops then allocate nothing
        anchors = x[..., 0]
        anchors.copy_(sym_a)
        anchors.mul_(params[1][..., None]).add_(params[0][..., None])
        rest = x[..., 1:]
        rest.copy_(sym_d)
        rest.sub_(m.view(1, L, 1, 1, 1)).mul_(params[2][..., None, None]).add_(anchors[..., None])
        self._scatter(x.view(kv, L, R, Tp), out, L, R, T, flag)
