"""The eval harness (importable as ``mxq.eval``): perplexity, per-layer error, speed."""
