"""Shipped configuration data (the catalog); a package only so the files install with the wheel."""
