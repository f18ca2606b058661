"""The data-parallel process group (collectives, waits that name what failed) and the store-based meeting of ranks."""
