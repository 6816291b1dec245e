"""The model runner and its persistent input batch."""
