"""The models: plain PyTorch DLRM (knows no ranks), its interactions, and TorchRec's DLRM
as the second backend."""
