"""TorchServe's management API: its routes and the lifecycle routes."""
