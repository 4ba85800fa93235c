"""Automatic partition sizes for pipeline.Pipe."""
