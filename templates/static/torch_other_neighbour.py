def torch_other_neighbour(exact, nearest):
    """other_neighbour for the torch path."""
    toward = torch.where(exact > nearest.to(exact.dtype), float("inf"), float("-inf")).to(nearest.dtype)
    return torch.nextafter(nearest, toward)
