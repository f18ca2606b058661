"""The wrapped optimizer's update: flat runs of fragments, bucket by bucket, and what step() returns."""
