"""Parameter tensors of real models, for the step-exchange benchmark.

Each model is its list of parameter shapes (float32), derived from the
published architecture, in the order a framework lists them. A training
step's gradient exchange moves one tensor per parameter.

* ``resnet50``: He et al. 2015, torchvision's layout: 161 tensors, 25,557,032
  parameters (97.5 MiB).
* ``bert-base``: Devlin et al. 2018 (uncased, 30,522-token vocabulary, 12
  layers, hidden 768, 12 heads, feed-forward 3,072), with the pooler: 199
  tensors, 109,482,240 parameters (417.6 MiB).
* ``many-small``: a model of many small tensors (2,000 of 16 B to 64 KiB,
  log-uniform, fixed seed), where the per-tensor cost of a transport is all
  there is.
"""

from __future__ import annotations

import math
import random

__all__ = ["MODELS", "shapes", "nbytes"]


def _resnet50() -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []

    def conv_bn(cin: int, cout: int, k: int) -> None:
        out.append((cout, cin, k, k))
        out.extend([(cout,), (cout,)])  # batch norm: weight, bias

    conv_bn(3, 64, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            conv_bn(cin, width, 1)
            conv_bn(width, width, 3)
            conv_bn(width, width * 4, 1)
            if b == 0:
                conv_bn(cin, width * 4, 1)  # the downsample branch
            cin = width * 4
    out.extend([(1000, 2048), (1000,)])
    return out


def _bert_base() -> list[tuple[int, ...]]:
    hidden, ffn, layers = 768, 3072, 12
    out: list[tuple[int, ...]] = [(30522, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            out.extend([(hidden, hidden), (hidden,)])
        out.extend([(hidden,), (hidden,)])  # attention LayerNorm
        out.extend([(ffn, hidden), (ffn,), (hidden, ffn), (hidden,)])
        out.extend([(hidden,), (hidden,)])  # output LayerNorm
    out.extend([(hidden, hidden), (hidden,)])  # pooler
    return out


def _many_small(count: int = 2000, seed: int = 7) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [(max(4, int(math.exp(rng.uniform(math.log(4), math.log(16384))))),) for _ in range(count)]


MODELS = {"resnet50": _resnet50, "bert-base": _bert_base, "many-small": _many_small}


def shapes(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``model`` (float32 tensors)."""
    try:
        return MODELS[model]()
    except KeyError:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def nbytes(model: str) -> int:
    """Bytes of one step's exchange of ``model`` (float32)."""
    return sum(math.prod(s) for s in shapes(model)) * 4
