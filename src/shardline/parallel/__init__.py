"""Sharding a model's computation over the ranks of an instance: pipeline, tensor and
ring stages (:mod:`~shardline.parallel.stage`) and what they send each other."""

POINT_TO_POINT_BYTES = 128 * 1024
"""The largest all-reduce (bytes, in the sum's dtype) a gloo group takes with
point-to-point sends (:func:`shardline.parallel.point_to_point.all_reduce`) rather than
gloo's ring all-reduce: a decode step's (8 rows of a 4,096 hidden size in
float32). ``scripts/collective_costs.py``, 3 ranks on a 2-vCPU VM: 128 KiB 1.50 ms by
gloo, 0.65 point-to-point; a 512-row chunk of SmolLM2's (1.2 MB) 2.7 against 4.3."""
