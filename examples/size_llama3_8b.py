"""Llama-3-8B's shapes on the meta device, for `python -m fxzero explain examples/size_llama3_8b.py --size --world-size 64`
(needs `transformers`; nothing is allocated)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
def fxzero_explain():
    """Llama-3-8B's shapes (its published config), bf16, on the meta device: nothing allocated."""
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model, ()
