"""trainer.recompute: activation recomputation changes memory, not bits (SR call counters rewound on the re-run)."""

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from rl4bit.config import ConfigError, load_config, trainer_args
from rl4bit.trainer import recompute
from rl4bit.trainer.actor import TrainBatch, Trainer, sequence_logprobs

from .conftest import QUICKSTART, SMALL

ARGS = SMALL + ["trainer.tokens_per_microbatch=40", "model.num_layers=3"]  # several micro-batches, two PPO epochs


def _batch(vocab: int, n: int = 8) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    comps = [torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    return TrainBatch(prompts, comps, [[-1.0] * len(c) for c in comps], [(-1.0) ** i * (0.5 + i / n) for i in range(n)])


def _trained(recipe: str, on: bool, early_stop: bool = True):
    cfg = load_config(QUICKSTART, ARGS + [f"recipe.name={recipe}", f"trainer.recompute={str(on).lower()}"])
    t = Trainer(**trainer_args(cfg))
    t.setup_rl()
    with set_checkpoint_early_stop(early_stop):
        metrics = t.train_step(_batch(len(t.tokenizer)))
    return t, metrics


@pytest.mark.parametrize("recipe,early_stop", [("nvfp4", True), ("nvfp4", False), ("mxfp8", True), ("bf16", True)])
def test_recompute_gives_the_same_bits(recipe, early_stop):
    (a, ma), (b, mb) = _trained(recipe, False), _trained(recipe, True, early_stop)
    assert recompute.decoder_layers(b.model)[0]._rl4bit_recompute
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    differ = [k for k in pa if not torch.equal(pa[k], pb[k])]
    assert not differ, f"{len(differ)} of {len(pa)} parameters differ after one step with recomputation: {differ[:3]}"


def test_without_the_counter_rewind_stochastic_rounding_draws_other_bits(monkeypatch):
    """A re-run that runs to the end of the layer (early stop off) advances the call counters; without the rewind
    the later micro-batches' keys shift and the nvfp4 gradients change: the rewind is what keeps the bits."""
    a, _ = _trained("nvfp4", False)
    monkeypatch.setattr(recompute, "_counters", lambda model: [])  # rewind the implementation choice only
    b, _ = _trained("nvfp4", True, early_stop=False)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert any(not torch.equal(pa[k], pb[k]) for k in pa)


def test_recompute_keeps_fewer_activations():
    """Bytes autograd keeps for the backward of one micro-batch's forward (the outermost saved-tensor hooks see what
    stays alive; checkpoint's own hooks drop the layer internals)."""
    saved = {}
    for on in (False, True):
        cfg = load_config(QUICKSTART, ARGS + ["recipe.name=nvfp4", f"trainer.recompute={str(on).lower()}",
                                              "model.hidden_size=64", "model.expert_intermediate_size=64"])
        t = Trainer(**trainer_args(cfg))
        t.setup_rl()
        batch = _batch(len(t.tokenizer), n=6)
        total = [0]

        def pack(x):
            total[0] += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            sequence_logprobs(t.model, batch.prompt_ids, batch.completion_ids, 1.0, cfg.model.max_seq_len)
        saved[on] = total[0]
    print(f"saved for backward: {saved[False]:,} B plain, {saved[True]:,} B with recompute")
    assert saved[True] < 0.5 * saved[False], saved


def test_recompute_with_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="recompute.*world_size=2"):
        load_config(QUICKSTART, ARGS + ["trainer.recompute=true", "trainer.world_size=2"])
