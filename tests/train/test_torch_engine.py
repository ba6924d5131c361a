"""The torch trainer: micro-batch gradient accumulation equals one pass over the batch."""

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.rl.config import LossConfig
from areal_fast.train.config import ActorConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine


def _batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(8):
        p, c = (
            int(torch.randint(2, 9, (1,), generator=g)),
            int(torch.randint(1, 12, (1,), generator=g)),
        )
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        behav = (-torch.rand(c, generator=g) * 4).tolist()
        trajs.append(
            Trajectory(
                ids[:p],
                ids[p:],
                behav,
                [0] * c,
                "stop",
                group_id=i // 2,
                reward=float(torch.rand(1, generator=g)),
            )
        )
    adv = torch.randn(8, generator=g)
    return pack_trajectories(trajs, adv)


AGGREGATIONS = [
    LossConfig(),
    LossConfig(aggregation="seq_mean_token_mean"),
    LossConfig(aggregation="seq_mean_token_sum", seq_len_norm=8.0),
    LossConfig(aggregation="token_sum", kl_coef=0.1, entropy_coef=0.01),
]


@pytest.mark.parametrize("loss_config", AGGREGATIONS, ids=lambda c: c.aggregation)
@pytest.mark.parametrize("method", ["kk", "ffd"])
def test_micro_batches_accumulate_to_full_batch_gradient(
    tiny_model_dir, loss_config, method, fresh_seed
):
    grads = []
    for budget in (10_000, 24):
        model = load_causal_lm(str(tiny_model_dir))
        ref = load_causal_lm(str(tiny_model_dir)) if loss_config.kl_coef else None
        if ref is not None:
            g = torch.Generator().manual_seed(fresh_seed)
            with torch.no_grad():  # a reference that differs from the policy, same in both runs
                for p in ref.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        actor = ActorConfig(
            loss=loss_config,
            optim=OptimizerConfig(),
            max_tokens_per_mb=budget,
            pack_method=method,
            keep_groups=False,
            use_decoupled_loss=False,
        )
        trainer = TorchTrainEngine(model, actor, temperature=0.9, ref_model=ref)
        batch = _batch(model.config.vocab_size, fresh_seed % 1000)
        stats = trainer.accumulate_gradients(batch)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), stats))
    (full, full_stats), (split, split_stats) = grads
    assert full_stats["num_micro_batches"] == 1 and split_stats["num_micro_batches"] > 2
    assert torch.allclose(full, split, rtol=1e-4, atol=1e-6), (full - split).abs().max()
    assert full_stats["loss"] == pytest.approx(split_stats["loss"], rel=1e-5, abs=1e-7)


def test_train_step_changes_weights_and_clips(tiny_model_dir, fresh_seed):
    model = load_causal_lm(str(tiny_model_dir))
    before = [p.detach().clone() for p in model.parameters()]
    actor = ActorConfig(
        loss=LossConfig(),
        optim=OptimizerConfig(lr=1e-3, grad_clip=1e-3),
        keep_groups=False,
        use_decoupled_loss=False,
    )
    trainer = TorchTrainEngine(model, actor, temperature=1.0)
    stats = trainer.train_step(_batch(model.config.vocab_size, 3))
    assert stats["grad_norm"] > 1e-3  # pre-clip norm is reported
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_keep_groups_never_splits_a_group(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    actor = ActorConfig(
        loss=LossConfig(),
        optim=OptimizerConfig(),
        max_tokens_per_mb=40,
        keep_groups=True,
        use_decoupled_loss=False,
    )
    trainer = TorchTrainEngine(model, actor, temperature=1.0)
    batch = _batch(model.config.vocab_size, 5)
    seen = {}
    for i, mb in enumerate(trainer.micro_batches(batch)):
        assert mb.num_tokens <= 40
        for gid in mb.group_ids.tolist():
            assert seen.setdefault(gid, i) == i
    assert sorted(seen) == sorted(set(batch.group_ids.tolist()))


def test_kl_needs_reference(tiny_model_dir):
    with pytest.raises(ValueError, match="reference"):
        TorchTrainEngine(
            load_causal_lm(str(tiny_model_dir)),
            ActorConfig(loss=LossConfig(kl_coef=0.1)),
            temperature=1.0,
        )
