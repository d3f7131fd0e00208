"""Side-by-side measurements of lit_balance against peer samplers and batching strategies.

Run from the repository root (each module's docstring lists its options)::

    python -m benchmarks.bench_samplers        # samplers on real length distributions, simulated ranks
    python -m benchmarks.bench_packing         # packed (padding-free) micro-batches against the packing peers
    python -m benchmarks.compare_strategies    # end-to-end training under each strategy, 2 CPU DDP ranks
    python -m benchmarks.bench_callbacks       # overhead of the measuring and adapting callbacks

Peer baselines live in :mod:`benchmarks.peers` and :mod:`benchmarks.packing_peers`; every plan figure comes from :mod:`lit_balance.plan.stats`.
"""
