"""rl4bit's quantized checkpoint directory: write it atomically, verify it, read it back.

    write_checkpoint(out, model, plan, tokenizer=tok)      # model converted by trainer.surgery
    qweights = load_qtensors(out)      # {module: {param: QTensor}}  -> surgery.load_quantized (serving)
    state = load_state_dict(out)       # plain HF state dict, decoded  -> transformers model.load_state_dict

Directory (Hugging Face style; vLLM reads it through compressed-tensors):
- `config.json`: the model's config + `quantization_config` (`rl4bit.common.ct_layout`);
- tokenizer files when a tokenizer is given;
- `model-0000i-of-0000n.safetensors` shards (layers kept whole, in order) and
  `model.safetensors.index.json`: `weight_map` as usual, and under `metadata`
  the SHA-256 and byte size of every shard plus a CRC-32 per tensor, so a bad
  shard is reported with the tensor it hits;
- `rl4bit_layout.json`: which stored tensors make up which model weight, in
  which format and shape (what `load_qtensors` / `load_state_dict` rebuild);
  its SHA-256 is in the index too, so an edited or damaged layout is refused.
The tensors are the trainer forward's own QTensors (`quantized_weights()`), bit
for bit: no re-quantization, no calibration.

Safety: the whole directory is written to a temporary sibling (files fsynced),
then renamed over `out`; the previous `out` is moved aside first and deleted
only after the rename, so an interrupted export leaves it intact (at worst
under `<out>.old-*` if the process dies between the two renames). The
temporary copy (`.<out>.tmp-*`) of an export that was killed is removed by the
next export to `out` (`rl4bit.common.atomic.temp_dir`: never a live writer's). An `out`
that is a file, or a non-empty directory that is not an rl4bit export, is
refused (FileExistsError) rather than deleted. A weight holding NaN/Inf is
refused when writing and when reading (CheckpointError naming it). Damage the
checksums cannot describe (unparsable JSON, a malformed safetensors header) is a
CheckpointError naming the file too. safetensors and JSON only: nothing is pickled.

Leaves out: optimizer state and RNG (the RL checkpoint is rl4bit.common.checkpoint's),
streaming loads of shards larger than memory, remote storage.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rl4bit.common import ct_layout
from rl4bit.common.atomic import fsync_tree, replace_dir, restore_dir, temp_dir
from rl4bit.kernels import QTensor
from rl4bit.kernels.checks import all_finite

INDEX = "model.safetensors.index.json"
LAYOUT = "rl4bit_layout.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 2 << 30


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: the message names the file, the tensor and what to do."""


# ------------------------------------------------------------------ what the model's weights are, as stored


