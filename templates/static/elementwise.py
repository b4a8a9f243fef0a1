def elementwise(value, like):
    """A per-element tensor shaped like `like`, also when the step produced a constant."""
    return torch.broadcast_to(torch.as_tensor(value, dtype=like.dtype, device=like.device), like.shape)
