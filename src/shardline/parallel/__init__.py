"""Sharding a model's computation over the ranks of an instance: pipeline, tensor and
ring stages (:mod:`~shardline.parallel.stage`) and what they send each other."""