@dataclass(frozen=True)
class Entry:
    """One model weight as stored: `module.param` in format fmt ("nvfp4" | "mxfp8" | "bf16" | "dense")."""

    module: str
    param: str
    fmt: str
    shape: tuple
    fused: bool
    """True for transformers-5 fused experts (3D [E, N, K]), stored per expert and projection."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param

    @property
    def layer(self) -> int | None:
        return ct_layout.layer_of(self.name)


def expert_weight_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]] | None:
    """{param name: 3D shape} for a fused-experts module (HF 5.x layout or converted), else None."""
    shapes = getattr(module, "expert_weight_shapes", None)  # converted QuantExperts (also in serving mode)
    if shapes is not None:
        return dict(shapes)
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
        return {"gate_up_proj": tuple(gu.shape), "down_proj": tuple(dn.shape)}
    return None


def model_layout(model, plan: dict[str, str]) -> list[Entry]:
    """Every weight of `model` (converted or plain), planned modules first within their layer, in layer order."""
    modules = dict(model.named_modules())
    entries, covered = [], set()
    for name, fmt in plan.items():
        module = modules[name]
        experts = expert_weight_shapes(module)
        if experts is not None:
            for param, shape in experts.items():
                entries.append(Entry(name, param, fmt, tuple(shape), True))
                covered.add(f"{name}.{param}")
        elif fmt != "bf16":
            entries.append(Entry(name, "weight", fmt, (1, module.out_features, module.in_features), False))
            covered.add(f"{name}.weight")
    for name, t in model.state_dict().items():
        if name not in covered:
            module, _, param = name.rpartition(".")
            entries.append(Entry(module, param, "dense", tuple(t.shape), False))
    order = {e: i for i, e in enumerate(entries)}
    return sorted(entries, key=lambda e: (e.layer is None, e.layer or 0, order[e]))


def entry_value(model, entry: Entry, dense_dtype=torch.bfloat16, quantized: dict | None = None):
    """One weight as the model computes with it: the module's own QTensor, or the dense tensor (detached).

    Dense floating-point tensors are cast to `dense_dtype` (None: kept as they
    are, the live tensor itself, not a copy). `quantized`: an optional cache
    {module name: module.quantized_weights()}, so a module holding several
    weights (fused experts) is quantized once per call site, not once a weight.
    """
    module = model.get_submodule(entry.module) if entry.module else model
    if entry.fmt in ("nvfp4", "mxfp8"):
        if quantized is None:
            return module.quantized_weights()[entry.param]
        if entry.module not in quantized:
            quantized[entry.module] = module.quantized_weights()
        return quantized[entry.module][entry.param]
    w = getattr(module, entry.param).detach()
    return w.to(dense_dtype) if dense_dtype is not None and w.is_floating_point() else w


def encode_entry(model, entry: Entry, dense_dtype=torch.bfloat16, outers: dict | None = None,
                 quantized: dict | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of one weight (`entry_value`: quantized weights are the module's own QTensors).

    NVFP4: the exact decode outers go into `outers[entry.name]` (-> shard metadata).
    """
    value = entry_value(model, entry, dense_dtype, quantized)
    if isinstance(value, QTensor):
        if value.fmt == "nvfp4" and outers is not None:
            outers[entry.name] = ct_layout.outer_hex(value)
        return ct_layout.encode_qtensor(entry.module, entry.param, value, fused_experts=entry.fused)
    return ct_layout.encode_dense(entry.module, entry.param, value, fused_experts=entry.fused, dtype=None)


def decode_entry(tensors: dict, entry: Entry, outers: dict | None = None):
    """QTensor (quantized) or Tensor (dense) of one weight, from stored tensors (+ the metadata's exact outers)."""
    if entry.fmt in ("nvfp4", "mxfp8"):
        return ct_layout.decode_qtensor(tensors, entry.module, entry.param, entry.fmt, entry.shape,
                                        fused_experts=entry.fused, outer=(outers or {}).get(entry.name))
    return ct_layout.decode_dense(tensors, entry.module, entry.param, entry.shape, fused_experts=entry.fused)


def layout_json(entries: list[Entry], plan: dict[str, str], **extra) -> dict:
    return {"format_version": FORMAT_VERSION, "plan": plan, "entries": [asdict(e) for e in entries], **extra}


def entries_from_json(d: dict, where: str = LAYOUT) -> list[Entry]:
    """The entries of a layout (`layout_json`); CheckpointError naming `where` when it is not rl4bit's layout."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: a JSON {type(d).__name__}, not rl4bit's layout (damaged); re-export")
    if d.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {d.get('format_version')!r}, this rl4bit reads "
                              f"{FORMAT_VERSION}; re-export with this version")
    entries = d.get("entries")
    for i, e in enumerate(entries if isinstance(entries, list) else [None]):
        if not (isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ("module", "param", "fmt"))
                and isinstance(e.get("shape"), (list, tuple)) and all(type(n) is int and n >= 0 for n in e["shape"])
                and isinstance(e.get("fused"), bool)):
            raise CheckpointError(f"{where}: entry {i} is not a weight entry (module, param, fmt, shape, fused) "
                                  "(damaged or edited); re-export")
    return [Entry(e["module"], e["param"], e["fmt"], tuple(e["shape"]), e["fused"]) for e in entries]


# ------------------------------------------------------------------ safetensors bytes + checksums


def tensor_crcs(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """CRC-32 (hex) of each tensor's raw bytes."""
    return {k: f"{zlib.crc32(_raw(t)):08x}" for k, t in tensors.items()}


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


