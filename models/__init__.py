"""Small model definitions for tests, benchmarks and the README demo."""
