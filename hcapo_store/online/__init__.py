"""The store inside the training loop: follow a collection as it is written."""