OUTER_KEY = "rl4bit.nvfp4_decode_outer"


def pack(tensors: dict[str, torch.Tensor], outers: dict | None = None, extra: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of a tensor dict (no pickling); `outers` go to the metadata as JSON, `extra` as given."""
    meta = {"format": "pt", **(extra or {})}
    if outers:
        meta[OUTER_KEY] = json.dumps(outers)
    return st_save(tensors, metadata=meta)


def metadata(blob: bytes, where: str) -> dict[str, str]:
    """The __metadata__ of a safetensors blob (its header checked: CheckpointError naming `where` otherwise)."""
    meta: dict = {}
    _header(blob, where, meta)
    return meta


def _header_problem(header, meta) -> str | None:
    """What makes a parsed safetensors header malformed, or None (so a flipped bit is named, not a KeyError)."""
    if not isinstance(header, dict):
        return f"a JSON {type(header).__name__}, not an object"
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return "__metadata__ is not a map of strings"
    for name, info in header.items():
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            return f"tensor {name!r} has no dtype"
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            return f"tensor {name!r} has no valid shape"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has no valid data_offsets"
    return None


def _header(blob: bytes, where: str, meta: dict | None = None) -> tuple[dict, int]:
    """(tensor entries, data start) of a safetensors blob's header, checked for shape; `meta` gets __metadata__."""
    if len(blob) < 8:
        raise CheckpointError(f"{where}: {len(blob)} bytes, too short to hold a safetensors header (truncated); "
                              "re-export")
    (n,) = struct.unpack("<Q", blob[:8])
    try:
        header = json.loads(blob[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{where}: the safetensors header is corrupt (or the file is truncated); "
                              "re-export") from None
    m = (header.pop("__metadata__", None) or {}) if isinstance(header, dict) else {}
    problem = _header_problem(header, m)
    if problem is not None:
        raise CheckpointError(f"{where}: the safetensors header is corrupt ({problem}); re-export / resend it")
    if meta is not None:
        meta.update(m)
    return header, 8 + n


def diagnose(blob: bytes, where: str, crcs: dict[str, str] | None, expected_bytes: int | None) -> str:
    """Which tensor of a bad safetensors blob is hit: truncation or a CRC mismatch, named."""
    header, start = _header(blob, where)
    have = len(blob) - start
    if expected_bytes is not None and len(blob) < expected_bytes or any(
            info["data_offsets"][1] > have for info in header.values()):
        cut = sorted((info["data_offsets"][1], name) for name, info in header.items() if info["data_offsets"][1] > have)
        name = cut[0][1] if cut else "(after the last tensor)"
        return (f"{where} is truncated ({len(blob)} bytes, expected {expected_bytes}); tensor {name!r} is cut off; "
                "re-export / resend it")
    bad = []
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        if crcs is not None and name in crcs and f"{zlib.crc32(blob[start + lo:start + hi]):08x}" != crcs[name]:
            bad.append(name)
    if bad:
        return f"{where} is corrupt: tensor {bad[0]!r}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + \
            " does not match its checksum; re-export / resend it"
    return f"{where} does not match its SHA-256 (the header or padding changed); re-export / resend it"


def unpack(blob: bytes, where: str, sha256: str, crcs: dict[str, str] | None = None,
           expected_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify a safetensors blob against its SHA-256 and load it -> (tensors, outers from the metadata).

    CheckpointError naming the file and the tensor otherwise.
    """
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise CheckpointError(diagnose(blob, where, crcs, expected_bytes))
    meta: dict = {}
    _header(blob, where, meta)
    try:
        outers = json.loads(meta.get(OUTER_KEY, "{}"))
        if not isinstance(outers, dict):
            raise ValueError
    except ValueError:
        raise CheckpointError(f"{where}: metadata {OUTER_KEY} is not a JSON object; re-export / resend it") from None
    return st_load(blob), outers


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the stored tensors holding NaN/Inf (1-byte floats by bit pattern: `all_finite`)."""
    bad = []
    for name, t in tensors.items():
        if t.dtype == torch.uint8 and name.endswith(".weight_scale"):
            # MXFP8's E8M0 block scales are stored as uint8 (compressed-tensors); 0xFF is their NaN.
            # NVFP4's weight_scale is float8_e4m3fn, and its uint8 weight_packed codes are all finite.
            t = t.view(torch.float8_e8m0fnu)
        if not all_finite(t):
            bad.append(name)
    return bad


def _more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


# ------------------------------------------------------------------ write


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def group_by_layer(entries: list[Entry]) -> list[list[Entry]]:
    """Consecutive entries of the same layer (None = outside the layers) together, in order."""
    groups: list[list[Entry]] = []
    for e in entries:
        if groups and groups[-1][0].layer == e.layer:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def is_export(path: Path) -> bool:
    """Whether the directory `path` holds an rl4bit export (complete or not): its layout, an index rl4bit wrote, or
    the marker of a BF16 `--format hf` export (`rl4bit.export_hf.MARKER`).

    A Hugging Face model's own model.safetensors.index.json (no rl4bit_format_version) does not count."""
    if (path / LAYOUT).is_file() or (path / "rl4bit_export.json").is_file():  # the latter: `export --format hf`
        return True
    try:
        return "rl4bit_format_version" in json.loads((path / INDEX).read_bytes())["metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _check_out(out: Path) -> None:
    """Refuse an `out` that replacing would destroy: a file, or a non-empty directory that is not an rl4bit export."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export: {out} is a file, and exporting there would delete it; "
                              "pass --out a new directory (or move the file away)")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise FileExistsError(f"export: {out} is a non-empty directory that is not an rl4bit export (no {LAYOUT}, no "
                              f"{INDEX} written by rl4bit), and exporting there would delete everything in it; "
                              f"pass --out a new or empty directory, e.g. {out / 'rl4bit_export'}")


def write_checkpoint(out: str | Path, model, plan: dict[str, str], *, tokenizer=None, dense_dtype=torch.bfloat16,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra: dict | None = None) -> Path:
    """Export `model` (converted per `plan`) to the directory `out`, atomically; returns the path.

    `out` may be new, empty or a previous export (replaced); anything else is refused with FileExistsError.
    CheckpointError, and nothing written, when a weight holds NaN/Inf."""
    out = Path(out).resolve()
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries = model_layout(model, plan)
    with temp_dir(out) as tmp:  # removed on an exception; a killed export's is removed by the next one
        weight_map, shard_meta, crcs, blobs = {}, {}, {}, []
        pending: dict[str, torch.Tensor] = {}
        outers: dict[str, list] = {}

        def flush():
            if pending:
                blob = pack(pending, outers)
                fname = f"shard-{len(blobs):05d}.tmp"
                _write_file(tmp / fname, blob)
                blobs.append((fname, hashlib.sha256(blob).hexdigest(), len(blob), list(pending)))
                crcs.update(tensor_crcs(pending))
                pending.clear()
                outers.clear()

        for group in group_by_layer(entries):
            tensors, group_outers = {}, {}
            for e in group:
                stored = encode_entry(model, e, dense_dtype, group_outers)
                bad = nonfinite(stored)
                if bad:
                    raise CheckpointError(f"cannot export {e.name} ({e.fmt}): stored tensor {bad[0]!r}{_more(bad)} "
                                          f"holds NaN/Inf; nothing was written to {out}. The weights diverged: "
                                          "export an earlier checkpoint, or find where the NaN/Inf comes from")
                tensors.update(stored)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            if pending and sum(t.numel() * t.element_size() for t in pending.values()) + size > max_shard_bytes:
                flush()
            pending.update(tensors)
            outers.update(group_outers)
        flush()
        n = len(blobs)
        for i, (fname, sha, nbytes, names) in enumerate(blobs):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(tmp / fname, tmp / final)
            shard_meta[final] = {"sha256": sha, "bytes": nbytes}
            weight_map.update({k: final for k in names})
        total = sum(m["bytes"] for m in shard_meta.values())
        layout = _json(layout_json(entries, plan, **(extra or {})))
        index = {"metadata": {"total_size": total, "rl4bit_format_version": FORMAT_VERSION, "shards": shard_meta,
                              "tensor_crc32": crcs, "layout_sha256": hashlib.sha256(layout).hexdigest()},
                 "weight_map": weight_map}
        _write_file(tmp / LAYOUT, layout)
        _write_file(tmp / INDEX, _json(index))
        cfg = model.config.to_dict()
        if not cfg.get("architectures"):  # built from a config: loaders (vLLM, AutoModel) need the class name
            cfg["architectures"] = [type(model).__name__]
        experts = {e.module for e in entries if e.fused}
        qc = ct_layout.quantization_config(plan, experts)
        cfg.pop("quantization_config", None)
        if qc is not None:
            cfg["quantization_config"] = qc
        cfg["torch_dtype"] = cfg["dtype"] = str(dense_dtype).removeprefix("torch.")
        _write_file(tmp / "config.json", _json(cfg))
        gen = getattr(model, "generation_config", None)
        if gen is not None:  # its eos ids (often a list, beyond config.json's one) end vLLM's completions too
            _write_file(tmp / "generation_config.json", gen.to_json_string(use_diff=True).encode())
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        fsync_tree(tmp)
        replace_dir(tmp, out)
    return out


# ------------------------------------------------------------------ read


def _read_json(f: Path):
    try:
        return json.loads(f.read_bytes())
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        raise CheckpointError(f"{f} is not valid JSON (truncated or corrupted); re-export the checkpoint") from None


def _index_problem(index) -> str | None:
    """What keeps a parsed index from being the one `write_checkpoint` writes, or None."""
    meta = index.get("metadata") if isinstance(index, dict) else None
    shards = meta.get("shards") if isinstance(meta, dict) else None
    if not isinstance(shards, dict) or not isinstance(index.get("weight_map"), dict):
        return "no metadata.shards or weight_map"
    for name, m in shards.items():
        if Path(name).name != name or name in ("", ".", ".."):
            return f"shard name {name!r} is not a file name in the checkpoint directory"
        if not (isinstance(m, dict) and isinstance(m.get("sha256"), str) and type(m.get("bytes")) is int):
            return f"shard {name!r} has no sha256 and byte size"
    stray = [k for k, v in index["weight_map"].items() if v not in shards]
    if stray:
        return f"tensor {stray[0]!r} maps to {index['weight_map'][stray[0]]!r}, which is not a listed shard"
    if not isinstance(meta.get("tensor_crc32", {}), dict) or not isinstance(meta.get("layout_sha256", ""), str):
        return "tensor_crc32 or layout_sha256 is malformed"
    return None


def read_index(path: str | Path) -> tuple[dict, list[Entry], dict]:
    """(index, layout entries, layout) of an export, checked; CheckpointError naming the file otherwise.

    The layout is checked against the index's SHA-256 (exports written before it was recorded: not checked). An
    export that a crash mid-swap left aside (`atomic.restore_dir`) is put back first."""
    path = Path(path)
    restore_dir(path)
    for f in (INDEX, LAYOUT, "config.json"):
        if not (path / f).is_file():
            raise CheckpointError(f"{path}: {f} is missing; this is not a complete rl4bit checkpoint (re-export it)")
    index = _read_json(path / INDEX)
    problem = _index_problem(index)
    if problem is not None:
        raise CheckpointError(f"{path / INDEX} is damaged: {problem}; re-export the checkpoint")
    want = index["metadata"].get("layout_sha256")
    if want is not None and hashlib.sha256((path / LAYOUT).read_bytes()).hexdigest() != want:
        raise CheckpointError(f"{path / LAYOUT} does not match the SHA-256 in {INDEX} (edited, truncated or "
                              "corrupted); re-export the checkpoint")
    layout = _read_json(path / LAYOUT)
    return index, entries_from_json(layout, str(path / LAYOUT)), layout


def read_tensors(path: str | Path, outers: dict | None = None) -> dict[str, torch.Tensor]:
    """Every stored tensor, each shard verified against the index and for NaN/Inf (CheckpointError names file, tensor).

    `outers` (optional dict) receives the exact NVFP4 decode outers from the shard metadata.
    """
    path = Path(path)
    index, _, _ = read_index(path)
    meta = index["metadata"]
    outers = {} if outers is None else outers
    out: dict[str, torch.Tensor] = {}
    for fname, m in meta["shards"].items():
        f = path / fname
        if not f.is_file():
            held = [k for k, v in index["weight_map"].items() if v == fname]
            raise CheckpointError(f"{f}: shard is missing (holds e.g. {held[:1]}); re-export")
        tensors, shard_outers = unpack(f.read_bytes(), str(f), m["sha256"], meta.get("tensor_crc32"), m["bytes"])
        # the checksums match, so NaN/Inf here was written so by whoever exported it: refused all the same
        bad = nonfinite(tensors) + [f"{k} (decode outer)" for k, v in shard_outers.items() if not _finite_hex(v)]
        if bad:
            raise CheckpointError(f"{f}: tensor {bad[0]!r}{_more(bad)} holds NaN/Inf; the file is intact, the "
                                  "weights it was exported from were not: re-export from a finite checkpoint")
        out.update(tensors)
        outers.update(shard_outers)
    missing = sorted(set(index["weight_map"]) - set(out))
    if missing:
        raise CheckpointError(f"{path}: tensors {missing[:3]} are in the index but in no shard; re-export")
    return out


def _finite_hex(outer) -> bool:
    """Whether a stored outer (a list of float.hex strings, `ct_layout.outer_hex`) is finite and parses."""
    try:
        return isinstance(outer, list) and all(math.isfinite(float.fromhex(h)) for h in outer)
    except (TypeError, ValueError):
        return False


def load_qtensors(path: str | Path) -> dict[str, dict]:
    """{module: {param: QTensor}} of the quantized modules, bitwise the trainer's (for surgery.load_quantized)."""
    outers: dict = {}
    tensors = read_tensors(path, outers)
    _, entries, _ = read_index(path)
    out: dict[str, dict] = {}
    for e in entries:
        if e.fmt in ("nvfp4", "mxfp8"):
            out.setdefault(e.module, {})[e.param] = decode_entry(tensors, e, outers)
    return out


def load_state_dict(path: str | Path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A plain transformers state dict: quantized weights decoded (rl4bit.kernels.dequantize) to `dtype`."""
    outers: dict = {}
    tensors = read_tensors(path, outers)
    _, entries, _ = read_index(path)
    sd = {}
    for e in entries:
        w = decode_entry(tensors, e, outers)
        if e.fmt in ("nvfp4", "mxfp8"):
            w = ct_layout.dequantized(w, dtype)
            w = w if e.fused else w.reshape(e.shape[1:])
        elif w.is_floating_point():
            w = w.to(dtype)
        sd[e.name] = w
    return sd
