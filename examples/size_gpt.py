"""The 43M GPT of benchmarks/size_check.py (examples/train_gpt.py's model at width 768, 6 layers, 12
heads, context 64) on the meta device with one rank's batch of 2 x 64 tokens, for
`python -m fxzero explain examples/size_gpt.py --size --world-size 2 --transport gloo`:
model states, activations and the peak per rank, nothing allocated."""

import torch

from train_gpt import ModelArgs, Transformer


def fxzero_explain():
    """The model on the meta device and its (ids, targets) batch: the activations are sized on it."""
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=768, n_layer=6, n_head=12, block_size=64))
    ids = torch.empty(2, 64, dtype=torch.long, device="meta")
    return model, (ids, ids)
