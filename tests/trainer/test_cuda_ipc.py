"""CUDA IPC descriptions (`rl4bit.trainer.cuda_ipc`): plain data that another process opens as views of the
owner's device memory (GPU only), and a clear refusal of CPU tensors (everywhere)."""

import base64
import json
import subprocess
import sys

import pytest
import torch

from rl4bit.trainer.cuda_ipc import open_shared, share


def test_cpu_tensors_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="w: CUDA IPC shares CUDA tensors only"):
        share({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="not a CUDA IPC description"):
        open_shared({"w": {"size": [3]}})


CHILD = r"""
import base64, json, sys, torch
from rl4bit.trainer.cuda_ipc import open_shared
d = json.loads(sys.stdin.read())
for v in d.values():
    for k in ("handle", "ref_counter_handle", "event_handle"):
        v[k] = base64.b64decode(v[k]) if v[k] is not None else None
t = open_shared(d)
print(json.dumps({k: [str(x.dtype), list(x.shape), float(x.float().sum())] for k, x in t.items()}))
t["a"].add_(1)  # the owner sees it: a view of its memory, not a copy
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_another_process_opens_views_of_the_owners_memory():
    a = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    b = torch.full((5,), 7, dtype=torch.uint8, device="cuda")
    shared = share({"a": a, "b": b[1:]})  # an offset view too
    for v in shared.values():  # what a JSON channel needs; msgspec / Ray carry bytes as they are
        for k in ("handle", "ref_counter_handle", "event_handle"):
            v[k] = base64.b64encode(v[k]).decode() if v[k] is not None else None
    # -P: from the repository root, its rl4bit/ and kernels/ folders would shadow the installed packages
    r = subprocess.run([sys.executable, "-P", "-c", CHILD], input=json.dumps(shared), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {"a": ["torch.float32", [3, 4], 66.0], "b": ["torch.uint8", [4], 28.0]}
    torch.cuda.synchronize()
    assert torch.equal(a.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1)
