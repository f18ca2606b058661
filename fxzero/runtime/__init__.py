"""fxzero's runtime: layout plans, flat buffers, gradient sync and the sharded optimizer."""

from .buffers import Bucket, ParamAndGradBuffer, shard_buffer
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .comm import CollectiveError, DataParallelGroup
from .grad_sync import GradSync
from .grad_views import ShardedGrad
from .layout import BucketPlan, BufferPlan, Fragment, bucket_divisor, plan_buckets, shard_fragments
from .optimizer import DistributedOptimizer, StepResult

__all__ = [
    "Bucket",
    "BucketPlan",
    "BufferPlan",
    "CheckpointError",
    "CollectiveError",
    "DataParallelGroup",
    "DistributedOptimizer",
    "Fragment",
    "GradSync",
    "ParamAndGradBuffer",
    "ShardedGrad",
    "StepResult",
    "bucket_divisor",
    "latest_checkpoint",
    "load_checkpoint",
    "plan_buckets",
    "save_checkpoint",
    "shard_buffer",
    "shard_fragments",
]
