"""``dlrm bench``: our engine beside TorchRec in one run, and the machine's limit."""
