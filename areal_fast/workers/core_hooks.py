"""Where the processes of a shared core table check it (:mod:`.core_share`): hooks in the
trainer's model and optimizer, in a rollout engine's model and weight installs, and the
worker processes' start (:func:`trainer_cores`, :func:`rollout_cores`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from areal_fast.workers.core_share import CoreShare, CoreShareSpec, FixedCores


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The decoder of a causal LM (``get_decoder()``, else the model) and its layers
    (``decoder.layers``, else the longest ``ModuleList`` of the model; [] when it has none)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = max(lists, key=len) if lists else []
    return decoder, list(layers)


def hook_trainer(share: CoreShare, trainer) -> list:
    """Checks of ``share`` inside a trainer's step: before every decoder layer's forward,
    after the decoder (before the LM head and the loss), before every layer's backward (a
    gradient hook on the layer's output) and before each optimizer step.

    Parameters
    ----------
    share : CoreShare
    trainer : TrainEngine
        Its ``model`` (an ``nn.Module``) and ``optimizer`` get the hooks where it has them
        (a trainer without them is checked at the start of each step only).

    Returns
    -------
    list
        The hooks' removable handles.
    """

    def check(*_):  # hooks: None keeps the inputs, outputs and gradients as they are
        share.check()

    def on_output(module, args, output):
        if isinstance(output, (tuple, list)):
            output = next((o for o in output if isinstance(o, torch.Tensor)), None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(check)

    handles = []
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module):
        decoder, layers = decoder_layers(model)
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(check))
            handles.append(layer.register_forward_hook(on_output))
        handles.append(decoder.register_forward_hook(check))
    optimizer = getattr(trainer, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        handles.append(optimizer.register_step_pre_hook(check))
    return handles


def hook_engine(share: CoreShare, engine) -> list:
    """Mark a rollout engine's work in ``share``: a :meth:`CoreShare.pulse` before every
    forward of its model and of each decoder layer (each decode step, in the thread that
    generates), and a :meth:`CoreShare.working` block around its weight installs
    (``update_weights``, ``update_weights_from_buffer``, ``receive_weights``, where it has
    them). An engine without a torch model in this process (a server, vLLM)
    is marked as always working: its threads are not this process's to set.

    Returns
    -------
    list
        The hooks' removable handles ([] for an engine without a model).
    """
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        share.always_working()
        return []

    def pulse(*_):
        share.pulse()

    _, layers = decoder_layers(model)
    handles = [m.register_forward_pre_hook(pulse) for m in [model, *layers]]
    for name in ("update_weights", "update_weights_from_buffer", "receive_weights"):
        method = getattr(engine, name, None)
        if callable(method):
            setattr(engine, name, _while_working(share, method))
    return handles


def _while_working(share: CoreShare, method):
    def call(*args, **kwargs):
        with share.working():
            return method(*args, **kwargs)

    call.__wrapped__ = method
    return call


def trainer_cores(spec: Optional[CoreShareSpec], trainer):
    """A trainer process's cores: a :class:`CoreShare` of ``spec`` with its hooks in
    ``trainer`` (:func:`hook_trainer`), or :class:`FixedCores` when ``spec`` is None."""
    if spec is None:
        return FixedCores()
    share = CoreShare(spec)
    hook_trainer(share, trainer)
    return share


class SharedEngineFactory:
    """An engine factory whose engines mark their work in a :class:`CoreShare`
    (:func:`hook_engine`); ``for_worker`` passes through to the wrapped factory's."""

    def __init__(self, factory, share: CoreShare):
        self.factory, self.share = factory, share

    def for_worker(self, name: str) -> "SharedEngineFactory":
        """The wrapped factory specialised to worker ``name`` (where it can be), wrapped."""
        specialise = getattr(self.factory, "for_worker", None)
        return SharedEngineFactory(specialise(name) if specialise else self.factory, self.share)

    def __call__(self):
        engine, decode = self.factory()
        hook_engine(self.share, engine)
        return engine, decode


def rollout_cores(spec):
    """A rollout worker's spec as its process runs it: torch threads set to ``spec.threads``
    and, with ``spec.cores``, the slot claimed and the engine factory a
    :class:`SharedEngineFactory`."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.cores is None:
        return spec
    return dataclasses.replace(
        spec, engine_factory=SharedEngineFactory(spec.engine_factory, CoreShare(spec.cores))
    )
