"""torchvision classification models by name, and partial weight loading."""
