"""Which ``torch.device`` a device name means on this machine (:func:`pick_device`), for
the node's profile and its runners alike. No torch import here: the caller passes its
module (the node process never imports torch)."""

from __future__ import annotations


def pick_device(torch, device: str):
    """The ``torch.device`` a device name (:data:`shardline.node.profile.DEVICE_RE`) means on this machine, with
    ``torch`` the imported module (the caller's: the node never imports it).

    Raises:
        RuntimeError: the device asked for is not available to torch.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"no CUDA device {index} ({torch.cuda.device_count()} visible)")
        return torch.device("cuda", index)
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise RuntimeError("Apple MPS is not available to torch")
    return dev
