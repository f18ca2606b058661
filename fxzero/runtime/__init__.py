"""fxzero's runtime: layout plans, flat buffers, gradient sync and the sharded optimizer."""

from .buffers import Bucket, ParamAndGradBuffer, shard_buffer
from .comm import DataParallelGroup
from .grad_sync import GradSync
from .layout import BucketPlan, BufferPlan, Fragment, bucket_divisor, plan_buckets, shard_fragments
from .optimizer import DistributedOptimizer, StepResult

__all__ = [
    "Bucket",
    "BucketPlan",
    "BufferPlan",
    "DataParallelGroup",
    "DistributedOptimizer",
    "Fragment",
    "GradSync",
    "ParamAndGradBuffer",
    "StepResult",
    "bucket_divisor",
    "plan_buckets",
    "shard_buffer",
    "shard_fragments",
]
