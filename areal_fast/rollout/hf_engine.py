"""Embedded inference engine on top of transformers generation (CPU or GPU)."""

from __future__ import annotations

from typing import Iterable

import torch

from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.engine import SamplingParams


class HFEngine:
    """An :class:`~areal_fast.rollout.engine.InferenceEngine` running ``model.generate``.

    Prompts are left-padded into batches of at most ``max_batch_size`` sequences. Sampling
    uses temperature and top-p only: top-k, repetition penalties and every other logits
    processor that a model's ``generation_config.json`` may set are switched off. The
    behaviour log-prob of each generated token is ``log_softmax(logits / temperature)`` of the
    raw logits, i.e. the tempered full distribution that the trainer recomputes, so the PPO
    ratio is exactly 1 on-policy; with top_p < 1 the tokens are drawn from the nucleus of that
    distribution (the convention of vLLM's default logprobs). Greedy decoding (temperature 0)
    reports log-probs at temperature 1.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM; the engine owns it (weights change through :meth:`update_weights`).
    tokenizer : transformers tokenizer
        Supplies ``pad_token_id`` and ``eos_token_id``.
    max_batch_size : int
        Sequences generated together.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 64):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size} must be >= 1")
        from transformers import GenerationConfig

        self.model = model.eval()
        # transformers fills unset sampling options from the model's own generation config;
        # a neutral one keeps a model's repetition penalty etc. out of the sampling.
        self.model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.max_batch_size = max_batch_size
        self._version = 0

    @property
    def version(self) -> int:
        """Policy version of the weights currently served."""
        return self._version

    @property
    def device(self) -> torch.device:
        """Device of the served weights."""
        return next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        """Sample ``params.n`` completions per prompt; prompt-major order.

        ``group_id`` of each trajectory is the index of its prompt in ``prompts``.

        Raises
        ------
        ValueError
            If a prompt is empty.
        """
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty")
        expanded = [(gid, p) for gid, p in enumerate(prompts) for _ in range(params.n)]
        out: list[Trajectory] = []
        for start in range(0, len(expanded), self.max_batch_size):
            out.extend(self._generate_batch(expanded[start:start + self.max_batch_size], params))
        return out

    @torch.inference_mode()
    def _generate_batch(self, items: list[tuple[int, list[int]]], params: SamplingParams):
        from transformers import GenerationConfig

        width = max(len(p) for _, p in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (_, prompt) in enumerate(items):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        sample = params.temperature > 0
        config = GenerationConfig(
            do_sample=sample, temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None, top_k=0 if sample else None,
            max_new_tokens=params.max_new_tokens, pad_token_id=self.pad_id,
            eos_token_id=self.eos_id, return_dict_in_generate=True, output_logits=True)
        result = self.model.generate(input_ids=input_ids.to(self.device),
                                     attention_mask=attention_mask.to(self.device),
                                     generation_config=config)
        new_tokens = result.sequences[:, width:].cpu()
        scale = params.temperature if sample else 1.0
        logprobs = torch.stack([torch.log_softmax(s.float() / scale, dim=-1).gather(
            1, new_tokens[:, i:i + 1].to(s.device)).squeeze(1).cpu()
            for i, s in enumerate(result.logits)], dim=1)
        return [self._trajectory(gid, prompt, new_tokens[row], logprobs[row])
                for row, (gid, prompt) in enumerate(items)]

    def _trajectory(self, gid, prompt, tokens, logprobs) -> Trajectory:
        tokens = tokens.tolist()
        stop = tokens.index(self.eos_id) if self.eos_id in tokens else None
        length = len(tokens) if stop is None else stop + 1
        return Trajectory(prompt_ids=list(prompt), completion_ids=tokens[:length],
                          logprobs=logprobs[:length].tolist(), versions=[self._version] * length,
                          stop_reason="length" if stop is None else "stop", group_id=gid)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Install a complete set of new weights (in-process copy) and their version.

        All names, shapes are checked before any parameter changes, so a bad update leaves
        the previous weights served intact. Tensors are cast to the engine's dtype. Tied
        parameters (e.g. input/output embeddings) are updated once and stay aliased.

        Raises
        ------
        ValueError
            An unknown parameter name, a shape mismatch, or a parameter missing from the
            update (each message names the tensor).
        """
        params = dict(self.model.named_parameters())
        incoming = dict(named_tensors)
        for name, tensor in incoming.items():
            if name not in params:
                raise ValueError(f"weight update: engine has no parameter named {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"weight update: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"engine expects {tuple(params[name].shape)}")
        missing = sorted(set(params) - set(incoming))
        if missing:
            raise ValueError(f"weight update: missing {len(missing)} parameters, "
                             f"first {missing[0]!r}")
        for name, tensor in incoming.items():
            params[name].copy_(tensor)
        self._version = int(version)
