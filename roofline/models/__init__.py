"""Model architectures, the architecture registry and checkpoint loaders."""
