"""The ``cachegen`` codec: per-channel quantization with bits by layer depth, token groups
coded against an anchor where that pays, entropy coding. The design is described in this
distribution's README.

Tensor view. A vLLM CPU chunk ``[L, B, H, N, 2D]`` (layers, blocks, KV heads, block
size, K|V content, K stored transposed inside each block and head) is read as
``X[kv, layer, channel, token]`` with ``channel = head * D + d`` and ``token = block * N
+ n``. Any other tensor is read as one layer of rows over its last dimension (``[1, 1,
rows, last]``), so the codec accepts every float tensor, with CacheGen's structure only
where the layout is known.

Per chunk: every channel of every K/V tensor of every layer is quantized over the chunk's
tokens with ``2**bits - 1`` levels (asymmetric: a minimum and a step per channel, float16
-- float32 when a value is beyond float16's range -- the minimum rounded down and the
step up, so the stored grid covers every value), where the layer's depth band picks the
entry of ``bits``. Tokens are cut into groups of ``group_tokens``; the first token of a
group is its anchor. Per K or V tensor of each layer, the codes of the other tokens are
stored either as they are or as their difference from the anchor's code (modulo
``2**bits``: exact, so the anchor scheme never changes the error); ``anchor: auto``
picks, per tensor and chunk, whichever has the smaller empirical entropy. The codes are
then entropy-coded (``zstd`` or a ``range`` coder, one context per tensor and layer).
Error bound per element: half the step of its channel, ``(max - min) / (2**bits - 1) /
2`` (a little more from the float16 rounding of minimum and step), plus the rounding to
the output dtype.
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

__all__ = ["ANCHOR_SCHEMES", "CacheGenCodec"]

_TAG = b"CGEN"
_VERSION = 2
# kv, layers, rows, tokens, group, coder, vllm layout flag, parameter flags
_HEAD = struct.Struct("<BBHIIIBBH")
_VLLM_CPU = 1
_F32_PARAMS = 1
#: How the codes of a token group's other tokens are stored (see the module docstring).
ANCHOR_SCHEMES = ("auto", "first", "none")
_DIRECT, _DELTA = 0, 1
_F16_LIMIT = 60000.0


def _bands(layers: int, bits: Sequence[int]) -> list[int]:
    """Bits of each layer: layer ``l`` uses ``bits[l * len(bits) // layers]``."""
    return [bits[(i * len(bits)) // layers] for i in range(layers)]


def _entropy_bits(counts: np.ndarray[Any, Any]) -> float:
    """Total bits of an order-0 code of symbols with these counts."""
    c = counts[counts > 0].astype(np.float64)
    n = c.sum()
    return float(-(c * np.log2(c / n)).sum()) if n else 0.0


class CacheGenCodec:
    """CacheGen-style KV compression (codec name ``cachegen``, lossy).

    Options: ``bits`` (quantization bits per depth band, shallow to deep, 2-8 each;
    default ``[8]``), ``group_tokens`` (tokens per group, the first one the anchor;
    2-256; default 16), ``anchor`` (``auto``, ``first``: always code against the anchor,
    ``none``: never; default ``auto``), ``entropy`` (``zstd`` or ``range``), ``level``
    (zstd's level).
    """

    name = "cachegen"
    lossless = False

    def __init__(
        self,
        bits: Sequence[int] = (8,),
        group_tokens: int = 16,
        anchor: str = "auto",
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
        if anchor not in ANCHOR_SCHEMES:
            raise ValueError(f"anchor must be one of {', '.join(ANCHOR_SCHEMES)}, not {anchor!r}")
        if entropy not in ENTROPY_CODERS:
            raise ValueError(f"entropy must be one of {', '.join(ENTROPY_CODERS)}, not {entropy!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(f"level must be an integer 1-22, not {level!r}")
        self.bits = bits
        self.group_tokens = group_tokens
        self.anchor = anchor
        self.entropy = entropy
        self.level = level
        self._scratch = Scratch()

    def options(self) -> dict[str, Any]:
        """The options recorded with every object (``level`` changes only the bytes'
        size, not what decodes: it is left out so levels share a namespace; ``anchor``
        likewise, each stream records its choice, but it is kept: it is a setting worth
        seeing in a namespace)."""
        return {
            "anchor": self.anchor,
            "bits": list(self.bits),
            "entropy": self.entropy,
            "group_tokens": self.group_tokens,
        }

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
        self, tensor: torch.Tensor, kv: int, L: int, R: int, T: int, flag: int
    ) -> torch.Tensor:
        x = self._scratch.get("x", kv * L * R * T, torch.float32).view(kv, L, R, T)
        if flag == _VLLM_CPU:
            _, B, H, N, C = tensor.shape
            for i, view in enumerate(self._kv_views(tensor)):
                x[i].view(L, H, C // 2, B, N).copy_(view)
        else:
            x[0, 0].copy_(tensor.reshape(R, T))
        return x

    def _scatter(
        self, x: torch.Tensor, out: torch.Tensor, L: int, R: int, T: int, flag: int
    ) -> None:
        if flag == _VLLM_CPU:
            _, B, H, N, C = out.shape
            for i, view in enumerate(self._kv_views(out)):
                view.copy_(x[i].view(L, H, C // 2, B, N))
        else:
            out.view(R, T).copy_(x[0, 0])

    @staticmethod
    def _contexts(
        kv: int, L: int, R: int, ng: int, g: int, layer_bits: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """``(start, stop, alphabet)`` of each entropy context: the codes of one K or V
        tensor of one layer (anchors first, then the other tokens)."""
        per = R * ng * g
        return [(i * per, (i + 1) * per, 1 << layer_bits[i % L]) for i in range(kv * L)]

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
        layer_bits = _bands(L, self.bits)
        if tensor.numel() == 0:
            head = _HEAD.pack(kv, L, 0, R, T, g, coder, flag, 0)
            return self._finish(tensor, head, layer_bits, b"", torch.empty(0), b"")
        x = self._gather(tensor, kv, L, R, T, flag)
        if not bool(torch.isfinite(x).all()):
            raise CodecError("cachegen cannot encode non-finite KV values")
        mn, mx = x.amin(dim=-1), x.amax(dim=-1)  # [kv, L, R]
        pflags = 0
        pdtype = torch.float16
        if float(mn.abs().max()) > _F16_LIMIT or float(mx.abs().max()) > _F16_LIMIT:
            pdtype, pflags = torch.float32, _F32_PARAMS
        # the minimum rounded down and the step up: the stored grid covers every value
        mn_p = mn.to(pdtype)
        over = mn_p.float() > mn
        if bool(over.any()):
            mn_p = torch.where(over, torch.nextafter(mn_p, torch.full_like(mn_p, -np.inf)), mn_p)
        mn32 = mn_p.float()
        levels = torch.tensor([(1 << b) - 1 for b in layer_bits], dtype=torch.float32)
        step = (mx - mn32).clamp_min(0) / levels.view(1, L, 1)
        st_p = step.to(pdtype)
        low = st_p.float() < step
        if bool(low.any()):
            st_p = torch.where(low, torch.nextafter(st_p, torch.full_like(st_p, np.inf)), st_p)
        st_p = torch.where(st_p > 0, st_p, torch.ones_like(st_p))
        st32 = st_p.float()
        q = self._scratch.get("q", kv * L * R * Tp).view(kv, L, R, ng, g)
        qf = x.sub(mn32[..., None]).div_(st32[..., None]).round_()
        qf = torch.minimum(qf, levels.view(1, L, 1, 1)).clamp_(min=0)
        qt = q.view(kv, L, R, Tp)
        qt[..., :T].copy_(qf)
        if Tp > T:  # padding repeats the last token (codes only: never decoded out)
            qt[..., T:].copy_(qt[..., T - 1 : T].expand(kv, L, R, Tp - T))
        symbols = self._scratch.get("sym", kv * L * R * Tp).view(kv, L, R * Tp)
        modes = bytearray(kv * L)
        for k in range(kv):
            for lay in range(L):
                modes[k * L + lay] = self._code_context(
                    q[k, lay], symbols[k, lay], layer_bits[lay], ng, g
                )
        payload = encode_symbols(
            symbols.view(-1).numpy(),
            self._contexts(kv, L, R, ng, g, layer_bits),
            self.entropy,
            self.level,
        )
        params = torch.stack([mn_p, st_p]).to(pdtype)
        head = _HEAD.pack(kv, L, 0, R, T, g, coder, flag, pflags)
        return self._finish(tensor, head, layer_bits, bytes(modes), params, payload)

    def _code_context(self, q: torch.Tensor, out: torch.Tensor, bits: int, ng: int, g: int) -> int:
        """Write one tensor's codes ``q`` (``[R, ng, g]``) into ``out``: the anchors
        (``[R, ng]``), then the other tokens (``[R, ng, g - 1]``) as they are or against
        their anchor; return the mode chosen."""
        R = q.shape[0]
        anchors = out[: R * ng].view(R, ng)
        rest = out[R * ng :].view(R, ng, g - 1)
        anchors.copy_(q[..., 0])
        rest.copy_(q[..., 1:])
        if self.anchor == "none" or g < 2:
            return _DIRECT
        mask = (1 << bits) - 1
        delta = self._scratch.get("delta", R * ng * (g - 1)).view(R, ng, g - 1)
        torch.sub(q[..., 1:], q[..., :1], out=delta)  # uint8 arithmetic wraps modulo 256
        delta.bitwise_and_(mask)
        if self.anchor == "auto":
            alphabet = 1 << bits
            direct = np.bincount(rest.reshape(-1).numpy(), minlength=alphabet)
            coded = np.bincount(delta.view(-1).numpy(), minlength=alphabet)
            if _entropy_bits(coded) >= _entropy_bits(direct):
                return _DIRECT
        rest.copy_(delta)
        return _DELTA

    def _finish(
        self,
        tensor: torch.Tensor,
        head: bytes,
        layer_bits: Sequence[int],
        modes: bytes,
        params: torch.Tensor,
        payload: bytes,
    ) -> memoryview:
        bits_block = bytes(layer_bits) + b"\0" * (-len(layer_bits) % 8)
        modes_block = modes + b"\0" * (-len(modes) % 8)
        pbytes = params.numel() * params.element_size()
        nbytes = len(head) + len(bits_block) + len(modes_block) + pbytes + len(payload)
        stream = self._scratch.get("enc", FRAME_BYTES + nbytes).numpy()
        pos = FRAME_BYTES
        for part in (head, bits_block, modes_block):
            stream[pos : pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
            pos += len(part)
        if pbytes:
            stream[pos : pos + pbytes] = params.reshape(-1).view(torch.uint8).numpy()
            pos += pbytes
        stream[pos : pos + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        total = write_frame(stream, _TAG, _VERSION, tensor.dtype, tensor.numel(), nbytes)
        return stream.data[:total]

    # ------------------------------------------------------------------ decode
    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Decode ``buf`` into ``out``; :class:`CodecError` if it cannot."""
        frame = read_frame(buf, _TAG, (_VERSION,), out)
        body = frame.body
        if len(body) < _HEAD.size:
            raise CodecError("cachegen stream is truncated")
        kv, L, _, R, T, g, coder, flag, pflags = _HEAD.unpack_from(body, 0)
        if (kv, L, R, T, flag) != self._geometry(tuple(out.shape)):
            raise CodecError("cachegen stream was encoded for a tensor of another shape")
        if (
            coder >= len(ENTROPY_CODERS)
            or ENTROPY_CODERS[coder] != self.entropy
            or g != self.group_tokens
            or pflags & ~_F32_PARAMS
        ):
            raise CodecError("cachegen stream was encoded with other options than this codec's")
        pos = _HEAD.size
        if pos + L + (-L % 8) > len(body):
            raise CodecError("cachegen stream is truncated")
        layer_bits = list(body[pos : pos + L])
        pos += L + (-L % 8)
        if layer_bits != _bands(L, self.bits):
            raise CodecError("cachegen stream was encoded with other bits than this codec's")
        nmodes = kv * L if out.numel() else 0
        modes = bytes(body[pos : pos + nmodes])
        pos += nmodes + (-nmodes % 8)
        if out.numel() == 0:
            if pos != len(body):
                raise CodecError("stream has data for an empty tensor")
            return
        if len(modes) != nmodes or any(m not in (_DIRECT, _DELTA) for m in modes):
            raise CodecError("cachegen stream has a damaged anchor table")
        if (self.anchor == "none" and _DELTA in modes) or (
            self.anchor == "first" and _DIRECT in modes
        ):
            raise CodecError("cachegen stream was encoded with another anchor scheme")
        ng = -(-T // g)
        Tp = ng * g
        pdtype = torch.float32 if pflags & _F32_PARAMS else torch.float16
        psize = 4 if pflags & _F32_PARAMS else 2
        pbytes = 2 * kv * L * R * psize
        if pos + pbytes > len(body):
            raise CodecError("cachegen stream is truncated")
        raw = self._scratch.get("params", pbytes)
        raw.numpy()[:] = body[pos : pos + pbytes]
        pos += pbytes
        params = self._scratch.get("p32", 2 * kv * L * R, torch.float32).view(2, kv, L, R)
        params.copy_(raw.view(pdtype).view(2, kv, L, R))
        symbols = self._scratch.get("sym", kv * L * R * Tp)
        decode_symbols(
            body[pos:],
            symbols.numpy(),
            self._contexts(kv, L, R, ng, g, layer_bits),
            self.entropy,
        )
        sym = symbols.view(kv, L, R * Tp)
        for i, mode in enumerate(modes):
            k, lay = divmod(i, L)
            if mode == _DELTA:
                ctx = sym[k, lay]
                anchors = ctx[: R * ng].view(R, ng, 1)
                rest = ctx[R * ng :].view(R, ng, g - 1)
                rest.add_(anchors).bitwise_and_((1 << layer_bits[lay]) - 1)
        x = self._scratch.get("x", kv * L * R * Tp, torch.float32).view(kv, L, R, ng, g)
        # codes back in token order: anchors [R, ng] -> token 0 of each group
        for k in range(kv):
            for lay in range(L):
                ctx = sym[k, lay]
                xs = x[k, lay]
                xs[..., 0].copy_(ctx[: R * ng].view(R, ng))
                xs[..., 1:].copy_(ctx[R * ng :].view(R, ng, g - 1))
        x.mul_(params[1][..., None, None]).add_(params[0][..., None, None])
        self._scatter_padded(x.view(kv, L, R, Tp), out, L, R, T, Tp, flag)

    def _scatter_padded(
        self, x: torch.Tensor, out: torch.Tensor, L: int, R: int, T: int, Tp: int, flag: int
    ) -> None:
        if Tp == T:
            self._scatter(x, out, L, R, T, flag)
            return
        kv = x.shape[0]
        tight = self._scratch.get("tight", kv * L * R * T, torch.float32).view(kv, L, R, T)
        tight.copy_(x[..., :T])
        self._scatter(tight, out, L, R, T, flag)
