"""Batch-invariant kernels for the exact engine mode (EngineConfig.exact): each row's result is the
same bits whatever the number of rows in the launch and wherever the row sits."""
