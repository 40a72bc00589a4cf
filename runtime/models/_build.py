"""How every toy model gets its weights: from a fixed seed, on the CPU, then moved to its device.

The modules are declared inside :func:`declaring` and then filled from a private
:class:`torch.Generator`. Two consequences the pipeline relies on:

* the weights are a function of the seed alone: the same on every machine and every device,
  because they are drawn on the CPU and only then copied to CUDA;
* building a model never touches torch's *global* random state, so constructing a model inside a
  deterministic run (or a test) changes nothing else that draws random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def declaring() -> Iterator[None]:
    """Where a model declares its layers: on the CPU, with torch's global random state saved and
    restored around it, so the default initialisation (overwritten by :func:`init_from_seed`)
    leaves no trace. Not on the ``meta`` device: its ``normal_`` is a Python reference that
    imports ``torch._dynamo``, which costs every stage process almost a second at start-up."""
    with torch.random.fork_rng(devices=[]):
        yield


def init_from_seed(module: nn.Module, seed: int, device: torch.device | str) -> None:
    """Fill ``module`` (declared in :func:`declaring`) from ``seed``, then move it to ``device``.

    Embedding tables are drawn from N(0, 1); every other weight from N(0, 1/fan_in) (fan_in = the
    product of all but the first dimension), so activations keep a unit-ish scale through the
    small stacks; biases from N(0, 0.02²). Parameters are visited in ``named_parameters`` order,
    which is the declaration order and therefore stable.

    Afterwards the module is in eval mode with gradients off: these models are only ever run for
    inference, and parameters without ``requires_grad`` keep autograd out of every call.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, param in module.named_parameters():
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if id(param) in embedding_weights:
                scale = 1.0
            elif name.endswith("bias") or param.dim() < 2:
                scale = 0.02
            else:
                scale = 1.0 / math.sqrt(math.prod(param.shape[1:]))
            param.copy_(draw * scale)
    module.to(device)
    module.eval()
    module.requires_grad_(False)


def count_parameters(module: nn.Module) -> int:
    """Number of scalar weights in ``module`` (for reports)."""
    return sum(p.numel() for p in module.parameters())
