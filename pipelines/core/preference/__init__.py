"""Preference optimisation: the pairs (tokenized, batched, scored) and the DPO family's losses."""
