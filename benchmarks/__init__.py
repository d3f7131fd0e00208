"""Side-by-side measurements of lit_balance against peer samplers and batching strategies.

Run from the repository root (each module's docstring lists its options; ``docs/benchmarks.md`` has every table
with its command)::

    python -m benchmarks.bench_samplers        # samplers on real length distributions, simulated ranks
    python -m benchmarks.scale                 # planning 1M to 100M documents in windows
    python -m benchmarks.bench_packing         # packed (padding-free) micro-batches against the packing peers
    python -m benchmarks.compare_strategies    # end-to-end training under each strategy, 2 CPU DDP ranks
    python -m benchmarks.bench_callbacks       # overhead of the measuring and adapting callbacks
    python -m benchmarks.scale_text            # tokenizing large corpora: prepare_data beside encode_batch
    python -m benchmarks.packed_vs_padded      # end-to-end packed against padded micro-batches

They use lit_balance's public API only. Peer baselines live in :mod:`benchmarks.peers` and
:mod:`benchmarks.packing_peers`; every plan figure comes from :func:`lit_balance.plan_stats`; what several benchmarks
share is in :mod:`benchmarks._harness` (arguments, lengths, machine, launcher) and :mod:`benchmarks._training` (the
training runs' documents, model, Trainer and figures).
"""
