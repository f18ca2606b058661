"""Check the main job's model: ``python -m fxzero parity examples/parity_gpt.py --world-size 2``.

``fxzero_parity()`` is what the command calls. It returns the model of
``examples/train_gpt.py`` (a GPT whose output head is tied to its token embedding,
whose forward returns the loss, a mean over the batch) at a small size, a
``batch_fn(step)`` giving the *global* batch of each step (every rank takes its slice
of it), and the optimizer to wrap. To check your own model, write the same three
things for it.
"""

import torch

from train_gpt import ModelArgs, Transformer, load_bytes, windows

SEQ, GLOBAL_BATCH = 32, 8


def fxzero_parity():
    """(model, batch_fn, optimizer_factory) for ``python -m fxzero parity``."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=SEQ, dim=64, n_layer=2, n_head=4))
    data = torch.frombuffer(bytearray(load_bytes(None, limit=100_000)), dtype=torch.uint8).long()

    def batch_fn(step):
        """Windows of the standard library's source at offsets seeded by the step: the
        same global batch whoever asks for it."""
        starts = torch.randint(len(data) - SEQ - 1, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(step))
        return windows(data, starts, SEQ, "cpu")

    return model, batch_fn, lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
