"""Image folders, splits, transforms, samplers and loaders."""
