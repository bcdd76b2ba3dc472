"""The memory reports read allocator snapshots right: graph pools apart, live blocks grouped by rl4bit call site.

Synthetic snapshots in `torch.cuda.memory._snapshot()`'s layout (the CPU has no allocator to snapshot); the
GPU test `tests/sampler/test_decode_graph.py::test_cuda_graphs_equal_op_by_op` checks a real one.
"""

from __future__ import annotations

from rl4bit.bench.step import memory_sites
from rl4bit.metrics import private_pool_bytes


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def _block(size: int, state: str, *frames) -> dict:
    return {"size": size, "state": state, "frames": list(frames)}


TORCH = _frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 10, "forward")
KV = _frame("/work/main/sampler/kv_cache.py", 40, "__init__")
ADAM = _frame("/work/main/trainer/optim.py", 7, "step")
GRAPH = _frame("/work/main/sampler/decode_graph.py", 99, "capture")

SNAPSHOT = {"segments": [
    {"device": 0, "segment_pool_id": (0, 0), "total_size": 10 * 2**30, "allocated_size": 7 * 2**30, "blocks": [
        _block(4 * 2**30, "active_allocated", TORCH, KV),   # innermost own frame wins over torch's
        _block(2 * 2**30, "active_allocated", ADAM),
        _block(1 * 2**30, "active_allocated", KV),
        _block(3 * 2**30, "inactive", ADAM),              # cached, not live: not counted
    ]},
    {"device": 0, "segment_pool_id": (1, 7), "total_size": 3 * 2**30, "allocated_size": 2**29, "blocks": [
        _block(2**29, "active_allocated", GRAPH),
        _block(3 * 2**29, "inactive", GRAPH),
    ]},
]}


def test_private_pool_bytes_counts_what_graph_pools_reserve():
    assert private_pool_bytes(SNAPSHOT["segments"]) == 3 * 2**30
    assert private_pool_bytes(SNAPSHOT["segments"], device=0) == 3 * 2**30
    assert private_pool_bytes(SNAPSHOT["segments"], device=1) == 0  # another GPU's pools are not this one's
    assert private_pool_bytes(SNAPSHOT["segments"][:1]) == 0


def test_memory_sites_groups_live_blocks_by_own_call_site():
    sites = memory_sites(SNAPSHOT, top=2)
    assert sites == [("kv_cache.py:40 __init__", 5.0), ("optim.py:7 step", 2.0)]
    assert ("decode_graph.py:99 capture [graph pool]", 0.5) in memory_sites(SNAPSHOT, top=10)
