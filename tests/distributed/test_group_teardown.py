"""The trainer group's teardown frees the process group, so gloo never shuts down inside interpreter exit.

`torch.distributed.nn.functional` binds `group.WORLD` as a default argument at its first import; imported after
`init_process_group` (building a transformers model does it), it keeps the group alive past
`destroy_process_group`, and gloo's threads would be torn down during finalization, where they can abort the
process ("terminate called without an active exception").
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, socket, weakref
    import torch
    import torch.distributed as dist
    from rl4bit.trainer.sharding import close_group, init_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_group(0, 1, "127.0.0.1", port, torch.device("cpu"))
    ref = weakref.ref(dist.group.WORLD)
    import torch.distributed.nn.functional  # what building a transformers model imports
    close_group()
    gc.collect()
    print("freed" if ref() is None else f"alive: {len(gc.get_referrers(ref()))} tracked referrers")
""")


def test_close_group_frees_the_process_group():
    """A fresh process (the import must be its first): after close_group no reference to the group remains."""
    out = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "freed", out.stdout + out.stderr[-2000:]
