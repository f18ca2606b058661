"""What the sharded optimizer runs on: layout plans (elementwise and whole-param), flat buffers, the param table, shards,
the flat update, the process group, the readiness ledger, gradient reduce-scatters and param all-gathers
(the gather protocol). :func:`fxzero.runtime.build_runtime` assembles them."""

from .layout.buffers import Bucket, ParamAndGradBuffer, shard_buffer
from .communication.comm import CollectiveError, DataParallelGroup
from .gradients.grad_sync import GradReductions, GradSync
from .gradients.grad_views import ShardedGrad
from .layout.layout import BucketPlan, BufferPlan, Fragment, bucket_divisor, param_start_alignment, plan_buckets, shard_fragments
from .gradients.ledger import Ledger
from .layout.ownership import Balance, balance, plan_owned_buckets
from .params.param_sync import Gather
from .layout.param_table import ParamRow, ParamTable

__all__ = [
    "Balance",
    "Bucket",
    "BucketPlan",
    "BufferPlan",
    "CollectiveError",
    "DataParallelGroup",
    "Fragment",
    "Gather",
    "GradReductions",
    "GradSync",
    "Ledger",
    "ParamAndGradBuffer",
    "ParamRow",
    "ParamTable",
    "ShardedGrad",
    "balance",
    "bucket_divisor",
    "param_start_alignment",
    "plan_buckets",
    "plan_owned_buckets",
    "shard_buffer",
    "shard_fragments",
]
