"""Everything that knows about transformers lives in this package."""
