"""Data: reading sources, cleaning, images, the sample worlds, chat templates and examples, packing, parallel batches."""
