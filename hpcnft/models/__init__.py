"""Model folders: loading SD3 and PickScore, and building the tiny stand-ins."""
