"""Speed: the perf levers (one interface, `levers`) and their kernels, and MFU accounting (`mfu`)."""
