"""The Trainer: holds the policy (converted by the recipe), runs GRPO steps, exports weights.

A plain class (Ray wraps it in `rl4bit.actors`; `local` mode calls it directly):

    trainer = Trainer(**trainer_args(cfg))     # its sections of the job's config (rl4bit.config.trainer_args)
    trainer.warm_start(train_samples, **warm)  # optional supervised phase (quickstart)
    trainer.setup_rl()                         # recipe conversion, AdamW, reference model
    metrics = trainer.train_step(batch)        # a TrainBatch of one RL step's rollouts
    version, count, layout = trainer.weight_header()   # weight sync (rl4bit.trainer.weight_sync), then
    bucket = trainer.weight_bucket(i)                  #   bucket i of 0..count-1, for the samplers
    update, quantized = trainer.weight_tensors()       # or, samplers in this process: the same values as tensors
    trainer.save_checkpoint(run_dir, step, {"data": ...})  # its state, as each rank of a TrainerGroup writes its own

Logprobs are recomputed through the embedded sampler's batch-invariant forward (`rl4bit.trainer.logprobs`), so
on the same weights they equal the sampler's bitwise and `mismatch/k3` is 0 on CPU. Sharded (`rank`,
`world`), built by `rl4bit.trainer_group`): FSDP2 after the recipe conversion, expert parallelism over the whole
group; the `Trainer` class docstring says what each changes. Leaves out: minibatches within an epoch,
learning-rate schedules, EP groups smaller than the trainer group."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl4bit.common.checkpoint import load_checkpoint, save_checkpoint
from rl4bit.kernels import NonFiniteInputError, deferred_checks, invariant
from rl4bit.kernels.transfer import to_device
from rl4bit.trainer import cuda_ipc, grpo, tensor_broadcast, trainer_state
from rl4bit.trainer.batch import TrainBatch, microbatches, pad, stack
from rl4bit.trainer.config import ModelConfig, RLConfig, TrainerConfig
from rl4bit.trainer.logprobs import sequence_logprobs
from rl4bit.trainer.models import autocast_dtype, build_model
from rl4bit.trainer.recipe import RecipeConfig
from rl4bit.trainer.tokenizer import build_tokenizer
from rl4bit.trainer.warmstart import supervised_warm_start
from rl4bit.trainer.weight_sync import WeightSender, update_bytes


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient."""


