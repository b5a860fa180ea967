"""Real multi-process DDP scenarios shared by the distributed tests and the sample-log recorder."""
