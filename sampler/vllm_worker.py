"""vLLM's worker extension (`worker_extension_cls`): `RepackMoE`, methods vLLM mixes into its worker class.

They run in vLLM's worker, in-process or in its own process: the MoE repack after each reload (why:
`rl4bit.sampler.vllm_engine`'s module doc), the reload from CUDA IPC descriptions, and a report of the kernels
vLLM chose. `VLLMEngine` names the class by import path and the worker imports this module itself, so it
imports nothing at module level (vLLM, torch and `rl4bit.trainer.cuda_ipc` only inside the methods).
"""

from __future__ import annotations


class RepackMoE:
    """vLLM worker extension (`worker_extension_cls`): methods vLLM mixes into its worker class.

    `rl4bit_repack_moe()` runs, after `reload_weights`, the expert kernel's
    `process_weights_after_loading` of every unquantized MoE layer (the CPU
    prepack) that vLLM's reload leaves out; returns how many layers it did.
    """

    def rl4bit_repack_moe(self) -> int:
        from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

        n = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "moe_kernel", None) if isinstance(method, UnquantizedFusedMoEMethod) else None
            if kernel is not None:
                # UnquantizedFusedMoEMethod._setup_kernel skips this step on a weight update
                # (`is_weight_update`); on CPU it is the prepack into the grouped-GEMM layout, so without it
                # the experts read raw weights as packed ones. Quantized MoE methods (e.g. compressed-tensors
                # NVFP4) re-run it themselves inside process_weights_after_loading: not touched here.
                kernel.fused_experts.process_weights_after_loading(module)
                n += 1
        return n

    def rl4bit_reload_shared(self, shared: dict[str, dict]) -> int:
        """`reload_weights` from CUDA IPC descriptions (`rl4bit.trainer.cuda_ipc.share`) of the sender's device
        tensors; returns once the worker's copies are done (the sender may then free them)."""
        import torch

        from rl4bit.trainer.cuda_ipc import open_shared

        tensors = open_shared(shared)
        self.model_runner.reload_weights(weights_iterator=list(tensors.items()))
        torch.cuda.synchronize()
        return len(tensors)

    def rl4bit_kernels(self) -> dict[str, list[str]]:
        """{quant method class: [kernel classes]} over the model's layers: what vLLM chose to run each format
        with (e.g. CompressedTensorsW4A4Nvfp4MoEMethod with MarlinExperts on Hopper)."""
        seen: dict[str, set[str]] = {}
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            kinds = seen.setdefault(type(method).__name__, set())
            for attr in ("moe_kernel", "kernel", "scheme"):
                part = getattr(method, attr, None)
                if part is not None:
                    kinds.add(type(getattr(part, "fused_experts", part)).__name__)
            scheme = getattr(module, "scheme", None)
            if scheme is not None:
                kinds.add(type(scheme).__name__)
                kernel = getattr(scheme, "kernel", None)
                if kernel is not None:
                    kinds.add(type(kernel).__name__)
        return {k: sorted(v) for k, v in seen.items()}
