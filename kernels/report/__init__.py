"""Results with provenance (one JSON shape for every part) and the cost of invariance."""
