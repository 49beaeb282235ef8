"""The KV-cache sampler behind rollout.py: the cache, its slots and one decoding pass over them
(kv_cache.py), the lean decode step of the supported architectures (decode.py)."""
