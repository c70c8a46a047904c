"""MODEL_SPEC for the command line: a built-in preset or a user's ``module:function``.

Presets (built on the meta device: no weights are allocated):

* ``gpt:<size>``: the GPT-3 paper's shapes (1.3b, 13b, 175b) and ``gpt:tiny``;
* ``bert:<size>``: the MiCS thesis's BERT models (10b: Table 3-I; 26b, 52b, 104b, 146b: Table 4-I),
  bidirectional attention, the same blocks;
* ``hf:<family>-<size>``: a Hugging Face ``transformers`` model from its config
  (``hf_models``: gpt2, llama or bert at tiny, 124m, 1.5b, 7b, 70b).

``module:function`` (a module on ``sys.path`` or a ``path/to/file.py``) names a function called
with no arguments that returns ``(model, example_inputs, loss_fn)``, as ``mc.trace`` takes them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from micscompile.core.errors import Error
from micscompile.zoo.models import BERT_10B, GPTConfig, meta_gpt

GPT_PRESETS = {
    "tiny": GPTConfig(vocab_size=512, seq_len=64, layers=4, hidden=256, heads=4),
    "1.3b": GPTConfig(vocab_size=51200, seq_len=2048, layers=24, hidden=2048, heads=16),
    "13b": GPTConfig(vocab_size=51200, seq_len=2048, layers=40, hidden=5120, heads=40),
    "175b": GPTConfig(vocab_size=51200, seq_len=2048, layers=96, hidden=12288, heads=96),
}
_BERT = dict(vocab_size=50000, seq_len=1024, causal=False)
BERT_PRESETS = {
    "10b": BERT_10B,
    "26b": GPTConfig(layers=48, hidden=6720, heads=48, **_BERT),
    "52b": GPTConfig(layers=64, hidden=8192, heads=64, **_BERT),
    "104b": GPTConfig(layers=128, hidden=8192, heads=64, **_BERT),
    "146b": GPTConfig(layers=80, hidden=12288, heads=96, **_BERT),
}


class SpecError(Error, ValueError):
    """A MODEL_SPEC that names nothing loadable; the message says what would work."""


def preset_names() -> list[str]:
    from micscompile.zoo.hf_models import FAMILIES, SIZES

    return ([f"gpt:{s}" for s in GPT_PRESETS] + [f"bert:{s}" for s in BERT_PRESETS]
            + [f"hf:{f}-{s}" for f in FAMILIES for s in SIZES])


def load(spec: str, *, micro_batch: int = 1, seq_len: int | None = None) -> tuple[nn.Module, tuple, Callable]:
    """(model, example_inputs, loss_fn) for ``spec``; ``micro_batch`` and ``seq_len`` shape the
    presets' example inputs (a user function chooses its own)."""
    family, sep, name = spec.partition(":")
    if not sep or not name:
        raise SpecError(f"MODEL_SPEC {spec!r}: expected a preset ({', '.join(preset_names()[:6])}, ...) "
                        "or module:function")
    if family in ("gpt", "bert"):
        table = GPT_PRESETS if family == "gpt" else BERT_PRESETS
        if name not in table:
            raise SpecError(f"unknown {family} preset {name!r}; known: {', '.join(f'{family}:{s}' for s in table)}")
        return meta_gpt(table[name] if seq_len is None else dataclasses.replace(table[name], seq_len=seq_len),
                        micro_batch)
    if family == "hf":
        from micscompile.zoo import hf_models

        fam, _, size = name.partition("-")
        seq = seq_len or (16 if size == "tiny" else 1024)
        try:
            with torch.device("meta"):
                model = hf_models.build(fam, size or "tiny", seq_len=seq)
        except ImportError as exc:
            raise SpecError(f"{spec}: needs the transformers package (pip install 'micscompile[hf]')") from exc
        except ValueError as exc:
            raise SpecError(f"{spec}: {exc}") from exc
        x = torch.zeros(micro_batch, seq, dtype=torch.long)
        return model, (x, x), hf_models.lm_loss
    return _user_function(spec, family, name)()


def _user_function(spec: str, module_name: str, func_name: str) -> Callable:
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.exists():
                raise SpecError(f"MODEL_SPEC {spec!r}: no file {path}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[path.stem] = module
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # as `python -m` does: the user's module beside them
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"MODEL_SPEC {spec!r}: cannot import {module_name!r} ({exc}); presets: "
                        f"{', '.join(preset_names()[:6])}, ...") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise SpecError(f"MODEL_SPEC {spec!r}: {module_name} has no function {func_name!r}")

    def call() -> tuple[nn.Module, tuple, Callable]:
        out = fn()
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], nn.Module)):
            raise SpecError(f"MODEL_SPEC {spec!r}: {func_name}() must return (model, example_inputs, loss_fn)")
        return out[0], tuple(out[1]), out[2]

    return call
