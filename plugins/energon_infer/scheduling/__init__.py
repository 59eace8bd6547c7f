"""Iteration-level batching in the user's process: the scheduler, its options, the KV block allocator, swap decisions and the incremental detokeniser. Imports loading and the shared modules."""
