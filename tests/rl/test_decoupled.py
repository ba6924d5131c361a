"""Decoupled PPO in the torch trainer: proximal log-probs, minibatches, behaviour weights."""

import copy

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl import fused_loss as loss_ops
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.rl.config import LossConfig
from areal_fast.rl.decoupled import loglinear_prox_logprobs
from areal_fast.train import torch_engine
from areal_fast.train.config import ActorConfig
from areal_fast.train.torch_engine import OptimizerConfig, TorchTrainEngine, packed_forward_logprobs


def _trajectories(vocab, seed, max_version=3, num=8):
    """Random trajectories with random behaviour log-probs and per-token versions."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(num):
        p = int(torch.randint(2, 7, (1,), generator=g))
        c = int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        behav = (-torch.rand(c, generator=g) * 4 - 1).tolist()
        versions = torch.randint(0, max_version + 1, (c,), generator=g).sort().values.tolist()
        trajs.append(Trajectory(ids[:p], ids[p:], behav, versions, "stop", group_id=i // 2))
    return trajs, torch.randn(num, generator=g)


def _batch(vocab, seed, max_version=3):
    return pack_trajectories(*_trajectories(vocab, seed, max_version))


def _with_behav(trajs, advantages, logprobs):
    """Re-pack ``trajs`` with behaviour log-probs taken from a packed [T] tensor."""
    batch = pack_trajectories(trajs, advantages)
    per_token = logprobs[batch.loss_mask].tolist()
    out, start = [], 0
    for t in trajs:
        n = len(t.completion_ids)
        out.append(
            Trajectory(
                t.prompt_ids,
                t.completion_ids,
                per_token[start : start + n],
                t.versions,
                t.stop_reason,
                t.group_id,
            )
        )
        start += n
    return pack_trajectories(out, advantages)


def _model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


def _trainer(model, loss_config=None, lr=1e-3, initial_version=0, **actor_fields):
    """A trainer at temperature 0.9; ``actor_fields`` over plain PPO with groups free to
    split and a 40-token micro-batch budget."""
    fields = {
        "keep_groups": False,
        "use_decoupled_loss": False,
        "max_tokens_per_mb": 40,
        **actor_fields,
    }
    actor = ActorConfig(loss=loss_config or LossConfig(), optim=OptimizerConfig(lr=lr), **fields)
    return TorchTrainEngine(model, actor, temperature=0.9, initial_version=initial_version)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------------------
# loglinear_prox_logprobs
# ---------------------------------------------------------------------------------------


def test_loglinear_matches_float64_hand_computation(fresh_seed):
    num, prox_version = 64, 5
    logprobs = -torch.rand(num) * 5
    behav = -torch.rand(num) * 5
    staleness = torch.randint(0, 4, (num,))  # 0 (on-policy), 1, 2, 3
    staleness[:4] = torch.tensor([0, 1, 2, 3])
    versions = (prox_version - staleness).to(torch.int32)
    mask = torch.rand(num) < 0.8
    mask[:4] = True
    versions[~mask] = -1
    out = loglinear_prox_logprobs(logprobs, behav, versions, prox_version, mask)

    lp, bh = logprobs.double(), behav.double()
    for t in range(num):
        if not mask[t]:
            assert out[t] == behav[t]
            continue
        v_b = int(versions[t])
        alpha = (prox_version - v_b) / ((prox_version + 1) - v_b)
        expected = float(bh[t]) + alpha * (float(lp[t]) - float(bh[t]))
        assert float(out[t]) == pytest.approx(expected, abs=1e-5)
    on_policy = mask & (staleness == 0)
    assert torch.equal(out[on_policy], behav[on_policy])  # alpha = 0 exactly
    one = mask & (staleness == 1)
    assert torch.allclose(out[one], 0.5 * (behav[one] + logprobs[one]), atol=1e-6)


@pytest.mark.parametrize("bad, match", [(6, "newer than prox_version"), (-2, ">= 0")])
def test_loglinear_rejects_bad_versions(bad, match):
    versions = torch.tensor([5, bad, -1], dtype=torch.int32)
    mask = torch.tensor([True, True, False])
    with pytest.raises(ValueError, match=match):
        loglinear_prox_logprobs(torch.zeros(3), torch.zeros(3), versions, 5, mask)
    # the same version on a masked-out token is ignored
    loglinear_prox_logprobs(
        torch.zeros(3), torch.zeros(3), versions, 5, torch.tensor([True, False, False])
    )


def test_loglinear_in_trainer_uses_interpolated_prox(tiny_model_dir, fresh_seed, monkeypatch):
    model = _model(tiny_model_dir)
    trainer = _trainer(
        model, use_decoupled_loss=True, prox_logp_method="loglinear", initial_version=3
    )
    batch = _batch(model.config.vocab_size, fresh_seed % 1000, max_version=3)
    before = copy.deepcopy(model)
    seen = _spy_grpo_loss(monkeypatch)
    stats = trainer.train_step(batch)
    assert len(seen) >= 1 and stats["version"] == 4.0
    stale = (3 - batch.versions[batch.loss_mask]).double()
    assert stats["staleness_mean"] == pytest.approx(float(stale.mean()))
    assert stats["staleness_max"] == float(stale.max())
    for mb, _, prox in seen:
        start, _ = packed_forward_logprobs(before, mb, 0.9, with_entropy=False)
        expected = loglinear_prox_logprobs(start, mb.behav_logprobs, mb.versions, 3, mb.loss_mask)
        assert torch.allclose(prox[mb.loss_mask], expected[mb.loss_mask], atol=1e-5)
        assert not torch.allclose(prox[mb.loss_mask], start[mb.loss_mask], atol=1e-3)


# ---------------------------------------------------------------------------------------
# recompute
# ---------------------------------------------------------------------------------------


def _spy_grpo_loss(monkeypatch):
    """Record (micro-batch, current log-probs, prox log-probs) of every grpo_loss call (the
    fused loss's, or the composed reference's)."""
    seen, current_mb = [], []
    original_mb_loss = TorchTrainEngine._micro_batch_loss

    def mb_loss(self, mb, *args, **kwargs):
        current_mb[:] = [mb]
        return original_mb_loss(self, mb, *args, **kwargs)

    def spy(original_loss):
        def loss(logprobs, *args, prox_logprobs=None, **kwargs):
            prox = None if prox_logprobs is None else prox_logprobs.detach().clone()
            seen.append((current_mb[0], logprobs.detach().clone(), prox))
            return original_loss(logprobs, *args, prox_logprobs=prox_logprobs, **kwargs)

        return loss

    monkeypatch.setattr(TorchTrainEngine, "_micro_batch_loss", mb_loss)
    monkeypatch.setattr(torch_engine, "grpo_loss", spy(torch_engine.grpo_loss))
    monkeypatch.setattr(loss_ops, "grpo_loss", spy(loss_ops.grpo_loss))
    return seen


def test_recompute_single_minibatch_equals_explicit_pass(tiny_model_dir, fresh_seed):
    loss_config = LossConfig(behav_weight_cap=5.0)
    batch = _batch(_model(tiny_model_dir).config.vocab_size, fresh_seed % 1000)
    # gradients: in-forward detached log-probs vs an explicit no-grad pass
    inline = _trainer(
        _model(tiny_model_dir), loss_config, use_decoupled_loss=True, initial_version=3
    )
    explicit = _trainer(
        _model(tiny_model_dir), loss_config, use_decoupled_loss=True, initial_version=3
    )
    stats_a = inline.accumulate_gradients(batch)
    stats_b = explicit.accumulate_gradients(batch, prox_logprobs=explicit.recompute_logprobs(batch))
    assert stats_a["num_micro_batches"] > 1
    assert torch.allclose(_flat_grad(inline.model), _flat_grad(explicit.model), atol=1e-5)
    for key in ("loss", "behav_weight_mean", "ratio_mean", "clip_fraction"):
        assert stats_a[key] == pytest.approx(stats_b[key], rel=1e-5, abs=1e-6), key
    # whole steps: same updated weights and metrics
    inline = _trainer(
        _model(tiny_model_dir), loss_config, use_decoupled_loss=True, initial_version=3
    )
    explicit = _trainer(
        _model(tiny_model_dir), loss_config, use_decoupled_loss=True, initial_version=3
    )
    explicit._explicit_prox_pass = True
    stats_a, stats_b = inline.train_step(batch), explicit.train_step(batch)
    assert torch.allclose(_flat(inline.model), _flat(explicit.model), atol=1e-5)
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-5, abs=1e-6)
    assert stats_a["grad_norm"] == pytest.approx(stats_b["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("method", ["recompute", "loglinear"])
def test_on_policy_batch_equals_plain_step(tiny_model_dir, fresh_seed, method):
    model = _model(tiny_model_dir)
    trajs, adv = _trajectories(model.config.vocab_size, fresh_seed % 1000, max_version=0)
    probe = _trainer(copy.deepcopy(model))
    batch = _with_behav(trajs, adv, probe.recompute_logprobs(pack_trajectories(trajs, adv)))
    plain = _trainer(copy.deepcopy(model))
    decoupled = _trainer(copy.deepcopy(model), use_decoupled_loss=True, prox_logp_method=method)
    stats_plain, stats_dec = plain.train_step(batch), decoupled.train_step(batch)
    assert torch.allclose(_flat(plain.model), _flat(decoupled.model), atol=1e-6)
    assert stats_dec["loss"] == pytest.approx(stats_plain["loss"], rel=1e-5, abs=1e-7)
    assert stats_dec["behav_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats_dec["staleness_mean"] == 0.0 and stats_dec["staleness_max"] == 0.0
    assert "behav_weight_mean" not in stats_plain and "staleness_mean" not in stats_plain
    assert stats_plain["num_minibatches"] == 1.0 and stats_plain["version"] == 1.0


def test_two_minibatches_use_step_start_prox(tiny_model_dir, fresh_seed, monkeypatch):
    model = _model(tiny_model_dir)
    batch = _batch(model.config.vocab_size, fresh_seed % 1000)
    one = _trainer(
        copy.deepcopy(model), use_decoupled_loss=True, initial_version=3, keep_groups=True
    )
    one.train_step(batch)

    two = _trainer(
        copy.deepcopy(model),
        use_decoupled_loss=True,
        initial_version=3,
        keep_groups=True,
        ppo_n_minibatches=2,
    )
    before = copy.deepcopy(two.model)
    parts = two.minibatch_parts(batch)
    assert len(parts) == 2 and sorted(i for p in parts for i in p) == list(range(8))
    for part in parts:  # groups (two sequences each) stay together
        assert len({int(batch.group_ids[i]) for i in part}) * 2 == len(part)
    seen = _spy_grpo_loss(monkeypatch)
    stats = two.train_step(batch)

    assert stats["num_minibatches"] == 2.0 and stats["version"] == 4.0 and two.version == 4
    steps = {
        int(two.optimizer.state[p]["step"])
        for p in two.model.parameters()
        if p in two.optimizer.state
    }
    assert steps == {2}
    assert not torch.allclose(_flat(one.model), _flat(two.model), atol=1e-6)
    assert stats["num_micro_batches"] == float(len(seen))
    for mb, _, prox in seen:
        start, _ = packed_forward_logprobs(before, mb, 0.9, with_entropy=False)
        assert torch.allclose(prox[mb.loss_mask], start[mb.loss_mask], atol=1e-5)
    (_, first_lp, first_prox), (_, last_lp, last_prox) = seen[0], seen[-1]
    first_mask, last_mask = seen[0][0].loss_mask, seen[-1][0].loss_mask
    # the first minibatch runs at the step-start weights, the second on updated ones
    assert torch.allclose(first_lp[first_mask], first_prox[first_mask], atol=1e-5)
    assert (last_lp - last_prox)[last_mask].abs().max() > 1e-4


def test_behav_weight_cap_masks_tokens(tiny_model_dir, fresh_seed):
    cap = 2.0
    model = _model(tiny_model_dir)
    trajs, adv = _trajectories(model.config.vocab_size, fresh_seed % 1000)
    packed = pack_trajectories(trajs, adv)
    current = _trainer(copy.deepcopy(model)).recompute_logprobs(packed)
    g = torch.Generator().manual_seed(fresh_seed)
    # log-weights far from log(cap) = 0.69, so the masked set is unambiguous
    shift = torch.tensor([-0.5, 0.0, 1.0])[torch.randint(0, 3, current.shape, generator=g)]
    batch = _with_behav(trajs, adv, current - shift)
    high = batch.loss_mask & (shift > 0.69)
    assert 0 < int(high.sum()) < int(batch.loss_mask.sum())

    config = LossConfig(aggregation="token_sum", behav_weight_cap=cap)
    capped = _trainer(copy.deepcopy(model), config, use_decoupled_loss=True)
    stats = capped.accumulate_gradients(batch)
    weight = torch.exp(current - batch.behav_logprobs)[batch.loss_mask]
    assert stats["behav_weight_masked_fraction"] == pytest.approx(
        float((weight > cap).float().mean()), abs=1e-6
    )
    assert stats["behav_weight_mean"] == pytest.approx(float(weight.mean()), rel=1e-4)

    # token_sum: masked tokens contribute nothing, so dropping them changes no gradient
    kept = copy.copy(batch)
    kept.loss_mask = batch.loss_mask & ~high
    reference = _trainer(
        copy.deepcopy(model), LossConfig(aggregation="token_sum"), use_decoupled_loss=True
    )
    ref_stats = reference.accumulate_gradients(kept)
    assert ref_stats["behav_weight_masked_fraction"] == 0.0
    assert torch.allclose(
        _flat_grad(capped.model), _flat_grad(reference.model), rtol=1e-4, atol=1e-6
    )
    uncapped = _trainer(
        copy.deepcopy(model), LossConfig(aggregation="token_sum"), use_decoupled_loss=True
    )
    uncapped.accumulate_gradients(batch)
    assert not torch.allclose(
        _flat_grad(capped.model), _flat_grad(uncapped.model), rtol=1e-4, atol=1e-6
    )


# ---------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prox_logp_method": "rollout"}, "prox_logp_method"),
        ({"ppo_n_minibatches": 0}, "ppo_n_minibatches"),
        ({"ppo_n_minibatches": 1.5}, "ppo_n_minibatches"),
        ({"initial_version": -1}, "initial_version"),
    ],
)
def test_bad_arguments(tiny_model_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        _trainer(_model(tiny_model_dir), **kwargs)


def test_too_many_minibatches_and_stray_prox(tiny_model_dir):
    model = _model(tiny_model_dir)
    batch = _batch(model.config.vocab_size, 7)
    trainer = _trainer(model, keep_groups=True, ppo_n_minibatches=5)  # 4 groups
    with pytest.raises(ValueError, match="ppo_n_minibatches"):
        trainer.train_step(batch)
    with pytest.raises(ValueError, match="prox_logprobs"):
        trainer.accumulate_gradients(batch, prox_logprobs=torch.zeros(batch.num_tokens))
    loglinear = _trainer(
        model,
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
        initial_version=2,
        ppo_n_minibatches=2,
    )  # versions up to 3: newer
    before = _flat(model)
    with pytest.raises(ValueError, match="prox_version"):
        loglinear.train_step(batch)
    assert torch.equal(_flat(model), before) and loglinear.version == 2  # no partial update
