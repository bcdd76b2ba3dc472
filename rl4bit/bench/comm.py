"""`rl4bit bench comm`: bytes and milliseconds per expert-parallel all-to-all, each wire format beside BF16.

For every world size (CPU: gloo with 2 and 4 processes; CUDA: NCCL over all
visible GPUs when there are at least 2) the ranks route random tokens top-k
over the experts (uniform router, so ~(world-1)/world of the rows leave the
rank) and time, for each all-to-all of an MoE layer and each of its formats
(rl4bit.trainer.ep_codec):

| phase | formats |
|---|---|
| dispatch (forward, source -> owner) | nvfp4 (the GEMM's own QTensor), bf16 |
| combine (forward, owner -> source) | rht_s2f6, mxfp8, bf16 |
| backward (both directions) | mxfp8, bf16 |

encode (quantize/transform + pack), the all_to_all_single itself, and decode
(unpack/dequantize, for rht_s2f6 the weighted sum and one inverse RHT per
token): the median of `repeats` runs, the max over ranks. Bytes are what
one rank sends to the others. The combine rows also carry an SQNR against
the unquantized expert outputs (activations with outlier channels).
Shapes: Qwen3-30B-A3B (hidden 2048, 128 experts, top-8) with 4096 tokens per
rank on CUDA, 512 on CPU; quick: hidden 256, 16 experts, top-4, 128 tokens.

Leaves out: the expert GEMMs (bench train), overlap of communication with
compute, multi-node links. Run `python -m rl4bit.bench.comm` for a quick CPU run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

FORMATS = [("dispatch", "nvfp4"), ("dispatch", "bf16"), ("combine", "rht_s2f6"), ("combine", "mxfp8"),
           ("combine", "bf16"), ("backward", "mxfp8"), ("backward", "bf16")]


def _shape(device: str, quick: bool) -> dict:
    if quick:
        return dict(hidden=256, experts=16, top_k=4, tokens=128)
    return dict(hidden=2048, experts=128, top_k=8, tokens=4096 if device == "cuda" else 512)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats):
    import torch.distributed as dist

    times, out = [], None
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def _worker(rank: int, world: int, port: int, device_kind: str, shape: dict, repeats: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from rl4bit.kernels import quantize
    from rl4bit.trainer import ep_codec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    from rl4bit.trainer.sharding import bind_world_defaults_early

    bind_world_defaults_early()
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        h, e, k, t = shape["hidden"], shape["experts"], shape["top_k"], shape["tokens"]
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(t, h, generator=g)
        x[:, torch.randperm(h, generator=g)[: h // 128]] *= 100.0  # outlier channels
        x = x.to(device=device, dtype=torch.bfloat16)
        idx = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.to(device)
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        send = torch.bincount(flat, minlength=e).reshape(world, e // world).sum(1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_s, recv_s = send.tolist(), recv.tolist()
        rows_out, rows_in = x[tok], None

        def a2a(buf, s, r):
            out = buf.new_empty(sum(r), buf.shape[1])
            dist.all_to_all_single(out, buf, r, s)
            return out

        results = {}
        for phase, fmt in FORMATS:
            if phase == "dispatch":
                enc = ((lambda: ep_codec.pack_nvfp4(ep_codec.gather_rows(
                           quantize(x, "nvfp4", outer="row", four_over_six=True), tok)))
                       if fmt == "nvfp4" else (lambda: ep_codec.pack_dense(rows_out)))
                dec = ((lambda b: ep_codec.unpack_nvfp4(b, h)) if fmt == "nvfp4"
                       else (lambda b: ep_codec.unpack_dense(b, torch.bfloat16, h)))
                s, r, src = send_s, recv_s, None
            else:  # the owner sends rows back; their values: what it received (expert outputs stand-in)
                if rows_in is None:
                    rows_in = a2a(ep_codec.pack_dense(rows_out), send_s, recv_s).view(torch.bfloat16)
                src = rows_in
                if phase == "combine":
                    enc = lambda: ep_codec.encode_combine(src, fmt, 7)  # noqa: E731
                    wk = w.reshape(-1)[order, None].float()

                    def dec(b):
                        z = ep_codec.decode_combine(b, fmt, h, torch.float32)
                        acc = torch.zeros(t, h, device=device).index_add_(0, tok, z * wk)
                        return ep_codec.combine_output(acc, fmt, 7)
                else:
                    enc = lambda: ep_codec.encode_grad(src, fmt)  # noqa: E731
                    dec = lambda b: ep_codec.decode_grad(b, fmt, h, torch.bfloat16)  # noqa: E731
                s, r = recv_s, send_s
            buf, t_enc = _timed(enc, device, repeats)
            got, t_a2a = _timed(lambda: a2a(buf, s, r), device, repeats)
            out, t_dec = _timed(lambda: dec(got), device, repeats)
            row = {"bytes": (sum(s) - s[rank]) * buf.shape[1], "bits_per_value": 8.0 * buf.shape[1] / h,
                   "encode_ms": 1e3 * t_enc, "a2a_ms": 1e3 * t_a2a, "decode_ms": 1e3 * t_dec}
            if phase == "combine":  # against the exact weighted sum of the unquantized rows
                exact = torch.zeros(t, h, device=device).index_add_(0, tok, a2a(ep_codec.pack_dense(src), s, r)
                                                                    .view(torch.bfloat16).float() * wk)
                sq = ep_codec.sqnr_db(exact, out)
                row["sqnr_db"] = None if sq == float("inf") else sq  # None: exact (JSON has no inf)
            vals = torch.tensor([row["encode_ms"], row["a2a_ms"], row["decode_ms"], row["bytes"]], dtype=torch.float64,
                                device=device)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            row.update(encode_ms=vals[0].item(), a2a_ms=vals[1].item(), decode_ms=vals[2].item(),
                       bytes=int(vals[3].item()))
            results[f"{phase}/{fmt}"] = row
        dist.barrier()
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def sqnr_text(row: dict) -> str:
    if "sqnr_db" not in row:
        return ""
    return "exact" if row["sqnr_db"] is None else f"{row['sqnr_db']:.1f}"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the ranks' MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argvs: list[list[str]], env: dict, timeout_s: float, name: str) -> None:
    """Run one process per rank (`argvs[r]`) and wait for all; kill what is left and raise RuntimeError
    (`name`: ..., each failed rank's stderr tail) if one fails or the whole run exceeds timeout_s."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in argvs]
    deadline, errors = time.monotonic() + timeout_s, []
    try:
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"rank {r}: no result within {timeout_s:.0f} s (a collective hangs?)")
                break
            if p.returncode:
                errors.append(f"rank {r} exited {p.returncode}:\n{err[-2500:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if errors:
        raise RuntimeError(f"{name}: " + "\n".join(errors))


def _launch(world: int, device: str, shape: dict, repeats: int, timeout_s: float = 600.0) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        out_file = str(Path(d) / "rank0.json")
        args = json.dumps(dict(world=world, port=port, device=device, shape=shape, repeats=repeats, out=out_file))
        run_ranks([[sys.executable, "-m", "rl4bit.bench.comm", "--worker", str(r), args] for r in range(world)],
                  dict(os.environ, OMP_NUM_THREADS="1"), timeout_s, "bench comm")
        return json.loads(Path(out_file).read_text())


def run(device: str = "cpu", quick: bool = False, out: str | None = None, repeats: int = 5) -> dict:
    """Measure and print the all-to-all table per world size; returns the figures (also out/bench_comm.json)."""
    from rich.console import Console
    from rich.table import Table

    dev = "cuda" if str(device).startswith("cuda") else "cpu"
    if dev == "cuda":
        import torch

        n = torch.cuda.device_count()
        worlds = [n] if n >= 2 else []
        if not worlds:
            print("bench comm: one GPU visible; NCCL all-to-all needs >= 2 (running gloo on CPU instead)")
            dev = "cpu"
    if dev == "cpu":
        worlds = [2, 4]
    shape = _shape(dev, quick)
    result = {"device": dev, "quick": quick, "shape": shape, "worlds": {}}
    console = Console(width=150)
    for world in worlds:
        rows = _launch(world, dev, shape, repeats)
        result["worlds"][str(world)] = rows
        table = Table(title=f"EP all-to-all, {world} ranks ({'nccl' if dev == 'cuda' else 'gloo'}; "
                            f"hidden {shape['hidden']}, {shape['experts']} experts, top-{shape['top_k']}, "
                            f"{shape['tokens']} tokens/rank)")
        for col in ("phase", "format", "bits/value", "bytes sent/rank", "x bf16", "encode ms", "a2a ms",
                    "a2a x bf16", "decode ms", "total ms", "total x bf16", "SQNR dB"):
            table.add_column(col, justify="right")
        for key, r in rows.items():
            phase, fmt = key.split("/")
            base = rows[f"{phase}/bf16"]
            tot = r["encode_ms"] + r["a2a_ms"] + r["decode_ms"]
            btot = base["encode_ms"] + base["a2a_ms"] + base["decode_ms"]
            r["total_ms"] = tot
            table.add_row(phase, fmt, f"{r['bits_per_value']:.3f}", f"{r['bytes']:,}",
                          f"{r['bytes'] / max(base['bytes'], 1):.3f}",
                          f"{r['encode_ms']:.2f}", f"{r['a2a_ms']:.2f}", f"{r['a2a_ms'] / base['a2a_ms']:.2f}",
                          f"{r['decode_ms']:.2f}", f"{tot:.2f}", f"{tot / btot:.2f}",
                          sqnr_text(r))
        console.print(table)
    if out is not None:
        from rl4bit.common.atomic import atomic_write_text

        atomic_write_text(Path(out) / "bench_comm.json", json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        a = json.loads(sys.argv[3])
        _worker(int(sys.argv[2]), a["world"], a["port"], a["device"], a["shape"], a["repeats"], a["out"])
    else:
        run(quick=True)
