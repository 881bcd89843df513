"""Local stub (not upstream): the vision tower is out of scope for this harness."""
import torch


class ViT(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vision stub: set vision_n_layers=0")


class Aligner(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vision stub: set vision_n_layers=0")
