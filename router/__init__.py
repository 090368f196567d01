"""router package."""
