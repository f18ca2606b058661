"""The sharded optimizer and what it runs on: layout plans, flat buffers, shards, the process
group, gradient reduce-scatters and param all-gathers."""

from .buffers import Bucket, ParamAndGradBuffer, shard_buffer
from .comm import CollectiveError, DataParallelGroup
from .grad_sync import GradSync
from .grad_views import ShardedGrad
from .layout import BucketPlan, BufferPlan, Fragment, bucket_divisor, plan_buckets, shard_fragments
from .optimizer import DistributedOptimizer, StepResult

__all__ = [
    "Bucket",
    "BucketPlan",
    "BufferPlan",
    "CollectiveError",
    "DataParallelGroup",
    "DistributedOptimizer",
    "Fragment",
    "GradSync",
    "ParamAndGradBuffer",
    "ShardedGrad",
    "StepResult",
    "bucket_divisor",
    "plan_buckets",
    "shard_buffer",
    "shard_fragments",
]
