"""``memory.copy_tensor``: one ``memmove`` for contiguous host tensors of one dtype and
shape, torch's ``copy_`` for everything else, and the same bytes either way."""

from __future__ import annotations

import pytest
import torch

from lmcache_core import memory


@pytest.fixture
def memmoves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Byte counts of the ``memmove`` calls ``copy_tensor`` makes (the real copy still runs)."""
    calls: list[int] = []
    real = memory._memmove

    def counting(dst: int, src: int, n: int) -> int:
        calls.append(n)
        return int(real(dst, src, n))

    monkeypatch.setattr(memory, "_memmove", counting)
    return calls


def test_contiguous_host_tensors_take_one_memmove(memmoves: list[int]) -> None:
    src = torch.randn(3, 5, 7, dtype=torch.float32)
    dst = torch.zeros_like(src)
    memory.copy_tensor(dst, src)
    assert torch.equal(dst, src)
    assert memmoves == [src.nbytes]


def test_inference_tensors_are_copied_outside_inference_mode(memmoves: list[int]) -> None:
    # vLLM's KV buffers are inference tensors: a plain in-place copy_ into one raises
    with torch.inference_mode():
        dst = torch.zeros(64, dtype=torch.bfloat16)
    src = torch.randn(64).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        dst.copy_(src)
    memory.copy_tensor(dst, src)
    assert torch.equal(dst, src) and memmoves == [dst.nbytes]
    strided = src.view(8, 8).t()  # the fallback runs in inference mode too
    memory.copy_tensor(dst.view(8, 8), strided)
    assert torch.equal(dst.view(8, 8), strided) and len(memmoves) == 1


def test_views_conversions_and_broadcasts_use_torch(memmoves: list[int]) -> None:
    base = torch.arange(48, dtype=torch.float32).view(6, 8)
    # a strided destination: the bytes must land element by element, not in a row
    dst = torch.zeros(8, 6, dtype=torch.float32).t()
    memory.copy_tensor(dst, base)
    assert torch.equal(dst, base)
    # another dtype of the same byte size: a conversion, never a reinterpretation
    as_int = torch.zeros(6, 8, dtype=torch.int32)
    memory.copy_tensor(as_int, base)
    assert torch.equal(as_int, base.to(torch.int32))
    # another shape (a broadcast)
    row = torch.zeros(6, 8, dtype=torch.float32)
    memory.copy_tensor(row, base[0])
    assert torch.equal(row, base[0].expand(6, 8))
    assert memmoves == []


def test_empty_tensors_copy_nothing(memmoves: list[int]) -> None:
    memory.copy_tensor(torch.empty(0), torch.empty(0))
    assert memmoves == []