@dataclass
class _StepState:
    """One RL step inside the trainer: its micro-batches and what its epochs accumulate."""

    keep: list[int]  # the rows that train (a failed rollout has no completion)
    mbs: list[list[int]]  # micro-batches of rows, each within trainer.tokens_per_microbatch
    total_tokens: float  # completion tokens of the kept rows (the loss's normalisation)
    total_seqs: float
    old: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> epoch 0's logprobs (the PPO ratio's "old")
    ref: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> the KL reference model's logprobs
    sums: dict[str, float] = field(default_factory=lambda: dict(
        loss=0.0, clipped=0.0, ratio_sum=0.0, tokens=0.0, tis_truncated=0.0, kl_ref_sum=0.0, entropy=0.0, k3=0.0,
        max_abs=0.0))
    rmin: float = math.inf
    rmax: float = -math.inf
    norms: list[float] = field(default_factory=list)  # the grad norm of every optimizer step taken or skipped
    skipped: int = 0

    @classmethod
    def plan(cls, batch: TrainBatch, tokens_per_microbatch: int) -> _StepState:
        keep = [i for i, c in enumerate(batch.completion_ids) if c]
        lengths = [len(batch.prompt_ids[i]) + len(batch.completion_ids[i]) for i in range(len(batch.prompt_ids))]
        mbs = [[keep[j] for j in mb] for mb in microbatches([lengths[i] for i in keep], tokens_per_microbatch)]
        return cls(keep, mbs, float(sum(len(batch.completion_ids[i]) for i in keep)), float(len(keep)))


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Policy + AdamW; one `train_step` per RL step.

    The recipe's quantized modules (`rl4bit.trainer.surgery`) hold FP32 master weights; AdamW updates them in
    place. The weight sync ships what the forward computes with: the quantized modules' QTensors and every other
    tensor as its FP32 master. With `model.dtype: bfloat16` the forward runs under bf16 autocast, as do the
    embedded samplers' (`rl4bit.trainer.models.autocast_dtype`, one function for both sides).

    Per RL step: `ppo_epochs` optimizer steps over all rollouts, each accumulating micro-batches of at most
    `trainer.tokens_per_microbatch` tokens; epoch 0's forward also yields the "old" logprobs of the PPO ratio. A
    step whose loss or gradient norm is not finite, or whose quantized GEMMs met NaN/Inf (`deferred_checks`), is
    skipped by every rank at the same micro-batch; the job stops after `trainer.max_nonfinite_steps` in a row.

    Sharded (world > 1; world == 1 runs exactly the one-process code): each micro-batch is split across ranks
    (rank r takes sequences r, r+world, ...; a rank without one runs a zero-weight dummy so every rank makes the
    same FSDP collectives); the loss keeps the global normalisation and gradients are summed, so the step equals
    the one-process step up to reduction order and stochastic rounding, whose keys fold in the rank
    (`sharding.sr_step`). Loss, statistics and the grad norm are reduced over the group; `state()` holds this
    rank's pieces; `weight_bucket` all-gathers a bucket's layers and returns it on rank 0 (None elsewhere). The
    warm start runs replicated before sharding. Expert parallelism (`trainer.expert_parallel` =
    `trainer.world_size`): `shard_experts` leaves each rank its slice of every MoE layer's experts, FSDP2 shards
    the rest; the grad norm and clip span both (`sharding.clip_grad_norm_`); steps return the group's wire bytes
    (`comm/*`).
    """

    def __init__(self, model: ModelConfig, trainer: TrainerConfig, recipe: RecipeConfig, rl: RLConfig, *,
                 seed: int, temperature: float, bitwise_sampler: bool, cpu_threads: int = 0, rank: int = 0,
                 world: int = 1):
        """model, trainer, recipe, rl: the job's sections of those names. seed: `run.seed` (model init, torch
        RNG). temperature: the samplers' (`sampler.temperature`), which the recomputed logprobs divide by.
        bitwise_sampler: whether the samplers compute this forward bit for bit (the embedded engine); when not
        (vLLM), truncated importance sampling is on by default (`rl.tis_cap`). cpu_threads: `run.cpu_threads`
        (0 = torch's default). rank, world: this rank of a trainer group (`rl4bit.trainer_group`)."""
        self.rank, self.world = int(rank), int(world)
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        self.model_cfg, self.trainer_cfg, self.recipe, self.rl = model, trainer, recipe, rl
        self.temperature = temperature
        self.tis_cap = rl.tis_cap if rl.tis_cap is not None else (None if bitwise_sampler else 2.0)
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(auto if trainer.device == "auto" else trainer.device)
        if self.device.type == "cuda" and model.invariant_kernels:  # the samplers too (sampler/actor.py);
            invariant.set_mode(True)  # the driver turns it off when the job ends
        self.tokenizer = build_tokenizer(model)
        torch.manual_seed(seed)
        self.model = build_model(model, len(self.tokenizer), seed).to(self.device)
        self.optimizer = None
        self.ref_model = None
        self.opt_steps = 0
        self.version = 0
        self.nonfinite_in_a_row = 0
        self.plan: dict[str, str] = {}
        self.ep = 1
        self._sender = None
        self._shared = None
        self._sync_group = tensor_broadcast.SyncGroup()
        """The update handed out by `weight_shared`, alive until `release_shared`."""

    # ------------------------------------------------------------------ phases
    def warm_start(self, samples: list[dict], *, steps: int, lr: float, batch_size: int, seed: int,
                   chat: bool) -> dict:
        """Supervised warm start on (prompt, answer) pairs, before the recipe conversion (`run.warmup_*`,
        `run.seed`, `data.chat_template`)."""
        return supervised_warm_start(self.model, self.tokenizer, samples, steps=steps, lr=lr, batch_size=batch_size,
                                     seed=seed, chat=chat)

    def setup_rl(self) -> None:
        """Convert the model by the recipe (FP32 masters), build AdamW and the frozen reference."""
        from rl4bit.trainer.surgery import convert_model

        self.plan = convert_model(self.model, self.recipe)
        self.model.to(self.device).eval()  # eval: no dropout; training-mode switches do not apply here
        t = self.trainer_cfg
        self.ep = ep = self._expert_parallel()
        if ep > 1:
            from rl4bit.trainer.expert_parallel import shard_experts

            shard_experts(self.model, None, combine=t.combine)  # the EP group is the whole (default) group
        if self.rl.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        if t.recompute:
            from rl4bit.trainer.recompute import enable_recompute

            enable_recompute(self.model)  # after the reference copy: its forward runs without gradients anyway
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [self.params]
        if self.world > 1:
            from rl4bit.trainer.expert_parallel import expert_params
            from rl4bit.trainer.sharding import shard_model

            for m in (self.model, self.ref_model):
                if m is not None:
                    shard_model(m, self.device, ignored_params={p for p, _ in expert_params(m).values()})
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            mine = {id(p) for p, _ in expert_params(self.model).values()}
            # two param groups: foreach AdamW cannot mix FSDP's DTensors with the plain expert slices in one list
            groups = [g for g in ([p for p in self.params if id(p) not in mine],
                                  [p for p in self.params if id(p) in mine]) if g]
        self.optimizer = torch.optim.AdamW([{"params": g} for g in groups], lr=t.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay)
        self.version = 1  # the first policy the samplers serve (their built-in weights are version 0)

    def _expert_parallel(self) -> int:
        """trainer.expert_parallel, checked: 1, or the whole group (= trainer.world_size)."""
        ep = int(self.trainer_cfg.expert_parallel)
        if ep == 1:
            return 1
        if ep != self.world:
            raise ValueError(
                f"trainer.expert_parallel={ep} with trainer.world_size={self.world}: expert parallelism shards the "
                f"experts over the whole trainer group; set trainer.world_size={ep} or trainer.expert_parallel="
                f"{self.world if self.world > 1 else 1} "
                "(EP groups smaller than the group, 2D meshes, are not supported)")
        from rl4bit.trainer.modules import QuantExperts

        if not any(isinstance(m, QuantExperts) for m in self.model.modules()):
            raise ValueError(f"trainer.expert_parallel={ep} but the model has no MoE experts module "
                             "(a dense model); set trainer.expert_parallel=1")
        return ep

    def _set_step(self, step: int) -> None:
        """Key the next forward/backward's stochastic rounding on `step` (and on the rank: sharding.sr_step)."""
        from rl4bit.trainer.expert_parallel import ExpertParallelExperts
        from rl4bit.trainer.sharding import sr_step
        from rl4bit.trainer.surgery import quant_modules

        for m in quant_modules(self.model).values():
            # EP modules key their SR calls by rank themselves; their combine's RHT seed needs the plain step
            m.set_step(step if isinstance(m, ExpertParallelExperts) else sr_step(step, self.rank, self.world))

    # ------------------------------------------------------------------ the step
    def _autocast(self):
        dtype = autocast_dtype(self.model_cfg)
        return torch.autocast(self.device.type, dtype or torch.bfloat16, enabled=dtype is not None)

    def _logprobs(self, model, batch: TrainBatch, idx: list[int]):
        with self._autocast():
            return sequence_logprobs(model, [batch.prompt_ids[i] for i in idx], [batch.completion_ids[i] for i in idx],
                                     self.temperature, self.model_cfg.max_seq_len)

    def train_step(self, batch: TrainBatch) -> dict:
        """`ppo_epochs` optimizer steps on one RL step's rollouts; returns the step's metrics.

        Each epoch is a `forward_backward` over the micro-batches, then an `optimizer_step`."""
        step = _StepState.plan(batch, self.trainer_cfg.tokens_per_microbatch)
        for epoch in range(self.rl.ppo_epochs):
            loss = self.forward_backward(batch, step, epoch)
            self.optimizer_step(loss, step)
            if epoch == 0 and self._old_missing(step.mbs, step.old):
                break  # epoch 0 records the old logprobs the later epochs need; it stopped early: no later epoch
        self.version += 1
        return self._step_metrics(step)

    def forward_backward(self, batch: TrainBatch, step: _StepState, epoch: int) -> float:
        """Accumulate the gradients of every micro-batch of `step` (this rank's share); the epoch's loss (the
        group's), NaN when a micro-batch met NaN/Inf on any rank (the epoch stops there, its statistics dropped)."""
        self._set_step(self.opt_steps)
        self.optimizer.zero_grad(set_to_none=True)
        sums, loss_total = step.sums, 0.0
        for mb in (step.mbs if self.world == 1 else [mb[self.rank:: self.world] for mb in step.mbs]):
            failed = False
            before = dict(sums)  # a failed micro-batch's entropy and mismatch figures are not kept
            try:
                # One read of the quantize kernels' NaN/Inf flag a micro-batch (at the block's exit), not one a
                # quantize: each read is a host sync that stops the host from running ahead of the GPU. The
                # host-side checks (every quantize on the CPU) wait for the exit too, so a rank never fails
                # mid-backward while the others are inside a collective. A rank without sequences runs a dummy
                # under the same checks: its collectives are the others'.
                with deferred_checks(host=True):
                    if not mb:
                        self._dummy_microbatch(epoch)
                    else:
                        loss, st = self._microbatch_loss(batch, mb, epoch, step.old, step.ref, sums,
                                                         tis_cap=self.tis_cap, total_tokens=step.total_tokens,
                                                         total_seqs=step.total_seqs)
                        loss.backward()
            except (FloatingPointError, NonFiniteInputError):  # NaN/Inf met by a quantized GEMM
                failed = True
            if self._any_rank(failed):  # a non-finite step, on every rank: their next collectives must meet
                if epoch == 0:  # old logprobs the failed forward left NaN/Inf: no later epoch trains on them
                    for i in mb:  # (finite ones stay: a NaN met in the backward alone leaves them valid; a
                        # forward that met an Inf and saturated leaves finite garbage, but the weights are
                        # unchanged, so the later epochs meet the same Inf and are skipped too)
                        if i in step.old and not bool(torch.isfinite(step.old[i]).all()):
                            del step.old[i]
                sums.update(before)
                loss_total = math.nan
                break
            if not mb:
                continue
            loss_total += loss.item()
            for k in ("clipped", "ratio_sum", "tokens", "tis_truncated", "kl_ref_sum"):
                sums[k] += st.get(k, 0.0)
            step.rmin, step.rmax = min(step.rmin, st["ratio_min"]), max(step.rmax, st["ratio_max"])
        if self.world > 1:
            from rl4bit.trainer.sharding import all_reduce

            loss_total = all_reduce([loss_total])[0]
        sums["loss"] += loss_total
        return loss_total

    def optimizer_step(self, loss: float, step: _StepState) -> None:
        """Clip the accumulated gradients and take the AdamW step, or skip it when the loss or the gradient norm is
        not finite (every rank alike: the norm is the group's); NonFiniteError after `trainer.max_nonfinite_steps`
        skips in a row."""
        t = self.trainer_cfg
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        if self.world > 1:
            from rl4bit.trainer.sharding import clip_grad_norm_

            norm = clip_grad_norm_(self.params, max_norm)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        step.norms.append(norm)
        if math.isfinite(loss) and math.isfinite(norm):
            self.optimizer.step()
            self.nonfinite_in_a_row = 0
        else:
            step.skipped += 1
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= t.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                    f"(loss {loss}, grad norm {norm}); lower trainer.lr or try recipe.name=mxfp8")
        self.opt_steps += 1

    def _step_metrics(self, step: _StepState) -> dict:
        """The RL step's metrics from its statistics, reduced over the group."""
        sums, rmin, rmax = step.sums, step.rmin, step.rmax
        if self.world > 1:
            from rl4bit.trainer.sharding import all_reduce

            keys = [k for k in sums if k not in ("loss", "max_abs")]  # the loss is already the group's
            sums.update(zip(keys, all_reduce([sums[k] for k in keys])))
            sums["max_abs"] = all_reduce([sums["max_abs"]], torch.distributed.ReduceOp.MAX)[0]
            rmin = all_reduce([rmin], torch.distributed.ReduceOp.MIN)[0]
            rmax = all_reduce([rmax], torch.distributed.ReduceOp.MAX)[0]
        ntok = max(step.total_tokens, 1.0)
        nrat = max(sums["tokens"], 1.0)
        comm = {}
        if self.ep > 1:
            from rl4bit.trainer.expert_parallel import comm_metrics

            comm = comm_metrics([m for m in (self.model, self.ref_model) if m is not None], reduce=True)  # all ranks
        norms = step.norms
        return comm | {
            "loss": sums["loss"] / len(norms),  # the epochs run (one if the first was non-finite)
            "grad_norm": sum(norms) / len(norms),
            "ppo/clip_frac": sums["clipped"] / nrat,
            "ratio/mean": sums["ratio_sum"] / nrat if sums["tokens"] else 1.0,
            "ratio/min": rmin if step.keep else 1.0,
            "ratio/max": rmax if step.keep else 1.0,
            "tis/truncated_frac": sums["tis_truncated"] / nrat,
            "tis/enabled": float(self.tis_cap is not None),
            "kl/ref": sums["kl_ref_sum"] / nrat,
            "mismatch/k3": sums["k3"] / ntok,
            "mismatch/max_abs": sums["max_abs"],
            "policy/entropy": sums["entropy"] / ntok,
            "train/skipped_steps": float(step.skipped),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "policy/version": float(self.version),
        }

    def _old_missing(self, mbs: list[list[int]], old: dict) -> bool:
        """Whether epoch 0 stopped before recording every "old" logprob (NaN/Inf raised mid-epoch), on any rank."""
        mine = [i for mb in (mbs if self.world == 1 else [mb[self.rank:: self.world] for mb in mbs]) for i in mb]
        return self._any_rank(any(i not in old for i in mine))

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank of the group (one all-reduce when world > 1): a decision every rank
        takes together."""
        if self.world == 1:
            return flag
        from rl4bit.trainer.sharding import all_reduce

        return all_reduce([float(flag)], torch.distributed.ReduceOp.MAX)[0] > 0

    def _microbatch_loss(self, batch: TrainBatch, mb: list[int], epoch: int, old: dict, ref: dict, sums: dict,
                         **loss_kw):
        """The PPO loss of micro-batch `mb` (and its stats). Epoch 0 also records the "old" and reference
        logprobs (into `old`, `ref`) and the entropy and sampler-vs-trainer mismatch (into `sums`)."""
        rl = self.rl
        logp_list, entropy = self._logprobs(self.model, batch, mb)
        if epoch == 0:
            for i, lp in zip(mb, logp_list):
                old[i] = lp.detach()
            if self.ref_model is not None:
                with torch.no_grad():
                    for i, lp in zip(mb, self._logprobs(self.ref_model, batch, mb)[0]):
                        ref[i] = lp
        logp, mask = stack(logp_list), pad([batch.completion_ids[i] for i in mb], self.device)[1]
        old_lp = stack([old[i] for i in mb])
        samp = pad([batch.sampler_logprobs[i] for i in mb], self.device)[0]
        if epoch == 0:  # entropy and the sampler-vs-trainer mismatch, read from the device together (one sync)
            m = mask.bool()
            # KL(sampler || trainer), in float64: an FP32 k3 is rounding noise below ~1e-7 a token
            kl = torch.where(m, grpo.k3(samp.double(), old_lp.double()), 0.0).sum()
            gap = torch.where(m, (samp - old_lp).abs(), 0.0)  # >= 0: a max over it is the real tokens' (0 if none)
            gap_max = gap.amax() if gap.numel() else gap.new_zeros(())
            ent, kl, gap_max = torch.stack([entropy.detach().double().reshape(()), kl, gap_max.double()]).tolist()
            sums["entropy"] += ent
            sums["k3"] += kl
            sums["max_abs"] = max(sums["max_abs"], gap_max)
        adv = to_device(torch.tensor([batch.advantages[i] for i in mb]), self.device)
        return grpo.ppo_clip_loss(logp, old_lp, adv, mask, clip_eps=rl.clip_eps, agg=rl.loss_agg, sampler_logp=samp,
                                  ref_logp=stack([ref[i] for i in mb]) if ref else None, kl_coef=rl.kl_coef,
                                  **loss_kw)

    def _dummy_microbatch(self, epoch: int) -> None:
        """A one-token forward/backward with zero loss weight: this rank joins the micro-batch's FSDP collectives."""
        dummy = TrainBatch([[0]], [[0]], [[0.0]], [0.0])
        logp_list, _ = self._logprobs(self.model, dummy, [0])
        if epoch == 0 and self.ref_model is not None:
            with torch.no_grad():
                self._logprobs(self.ref_model, dummy, [0])
        (logp_list[0].sum() * 0.0).backward()

    # ------------------------------------------------------------------ sync and state
    def weight_header(self) -> tuple[int, int, dict]:
        """(policy version, number of buckets, layout) of the next weight update (`rl4bit.trainer.weight_sync`)."""
        if self._sender is None:
            if self.optimizer is None:
                raise RuntimeError("weight sync before setup_rl(): the samplers serve the recipe-converted model; "
                                   "call trainer.setup_rl() (or load_state after it) first")
            # dense: FP32 masters, as computed with
            self._sender = WeightSender(self.model, self.plan, dense_dtype=None)
        return self.version, self._sender.num_buckets, self._sender.layout()

    def weight_bucket(self, index: int):
        """Bucket `index` of the current version: the stored tensors of whole layers, SHA-256 stamped.

        Quantized weights are re-quantized from the FP32 masters with nearest
        rounding (`module.quantized_weights()` -> `qgemm.quantize_weight`, the
        very call the forward makes; deterministic), not cached from the last
        forward: that forward ran before the optimizer step, so its QTensors are
        one step stale, and keeping them would hold a second copy of the expert
        weights. The bits shipped are the ones the next forward (and its logprob
        recompute) uses, so the samplers serve the trainer's QTensors bit for
        bit. Cost: one quantize pass over the expert weights per sync.
        """
        if self._sender is None:
            self.weight_header()
        if self.world == 1:
            return self._sender.bucket(self.version, index)
        from rl4bit.trainer.expert_parallel import full_experts
        from rl4bit.trainer.sharding import gathered

        names = [e.module for e in self._sender.groups[index]]
        with gathered(self.model, names), full_experts(self.model, names):  # every rank: all-gathers
            bucket = self._sender.bucket(self.version, index)
        return bucket if self.rank == 0 else None

    def weight_tensors(self):
        """The update of the current version as tensors on this trainer's device (one process, world == 1).

        -> (WeightUpdate(version, {state-dict name: dense tensor}), {module: {param: QTensor}}),
        for samplers in the same process (`Sampler.apply_tensors`, the driver's
        direct path): the values `weight_bucket` would ship, computed by the same
        call (`WeightSender.tensors` -> `checkpoint_format.entry_value`: QTensors
        re-quantized from the FP32 masters with nearest rounding, dense tensors
        the FP32 masters), never serialized or checksummed. The dense tensors
        are the live parameters themselves (receivers only copy from them); the
        QTensors are one new copy of the quantized weights, freed when the
        caller drops the update.
        """
        if self.world != 1:
            raise RuntimeError(f"weight_tensors on a sharded trainer (world {self.world}): its weights are spread "
                               "over ranks; sync through weight_header / weight_bucket")
        if self._sender is None:
            self.weight_header()
        return self._sender.tensors(self.version)

    def weight_shared(self) -> dict:
        """`weight_tensors` as CUDA IPC descriptions (`cuda_ipc.share_update`) for samplers in other processes on
        this GPU: plain data, no bytes copied. The update stays alive here until `release_shared`; call it once
        every sampler has applied it."""
        self._shared = self.weight_tensors()
        return cuda_ipc.share_update(*self._shared)

    def release_shared(self) -> None:
        """Drop the update `weight_shared` handed out (its QTensors are a copy of the quantized weights)."""
        self._shared = None

    def gpu_uuid(self) -> str | None:
        """This trainer's GPU (None off CUDA): samplers on the same one take updates by CUDA IPC."""
        return cuda_ipc.device_uuid(self.device)

    def sync_address(self) -> str:
        """A `tcp://` address on this trainer's host for the weight-sync group (`tensor_broadcast.local_address`)."""
        return tensor_broadcast.local_address()

    def join_sync_group(self, address: str, world: int, backend: str, timeout_s: float) -> None:
        """Join the weight-sync group as its rank 0 (the samplers are 1..world-1); `broadcast_weights` then sends."""
        self._one_rank("join_sync_group")
        self._sync_group.join(address, world, 0, backend, timeout_s)

    def sync_group(self) -> str | None:
        """The address of the weight-sync group this trainer is in (None: none)."""
        return self._sync_group.address

    def broadcast_weights(self) -> int:
        """Broadcast the current version's update to the sync group's samplers (`tensor_broadcast`: the
        `weight_tensors` values, no serialization); the bytes each receives. WeightSyncError when any failed."""
        update, quantized = self.weight_tensors()
        tensor_broadcast.broadcast_tensors(0, update=update, quantized=quantized)
        return update_bytes(update, quantized)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's full tensors on rank 0, None elsewhere (collectives: every rank calls it; tests and exports)."""
        if self.world == 1:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        from rl4bit.trainer.expert_parallel import full_expert_state
        from rl4bit.trainer.sharding import full_value

        experts = full_expert_state(self.model)
        out = {k: experts[k].cpu() if k in experts else full_value(v).detach().cpu().clone()
               for k, v in self.model.state_dict().items()}
        return out if self.rank == 0 else None

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything to resume, as tensors and JSON-able metadata (`trainer_state.collect`)."""
        return trainer_state.collect(self)

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore `state()` (call after setup_rl); CheckpointError, before anything changes, when it does not fit
        this trainer (`trainer_state.restore`)."""
        trainer_state.restore(self, tensors, meta)

    def save_checkpoint(self, run_dir: str | Path, step: int, meta: dict, keep: int = 2) -> Path:
        """Write `state()` as checkpoint `step` of `run_dir` (`rl4bit.common.checkpoint`, one tensor file) with
        `meta` and this trainer's meta ("trainer") in its state.json; the checkpoint directory. One rank's form of
        `TrainerGroup.save_checkpoint`: the trainer writes its own state, as every rank of a group writes its shard."""
        self._one_rank("save_checkpoint")
        tensors, mine = self.state()
        return save_checkpoint(run_dir, step, tensors, {"trainer": mine, **meta}, keep=keep)

    def load_checkpoint(self, run_dir: str | Path) -> dict:
        """Restore the latest checkpoint of `run_dir` (call after setup_rl); its state.json. One rank's form of
        `TrainerGroup.load_checkpoint`. FileNotFoundError when the run has none; CheckpointError for a damaged file
        (named), a checkpoint of a trainer group, or a state that does not fit this trainer."""
        self._one_rank("load_checkpoint")
        tensors, meta = load_checkpoint(run_dir, world=1)
        self.load_state(tensors, meta["trainer"])
        return meta

    def _one_rank(self, what: str) -> None:
        if self.world != 1:
            raise RuntimeError(f"{what} on trainer rank {self.rank} of {self.world}: a trainer group checkpoints "
                               "and syncs through rl4bit.trainer_group.TrainerGroup (every rank writes its shard)")
