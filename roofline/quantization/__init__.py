"""Weight quantization as strategy objects on the linear layer (see :mod:`.base`)."""
