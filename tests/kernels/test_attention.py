"""The fused causal attention (`kernels/attention_triton.py`, `kernels/attention.py`).

Against `attention.reference` (torch ops, the same roundings, plain softmax) to rounding; bitwise against itself
where its docstring promises it: a token's output is the same alone or next to other sequences, in a prefill of
its whole sequence or a one-token decode step, with its keys in a cache slot or in the packed row (the trainer's
layout). CPU: the Triton interpreter (triton_setup); with CUDA, the compiled kernel.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch

from rl4bit.kernels import fused
from rl4bit.kernels.attention import attend, fused_attention_ok, reference
from rl4bit.kernels.attention_triton import BLOCK_M, attention, cache_write, seq_table, split_counters, tile_table


def _packed(lengths, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths) + 3  # three rows no sequence covers
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    return q, k, v


def _groups(lengths):
    by_len, at = {}, 0
    for n in lengths:
        by_len.setdefault(n, []).append(at)
        at += n
    return [(n, (torch.tensor(firsts)[:, None] + torch.arange(n)[None, :]).to(DEVICE)) for n, firsts in by_len.items()]


def _packed_tables(lengths, hq, hkv):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return (seq_table(starts, lengths, [0] * len(lengths), starts, DEVICE),
            tile_table(lengths, hq // hkv, DEVICE))


def _run_packed(q, k, v, lengths, dtype, scaling=0.25):
    seqs, tiles = _packed_tables(lengths, q.shape[1], k.shape[1])
    return attend(q, k, v, seqs, tiles, scaling, dtype, groups=_groups(lengths))


@pytest.mark.parametrize("dtype,compute,hq,hkv,d", [
    (torch.float32, torch.float32, 4, 2, 16),
    (torch.float32, torch.bfloat16, 8, 2, 24),   # FP32 q/k (qk-norm) under BF16 autocast; head dim not a power of 2
    (torch.bfloat16, torch.bfloat16, 4, 4, 32),
    (torch.float16, torch.float16, 2, 1, 160),    # head dim > 128: the narrower key block
])
def test_matches_the_torch_formula(dtype, compute, hq, hkv, d):
    lengths = [5, 1, 70, 5, 17]  # 70 keys: two key blocks; 17 tokens x g heads: several row tiles
    q, k, v = _packed(lengths, hq, hkv, d, dtype)
    got = _run_packed(q, k, v, lengths, compute)
    want = reference(q, k, v, _groups(lengths), 0.25, compute)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[compute]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))  # uncovered rows stay zero
    assert got.dtype == q.dtype


def test_a_sequence_is_the_same_bits_alone_and_next_to_others():
    lengths = [9, 33, 2, 40]
    q, k, v = _packed(lengths, 8, 2, 16, torch.float32, seed=1)
    together = _run_packed(q, k, v, lengths, torch.bfloat16)
    at = 0
    for n in lengths:
        alone = _run_packed(q[at:at + n].clone(), k[at:at + n].clone(), v[at:at + n].clone(), [n], torch.bfloat16)
        assert torch.equal(alone[:n], together[at:at + n])
        at += n


def test_decode_steps_over_a_cache_equal_the_prefill_and_the_packed_row():
    """One sequence of 70 tokens: its keys in cache slot 2 of 4 (other slots hold noise), attended as a prefill
    in two chunks (5 tokens, then 65 from position 5: row tiles straddle the 64-key block edge), as 70
    one-token decode steps (each next to another sequence's step), and in the packed row."""
    n, hq, hkv, d, max_len = 70, 8, 2, 16, 80
    q, k, v = _packed([n], hq, hkv, d, torch.float32, seed=2)
    q, k, v = q[:n], k[:n], v[:n]
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(4, hkv, max_len, d, generator=g).to(torch.bfloat16).to(DEVICE)
    vc = torch.randn(4, hkv, max_len, d, generator=g).to(torch.bfloat16).to(DEVICE)
    kc[2, :, :n], vc[2, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
    c, slot2 = torch.bfloat16, 2 * hkv * max_len  # slot 2's first row, in position strides
    packed = _run_packed(q, k, v, [n], c)
    chunks = attend(q, kc, vc, seq_table([0, 5], [5, n - 5], [0, 5], [slot2, slot2], DEVICE),
                    tile_table([5, n - 5], hq // hkv, DEVICE), 0.25, c, covered=True)
    assert torch.equal(chunks, packed)
    for t in range(n):  # row 0: the sequence's token t; row 1: a neighbour at position 75 of slot 1
        qs = torch.stack([q[t], q[(t + 5) % n]])
        seqs = seq_table([0, 1], [1, 1], [t, 75], [slot2, 1 * hkv * max_len], DEVICE)
        step = attend(qs, kc, vc, seqs, tile_table([1, 1], hq // hkv, DEVICE), 0.25, c, covered=True)
        assert torch.equal(step[0], packed[t]), t


def test_long_rows_split_over_key_chunks_equal_the_unsplit_kernel():
    """Rows whose keys span several KEY_CHUNKs (positions up to 300): one-token decode steps split over key
    chunks (`key_chunks`, the engine's decode path) equal the unsplit kernel and the packed row bitwise, and the
    packed row matches the torch formula; a split larger than needed changes nothing."""
    n, hq, hkv, d, max_len = 300, 4, 2, 16, 320
    q, k, v = _packed([n], hq, hkv, d, torch.float32, seed=12)
    q, k, v = q[:n], k[:n], v[:n]
    c = torch.bfloat16
    packed = _run_packed(q, k, v, [n], c)
    torch.testing.assert_close(packed.float(), reference(q, k, v, _groups([n]), 0.25, c).float(), atol=2e-2,
                               rtol=2e-2)
    kc = torch.zeros(2, hkv, max_len, d, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kc[1, :, :n], vc[1, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
    slot1 = hkv * max_len
    counters = split_counters(1, hkv, DEVICE)  # shared by the calls below, as a decode step's layers share one
    for t in (0, 127, 128, 129, 200, 255, 256, 299):
        seqs = seq_table([0], [1], [t], [slot1], DEVICE)
        tiles = tile_table([1], hq // hkv, DEVICE)
        whole = attend(q[t:t + 1], kc, vc, seqs, tiles, 0.25, c, covered=True)
        assert torch.equal(whole[0], packed[t]), t
        for chunks in (-(-max_len // 128), 7):
            for shared in (None, counters):
                split = attention(q[t:t + 1].contiguous(), kc, vc, seqs, tiles, 0.25, c,
                                  torch.empty_like(q[t:t + 1]), key_chunks=chunks, counters=shared)
                assert torch.equal(split[0], packed[t]), (t, chunks)
                assert not counters.any(), (t, chunks)  # every call leaves them zero for the next
    with pytest.raises(ValueError, match="counters torch.int64"):
        attention(q[299:].contiguous(), kc, vc, seqs, tiles, 0.25, c, torch.empty_like(q[299:]), key_chunks=3,
                  counters=counters.long())
    with pytest.raises(ValueError, match=r"contiguous int32 zeros"):
        attention(q[299:].contiguous(), kc, vc, seqs, tiles, 0.25, c, torch.empty_like(q[299:]), key_chunks=3,
                  counters=split_counters(2, hkv, DEVICE)[::2])
    with pytest.raises(ValueError, match=r"at least 1 tiles x 2 kv heads"):
        attention(q[299:].contiguous(), kc, vc, seqs, tiles, 0.25, c, torch.empty_like(q[299:]), key_chunks=3,
                  counters=counters[:1])
    seqs, tiles = seq_table([0], [1], [299], [slot1], DEVICE), tile_table([1], hq // hkv, DEVICE)
    with pytest.raises(ValueError, match="key_chunks 2 must be 0 or cover the 320 key positions"):
        attention(q[299:].contiguous(), kc, vc, seqs, tiles, 0.25, c, torch.empty_like(q[299:]), key_chunks=2)
    import rl4bit.kernels.attention_triton as at

    budget = at.SPLIT_MAX_BYTES
    try:  # past the states' byte budget the call runs unsplit: the same bits
        at.SPLIT_MAX_BYTES = 1
        over = attention(q[299:].contiguous(), kc, vc, seqs, tiles, 0.25, c, torch.empty_like(q[299:]), key_chunks=3)
    finally:
        at.SPLIT_MAX_BYTES = budget
    assert torch.equal(over[0], packed[299])


def test_gradients_are_the_torch_formulas():
    lengths = [6, 19, 6]
    q, k, v = (x.requires_grad_() for x in _packed(lengths, 4, 2, 16, torch.float32, seed=4))
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = _run_packed(q, k, v, lengths, torch.bfloat16)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    want = torch.autograd.grad((reference(q, k, v, _groups(lengths), 0.25, torch.bfloat16) * weight).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert all(a.abs().sum() > 0 for a in got)


def test_frozen_keys_and_values_get_no_gradient():
    lengths = [4, 7]
    q, k, v = _packed(lengths, 4, 2, 16, torch.float32, seed=6)
    q.requires_grad_()
    (dq,) = torch.autograd.grad(_run_packed(q, k, v, lengths, torch.float32).sum(), (q,))
    assert dq.shape == q.shape and torch.isfinite(dq).all()


def test_bad_shapes_raise():
    q, k, v = _packed([4], 6, 4, 16, torch.float32)  # 6 query heads over 4 kv heads
    seqs, tiles = _packed_tables([4], 6, 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention(q, k.transpose(0, 1), v.transpose(0, 1), seqs, tiles, 1.0, torch.float32, torch.zeros_like(q))
    q, k, v = _packed([4], 4, 2, 512, torch.float32)
    with pytest.raises(ValueError, match="head dim 512"):
        attention(q, k.transpose(0, 1), v.transpose(0, 1), seqs, tiles, 1.0, torch.float32, torch.zeros_like(q))
    q, k, v = _packed([4], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="same strides"):  # one kv_base serves both
        attention(q, k.transpose(0, 1), v.transpose(0, 1).contiguous(), seqs, tiles, 1.0, torch.float32,
                  torch.zeros_like(q))


def test_unsupported_calls_fall_back_instead_of_raising():
    """The callers' gate: what `attention` would refuse goes to their torch path."""
    q, k = torch.zeros(1, 6, 3, 16, device=DEVICE), torch.zeros(1, 2, 3, 16, device=DEVICE)
    saved = fused.state()
    fused.set_enabled(True, q.device.type)
    try:
        assert fused_attention_ok(q, k, k, torch.bfloat16) and fused_attention_ok(q.half(), k, k, torch.float32)
        six_over_four = k[:, :1].expand(1, 4, 3, 16)
        assert not fused_attention_ok(q, six_over_four, six_over_four, torch.float32)
        assert not fused_attention_ok(q, k, k, torch.float64)
        assert not fused_attention_ok(q.double(), k.double(), k.double(), torch.float32)
        assert not fused_attention_ok(q, k[..., :8], k[..., :8], torch.float32)  # head dims disagree
        assert not fused_attention_ok(q, k, k[..., :8], torch.float32)  # values' head dim
        assert not fused_attention_ok(q, k, k[:, :1], torch.float32)  # values' head count
        wide = torch.zeros(1, 2, 3, 512, device=DEVICE)
        assert not fused_attention_ok(wide, wide, wide, torch.float32)
        fused.set_enabled(False)
        assert not fused_attention_ok(q, k, k, torch.bfloat16)
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")


def test_tile_table_covers_every_row_once():
    tiles = tile_table([1, 5, 9], 4, "cpu")
    rows = {(int(s), int(r0) + i) for s, r0 in tiles.T for i in range(BLOCK_M) if int(r0) + i < [1, 5, 9][s] * 4}
    assert rows == {(s, r) for s, n in enumerate([1, 5, 9]) for r in range(n * 4)}


def test_cache_write_is_torchs_index_write():
    """FP32 keys rounded into a BF16 cache (ties to even, -0.0, NaN), and BF16 into BF16, at scattered slots:
    torch's index write on the same device, bit for bit (a NaN stays NaN; its payload is the conversion's)."""
    g = torch.Generator().manual_seed(7)
    key = torch.randn(5, 2, 24, 3, generator=g)[..., 0].to(DEVICE)  # last dim not contiguous: copied first
    value = torch.randn(5, 2, 24, generator=g).to(DEVICE)
    key[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), -0.0])  # ties, NaN, -0
    slot, pos = torch.tensor([3, 0, 3, 1, 2]).to(DEVICE), torch.tensor([0, 7, 9, 2, 31]).to(DEVICE)
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        want_k, want_v = (torch.zeros(4, 2, 32, 24, dtype=dtype, device=DEVICE) for _ in range(2))
        want_k[slot, :, pos], want_v[slot, :, pos] = key.to(dtype), value.to(dtype)
        kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
        cache_write(key, value, kc, vc, slot, pos)
        nan = want_k.isnan()
        assert nan.sum() == 1 and torch.equal(kc.isnan(), nan)
        assert torch.equal(kc.view(bits)[~nan], want_k.view(bits)[~nan])
        assert torch.equal(vc.view(bits), want_v.view(bits))


@pytest.mark.parametrize("g", [4, 16, 20, 33])  # above BLOCK_M query heads a kv head: several tiles a token
def test_decode_graph_tables_are_the_host_tables(g):
    """`DecodeLayout.attention_tables` (device ops, CUDA-graph safe) = `StepLayout.attention_tables` (host lists)
    for a decode step: the same sequences, key rows and tiles."""
    from rl4bit.sampler.decode_graph import DecodeLayout
    from rl4bit.sampler.kv_cache import KVCache, StepLayout

    cache = KVCache(1, 5, 2, 24, 16, torch.float32, DEVICE)
    slots, pos = [3, 0, 4], [7, 0, 23]
    fields = dict(cache=cache, slots=slots, spans=[(0, 1), (1, 2), (2, 3)], starts=pos,
                  token_slot=torch.tensor(slots, device=DEVICE), token_pos=torch.tensor(pos, device=DEVICE))
    host, dev = StepLayout(**fields).attention_tables(g, DEVICE), DecodeLayout(**fields).attention_tables(g, DEVICE)
    assert torch.equal(host[0].cpu(), dev[0].cpu()) and torch.equal(host[1].cpu(), dev[1].cpu())
    assert host[0][3].tolist() == [s * 2 * 24 for s in slots]  # a slot's first row: slot x kv heads x max_len


def test_sweep_attention_script_checks_split_against_unsplit_bits():
    """`scripts/sweep_attention.py --quick` (the split-vs-unsplit timing the engine's SPLIT_MAX_ROWS is chosen
    from) runs its cases, finds every split output bitwise equal to the unsplit one, and exits 0."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-P", str(root / "scripts" / "sweep_attention.py"), "--device", DEVICE,
                          "--quick"], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    table = [line.split() for line in run.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(table) == 6 and all(row[-1] == "True" for row in table), run.stdout
