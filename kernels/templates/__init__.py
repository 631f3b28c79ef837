"""Generated-kernel templates, one per stage."""
