"""Recipe that builds the bundled strata-nano pack (see training/README.md)."""
