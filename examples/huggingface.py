"""A Hugging Face model and dataset as they come (examples/hf_gpt2.yaml, docs/huggingface.md).

`tiny_gpt2` builds a small GPT-2 from its config (no download: nothing is fetched at run time);
`byte_windows` returns a (train, test) pair of `datasets.Dataset`s of `input_ids` and `labels`:
48-byte windows of English that ships with Python (examples/datasets.py:text_corpus), one byte
a token. The labels are the inputs themselves: the model shifts them (Hugging Face's
convention), so `task.name: model_loss` trains on the loss the model returns. Needs the `hf`
extra (`pip install -e .[hf]`).
"""
from __future__ import annotations

from typing import Any, Optional

CONTEXT = 48


def tiny_gpt2(vocab_size: int = 128, n_positions: int = CONTEXT, n_embd: int = 96, n_layer: int = 2,
              n_head: int = 4, pretrained: Optional[str] = None) -> Any:
    """GPT2LMHeadModel from a GPT2Config (~240k parameters at the defaults); `pretrained`: a
    local directory written by save_pretrained (a run's export) to start from instead."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if pretrained:
        return GPT2LMHeadModel.from_pretrained(pretrained)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd,
                                      n_layer=n_layer, n_head=n_head, bos_token_id=0, eos_token_id=0))


def windows(context: int = CONTEXT, limit: Optional[int] = None) -> list[list[int]]:
    """The corpus cut into windows of `context` byte ids (the first `limit` windows when given)."""
    from examples.datasets import text_corpus

    data = text_corpus()
    n = len(data) // context if limit is None else min(limit, len(data) // context)
    return [list(data[i * context:(i + 1) * context]) for i in range(n)]


def byte_windows(context: int = CONTEXT, test_fraction: float = 0.1, limit: Optional[int] = None,
                 torch_format: bool = False) -> tuple[Any, Any]:
    """(train, test) datasets.Dataset of `input_ids` and `labels` (the same ids): every 1/test_fraction-th
    window held out for test. `torch_format`: `with_format("torch")` (items are tensors)."""
    import datasets

    rows = windows(context, limit)
    every = max(2, round(1 / test_fraction))
    test = [r for i, r in enumerate(rows) if i % every == 0]
    train = [r for i, r in enumerate(rows) if i % every != 0]
    out = tuple(datasets.Dataset.from_dict({"input_ids": part, "labels": part}) for part in (train, test))
    return tuple(d.with_format("torch") for d in out) if torch_format else out


def small_windows() -> tuple[Any, Any]:
    """byte_windows over the first 2,400 windows (2,160 train, 240 test): the tests' short runs."""
    return byte_windows(limit=2400)


def perplexity(model: Any, rows: Any, batch: int = 256) -> float:
    """Next-token perplexity of a causal LM over `rows` of ids ([n, T] tensor), in a plain loop
    that uses nothing of the project: how the tests and benchmarks/hf_gpt2.py score a model."""
    import math

    import torch
    import torch.nn.functional as F

    model.eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i:i + batch]
            logits = model(input_ids=x).logits[:, :-1]
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), x[:, 1:].reshape(-1),
                                         reduction="sum"))
            tokens += x[:, 1:].numel()
    return math.exp(nll / tokens)
