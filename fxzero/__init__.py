"""fxzero: ZeRO-1 distributed-optimizer training (Megatron-LM's distributed optimizer)
as a torch.compile backend.

    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
"""

from . import mxfp8
from .config import Config, default_bucket_size
from .runtime import (
    Bucket,
    BucketPlan,
    BufferPlan,
    CheckpointError,
    CollectiveError,
    DistributedOptimizer,
    Fragment,
    ParamAndGradBuffer,
    StepResult,
    latest_checkpoint,
    load_checkpoint,
    plan_buckets,
    save_checkpoint,
    shard_buffer,
    shard_fragments,
)
from .runtime.inspect import explain

__all__ = [
    "Bucket",
    "BucketPlan",
    "BufferPlan",
    "CheckpointError",
    "CollectiveError",
    "Config",
    "DistributedOptimizer",
    "Fragment",
    "ParamAndGradBuffer",
    "StepResult",
    "default_bucket_size",
    "explain",
    "latest_checkpoint",
    "load_checkpoint",
    "mxfp8",
    "plan_buckets",
    "save_checkpoint",
    "shard_buffer",
    "shard_fragments",
]
