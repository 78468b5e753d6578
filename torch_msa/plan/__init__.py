"""The plan: the KV-outer schedule of one layer's selection (`README.md`)."""
